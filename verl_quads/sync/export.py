"""``verl-quads export``: a trained checkpoint -> an NVFP4 checkpoint in the compressed-tensors format.

What is written (``--out DIR``):

- ``model*.safetensors`` (+ ``model.safetensors.index.json`` when sharded): for every module the
  trainer's QAT quantizes (the same rule as :func:`verl_quads.qat.apply_qat`: every ``nn.Linear`` not
  matched by ``QuantConfig.ignore`` and every fused-experts module), under HF checkpoint names:

  - ``<m>.weight_packed`` uint8 ``[N, K/2]`` (two E2M1 codes per byte, even element in the low nibble),
  - ``<m>.weight_scale`` float8_e4m3fn ``[N, K/16]`` (linear, un-swizzled layout),
  - ``<m>.weight_global_scale`` float32 ``[1]`` (the *encode* scale ``448*6/amax``);

  routed experts are written per expert (``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``),
  the expert layout vLLM's Qwen3-MoE / OLMoE / Mixtral loaders map onto ``w13`` / ``w2``. Every other
  tensor (embeddings, norms, router, lm_head, biases) is copied unchanged from the source.
- ``config.json``: the source config plus ``quantization_config`` for compressed-tensors 0.17
  (``quant_method: compressed-tensors``, ``format: nvfp4-pack-quantized``, status ``compressed``, one
  config group targeting ``Linear`` with the ``NVFP4A16`` weight arguments: 4-bit float,
  ``tensor_group`` strategy, group size 16, symmetric, E4M3 scales; ``input_activations: null``), and
  ``ignore`` = the explicit names of the 2-D weight modules our ``QuantConfig.ignore`` keeps BF16.
- every other file of the source directory (tokenizer, generation config, chat template).
- ``verl_quads_export.json``: the QuantConfig, the source, byte counts.

Exactness: the quantized tensors come from :func:`verl_quads.sync.trainer.pack_for_rollout`, the
packed weight sync's own code (weights cast to ``param_dtype`` (bf16 by default, what the FSDP2 QAT
forward sees), one global scale per q/k/v and per gate/up group, one per expert (gate and up of an
expert sharing it), codes from :func:`verl_quads.nvfp4.quantize`). So the exported checkpoint holds
exactly what a ``quads_nvfp4`` vLLM engine holds after a sync, and it dequantizes to the trainer's QAT
effective weights (:func:`export_to_sync_stream` turns it back into that sync stream).

Activations: only weight quantization is exported (``NVFP4A16``). A W4A4 compressed-tensors checkpoint
needs a static per-tensor ``input_global_scale`` calibrated on data; our rollout quantizes activations
with a dynamic per-token global scale (plus QUADS residuals), which compressed-tensors cannot express.

Inputs accepted by :func:`resolve_source`: an HF model directory (``config.json`` + safetensors), a verl
checkpoint directory (``global_step_N`` or its ``actor``) whose ``huggingface/`` holds the full model
(verl saves it when ``checkpoint.save_contents`` includes ``hf_model``). A verl checkpoint with only FSDP
shards must be merged first: ``python -m verl.model_merger merge --backend fsdp --local_dir
<ckpt>/actor --target_dir <hf dir>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verl_quads.config import QuantConfig
from verl_quads.nvfp4 import validate_input
from verl_quads.sync.format import FUSED_LINEAR, HEADER_NAME, encode_header, vllm_module_of
from verl_quads.sync.trainer import SyncPlan, SyncStats, pack_for_rollout, plan_from_model

CT_FORMAT = "nvfp4-pack-quantized"
EXPORT_META = "verl_quads_export.json"
_PER_EXPERT = re.compile(r"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PER_EXPERT_PACKED = re.compile(r"^(?P<mod>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight_packed$")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

#: ``NVFP4A16`` weight arguments of compressed-tensors 0.17 (``quantization/quant_scheme.py``),
#: spelled out so the export does not depend on compressed-tensors (the tests parse it with it).
NVFP4_WEIGHT_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": 16,
    "strategy": "tensor_group",
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "scale_dtype": "torch.float8_e4m3fn",
    "zp_dtype": None,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
}


class ExportError(ValueError):
    """The source checkpoint cannot be exported (message names the tensor / module / option)."""


# ----------------------------------------------------------------------------- source
def resolve_source(path: str | Path) -> Path:
    """The HF model directory to read: ``path`` itself, or a verl checkpoint's ``huggingface/``."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"verl-quads export: --model {str(p)!r} is not a directory")
    for cand in (p, p / "huggingface", p / "actor" / "huggingface"):
        if (cand / "config.json").is_file() and any(cand.glob("*.safetensors")):
            return cand
    for cand in (p, p / "actor"):
        shards = sorted(cand.glob("model_world_size_*_rank_*.pt"))
        if shards:
            raise ExportError(
                f"verl-quads export: {cand} is a verl FSDP checkpoint without a full HF model (only "
                f"{len(shards)} FSDP shard file(s)); merge it first: python -m verl.model_merger merge "
                f"--backend fsdp --local_dir {cand} --target_dir <hf dir>, then export <hf dir> "
                "(or save with checkpoint.save_contents including hf_model)"
            )
    raise ExportError(
        f"verl-quads export: {p} holds no HF model (config.json + *.safetensors), neither directly nor under "
        "huggingface/ or actor/huggingface/"
    )


