"""The packed weight-sync wire format: names, layouts and the header (trainer -> vLLM).

A sync is one stream of ``(name, tensor)`` pairs through verl's bucketed transfer
(``BucketedWeightSender`` -> ``BucketedWeightReceiver``), in this order:

1. :data:`HEADER_NAME`: uint8 ``[n]``, UTF-8 JSON (see :func:`encode_header`): format version, the
   trainer's ``quant`` / trainer mode / expected rollout mode, and the sorted vLLM names of every
   quantized module. The receiver checks it before touching anything.
2. For every quantized module, the ``quads_nvfp4`` method's kernel parameters under their vLLM names
   (``<vllm module>.<param>``), already in the layout the method holds:

   - linear (vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the members are
     concatenated along the output dim in that order, one shared global scale):
     ``weight_packed`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
     ``weight_global_scale`` float32 0-d;
   - routed experts (HF ``gate_up_proj`` [E, 2I, H] -> vLLM ``w13``, ``down_proj`` [E, H, I] -> ``w2``;
     one global scale per expert, gate and up of an expert sharing it):
     ``w13_weight_packed`` uint8 ``[E, 2I, H/2]``, ``w13_weight_scale`` e4m3 ``[E, 2I, H/16]``,
     ``w13_weight_global_scale`` float32 ``[E]`` and the same three for ``w2`` (``[E, H, I/2]``, ...).
3. Everything else (embeddings, norms, router, lm_head, biases) unchanged, under the trainer's
   (HF) names, loaded by vLLM's own ``load_weights``.

Global scales are the *encode* scales ``448 * 6 / amax`` (compressed-tensors' ``weight_global_scale``).
"""

from __future__ import annotations

import json
import re

import torch

FORMAT_VERSION = 1
HEADER_NAME = "verl_quads.sync.header"

LINEAR_PARAMS = ("weight_packed", "weight_scale", "weight_global_scale")
EXPERT_PARAMS = tuple(f"{s}_weight_{p}" for s in ("w13", "w2") for p in ("packed", "scale", "global_scale"))

#: HF linear leaf -> vLLM fused leaf (the order inside a fused group is the tuple order).
FUSED_LINEAR = {
    ("q_proj", "k_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
}
_LEAF_TO_FUSED = {leaf: fused for members, fused in FUSED_LINEAR.items() for leaf in members}
_EXPERT_SUBMODULE = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")


class SyncError(RuntimeError):
    """A packed weight sync was refused (nothing was written into the engine)."""


class SyncModeError(SyncError):
    """The trainer's and the engine's quantization modes do not match."""


def encode_header(quant: str, trainer_mode: str, rollout_mode: str, modules: list[str], version: int = 0) -> torch.Tensor:
    """The header tensor: uint8 ``[n]`` holding UTF-8 JSON.

    ``version``: the policy version of these weights (the trainer engine's sync counter, 0 for the
    first sync); the engine stamps TRACE guidance captured with them with it.
    """
    doc = {
        "format": FORMAT_VERSION,
        "version": int(version),
        "quant": quant,
        "trainer_mode": trainer_mode,
        "rollout_mode": rollout_mode,
        "modules": sorted(modules),
    }
    return torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8).clone()


def decode_header(t: torch.Tensor) -> dict:
    """Inverse of :func:`encode_header`; raises :class:`SyncError` on a malformed header."""
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise SyncError(f"{HEADER_NAME}: expected a uint8 vector, got {t.dtype} {tuple(t.shape)}")
    try:
        doc = json.loads(bytes(t.cpu().tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SyncError(f"{HEADER_NAME}: not valid JSON: {e}") from e
    if doc.get("format") != FORMAT_VERSION:
        raise SyncError(f"{HEADER_NAME}: format {doc.get('format')!r}, this verl-quads reads {FORMAT_VERSION}")
    return doc


def vllm_module_of(hf_module: str) -> str:
    """vLLM module that an HF module's weights load into (q/k/v -> qkv_proj, experts.<e>.* -> experts)."""
    m = _EXPERT_SUBMODULE.search(hf_module)
    if m:
        return hf_module[: m.start()] + ".experts"
    parent, _, leaf = hf_module.rpartition(".")
    fused = _LEAF_TO_FUSED.get(leaf)
    if fused is None:
        return hf_module
    return f"{parent}.{fused}" if parent else fused


def is_renamed(hf_module: str) -> bool:
    """True if :func:`vllm_module_of` maps the module onto a differently-named (fused) vLLM module."""
    return vllm_module_of(hf_module) != hf_module


__all__ = [
    "FORMAT_VERSION",
    "HEADER_NAME",
    "LINEAR_PARAMS",
    "EXPERT_PARAMS",
    "FUSED_LINEAR",
    "SyncError",
    "SyncModeError",
    "encode_header",
    "decode_header",
    "vllm_module_of",
    "is_renamed",
]
