"""scripts/triton36_check.py's job runner (the offline sm_90 compile check is not run in CI: it downloads triton 3.6):
a job that kills its worker process is reported as that job's failure and every other job still reports, instead of
the whole check hanging (session 13: a triton 3.6 LLVM abort left multiprocessing.Pool waiting forever)."""

import importlib.util
import os
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "triton36_check.py"


@pytest.fixture(scope="module")
def t36():
    spec = importlib.util.spec_from_file_location("triton36_check_under_test", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def _job(i):
    if i == 3:
        os._exit(134)  # what an LLVM assertion abort does to the compiling process
    return i, True, "", 0.0


@pytest.mark.parametrize("workers", [1, 3])
def test_run_jobs_reports_a_dead_worker_as_that_jobs_failure(t36, workers):
    got = {i: (ok, msg) for i, ok, msg, _ in t36.run_jobs(_job, 7, workers)}
    assert sorted(got) == list(range(7))
    assert [i for i, (ok, _) in got.items() if not ok] == [3]
    assert "process died" in got[3][1]


def test_run_jobs_without_deaths_runs_each_job_once(t36):
    got = [r[0] for r in t36.run_jobs(_ok, 5, 2)]
    assert sorted(got) == list(range(5))


def _ok(i):
    return i, True, "", 0.0
