"""verl_quads.diagnostics.realistic at toy size on CPU (< 60 s): local text -> tokenizer (with the BOS
option) -> trained Qwen3-MoE (no weight decay on norms/embedding) -> outlier statistics -> selection
rules -> probe over 3 seeds -> trace guided-layer sweep -> extra probe -> JSON."""

from __future__ import annotations

import json

import torch


def test_realistic_toy(tmp_path):
    from transformers import AutoTokenizer

    from verl_quads.diagnostics.realistic import main

    # one intra-op thread: the toy's thousands of tiny CPU ops otherwise spend most of their time in
    # OpenMP hand-offs (probe phases 12 s -> 3 s alone; 70 s -> 35 s for the test on the shared 2-core host)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run_toy(tmp_path, main, AutoTokenizer)
    finally:
        torch.set_num_threads(threads)


def _run_toy(tmp_path, main, AutoTokenizer):
    rep = main(["--toy", "--seconds", "1", "--modes", "bf16,naive", "--guided-sweep", "1,2",
                "--rule-ratios", "0.5", "--bos", "--weight-decay-on", "matrices",
                "--extra-modes", "quads@0.5", "--block-ratios", "0.5", "--out", str(tmp_path), "--ckpt", str(tmp_path / "ckpt")])
    data = json.loads((tmp_path / "realistic.json").read_text())
    prov = data["provenance"]
    assert data["training"]["steps"] >= 1 and prov["n_files"] > 0 and prov["train_tokens"] > 1000
    assert "<|bos|>" in prov["tokenizer"]
    # --bos: the saved tokenizer (the probe's) starts every prompt with the BOS token the windows started with
    assert not (tmp_path / "model").exists() and (tmp_path / "ckpt" / "config.json").exists()
    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert tok("def f(x):").input_ids[0] == tok.convert_tokens_to_ids("<|bos|>") != tok.eos_token_id
    assert set(data["selection_rules"]["mean"]) == {"naive", "per_call@0.5", "per_token@0.5", "per_call_outaware@0.5",
                                                   "per_token_outaware@0.5", "per_token_channel@0.5",
                                                   "per_token_channel_sampled@0.5"}
    assert set(data["outliers_init"]) == set(data["outliers_trained"]) == {
        f"layer{i}.{k}" for i in range(2) for k in ("attn_in", "mlp_in")}
    for v in data["outliers_trained"].values():
        assert v["kurtosis"] > 0 and v["max_over_median"] >= 1.0
    pm = data["probe"]["per_mode"]
    # --block-ratios 0.5 appends the block rule's mode to the main probe (with its decomposition)
    assert list(pm) == ["bf16", "naive", "quads@0.5:block"] and all(pm[m]["total"]["logp_gap_p99"]["n"] == 3 for m in pm)
    assert "activations_only" in pm["quads@0.5:block"]["decomposition"]
    assert data["probe"]["quads_rules"] == {"quads@0.5:block": {"residual_ratio": 0.5, "residual_per_token": True,
                                                                "residual_granularity": "block"}}
    assert "hf" in data["probe"]["engine"]
    sweep = data["trace_sweep"]
    assert [sweep[k]["guided_layers"] for k in sorted(sweep)] == [1, 2]
    assert sweep["1"]["cache_bytes_per_token"] * 2 == sweep["2"]["cache_bytes_per_token"]
    # all layers guided: the trainer follows every rollout code, so its gap is at most naive's
    assert sweep["2"]["total"]["logp_gap_mean"]["mean"] <= pm["naive"]["total"]["logp_gap_mean"]["mean"]
    assert (tmp_path / "probe.png").exists() and rep["wall_s"] > 0
    # the extra probe reruns bf16/naive as its closure anchors, without decomposition
    px = data["probe_extra"]["per_mode"]
    assert list(px) == ["bf16", "naive", "quads@0.5"] and all("decomposition" not in px[m] or
                                                               set(px[m]["decomposition"]) == {"engine_floor"} for m in px)
    # plain quads@R is the product default: the per-token channel rule over a sampled threshold (session 33)
    assert data["probe_extra"]["quads_rules"]["quads@0.5"]["residual_granularity"] == "channel_sampled"
    assert "quads@0.5: k=0.5 per token channels (sampled threshold)" in (tmp_path / "extra" / "probe.txt").read_text()
    # the emulated rollout (hf engine) resolves residual_combine=auto (the default) to bf16, and says so
    assert data["probe_extra"]["quads_operand"]["quads@0.5"] == {"residual_combine": "auto", "rollout": "bf16",
                                                                 "emulated": "bf16"}
    assert "quads@0.5: k=0.5 per token channels (sampled threshold), operand bf16 (residual_combine=auto)" in \
        (tmp_path / "extra" / "probe.txt").read_text()
    assert (tmp_path / "extra" / "probe.txt").exists() and "extra_probe" in data["phase_seconds"]


