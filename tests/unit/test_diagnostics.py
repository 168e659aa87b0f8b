"""verl_quads.diagnostics.stats on synthetic tensors (values checked against hand/numpy computations),
and the HF rollout emulator (equal to the QAT trainer in float32; the vLLM MoE method where installed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl_quads.diagnostics import stats as S


def test_gap_stats_matches_numpy():
    g = torch.Generator().manual_seed(0)
    r = -torch.rand(4, 50, generator=g) * 3
    t = r + torch.randn(4, 50, generator=g) * 0.1
    mask = torch.rand(4, 50, generator=g) > 0.3
    out = S.gap_stats(r, t, mask)
    d = (t - r).double().numpy()[mask.numpy()]
    assert out["n_tokens"] == int(mask.sum())
    assert out["logp_gap_max"] == pytest.approx(np.abs(d).max())
    assert out["logp_gap_mean"] == pytest.approx(np.abs(d).mean())
    assert out["logp_gap_p99"] == pytest.approx(np.quantile(np.abs(d), 0.99))
    assert out["k3_kl"] == pytest.approx(np.mean(np.exp(d) - d - 1))


def test_gap_stats_masked_tokens_do_not_count_and_empty_mask_raises():
    r = torch.zeros(1, 3)
    t = torch.tensor([[0.1, 100.0, -0.2]])
    out = S.gap_stats(r, t, torch.tensor([[True, False, True]]))
    assert out["logp_gap_max"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="no token"):
        S.gap_stats(r, t, torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        S.gap_stats(r, t, torch.ones(1, 2, dtype=torch.bool))


def test_k3_is_zero_for_identical_and_positive_otherwise():
    r = -torch.rand(2, 10)
    assert S.gap_stats(r, r.clone(), torch.ones(2, 10, dtype=torch.bool))["k3_kl"] == 0.0
    assert S.gap_stats(r, r + 0.3, torch.ones(2, 10, dtype=torch.bool))["k3_kl"] == pytest.approx(math.exp(0.3) - 1.3)


def test_argmax_differs():
    a = torch.tensor([[1, 2, 3, 4]])
    b = torch.tensor([[1, 0, 3, 0]])
    assert S.argmax_differs(a, b, torch.ones(1, 4, dtype=torch.bool)) == 0.5
    assert S.argmax_differs(a, b, torch.tensor([[True, False, True, True]])) == pytest.approx(1 / 3)


def test_routing_disagreement_sets_not_order():
    r = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [T=2, L=2, k=2]
    t = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [0, 1]]])
    out = S.routing_disagreement(r, t)
    assert out["routing_set_differs"] == 0.5  # (0,1): same set reordered; (2,3)vs(2,4) differs; (6,7)vs(0,1) differs
    assert out["routing_slot_differs"] == pytest.approx(3 / 8)
    masked = S.routing_disagreement(r, t, torch.tensor([True, False]))
    assert masked["routing_set_differs"] == 0.5 and masked["routing_slot_differs"] == 0.25


def test_relative_error_and_closure_and_summarize():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert S.relative_error(ref, ref + torch.tensor([[0.0, 0.5], [0.0, 0.0]])) == pytest.approx(0.1)
    assert S.relative_error(ref, ref * 2, torch.tensor([True, False])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="zero"):
        S.relative_error(torch.zeros(2), torch.ones(2))
    assert S.closure(0.3, 1.0, 0.2) == pytest.approx(0.875)
    assert math.isnan(S.closure(0.3, 0.2, 0.2))
    s = S.summarize([{"a": 1.0, "b": 2.0}, {"a": 3.0}, {"a": 5.0}])
    assert set(s) == {"a"} and s["a"]["mean"] == 3.0 and s["a"]["std"] == 2.0 and s["a"]["min"] == 1.0 and s["a"]["n"] == 3


# ------------------------------------------------------------------ HF rollout emulator
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from verl_quads.diagnostics.outliers import build_tiny_with_outliers

    return build_tiny_with_outliers(tmp_path_factory.mktemp("tiny_outliers"))


def _load(path, dtype):
    from verl_quads.diagnostics.probe import load_hf

    return load_hf(path, "sdpa", "cpu", dtype=dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4_qat"])
def test_emulator_equals_qat_trainer_in_float32(tiny, mode):
    """Same quantization choices on both sides, float32 model: the emulated rollout's hidden states equal
    the QAT trainer's to float32 summation-order rounding (w4a4_qat's RTN activations = the rollout's naive
    activations), while quantization itself moves them by orders of magnitude more."""
    from verl_quads.diagnostics.hf_rollout import RolloutEmulator, RolloutSpec
    from verl_quads.qat import apply_qat

    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    t, e = _load(tiny, torch.float32), _load(tiny, torch.float32)
    apply_qat(t, mode, backend="torch")
    spec = RolloutSpec(True, "none" if mode == "w4a16" else "naive")
    with torch.no_grad(), RolloutEmulator(e, spec).installed():
        he = e(input_ids=ids, output_hidden_states=True).hidden_states
    with torch.no_grad():
        ht = t(input_ids=ids, output_hidden_states=True).hidden_states
    for a, b in zip(he, ht):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        hb = _load(tiny, torch.float32)(input_ids=ids, output_hidden_states=True).hidden_states
    assert (hb[-1] - ht[-1]).abs().max() > 1e-2  # and quantization did change something


def test_emulator_remove_restores_and_routing_recorded(tiny):
    from verl_quads.diagnostics.hf_rollout import RolloutEmulator, RolloutSpec, assemble_routing

    m = _load(tiny, torch.bfloat16)
    ids = torch.randint(0, 500, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        emu = RolloutEmulator(m, RolloutSpec(True, "quads", 0.5))
        with emu.installed():
            emu.rows = (torch.zeros(6, dtype=torch.long), torch.arange(6))
            q = m(input_ids=ids).logits
        back = m(input_ids=ids).logits
    assert not torch.equal(ref, q)
    torch.testing.assert_close(ref, back, rtol=0, atol=0)
    rt = assemble_routing(emu.routing, 1, 6, m.config.num_experts_per_tok)
    assert rt.shape == (1, 6, m.config.num_hidden_layers, m.config.num_experts_per_tok) and bool((rt >= 0).all())


def test_emulator_padding_rows_do_not_change_per_call_quads_of_valid_rows(tiny):
    """Per-call QUADS selection ranks blocks over the whole GEMM call: with ``rows`` marking padding, the
    padding rows' contents do not change any valid row's logits (bit for bit); without ``rows`` they do
    (the control that shows the check can fail)."""
    from verl_quads.diagnostics.hf_rollout import RolloutEmulator, RolloutSpec

    m = _load(tiny, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 500, (2, 8), generator=g)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0  # sequence 1 is left-padded by 3
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    rows = (torch.where(am.bool(), torch.arange(2).unsqueeze(1), -1).flatten(), torch.where(am.bool(), pos, -1).flatten())
    emu = RolloutEmulator(m, RolloutSpec(True, "quads", 0.25, residual_per_token=False, residual_granularity="block"))
    outs = {}
    with torch.no_grad(), emu.installed():
        for pad in (0, 1):
            x = ids.clone()
            x[1, :3] = torch.randint(0, 500, (3,), generator=g) if pad else 7
            for with_rows in (True, False):
                emu.rows = rows if with_rows else None
                outs[pad, with_rows] = m(input_ids=x, attention_mask=am, position_ids=pos).logits[am.bool()]
    assert torch.equal(outs[0, True], outs[1, True])
    assert not torch.equal(outs[0, False], outs[1, False])


def test_probe_quads_modes_follow_the_product_default_and_name_the_other_rules():
    """quads@R is QuantConfig's default rule (per-token channels over a sampled threshold since session 33); :channel
    names the exact channel rule, :block / :call the block rules; the old ':token' (per-token blocks until session 5)
    and duplicate names are refused instead of silently re-ruled."""
    from verl_quads.config import QuantConfig
    from verl_quads.diagnostics.probe import parse_mode, run_probe

    rule = lambda m: (m.name, m.cfg.residual_ratio, m.cfg.residual_per_token, m.cfg.residual_granularity)  # noqa: E731
    assert QuantConfig("quads").residual_granularity == "channel_sampled"
    assert rule(parse_mode("quads@0.25")) == ("quads@0.25", 0.25, True, "channel_sampled")
    assert rule(parse_mode("quads")) == ("quads@0.5", 0.5, True, "channel_sampled")
    assert rule(parse_mode("quads@0.25:sampled")) == ("quads@0.25", 0.25, True, "channel_sampled")
    assert rule(parse_mode("quads@0.25:channel")) == ("quads@0.25:channel", 0.25, True, "channel")
    assert rule(parse_mode("quads@0.25:block")) == ("quads@0.25:block", 0.25, True, "block")
    assert rule(parse_mode("quads@0.25:call")) == ("quads@0.25:call", 0.25, False, "block")
    with pytest.raises(ValueError, match=r"':token' \(per-token 16-channel blocks until session 5\).*quads@R:block"):
        parse_mode("quads@0.5:token")
    with pytest.raises(ValueError, match=r"bad QUADS selection in 'quads@0.5:row'"):
        parse_mode("quads@0.5:row")
    with pytest.raises(ValueError, match=r"name the same mode more than once: \['quads@0.5'\]"):
        run_probe("/nonexistent", modes=["quads@0.5", "quads@0.5:sampled"])


def test_emulator_and_probe_header_follow_residual_combine_auto(monkeypatch):
    """The HF emulator runs the emulated (torch) arithmetic, so quant_config.residual_combine='auto' (the default)
    resolves to bf16 there as on the plugin's torch/triton backends: its QUADS operand is the core's QDQ activation
    (residual_fake_quantize, rounded once to bf16), fp4x2 when asked; probe.txt's QUADS header line names the
    operand the rollout engine runs (hf: bf16; a vLLM engine on a native backend, mocked: fp4x2, with the
    decomposition's emulated bf16 named beside it)."""
    import verl_quads.nvfp4 as nv
    from verl_quads.config import QuantConfig
    from verl_quads.diagnostics import probe as P
    from verl_quads.diagnostics.hf_rollout import RolloutEmulator, RolloutSpec
    from verl_quads.rollout import backend as backend_mod

    spec = RolloutSpec.for_rollout_mode(QuantConfig("quads"))
    assert (spec.residual_combine, spec.combine) == ("auto", "bf16")
    assert RolloutSpec(True, "quads", residual_combine="fp4x2").combine == "fp4x2"
    with pytest.raises(ValueError, match=r"RolloutSpec\.residual_combine .* must be one of \('auto', 'fp4x2', 'bf16'\)"):
        RolloutSpec(True, "quads", residual_combine="fp16")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    x[:, 5] *= 30
    gs = nv.per_row_global_scale(x)
    ops = {c: RolloutEmulator(torch.nn.Linear(1, 1), RolloutSpec(False, "quads", 0.5, residual_combine=c))
           ._quant_act(x, 0, "self_attn.o_proj") for c in ("auto", "fp4x2")}
    assert torch.equal(ops["auto"], nv.residual_fake_quantize(x, 0.5, gs, granularity="channel", backend="torch").float())
    assert torch.equal(ops["fp4x2"], nv.residual_quantize(x, 0.5, gs, granularity="channel", backend="torch")
                       .dequantize(torch.float32))
    assert not torch.equal(ops["auto"], ops["fp4x2"])  # bf16 rounding of the sum changes some elements

    cfg = P.parse_mode("quads@0.5").cfg
    hf = P.HFEngine.__new__(P.HFEngine)
    assert P._quads_operand(hf, cfg) == {"residual_combine": "auto", "rollout": "bf16", "emulated": "bf16"}
    vl = P.VLLMEngine.__new__(P.VLLMEngine)
    monkeypatch.setattr(backend_mod, "resolve_backend", lambda requested: "native")
    assert P._quads_operand(vl, cfg) == {"residual_combine": "auto", "rollout": "fp4x2", "emulated": "bf16"}
    res = P.ProbeResult("hf", "m", ["quads@0.5"], [0, 1, 2], 2, 4)
    res.quads_rules = {"quads@0.5": {"residual_ratio": 0.5, "residual_per_token": True, "residual_granularity": "channel"}}
    res.quads_operand = {"quads@0.5": P._quads_operand(hf, cfg)}
    head = next(line for line in P.format_tables(res).splitlines() if line.startswith("QUADS selection"))
    assert head.startswith("QUADS selection: quads@0.5: k=0.5 per token channels, operand bf16 (residual_combine=auto) [")
    res.quads_operand = {"quads@0.5": P._quads_operand(vl, cfg)}
    head = next(line for line in P.format_tables(res).splitlines() if line.startswith("QUADS selection"))
    assert "operand fp4x2 (residual_combine=auto, emulated (decomposition) bf16)" in head


def test_paired_difference_by_hand():
    base = [{"logp_gap_p99": 0.5, "k3_kl": 0.1}, {"logp_gap_p99": 0.7, "k3_kl": 0.3}, {"logp_gap_p99": 0.6, "k3_kl": 0.2}]
    var = [{"logp_gap_p99": 0.4, "k3_kl": 0.1}, {"logp_gap_p99": 0.9, "k3_kl": 0.2}, {"logp_gap_p99": 0.3, "k3_kl": 0.25}]
    out = S.paired_difference(base, var, keys=("logp_gap_p99", "k3_kl"))
    d = np.array([-0.1, 0.2, -0.3])  # variant - base, by hand
    p = out["logp_gap_p99"]
    assert (p["base"], p["variant"]) == (pytest.approx(0.6), pytest.approx(1.6 / 3))
    assert p["diff"] == pytest.approx(d.mean()) and p["diff_std"] == pytest.approx(d.std(ddof=1))
    assert (p["variant_lower"], p["n"]) == (2, 3)
    assert out["k3_kl"]["variant_lower"] == 1  # 0.1 vs 0.1 is not lower
    assert S.paired_difference(base[:1], var[:1], keys=("k3_kl",))["k3_kl"]["diff_std"] == 0.0
    with pytest.raises(ValueError, match="same number"):
        S.paired_difference(base, var[:2])


def test_probe_pairs_a_rule_variant_on_the_base_rollouts_tokens(tiny):
    """Step 6 of the probe: quads@0.5:block is paired with quads@0.5 (the trace and unrelated modes are not); the
    base's side of each batch equals the decomposition's independently computed 'both' ablation on the same
    rollout, the variant's differs (another rule), both on the base's tokens; the table prints the pair."""
    from verl_quads.diagnostics.probe import format_tables, parse_mode, run_probe, variant_pairs

    names = lambda ms: [(b.name, v.name) for b, v in variant_pairs([parse_mode(m) for m in ms])]  # noqa: E731
    assert names(["naive", "quads@0.5", "quads@0.5:block", "quads@0.25:sampled", "trace"]) == [
        ("quads@0.5", "quads@0.5:block")]
    res = run_probe(tiny, modes=["quads@0.5", "quads@0.5:block"], seeds=(0, 1, 2), max_new_tokens=4, engine="hf",
                    prompts=("The capital of France is", "def add(a, b):"))
    pr = res.paired["quads@0.5:block vs quads@0.5"]
    assert (pr["base"], pr["variant"], [x["seed"] for x in pr["runs"]]) == ("quads@0.5", "quads@0.5:block", [0, 1, 2])
    both = res.per_mode["quads@0.5"]["decomposition"]["both"]
    for k in S.GAP_KEYS:
        assert pr["summary"][k]["base"] == pytest.approx(both[k]["mean"], rel=1e-12, abs=0), k
    runs_base = res.per_mode["quads@0.5"]["runs"]
    for x, rb in zip(pr["runs"], runs_base):
        assert x["base"]["n_tokens"] == x["variant"]["n_tokens"] == rb["n_tokens"]
        assert 0.0 <= x["tokens_variant_lower"] + x["tokens_equal"] <= 1.0
    assert any(x["base"]["logp_gap_mean"] != x["variant"]["logp_gap_mean"] for x in pr["runs"])
    assert pr["summary"]["tokens_equal"]["mean"] < 1.0
    txt = format_tables(res)
    assert "== paired on the same tokens" in txt and "quads@0.5:block vs quads@0.5  p99|gap|" in txt


def test_probe_prompts_file_json_or_lines(tmp_path):
    from verl_quads.diagnostics.probe import load_prompts

    (tmp_path / "p.json").write_text('["a\\nb", "c"]')
    assert load_prompts(tmp_path / "p.json") == ("a\nb", "c")
    (tmp_path / "p.txt").write_text("a\n\nc\n")
    assert load_prompts(tmp_path / "p.txt") == ("a", "c")
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
        load_prompts(tmp_path / "bad.json")
