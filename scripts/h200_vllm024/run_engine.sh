#!/bin/bash
# Device side (the H200 of the device tool), from the repo root: LAST = the part carried by this call; the other parts
# wait in /tmp/vstage (earlier calls, pack.sh's header). Reassembles and installs vLLM 0.24.0 + deps under /tmp/v24/site
# (next to the image's torch 2.11 / triton 3.6 / transformers), registers verl-quads' vllm.general_plugins entry point,
# and runs tests/gpu/test_rollout_vllm_gpu.py and test_routing_log_gpu.py (log in $OUT/engine.log; VQ_SKIP_TEST=1:
# not), then the command in $VQ_RUN if set (log in $OUT/run.log; run by bash -c: several commands allowed), each
# under a timeout of T seconds (second argument, default 540). LAST=--reuse: the install of an earlier call on the
# same (still warm) machine is used.
set -o pipefail
LAST=$1; T=${2:-540}; t0=$(date +%s)
if [ "$LAST" = "--reuse" ]; then
  [ -d /tmp/v24/site/vllm ] || { echo "--reuse: no /tmp/v24/site/vllm (the machine was given back?)"; exit 3; }
else
cat /tmp/vstage/part? "$LAST" > /tmp/payload.tar.xz || exit 3
sha256sum /tmp/payload.tar.xz
rm -rf /tmp/v24 && mkdir -p /tmp/v24/site
python3 -c "import tarfile; tarfile.open('/tmp/payload.tar.xz').extractall('/tmp/v24', filter='data')" || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/v24/site /tmp/v24/whl/*.whl || exit 5
mv /tmp/v24/vllm /tmp/v24/vllm-0.24.0.dist-info /tmp/v24/site/
d=/tmp/v24/site/verl_quads-0.0.0.dist-info; mkdir -p $d
printf "Metadata-Version: 2.1\nName: verl-quads\nVersion: 0.0.0\n" > $d/METADATA
sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml \
  | sed 's/^\[project.entry-points."vllm.general_plugins"\]/[vllm.general_plugins]/; s/"//g' > $d/entry_points.txt
cat $d/entry_points.txt
fi
# VLLM_USE_FLASHINFER_SAMPLER=0: vLLM 0.24's sampler imports flashinfer (not carried) unless told not to use it
export PYTHONPATH=/tmp/v24/site:$PWD PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/tmp/vllm_cache VLLM_USE_FLASHINFER_SAMPLER=0
echo "setup $(( $(date +%s) - t0 ))s"
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
if [ -z "${VQ_SKIP_TEST:-}" ]; then  # the GPU engine tests (skip with VQ_SKIP_TEST=1)
  timeout "$T" python3 -m pytest tests/gpu/test_rollout_vllm_gpu.py tests/gpu/test_routing_log_gpu.py -v -s \
    -p no:cacheprovider -rA 2>&1 | tee "$OUT/engine.log" \
    | grep -a "^\[engine\]\|^\[generate\]\|^  eager\|^\[reload\]\|^PASSED\|^FAILED\|^ERROR\|^E \|passed\|failed"
fi
if [ -n "${VQ_RUN:-}" ]; then  # then another command in the same environment, e.g. VQ_RUN="python3 -m verl_quads.cli bench engine"
  timeout "$T" bash -c "$VQ_RUN" 2>&1 | tee "$OUT/run.log" | grep -a -v "^INFO\|^DEBUG\|^(EngineCore\|WARNING"
fi
echo "total $(( $(date +%s) - t0 ))s"
