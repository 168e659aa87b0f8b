"""QUADS selection-rule experiment support: probe modes quads@R (the product default: per-token channels),
quads@R:block / :call, and the per-GEMM rule comparison of verl_quads.diagnostics.realistic (tiny random
Qwen3-MoE on CPU)."""

from __future__ import annotations

import pytest
import torch


def test_probe_mode_selects_per_token_by_default_and_per_call_on_request():
    from verl_quads.diagnostics.probe import parse_mode

    tok, call = parse_mode("quads@0.5"), parse_mode("quads@0.25:call")
    assert tok.name == "quads@0.5" and tok.cfg.residual_per_token is True
    assert call.name == "quads@0.25:call" and call.cfg.residual_per_token is False and call.cfg.residual_ratio == 0.25
    assert call.cfg.residual_granularity == "block"  # per-call selection is defined for blocks only
    with pytest.raises(ValueError, match="':token'"):  # per-token BLOCKS until session 5: refused, not re-ruled
        parse_mode("quads@0.5:token")
    with pytest.raises(ValueError, match="selection"):
        parse_mode("quads@0.5:row")


def test_probe_mode_channel_rules_and_their_emulator_backend():
    """quads@R is the per-token sampled-threshold channel rule (QuantConfig's default since session 33),
    quads@R:channel the exact channel rule, quads@R:block the per-token block rule; the HF emulator quantizes every
    mode with the auto backend (the channel rules have their Triton kernel, bit-exact with the torch reference)."""
    from verl_quads.config import QuantConfig
    from verl_quads.diagnostics.hf_rollout import RolloutSpec
    from verl_quads.diagnostics.probe import parse_mode

    ch = parse_mode("quads@0.25")
    assert ch.name == "quads@0.25" and ch.cfg.residual_granularity == "channel_sampled"
    assert QuantConfig().residual_granularity == "channel_sampled"
    assert ch.cfg.residual_per_token is True and ch.cfg.residual_ratio == 0.25
    assert parse_mode("quads@0.25:sampled") == ch
    exact = parse_mode("quads@0.25:channel")
    assert exact.name == "quads@0.25:channel" and exact.cfg.residual_granularity == "channel"
    blk = parse_mode("quads@0.25:block")
    assert blk.name == "quads@0.25:block" and blk.cfg.residual_granularity == "block" and blk.cfg.residual_per_token
    spec = RolloutSpec.for_rollout_mode(ch.cfg)
    assert spec.residual_granularity == "channel_sampled" and spec.act_backend == "auto"
    assert RolloutSpec.for_rollout_mode(exact.cfg).residual_granularity == "channel"
    assert RolloutSpec.for_rollout_mode(blk.cfg).residual_granularity == "block"
    assert RolloutSpec(True, "quads").residual_granularity == "channel_sampled"
    assert RolloutSpec.for_rollout_mode(parse_mode("naive").cfg).act_backend == "auto"
    for kw in ({"residual_granularity": "channel"}, {"residual_granularity": "channel_sampled"}, {}):
        with pytest.raises(ValueError, match="blocks only"):
            RolloutSpec(True, "quads", 0.5, False, **kw)


def test_emulator_channel_mode_uses_the_cores_channel_rule():
    """A quads@0.5 (channel rule) emulated GEMM input == the NVFP4 core's channel-rule QDQ (torch reference), and differs
    from the block rule's (tiny random Qwen3-MoE, one forward)."""
    from verl_quads.diagnostics.hf_rollout import RolloutEmulator, RolloutSpec
    from verl_quads.diagnostics.realistic import build_model
    import verl_quads.nvfp4 as nv

    model = build_model(vocab=64, layers=1, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, inter=32, seed=0).eval()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    seen = {}
    h = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].detach()))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    x = seen["x"].reshape(-1, 64)
    ops = {}
    for gran in ("block", "channel"):
        emu = RolloutEmulator(model, RolloutSpec(False, "quads", 0.5, True, residual_granularity=gran))
        ops[gran] = emu._quant_act(x, 0, "self_attn.o_proj")
    want = nv.residual_fake_quantize(x, 0.5, nv.per_row_global_scale(x), granularity="channel", backend="torch")
    assert torch.equal(ops["channel"], want.float())
    assert not torch.equal(ops["channel"], ops["block"])


def test_selection_rule_errors_on_a_tiny_moe():
    from verl_quads.diagnostics.realistic import SELECTION_RULES, build_model, selection_rule_errors

    model = build_model(vocab=64, layers=2, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, inter=32, seed=0).eval()
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    res = selection_rule_errors(model, ids, (0.25, 1.0))
    names = set(res["gemms"])
    assert {"L0.qkv", "L0.o_proj", "L1.qkv", "L1.o_proj"} <= names
    assert any(n.startswith("L0.e") and n.endswith(".gate_up") for n in names)
    assert any(n.startswith("L1.e") and n.endswith(".down") for n in names)
    for row in res["gemms"].values():
        assert set(row) == {"naive"} | {f"{r}@{k:g}" for r in SELECTION_RULES for k in (0.25, 1.0)}
        for r in SELECTION_RULES:
            # every rule compensates something: never worse than naive, and at k = 1 all blocks are compensated
            assert row[f"{r}@0.25"] <= row["naive"] + 1e-12
            assert row[f"{r}@1"] == pytest.approx(row["per_token@1"], rel=0, abs=0)
        assert row["per_token@1"] < 0.5 * row["naive"]
    assert res["mean"]["per_token@0.25"] < res["mean"]["naive"]
