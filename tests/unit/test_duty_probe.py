"""verl_quads/bench/duty_probe.py on CPU (smoke: the GPU numbers come from the H200; here the table's shape, the
W4A16 output check and the argument errors)."""

import re

import pytest


def test_duty_probe_prints_a_row_per_pass_and_gap(capsys, monkeypatch):
    from verl_quads.bench import duty_probe

    monkeypatch.setitem(duty_probe.SHAPES, "tiny", (False, 32, 64))
    duty_probe.main(["--device", "cpu", "--shapes", "tiny", "--steps", "2", "--calls", "2", "--gaps-ms", "0,0.5"])
    out = capsys.readouterr().out
    rows = re.findall(r"^tiny\s+\|\s+(\d) \|\s+([\d.]+) \|\s+([\d.]+) \|\s+- \|\s+([\d.]+) \|\s+- \|\s+([\d.]+)x$",
                      out, re.M)
    assert [(r[0], r[1]) for r in rows] == [("1", "0.00"), ("1", "0.50"), ("2", "0.00"), ("2", "0.50")], out
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_duty_probe_refuses_bad_arguments(monkeypatch):
    from verl_quads.bench import duty_probe

    with pytest.raises(SystemExit):
        duty_probe.main(["--device", "cpu", "--shapes", "w13"])  # grouped: not a dense shape
    with pytest.raises(SystemExit):
        duty_probe.main(["--device", "cpu", "--gaps-ms", "-1"])
    with pytest.raises(SystemExit):
        duty_probe.main(["--device", "cpu", "--eager", "1", "--eager-modes", "w4a8"])


def test_duty_probe_checks_the_timed_call_against_the_qdq_reference(monkeypatch):
    from verl_quads.bench import duty_probe

    monkeypatch.setitem(duty_probe.SHAPES, "tiny", (False, 32, 64))
    monkeypatch.setattr(duty_probe.tg, "nvfp4_gemm", lambda op, w, s, gs: op.values[:, :32] * 0)
    with pytest.raises(RuntimeError, match="differs from the QDQ reference"):
        duty_probe.measure("tiny", [0.0], 1, 1, duty_probe.torch.device("cpu"))


def test_duty_probe_eager_host_time_prints_per_call_time_and_profile(capsys, monkeypatch):
    from verl_quads.bench import duty_probe

    monkeypatch.setitem(duty_probe.SHAPES, "tiny", (False, 32, 64))
    duty_probe.main(["--device", "cpu", "--shapes", "tiny", "--eager", "2", "--eager-modes", "w4a16,trace"])
    out = capsys.readouterr().out
    for mode in ("w4a16", "trace"):
        for part in ("whole call", "quantize_activation alone", "nvfp4_gemm alone", "bf16 x @ w.T"):
            assert re.search(rf"^\[eager\] tiny M=1 {mode} {re.escape(part)}.*: [\d.]+ us per call, 2 calls$", out,
                             re.M), out
    assert re.search(r"^\[eager\] tiny M=1 trace whole call into GuidanceStore.record_rows .*: [\d.]+ us per call, "
                     r"2 calls$", out, re.M), out
    assert "GuidanceStore" not in out.split("M=1 trace")[0]  # w4a16 records nothing
    assert "tottime" in out and "cumulative" in out and "nvfp4_gemm" in out
