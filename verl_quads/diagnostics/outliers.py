"""Activation outlier channels: measure them, and give a random tiny model some.

Quantization error is driven by a few activation channels much larger than the rest (trained LLMs
have them; random weights do not). :func:`activation_outlier_stats` measures, per decoder layer, the
GEMM input of the attention (the ``input_layernorm`` output) and of the MLP/experts
(``post_attention_layernorm`` output): the kurtosis over all elements, and the largest per-channel
absolute maximum over the median one (``max_over_median``).

:func:`build_tiny_with_outliers` builds the project's tiny random Qwen3-MoE
(:func:`verl_quads.models.tiny.build_tiny_qwen3_moe`) and then, to make its quantization error
realistic, *injects* outlier channels: it multiplies ``n_outliers`` fixed channels of every RMSNorm
weight by ``factor`` (so those channels of every GEMM input are ``factor`` times larger), and draws
the linear/expert weights with std ``weight_std`` instead of the tiny default so activations are not
all tiny. It says so in ``verl_quads_tiny.json`` (``injected_outliers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    m = x.mean()
    v = ((x - m) ** 2).mean()
    return float(((x - m) ** 4).mean() / (v * v)) if float(v) > 0 else float("nan")


def activation_outlier_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
    """``{"layer{i}.attn_in" | "layer{i}.mlp_in": {"kurtosis", "max_over_median", "max_channel"}}``."""
    caps: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] == "layers" and parts[-1] in ("input_layernorm", "post_attention_layernorm"):
            key = f"layer{parts[-2]}." + ("attn_in" if parts[-1] == "input_layernorm" else "mlp_in")

            def h(_m, _i, out, _k=key):
                caps[_k] = out.detach()

            hooks.append(mod.register_forward_hook(h))
    if not hooks:
        raise ValueError("activation_outlier_stats: no input_layernorm/post_attention_layernorm modules found")
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    valid = None if attention_mask is None else attention_mask.reshape(-1).bool()
    for k in sorted(caps, key=lambda s: (int(s[5:].split(".")[0]), s)):
        x = caps[k].reshape(-1, caps[k].shape[-1]).float()
        if valid is not None:
            x = x[valid.to(x.device)]
        chan = x.abs().amax(0)
        out[k] = {
            "kurtosis": _kurtosis(x),
            "max_over_median": float(chan.max() / chan.median().clamp_min(1e-30)),
            "max_channel": int(chan.argmax()),
        }
    return out


def build_tiny_with_outliers(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_outliers: int = 2,
    factor: float = 30.0,
    weight_std: float = 0.08,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    moe_intermediate_size: int = 64,
    num_experts: int = 8,
    top_k: int = 2,
) -> Path:
    """Tiny random Qwen3-MoE (BF16) with ``n_outliers`` injected outlier channels (see module docstring)."""
    from safetensors.torch import load_file, save_file

    from verl_quads.models.tiny import build_tiny_qwen3_moe

    out = build_tiny_qwen3_moe(
        out_dir, seed=seed, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=32, num_experts=num_experts, top_k=top_k,
        moe_intermediate_size=moe_intermediate_size, dtype="bfloat16",
    )
    path = out / "model.safetensors"
    sd = load_file(str(path))
    g = torch.Generator().manual_seed(seed + 1000)
    chans = torch.randperm(hidden_size, generator=g)[:n_outliers]
    for k, v in sd.items():
        if k.endswith("layernorm.weight") or k == "model.norm.weight":
            w = torch.ones_like(v, dtype=torch.float32)
            if k != "model.norm.weight":
                w[chans] = factor
            sd[k] = w.to(v.dtype)
        elif v.dim() >= 2 and "embed_tokens" not in k and "norm" not in k:
            sd[k] = (torch.randn(v.shape, generator=g) * weight_std).to(v.dtype)
    save_file(sd, str(path), metadata={"format": "pt"})
    meta = json.loads((out / "verl_quads_tiny.json").read_text())
    meta["injected_outliers"] = {"channels": chans.tolist(), "factor": factor, "weight_std": weight_std,
                                 "how": "input/post-attention RMSNorm weights of these channels multiplied by factor"}
    (out / "verl_quads_tiny.json").write_text(json.dumps(meta, indent=1))
    return out


__all__ = ["activation_outlier_stats", "build_tiny_with_outliers"]
