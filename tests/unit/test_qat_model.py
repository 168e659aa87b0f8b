"""verl_quads.qat on real transformers-5 models (tiny random Qwen3-MoE, OLMoE, dense Qwen3), CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from qat_models import tiny_model, tokens
from torch.overrides import TorchFunctionMode

from verl_quads.config import QuantConfig
from verl_quads.nvfp4 import fake_quantize, global_scale_from_amax
from verl_quads.qat import apply_qat, remove_qat

FAMILIES = ["qwen3_moe", "olmoe", "qwen3"]
GROUPS = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
          "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
          "up_proj": ("gate_proj", "up_proj")}


def expected_qdq_state(model: torch.nn.Module, cfg: QuantConfig) -> dict[str, torch.Tensor]:
    """What the forward must use, computed here independently: per-tensor / shared / per-expert scales."""
    out = {}
    for name, p in model.named_parameters():
        mod_name, leaf = name.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        if cfg.is_ignored(mod_name):
            continue
        if isinstance(mod, torch.nn.Linear) and leaf == "weight":
            parent_name, short = mod_name.rsplit(".", 1)
            parent = model.get_submodule(parent_name)
            members = GROUPS.get(short, (short,))
            amax = max(float(getattr(parent, m).weight.detach().abs().amax().float()) for m in members)
            out[name] = fake_quantize(p.detach(), global_scale_from_amax(torch.tensor(amax)))
        elif p.dim() == 3:  # fused experts [E, out, in]: one global scale per expert
            out[name] = torch.stack([fake_quantize(p.detach()[e]) for e in range(p.shape[0])])
    return out


def _fwd_bwd(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant", ["none", "naive"])
def test_none_is_bit_identical_to_stock(family, quant):
    stock = tiny_model(family)
    model = copy.deepcopy(stock)
    classes = {n: type(m) for n, m in model.named_modules()}
    assert apply_qat(model, QuantConfig(quant=quant)) is None
    assert {n: type(m) for n, m in model.named_modules()} == classes
    ids = tokens()
    l0, g0 = _fwd_bwd(stock, ids)
    l1, g1 = _fwd_bwd(model, ids)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


@pytest.mark.parametrize("family", FAMILIES)
def test_w4a16_forward_and_grads_equal_bf16_model_at_qdq_weights(family):
    """Logits and every gradient equal (bit for bit) the stock model run at the QDQ weights (STE)."""
    model = tiny_model(family)
    cfg = QuantConfig(quant="quads")
    ref = copy.deepcopy(model)
    expected = expected_qdq_state(model, cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in expected:
                p.copy_(expected[n])
    state = apply_qat(model, cfg)
    kinds = {k for k, *_ in state.modules.values()}
    assert kinds == ({"linear", "experts"} if family != "qwen3" else {"linear"})
    # Every linear/expert weight outside the ignore list is quantized; router, embeddings, lm_head, norms not.
    quantized_params = {f"{n}.weight" for n, v in state.modules.items() if v[0] == "linear"} | {
        f"{n}.{p}" for n, v in state.modules.items() if v[0] == "experts" for p in ("gate_up_proj", "down_proj")}
    assert quantized_params == set(expected)
    assert not any(".gate." in n or n.endswith("mlp.gate") or "lm_head" in n or "embed" in n for n in state.modules)
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tokens()
    l_ref, g_ref = _fwd_bwd(ref, ids)
    l_qat, g_qat = _fwd_bwd(model, ids)
    assert torch.equal(l_ref, l_qat)
    assert g_ref.keys() == g_qat.keys()
    for k in g_ref:
        assert torch.equal(g_ref[k], g_qat[k]), k
    # Parameters untouched (names, values): checkpoints and optimizers see the stock model.
    assert all(torch.equal(sd_before[k], v) for k, v in model.state_dict().items())
    assert list(sd_before) == list(model.state_dict())
    remove_qat(model)
    l_master, _ = _fwd_bwd(model, ids)
    assert not torch.equal(l_master, l_qat)


class _CaptureLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            self.calls.append((args[0].detach().clone(), args[1].detach().clone()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_effective_expert_weights_are_fake_quantize_per_expert(family):
    """With the eager experts implementation the forward's own F.linear calls see fake_quantize(W[e])."""
    model = tiny_model(family, experts_impl="eager")
    experts = model.model.layers[0].mlp.experts
    w13, w2 = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    apply_qat(model, "w4a16")
    h = torch.randn(6, 64).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2], [1, 3]])
    wts = torch.full((6, 2), 0.5, dtype=torch.bfloat16)
    with _CaptureLinear() as cap:
        experts(h, idx, wts)
    assert len(cap.calls) == 8  # 4 experts hit, gate_up then down each
    for e in range(4):
        assert torch.equal(cap.calls[2 * e][1], fake_quantize(w13[e]))
        assert torch.equal(cap.calls[2 * e + 1][1], fake_quantize(w2[e]))
    # The parameters are the master weights again after the call.
    assert torch.equal(experts.gate_up_proj.detach(), w13) and isinstance(experts.gate_up_proj, torch.nn.Parameter)