class _LazyCheckpoint:
    """Tensor names of a safetensors checkpoint (one file or a sharded index) and lazy loading."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        self.root = root
        self.where: dict[str, Path] = {}
        for f in sorted(root.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    if k in self.where:
                        raise ExportError(f"verl-quads export: tensor {k} appears in {self.where[k].name} and {f.name}")
                    self.where[k] = f
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return sorted(self.where)

    def _handle(self, name: str):
        from safetensors import safe_open

        f = self.where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def ndim(self, name: str) -> int:
        return len(self._handle(name).get_slice(name).get_shape())


def meta_model(src: Path, config: QuantConfig) -> torch.nn.Module:
    """The model of ``src``'s ``config.json`` on the meta device, with :func:`apply_qat` applied (no data)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_quads.qat import apply_qat

    if config.rollout_mode == "none":
        raise ExportError(
            "verl-quads export: quant='none' has no NVFP4 weights to export; use quant=w4a16, quads, trace, "
            "w4a4_qat or naive (all export the same NVFP4 weights; only the ignore list matters)"
        )
    hf_cfg = AutoConfig.from_pretrained(str(src))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    # naive (stock trainer): the modules its packed sync quantizes are the ones apply_qat selects
    apply_qat(model, dataclasses.replace(config, quant="w4a16") if config.trainer_mode == "none" else config)
    model._verl_quads_qat.config = config
    return model


def _check_fused_ignore(model: torch.nn.Module, config: QuantConfig) -> None:
    """vLLM runs q/k/v and gate/up as one GEMM: the ignore list must cover all or none of a group."""
    for parent, mod in model.named_modules():
        for members, fused in FUSED_LINEAR.items():
            present = [f"{parent}.{m}" if parent else m for m in members if isinstance(getattr(mod, m, None), torch.nn.Linear)]
            flags = [config.is_ignored(n) for n in present]
            if any(flags) and not all(flags):
                raise ExportError(
                    f"verl-quads export: quant_config.ignore keeps {[n for n, f in zip(present, flags) if f]} BF16 but "
                    f"not {[n for n, f in zip(present, flags) if not f]}; vLLM fuses them into {parent}.{fused} "
                    "(one GEMM): ignore all or none of them"
                )


# ----------------------------------------------------------------------------- trainer stream
@dataclass
class _Shapes:
    """Rows of each linear member (to split fused groups) and the experts' intermediate size."""

    rows: dict[str, int] = field(default_factory=dict)
    expert_inter: dict[str, int] = field(default_factory=dict)
    expert_has_gate: dict[str, bool] = field(default_factory=dict)


