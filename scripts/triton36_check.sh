#!/usr/bin/env bash
# Offline triton 3.6 compile check for sm_90 of every Triton / Gluon kernel launch verl-quads makes (no GPU).
#
# The H200 runs triton 3.6, this machine triton 3.9: code that 3.9 compiles can still break every kernel on the H200
# (session 8: a string constexpr default in a @triton.jit helper, "'str' object has no attribute 'type'" on 3.6 only).
# This script builds (once, cached) a venv with triton==3.6.0 and the CPU torch of the main environment, then runs
# scripts/triton36_check.py in it: the public functions are called at H200 shapes with a stub sm_90 driver, every
# launch is recorded through triton 3.6's own JIT binder (argument types, specialization, constexprs, num_warps /
# num_stages / maxnreg), and each unique one is compiled for sm_90 with triton 3.6 (bundled ptxas). One line per
# compile (ok / FAIL + the error); exit status non-zero on any failure, any kernel no scenario reached, or any
# scenario that could not run.
#
# How the lead runs it before an H200 call (from the repo root; ~5-8 min on 2 cores, the first run also ~1 min to
# build the venv):
#     flock /tmp/vq-heavy.lock bash scripts/triton36_check.sh > /tmp/t36.txt 2>&1; echo rc=$?; tail -3 /tmp/t36.txt
#     grep -A1 '^FAIL\|^DRIVE-FAIL\|^NOT-COVERED' /tmp/t36.txt     # what broke (full tracebacks: the log it names)
# Arguments go to the .py (--help): e.g. --kernels '_w4a16_stream_kernel' to compile one kernel's launches only,
# --groups core,channel,gemm,gluon, --list (record only), --fresh (no triton cache: recompile everything), -j N,
# --resources (each compile's registers / spill stack / shared memory: how many programs an SM can hold).
# Compiled kernels are cached (triton's cache keyed by source, options and version) in the venv folder, so a re-run
# compiles only what changed; failures are never cached.
#
# Not part of scripts/test.sh / CI: a fresh CI machine would have to download triton 3.6.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# torch: the pin of the main environment (scripts/requirements-cpu.txt: the CPU wheel on this machine's disk, cp311,
# hence the interpreter of the main environment, python3, rather than 3.12).
torch_pin="$(grep -E '^torch==' "$root/scripts/requirements-cpu.txt")"
pins="$torch_pin triton==3.6.0 numpy pytest"
hash="$(printf '%s\n%s\n' "$pins" "$(python3 --version)" | sha256sum | cut -c1-12)"
venv="${VQ_TRITON36_VENV:-$HOME/.cache/verl-quads/triton36-$hash}"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # shellcheck disable=SC2086
  if ! "$venv/bin/pip" install -q $pins; then
    echo "triton36_check: could not install '$pins' (is triton 3.6.0 downloadable here?)" >&2
    exit 2
  fi
  "$venv/bin/python" -c "import triton, torch; assert triton.__version__ == '3.6.0', triton.__version__
print('triton', triton.__version__, 'torch', torch.__version__)"
  touch "$venv/.complete"
fi
flock -u 9
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$venv/triton-cache}"  # --fresh: a temporary one instead
cd "$root"
env -u TRITON_INTERPRET PYTHONPATH="$root" "$venv/bin/python" "$root/scripts/triton36_check.py" "$@"