def test_effective_linear_weights_share_qkv_and_gate_up_scales():
    model = tiny_model("qwen3")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    masters = {n: getattr(m, n).weight.detach().clone() for m, names in ((attn, "qkv"), (mlp, ("gate", "up")))
               for n in ([f"{c}_proj" for c in names])}
    gs_qkv = global_scale_from_amax(torch.stack([masters[f"{c}_proj"].abs().amax().float() for c in "qkv"]).amax())
    gs_gu = global_scale_from_amax(torch.stack([masters[f"{c}_proj"].abs().amax().float() for c in ("gate", "up")]).amax())
    apply_qat(model, "w4a16")
    x = torch.randn(3, 64).to(torch.bfloat16)
    for name, gs in [("q_proj", gs_qkv), ("k_proj", gs_qkv), ("v_proj", gs_qkv), ("gate_proj", gs_gu), ("up_proj", gs_gu)]:
        mod = getattr(attn if name[0] in "qkv" else mlp, name)
        with _CaptureLinear() as cap:
            mod(x)
        assert torch.equal(cap.calls[0][1], fake_quantize(masters[name], gs)), name
        assert torch.equal(cap.calls[0][0], x)  # w4a16: BF16 activations
    # The group shares one scale: k's own per-tensor scale would give different values here.
    assert not torch.equal(fake_quantize(masters["k_proj"]), fake_quantize(masters["k_proj"], gs_qkv))


def _per_row_qdq(x):
    gs = global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
    return fake_quantize(x, gs)


def test_w4a4_linear_quantizes_inputs_per_token():
    model = tiny_model("qwen3")
    o = model.model.layers[0].self_attn.o_proj
    w = o.weight.detach().clone()
    apply_qat(model, "w4a4_qat")
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    x[0, 0] *= 100  # one loud token must not change the others' quantization
    with _CaptureLinear() as cap:
        y = o(x)
    assert torch.equal(cap.calls[0][0], _per_row_qdq(x))
    assert torch.equal(y, F.linear(_per_row_qdq(x), fake_quantize(w)))
    assert torch.equal(_per_row_qdq(x)[1], _per_row_qdq(x[1:])[0])


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_w4a4_experts_match_per_expert_reference(family, impl, monkeypatch):
    """grouped_mm: the model's implementation with the _apply_gate QDQ hook; eager: our per-expert loop."""
    import verl_quads.qat.model as qm

    model = tiny_model(family, experts_impl=impl)
    experts = model.model.layers[0].mlp.experts
    w13, w2 = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    apply_qat(model, "w4a4_qat")
    if impl == "grouped_mm":  # the fast path must be the one taken
        monkeypatch.setattr(qm._QATExperts, "_a4_forward", lambda *a: (_ for _ in ()).throw(AssertionError("loop")))
    torch.manual_seed(3)
    h = torch.randn(7, 64).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    wts = torch.rand(7, 2).to(torch.bfloat16)
    got = experts(h, idx, wts)
    want = torch.zeros_like(h)
    xq = _per_row_qdq(h)
    for e in range(4):
        tok, slot = torch.where(idx == e)
        if len(tok) == 0:
            continue
        gate, up = F.linear(xq[tok], fake_quantize(w13[e])).chunk(2, dim=-1)
        inter = _per_row_qdq(experts.act_fn(gate) * up)
        y = F.linear(inter, fake_quantize(w2[e])) * wts[tok, slot, None]
        want.index_add_(0, tok, y)
    assert torch.equal(got, want)


def test_a4_expert_loop_without_quantization_equals_stock_eager(monkeypatch):
    """The W4A4 experts loop is the stock eager computation plus QDQ: with QDQ replaced by identity it is bit-identical."""
    import verl_quads.qat.model as qm

    stock = tiny_model("qwen3_moe", experts_impl="eager")
    model = copy.deepcopy(stock)
    with torch.no_grad():  # stock at the QDQ weights
        for e in (m for m in stock.modules() if hasattr(m, "gate_up_proj")):
            e.gate_up_proj.copy_(torch.stack([fake_quantize(w) for w in e.gate_up_proj]))
            e.down_proj.copy_(torch.stack([fake_quantize(w) for w in e.down_proj]))
    cfg = QuantConfig(quant="w4a4_qat", ignore=QuantConfig().ignore + (r"self_attn",))
    apply_qat(model, cfg)
    monkeypatch.setattr(qm, "qdq_rtn", lambda x, backend="auto", check_finite=True: x)
    ids = tokens()
    l0, g0 = _fwd_bwd(stock, ids)
    l1, g1 = _fwd_bwd(model, ids)
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)


