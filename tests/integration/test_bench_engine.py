"""``verl-quads bench engine`` end to end on the real vLLM CPU build (tiny model; the numbers are not checked, the
table is: every mode x batch size timed, BF16 the 1.00x baseline, the others' ratio computed from the same run)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm]


def test_engine_bench_times_each_mode_against_bf16(capsys, tmp_path):
    from verl_quads.bench import engine

    engine.main(["--modes", "bf16,w4a16,w4a16-norouting", "--batch-sizes", "1,2", "--max-tokens", "3",
                 "--prompt-len", "5", "--repeats", "1", "--warmup", "2", "--layers", "1", "--hidden", "64", "--heads", "2",
                 "--kv-heads", "1", "--head-dim", "32", "--experts", "4", "--top-k", "2", "--moe-inter", "64", "--vocab", "512",
                 "--kv-cache-gb", "0.05", "--model-dir", str(tmp_path)])
    out = capsys.readouterr().out
    final = out[out.index("verl-quads bench engine: CPU"):]
    assert "2 untimed + 1 timed runs (median)" in final
    rows = re.findall(r"^([\w-]+)\s+\|\s+(\d+) \|\s+([\d.]+) \|\s+(\d+) \| ([\d.]+)x$", final, re.M)
    assert [(m, b) for m, b, *_ in rows] == [(m, b) for m in ("bf16", "w4a16", "w4a16-norouting") for b in "12"]
    by = {(m, int(b)): (float(t), float(r)) for m, b, t, _, r in rows}
    assert by[("bf16", 1)][1] == by[("bf16", 2)][1] == 1.0
    for m in ("w4a16", "w4a16-norouting"):
        for b in (1, 2):  # x bf16 = BF16 median / this median (times printed to 1 ms, ratios to 0.01)
            tb, tw = by[("bf16", b)][0], by[(m, b)][0]
            lo, hi = (tb - 5e-4) / (tw + 5e-4), (tb + 5e-4) / max(tw - 5e-4, 1e-9)
            assert lo - 0.005 <= by[(m, b)][1] <= hi + 0.005, (m, b, tb, tw, by[(m, b)][1])
    # routing capture on by default (every request's record collected in the timed loop), off in -norouting;
    # a record covers the computed positions: 5 prompt + 2 fed-back tokens (the 3rd is sampled, never computed)
    assert re.findall(r"^\[routing\] (\S+) batch (\d): (\d) records, each experts \((\d+), 1, 2\)", out, re.M) == [
        ("w4a16", "1", "1", "7"), ("w4a16", "2", "2", "7")]
    assert len(re.findall(r"^\[time\] w4a16 batch \d: .*; routing collection median [\d.]+ ms$", out, re.M)) == 2
    assert not re.findall(r"^\[time\] (bf16|w4a16-norouting) .*routing collection", out, re.M)


@pytest.mark.parametrize("processes", ["in", "mp"])
def test_engine_bench_routing_ab_switches_the_host_capture_off_in_the_same_engine(capsys, tmp_path, processes):
    """--routing-ab (and --collect-per-request) in the engine's own process and in vLLM's (mp: engine core + an
    mp-executor worker, as verl runs it; the switch, the hook timing and the records then cross processes through
    collective_rpc)."""
    from verl_quads.bench import engine

    engine.main(["--processes", processes, "--modes", "w4a16", "--routing-ab", "--collect-per-request", "--host-stats",
                 "--batch-sizes", "2", "--max-tokens", "3", "--prompt-len", "5",
                 "--repeats", "2", "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
                 "--head-dim", "32", "--experts", "4", "--top-k", "2", "--moe-inter", "64", "--vocab", "512",
                 "--kv-cache-gb", "0.05", "--model-dir", str(tmp_path)])
    out = capsys.readouterr().out
    final = out[out.index("verl-quads bench engine: CPU"):]
    assert re.findall(r"^(w4a16(?: ab-off)?)\s+\|\s+2 \|\s+[\d.]+ \|", final, re.M) == ["w4a16", "w4a16 ab-off"]
    # 2 timed generates each; the hook ran (and was timed) only in the "on" ones: 2 x (1 prefill + 2 decode) steps,
    # one more per generate when the second request arrives after the first one's prefill was scheduled (seen with
    # mp: the front end hands requests over one by one; the records are the same)
    on = re.search(r"^\[time\] w4a16 batch 2: median [\d.]+ s of \[([^\]]*)\]; routing collection", out, re.M)
    ab = re.search(r"^\[time\] w4a16 ab-off batch 2: median [\d.]+ s of \[([^\]]*)\]; runner hook \(begin_step "
                   r"\+ end_step\) (\d+) us/step host time over (\d+) steps$", out, re.M)
    assert on and ab, out[-3000:]
    assert len(on.group(1).split(",")) == len(ab.group(1).split(",")) == 2
    assert 2 * 3 <= int(ab.group(3)) <= 2 * 4 and int(ab.group(2)) > 0
    assert f"(eager=True, processes {processes})" in out
    host = re.search(r"^\[host\] w4a16 batch 2: cpu s per run \[([^\]]*)\]; gc collections \[([^\]]*)\], gc ms "
                     r"\[([^\]]*)\]$", out, re.M)
    assert host and all(len(g.split(",")) == 2 for g in host.groups()), out[-3000:]
    assert all(float(c) > 0 for c in host.group(1).split(","))
    # --collect-per-request: 2 more generates, each request's record popped by its own RPC (raises if one is missing)
    assert re.search(r"^\[collect\] w4a16 batch 2: one RPC per request [\d.]+ ms for 2 requests \(median of 2\); "
                     r"one RPC for the batch [\d.]+ ms$", out, re.M), out[-3000:]


def test_engine_bench_trace_collects_every_requests_guidance(capsys, tmp_path):
    """A trace engine's timed generates also pop every request's guidance (what verl's server hands the trainer)."""
    from verl_quads.bench import engine

    engine.main(["--modes", "trace", "--batch-sizes", "2", "--max-tokens", "3", "--prompt-len", "5", "--repeats", "1",
                 "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                 "--experts", "4", "--top-k", "2", "--moe-inter", "64", "--vocab", "512", "--kv-cache-gb", "0.05",
                 "--model-dir", str(tmp_path)])
    out = capsys.readouterr().out
    # one layer, every GEMM guided: qkv / o_proj (K 64), experts w13 (K 64) and w2 (K 64, 2 slots):
    # 3 x (64/8 + 64/16 + 4) + 2 x (64/8 + 64/16 + 4) = 80 bytes per token; 5 prompt + 2 fed-back positions
    assert re.search(r"^\[guidance\] trace batch 2: 2 requests, each 7 positions x 4 guided GEMMs, 80 bytes per "
                     r"token$", out, re.M), out[-3000:]
    assert re.search(r"^\[time\] trace batch 2: median [\d.]+ s of \[[^\]]*\]; routing collection median [\d.]+ ms; "
                     r"guidance collection median [\d.]+ ms$", out, re.M), out[-3000:]


def test_engine_bench_refuses_bad_arguments():
    from verl_quads.bench import engine

    with pytest.raises(SystemExit, match="unknown"):
        engine.main(["--modes", "bf16,fp8"])
    with pytest.raises(SystemExit, match="unknown"):
        engine.main(["--modes", "bf16-norouting"])
    with pytest.raises(SystemExit, match="must be positive"):
        engine.main(["--batch-sizes", "0"])
    with pytest.raises(SystemExit, match="--warmup must be >= 1"):
        engine.main(["--warmup", "0"])
    with pytest.raises(SystemExit, match="--profile needs --processes in"):
        engine.main(["--profile", "--processes", "mp"])
