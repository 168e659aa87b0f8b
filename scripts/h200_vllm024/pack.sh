#!/bin/bash
# Builds what tests/gpu/test_rollout_vllm_gpu.py needs on the device tool's H200 (no vLLM there, no network):
# vLLM 0.24.0 (its wheel requires torch==2.11.0, the H200's torch; CUDA 13 like its torch 2.11.0+cu130) minus the
# FA2 / FlashMLA / DeepGEMM extensions, plus the wheels of deps.txt, as one payload.tar.xz split into parts of
# PART bytes (each call's working tree must stay under 64 MiB: ~13 MB of repo (session 28) + one part). Usage, from the repo root:
#   bash scripts/h200_vllm024/pack.sh [OUTDIR=.h200v24]      # OUTDIR must be git-ignored (.git/info/exclude)
# then, in device calls chained within the machine's 30 s warm window (docs/vllm024_engine_h200.txt):
#   run(command="mkdir -p /tmp/vstage && mv OUTDIR/partK /tmp/vstage/", carry=["OUTDIR/partK"])   for every part but the last
#   run(command="bash scripts/h200_vllm024/run_engine.sh OUTDIR/partN", carry=["OUTDIR/partN"])
set -euo pipefail
OUT=${1:-.h200v24}; PART=${PART:-50000000}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../env.sh" >/dev/null
V=${VLLM024_DIR:-$HOME/.cache/verl-quads/vllm-0.24.0}   # extracted wheel (tests/unit/test_rollout_vllm024.py makes it)
[ -f "$V/vllm/_C_stable_libtorch.abi3.so" ] || { echo "no extracted vLLM 0.24.0 wheel at $V (run tests/unit/test_rollout_vllm024.py once, or set VLLM024_DIR)" >&2; exit 2; }
git check-ignore -q "$OUT/x" || { echo "$OUT is not git-ignored: add /$OUT/ to .git/info/exclude (the device tool would ship it whole)" >&2; exit 2; }
OUT=$(realpath -m "$OUT"); rm -rf "$OUT" && mkdir -p "$OUT/stage/whl"
PLAT=""; for t in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
  manylinux_2_34 manylinux_2_35; do PLAT="$PLAT --platform ${t}_x86_64"; done
"$VQ_VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d "$OUT/stage/whl" -r <(grep -v '^#' "$HERE/deps.txt")
tar cf - -C "$V" --exclude='vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' --exclude='vllm/third_party/deep_gemm/*.so' \
  --exclude='vllm/_flashmla_C.abi3.so' --exclude='__pycache__' vllm vllm-0.24.0.dist-info -C "$OUT/stage" whl \
  | xz -T2 -7 > "$OUT/payload.tar.xz"
rm -rf "$OUT/stage"
split -b "$PART" -d -a 1 --numeric-suffixes=1 "$OUT/payload.tar.xz" "$OUT/part"
sha256sum "$OUT/payload.tar.xz" | tee "$OUT/payload.sha256"
rm "$OUT/payload.tar.xz"
ls -la "$OUT"