def test_realistic_refuses_the_removed_channel_ratios_flag_and_bad_modes():
    """--channel-ratios (session 5: appended quads@R:channel) is refused with the new spelling, before any work;
    a bad --modes entry too (quads@R:token meant per-token BLOCKS until session 5)."""
    import pytest

    from verl_quads.diagnostics.realistic import main

    with pytest.raises(SystemExit, match=r"--channel-ratios was removed: quads@R is the product default rule.*"
                                         r"--block-ratios"):
        main(["--toy", "--seconds", "1", "--channel-ratios", "0.5"])
    with pytest.raises(SystemExit, match=r"--modes / --block-ratios: .*':token'.*quads@R:block"):
        main(["--toy", "--seconds", "1", "--modes", "bf16,quads@0.5:token"])
    with pytest.raises(SystemExit, match=r"--block-ratios must be a comma list"):
        main(["--toy", "--seconds", "1", "--block-ratios", "half"])


def test_weight_decay_groups_and_bos_windows():
    """--weight-decay-on matrices: RMSNorm gains and the token embedding get no decay, every weight matrix
    (attention, router, experts, untied LM head) does; all parameters exactly once. --bos: every training
    window starts with the BOS id (the data sampler is checked by training 1 step on ids that never hold it)."""
    import pytest

    from verl_quads.diagnostics.realistic import build_model, param_groups, train

    m = build_model(vocab=64, layers=1, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, inter=32, seed=0)
    decay, no = param_groups(m, 0.1, "matrices")
    names = {id(p): n for n, p in m.named_parameters()}
    no_names = {names[id(p)] for p in no["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert no["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1 and not no_names & decay_names
    assert no_names | decay_names == set(names.values())
    assert "model.embed_tokens.weight" in no_names and all("norm" in n for n in no_names - {"model.embed_tokens.weight"})
    assert {"lm_head.weight", "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight"} <= decay_names
    assert len(param_groups(m, 0.1, "all")) == 1
    with pytest.raises(ValueError, match="weight decay target"):
        param_groups(m, 0.1, "norms")
    seen = []
    h = m.model.embed_tokens.register_forward_hook(lambda _m, a, _o: seen.append(a[0].clone()))
    train(m, torch.arange(1, 40) % 60 + 1, seconds=60, seq=8, batch=3, lr=1e-3, device="cpu", seed=0, bos_id=0,
          wd_on="matrices", max_steps=1)
    h.remove()
    assert seen[0].shape == (3, 8) and bool((seen[0][:, 0] == 0).all()) and bool((seen[0][:, 1:] != 0).all())


def test_train_restores_last_finite_weights_when_the_loss_diverges():
    """A forward hook turns the logits to NaN from the 150th step on: training stops at the step-200
    check and restores the weights snapshotted at step 100 (all finite), and says so."""
    from verl_quads.diagnostics.realistic import build_model, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = build_model(vocab=64, layers=1, hidden=64, heads=2, kv_heads=1, experts=4, top_k=2, inter=32, seed=0)
        calls = []

        def poison(_m, _a, out):
            calls.append(1)
            return out * float("nan") if len(calls) > 150 else out

        h = m.lm_head.register_forward_hook(poison)
        res = train(m, torch.arange(200) % 64, seconds=120, seq=8, batch=2, lr=1e-3, device="cpu", seed=0, max_steps=400)
        h.remove()
    finally:
        torch.set_num_threads(threads)
    assert res["diverged_at_step"] == 200 and res["restored_step"] == 100 and res["steps"] == 100
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())
    assert res["loss_last"] == res["loss_last"]  # finite: the losses of the restored steps only


def test_encode_docs_equals_the_tokenizers_own_encoding(tmp_path):
    """The parallel per-document encoding == the saved tokenizer's encoding of each document, EOS after each."""
    from verl_quads.diagnostics.realistic import collect_source_text, encode_docs, train_tokenizer

    docs, _, _ = collect_source_text(24, 3000)
    tok = train_tokenizer(docs, tmp_path, 300, sample_bytes=20000, bos=True)
    ref = [t for d in docs for t in tok(d, add_special_tokens=False).input_ids + [tok.eos_token_id]]
    assert torch.equal(encode_docs(tok, docs), torch.tensor(ref)) and len(ref) > len(docs) * 10