def test_qat_module_errors_are_clear():
    model = tiny_model("qwen3_moe")
    apply_qat(model, "quads")
    with pytest.raises(RuntimeError, match="already applied"):
        apply_qat(model, "quads")
    with pytest.raises(ValueError, match="allowed: none, naive, w4a16, quads, trace, w4a4_qat"):
        QuantConfig(quant="w4a8")
    # A module with unknown 3-D parameters is refused, naming it.
    m = torch.nn.Module()
    m.blocks = torch.nn.Module()
    m.blocks.weird = torch.nn.Parameter(torch.zeros(2, 16, 16))
    with pytest.raises(ValueError, match=r"blocks .*weird"):
        apply_qat(m, "quads")


def test_check_finite_option():
    """Off by default (no device sync per QDQ; NaN propagates as in BF16); on: a clear error."""
    model = tiny_model("qwen3")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[0, 0] = float("nan")
    strict = copy.deepcopy(model)
    apply_qat(model, "quads")
    assert torch.isnan(model(input_ids=tokens()).logits).any()
    apply_qat(strict, "quads", check_finite=True)
    with pytest.raises(ValueError, match="contains 1 NaN"):
        strict(input_ids=tokens())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_abs_max_is_abs_amax_bit_for_bit(dtype):
    """The one-pass weight amax (infinity norm) equals ``w.abs().amax()`` bit for bit, incl. NaN/inf/zero experts."""
    from verl_quads.qat.weights import abs_max

    torch.manual_seed(0)
    w = (torch.randn(6, 48, 32) * torch.logspace(-3, 3, 6).view(6, 1, 1)).to(dtype)
    w[1] = 0.0
    w[2, 3, 4] = float("nan")
    w[3, 0, 0] = float("-inf")
    w[4] = -w[4].abs()  # the max magnitude comes from a negative element
    w[5, 7, 9] = -0.0
    for dims, keep in (((1, 2), True), ((1, 2), False), (None, False), ((-1,), True)):
        want = w.abs().amax(dim=dims, keepdim=keep) if dims is not None else w.abs().amax()
        got = abs_max(w, dim=dims, keepdim=keep)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.float().nan_to_num(-1.0), want.float().nan_to_num(-1.0)), dims
    assert torch.isnan(abs_max(w, dim=(1, 2))[2])


def test_weight_qdq_option_is_validated_and_per_version_needs_fsdp2():
    """``quant_config.weight_qdq``: allowed values in the error; ``per_version`` without an installed FSDP2 cache
    refuses to run a forward (it would multiply with the plain BF16 weight) and install() refuses a model
    that is not FSDP2-wrapped. (Equality with per_forward under fully_shard: tests/unit/test_qat_fsdp2.py.)"""
    from verl_quads.qat import fsdp_qdq

    with pytest.raises(ValueError, match=r"weight_qdq='per_step': allowed: auto, per_forward, per_version"):
        QuantConfig(quant="quads", weight_qdq="per_step")
    assert QuantConfig.from_mapping("quads", {"weight_qdq": "per_version"}).weight_qdq == "per_version"
    assert QuantConfig(quant="quads").weight_qdq == "auto"
    for family in ("qwen3_moe", "qwen3"):
        model = tiny_model(family)
        apply_qat(model, QuantConfig(quant="quads", weight_qdq="per_version"))
        with pytest.raises(RuntimeError, match=r"weight_qdq=per_version but no FSDP2 per-version weight QDQ is installed"):
            model(input_ids=tokens())
        with pytest.raises(ValueError, match=r"needs the root module wrapped by FSDP2 \(fully_shard\)"):
            fsdp_qdq.install(model)
    model = tiny_model("qwen3")
    apply_qat(model, QuantConfig(quant="quads", weight_qdq="per_forward"))
    with pytest.raises(ValueError, match=r"install\(\) is for quant_config.weight_qdq=per_version \(or auto\)"):
        fsdp_qdq.install(model)


def test_fsdp2_qdq_patch_guard():
    """The FSDP2 all-gather patch (per_version) names the torch releases it was read against and still finds
    the private symbols it wraps in the installed torch."""
    from verl_quads.patches import PatchVersionError
    from verl_quads.patches import fsdp2_qdq_all_gather as patch

    patch.check_upstream()
    with pytest.raises(PatchVersionError, match=r"written for torch 2.11.0, 2.13.0; found 2.14.0"):
        patch.apply(torch_version="2.14.0")