def _trainer_tensors(ckpt: _LazyCheckpoint, plan: SyncPlan, shapes: _Shapes) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as the trainer's ``state_dict`` stream: per-expert tensors of a quantized experts
    module are stacked into its fused ``gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``."""
    members = plan.member_to_group
    per_expert: dict[str, dict[tuple[int, str], str]] = {}
    others: list[str] = []
    for n in ckpt.names():
        m = _PER_EXPERT.match(n)
        if m and m["mod"] in plan.experts:
            per_expert.setdefault(m["mod"], {})[(int(m["e"]), m["proj"])] = n
        else:
            others.append(n)
    for n in others:
        t = ckpt.get(n)
        mod, _, leaf = n.rpartition(".")
        if leaf == "weight" and mod in members:
            validate_input(t, n)
            shapes.rows[mod] = t.shape[0]
        elif mod in plan.experts and leaf in ("gate_up_proj", "up_proj", "down_proj"):
            validate_input(t, n)
            if plan.experts[mod]:
                raise ExportError(f"verl-quads export: {n}: transposed ([E, in, out]) fused experts are not supported yet")
            if leaf != "down_proj":
                shapes.expert_has_gate[mod] = leaf == "gate_up_proj"
                shapes.expert_inter[mod] = t.shape[1] // (2 if leaf == "gate_up_proj" else 1)
        yield n, t
    for mod, got in per_expert.items():
        if plan.experts[mod]:
            raise ExportError(f"verl-quads export: {mod}: per-expert tensors of a transposed experts module are not supported")
        n_exp = 1 + max(e for e, _ in got)
        has_gate = any(p == "gate_proj" for _, p in got)
        projs = ("gate_proj", "up_proj", "down_proj") if has_gate else ("up_proj", "down_proj")
        missing = [f"{mod}.{e}.{p}.weight" for e in range(n_exp) for p in projs if (e, p) not in got]
        if missing:
            raise ExportError(f"verl-quads export: {mod}: {len(missing)} expert tensors missing, e.g. {missing[:4]}")
        up = []
        for e in range(n_exp):
            parts = [ckpt.get(got[(e, p)]) for p in projs[:-1]]
            for p, t in zip(projs, parts):
                validate_input(t, got[(e, p)])
            up.append(torch.cat(parts, dim=0))
        shapes.expert_has_gate[mod] = has_gate
        shapes.expert_inter[mod] = up[0].shape[0] // (2 if has_gate else 1)
        yield f"{mod}.{'gate_up_proj' if has_gate else 'up_proj'}", torch.stack(up)
        del up
        down = []
        for e in range(n_exp):
            t = ckpt.get(got[(e, "down_proj")])
            validate_input(t, got[(e, "down_proj")])
            down.append(t)
        yield f"{mod}.down_proj", torch.stack(down)


def _to_ct(name: str, t: torch.Tensor, plan: SyncPlan, shapes: _Shapes, vllm_to_experts: dict[str, str]):
    """One packed-sync tensor (vLLM names/layout) -> compressed-tensors entries (HF names)."""
    mod, _, leaf = name.rpartition(".")
    if mod in plan.linear_groups:
        members = plan.linear_groups[mod]
        if leaf == "weight_global_scale":
            for m in members:
                yield f"{m}.weight_global_scale", t.reshape(1).clone()
            return
        start = 0
        for m in members:
            r = shapes.rows[m]
            yield f"{m}.{leaf}", t[start : start + r].contiguous()
            start += r
        return
    experts = vllm_to_experts[mod]
    stem, _, param = leaf.partition("_weight_")
    param = "weight_" + param
    inter = shapes.expert_inter[experts]
    has_gate = shapes.expert_has_gate[experts]
    for e in range(t.shape[0]):
        if stem == "w2":
            parts = [("down_proj", t[e])]
        elif param == "weight_global_scale":
            parts = [(p, t[e]) for p in (("gate_proj", "up_proj") if has_gate else ("up_proj",))]
        elif has_gate:
            parts = [("gate_proj", t[e, :inter]), ("up_proj", t[e, inter:])]
        else:
            parts = [("up_proj", t[e])]
        for proj, v in parts:
            yield f"{experts}.{e}.{proj}.{param}", (v.reshape(1) if param == "weight_global_scale" else v).contiguous().clone()


# ----------------------------------------------------------------------------- export
@dataclass
class ExportResult:
    out: Path
    tensors: dict[str, torch.Tensor]
    quantized_modules: list[str]
    ignore: list[str]
    stats: SyncStats
    effective: dict[str, torch.Tensor] | None = None


def ct_quantization_config(ignore: list[str]) -> dict:
    """The ``quantization_config`` entry of ``config.json`` (compressed-tensors 0.17 field names)."""
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": dict(NVFP4_WEIGHT_ARGS),
                "input_activations": None,
                "output_activations": None,
                "format": CT_FORMAT,
            }
        },
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.17.0",
    }


def _save_tensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n in sorted(tensors):
        b = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + b > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = tensors[n]
        size += b
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / fn), metadata={"format": "pt"})
        files.append(fn)
        weight_map.update({n: fn for n in sh})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )
    return files


def export_checkpoint(
    model: str | Path,
    out: str | Path,
    config: QuantConfig | None = None,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 << 30,
    keep_effective: bool = False,
    overwrite: bool = False,
) -> ExportResult:
    """Export ``model`` (HF dir or verl checkpoint, see :func:`resolve_source`) to ``out``.

    ``config``: the trainer's QuantConfig (its ``ignore`` decides what is quantized; any QAT mode gives
    the same weights), default ``quant=quads``. ``param_dtype``: the dtype the trainer's QAT forward sees
    (FSDP2 ``mixed_precision.param_dtype``, bf16 by default). ``keep_effective``: also return the QAT
    effective weights (vLLM layout, ``param_dtype``) computed by the QAT code path, for checks.
    """
    config = config or QuantConfig(quant="quads")
    src = resolve_source(model)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"verl-quads export: --out {out} exists and is not empty (pass --overwrite)")
        if out.resolve() == src.resolve():
            raise ExportError("verl-quads export: --out must differ from the source directory")
        shutil.rmtree(out)
    if param_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ExportError(f"verl-quads export: param_dtype {param_dtype}; allowed: bfloat16, float16, float32")
    src_cfg = json.loads((src / "config.json").read_text())
    if "quantization_config" in src_cfg:
        raise ExportError(
            f"verl-quads export: {src}/config.json already has a quantization_config "
            f"({src_cfg['quantization_config'].get('quant_method')!r}); export needs the BF16/FP32 master weights"
        )
    qmodel = meta_model(src, config)
    _check_fused_ignore(qmodel, config)
    plan = plan_from_model(qmodel)
    ckpt = _LazyCheckpoint(src)
    names = set(ckpt.names())

    quantized = sorted(plan.linear_groups) + sorted(plan.experts)
    vllm_to_experts = {vllm_module_of(e): e for e in plan.experts}
    for g, members in plan.linear_groups.items():
        for m in members:
            if f"{m}.weight" not in names:
                raise ExportError(f"verl-quads export: the checkpoint has no {m}.weight (quantized linear of {g})")
    # BF16 2-D weight modules vLLM may build as Linear layers: named explicitly in the ignore list
    q_members = {m for ms in plan.linear_groups.values() for m in ms}
    ignore = sorted(
        n.rpartition(".")[0]
        for n in names
        if n.endswith(".weight")
        and n.rpartition(".")[0] not in q_members
        and not _PER_EXPERT.match(n)
        and not any(n.startswith(e + ".") for e in plan.experts)
        and ckpt.ndim(n) == 2
    )

    shapes = _Shapes()
    stats = SyncStats()
    effective: dict[str, torch.Tensor] | None = {} if keep_effective else None
    tensors: dict[str, torch.Tensor] = {}
    stream = pack_for_rollout(
        _trainer_tensors(ckpt, plan, shapes), plan, param_dtype, backend="torch", stats=stats, effective=effective
    )
    for name, t in stream:
        if name == HEADER_NAME:
            continue
        mod = name.rpartition(".")[0]
        if mod in plan.linear_groups or mod in vllm_to_experts:
            for k, v in _to_ct(name, t, plan, shapes, vllm_to_experts):
                tensors[k] = v
        else:
            tensors[name] = t.contiguous()

    out.mkdir(parents=True, exist_ok=True)
    files = _save_tensors(tensors, out, max_shard_bytes)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name not in _INDEX_FILES + ("config.json", EXPORT_META):
            shutil.copy2(f, out / f.name)
    src_cfg["quantization_config"] = ct_quantization_config(ignore)
    (out / "config.json").write_text(json.dumps(src_cfg, indent=2, sort_keys=True))
    meta = {
        "source": str(src.resolve()),
        "quant_config": config.to_dict(),
        "param_dtype": str(param_dtype).removeprefix("torch."),
        "scheme": "NVFP4A16 (weights NVFP4, activations left to the serving engine)",
        "quantized_modules": quantized,
        "files": files,
        "stats": {**stats.__dict__, "quantized_ratio": stats.quantized_ratio},
    }
    (out / EXPORT_META).write_text(json.dumps(meta, indent=2))
    return ExportResult(out, tensors, quantized, ignore, stats, effective)


# ----------------------------------------------------------------------------- back to a sync
def export_to_sync_stream(
    exported: str | Path, config: QuantConfig | None = None, version: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Read an exported directory back as the packed sync stream (header first, vLLM names/layouts).

    The inverse of the export's renaming: members of a fused group are concatenated in vLLM's order
    (their global scales must be equal: one shared scale), per-expert tensors are stacked into
    ``w13`` (gate then up) / ``w2``; other tensors pass unchanged. Feed it to
    :func:`verl_quads.sync.receiver.plan_load` / ``apply_load`` to load the checkpoint into a
    ``quads_nvfp4`` engine through the packed load path (no re-quantization). ``config`` defaults to
    the one recorded in ``verl_quads_export.json``.
    """
    exported = Path(exported)
    meta = json.loads((exported / EXPORT_META).read_text())
    config = config or QuantConfig.from_mapping(
        meta["quant_config"]["quant"], {k: v for k, v in meta["quant_config"].items() if k != "quant"}
    )
    plan = plan_from_model(meta_model(exported, config))
    ckpt = _LazyCheckpoint(exported)
    names = set(ckpt.names())
    stream: list[tuple[str, torch.Tensor]] = [
        (HEADER_NAME, encode_header(config.quant, config.trainer_mode, config.rollout_mode, plan.vllm_modules(), version))
    ]
    used: set[str] = set()

    def take(n: str) -> torch.Tensor:
        if n not in names:
            raise ExportError(f"verl-quads export: {exported} lacks {n}")
        used.add(n)
        return ckpt.get(n)

    for g, members in sorted(plan.linear_groups.items()):
        gss = [take(f"{m}.weight_global_scale") for m in members]
        if any(not torch.equal(gss[0], x) for x in gss[1:]):
            raise ExportError(f"verl-quads export: {members} have different weight_global_scale; {g} needs one shared scale")
        stream.append((f"{g}.weight_packed", torch.cat([take(f"{m}.weight_packed") for m in members])))
        stream.append((f"{g}.weight_scale", torch.cat([take(f"{m}.weight_scale") for m in members])))
        stream.append((f"{g}.weight_global_scale", gss[0].reshape(())))
    for mod in sorted(plan.experts):
        e_ids = sorted({int(m["e"]) for n in names if (m := _PER_EXPERT_PACKED.match(n)) and m["mod"] == mod})
        has_gate = f"{mod}.0.gate_proj.weight_packed" in names
        w13_projs = ("gate_proj", "up_proj") if has_gate else ("up_proj",)
        for stem, projs in (("w13", w13_projs), ("w2", ("down_proj",))):
            for p in ("packed", "scale"):
                stream.append((f"{vllm_module_of(mod)}.{stem}_weight_{p}",
                               torch.stack([torch.cat([take(f"{mod}.{e}.{pr}.weight_{p}") for pr in projs]) for e in e_ids])))
            gs = []
            for e in e_ids:
                g_e = [take(f"{mod}.{e}.{pr}.weight_global_scale") for pr in projs]
                if any(not torch.equal(g_e[0], x) for x in g_e[1:]):
                    raise ExportError(f"verl-quads export: {mod}.{e}: gate/up have different weight_global_scale")
                gs.append(g_e[0].reshape(()))
            stream.append((f"{vllm_module_of(mod)}.{stem}_weight_global_scale", torch.stack(gs)))
    stream.extend((n, ckpt.get(n)) for n in sorted(names - used))
    return stream


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="verl-quads export",
        description="Export a trained (BF16/FP32 master) checkpoint to a compressed-tensors NVFP4 checkpoint "
        "(the packed weights the trainer's QAT and the verl-quads sync use).",
    )
    p.add_argument("--model", required=True, help="HF model dir, or a verl checkpoint dir holding huggingface/")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent; see --overwrite)")
    p.add_argument(
        "--quant-config",
        default=None,
        help="JSON object of actor_rollout_ref.actor.quant_config keys (e.g. '{\"ignore\": [...]}') plus an optional "
        "'quant' (default quads); or a path to a JSON file holding one",
    )
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="dtype the trainer's QAT forward sees (FSDP2 mixed_precision.param_dtype; default bf16)")
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    raw = {}
    if a.quant_config:
        text = Path(a.quant_config).read_text() if Path(a.quant_config).is_file() else a.quant_config
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"verl-quads export: --quant-config is neither a JSON object nor a JSON file: {e}")
        if not isinstance(raw, dict):
            raise SystemExit(f"verl-quads export: --quant-config must be a JSON object, got {type(raw).__name__}")
    quant = raw.pop("quant", "quads")
    try:
        cfg = QuantConfig.from_mapping(quant, raw)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.param_dtype]
        res = export_checkpoint(a.model, a.out, cfg, param_dtype=dtype,
                                max_shard_bytes=int(a.max_shard_gb * 2**30), overwrite=a.overwrite)
    except ValueError as e:  # ExportError, QuantConfig and NVFP4 input errors
        raise SystemExit(str(e)) from None
    print(f"verl-quads export: wrote {res.out} ({len(res.quantized_modules)} quantized modules; "
          f"{res.stats.summary()}); ignore={res.ignore}")


__all__ = [
    "CT_FORMAT",
    "EXPORT_META",
    "NVFP4_WEIGHT_ARGS",
    "ExportError",
    "ExportResult",
    "ct_quantization_config",
    "export_checkpoint",
    "export_to_sync_stream",
    "resolve_source",
    "main",
]
