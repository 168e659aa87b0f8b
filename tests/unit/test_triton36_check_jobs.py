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


_RESOURCES_PROBE = r'''
import importlib.util, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = importlib.util.spec_from_file_location("t36", T36_PATH)
t36 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t36)


@triton.jit
def _copy(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    v = tl.load(x_ptr + i)  # 64 values per thread, all live across the row's sum
    tl.store(y_ptr + i, v / tl.sum(v * v, axis=0))


got = {}
for cap in (None, 32):
    opts = {"num_warps": 4} if cap is None else {"num_warps": 4, "maxnreg": cap}
    ck = triton.compile(ASTSource(_copy, {"x_ptr": "*fp32", "y_ptr": "*fp32", "N": "constexpr"}, {(2,): 8192}),
                        target=GPUTarget("cuda", 90, 32), options=opts)
    res = t36._resources(ck)
    m = re.match(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    assert m, res
    got[cap] = (int(m.group(1)), int(m.group(2)))
assert got[None][0] > 32 and 0 < got[32][0] <= 32 and got[32][1] > 0, got
print("compiled")
'''


def test_resources_reports_registers_of_an_sm90_compile(tmp_path):
    """``--resources`` (registers / spills per compile, from the cubin by triton's cuobjdump): a real sm_90 compile
    of a small kernel (64 values per thread held across a reduction) reports ``REG:n STACK:n SHARED:n ...``: more than
    32 registers uncapped, at most 32 and a non-empty spill stack under a 32-register cap."""
    from sm90_compile import compile_for_sm90_in_subprocess

    probe = tmp_path / "resources_probe.py"  # @triton.jit needs its source in a file
    probe.write_text(f"T36_PATH = {str(_PATH)!r}\n" + _RESOURCES_PROBE)
    compile_for_sm90_in_subprocess(f"import runpy; runpy.run_path({str(probe)!r}, run_name='__main__')",
                                   "offline check: on a GPU machine the kernels compile for the device itself")


_PATCH_HOST_PROBE = r'''
import importlib.util
import torch

spec = importlib.util.spec_from_file_location("t36", T36_PATH)
t36 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t36)
from verl_quads.nvfp4 import gemm_shared, gluon_dispatch, gluon_gemm, triton_gemm, triton_stream

mods = [m for m in t36.kernel_modules() if m.startswith("verl_quads.nvfp4.")]
for m in mods:
    __import__(m)
t36.patch_host(t36.host_modules(mods))
cpu = torch.device("cpu")
# the rewritten num_sms answers for the H200 in every module that imported it by name (the split-K plans)
for mod in (gemm_shared, triton_gemm, triton_stream):
    assert mod.num_sms is gemm_shared.num_sms and mod.num_sms(cpu) == 132, mod.__name__
# a host-only dispatch module (no kernel) is rewritten too: the dense Gluon table entry is taken on a "GPU" tensor
gluon_gemm.gluon_available = lambda: (True, "")  # whatever this machine's triton has
x = torch.zeros(4, 8192, dtype=torch.bfloat16)
w = torch.zeros(8192, 4096, dtype=torch.uint8)
assert gluon_dispatch.gluon_dense_config(x, w) is gluon_dispatch.GLUON_TABLE[(4, 8192, 8192)]
print("patched")
'''


def test_patch_host_reaches_imported_names_and_dispatch_modules(tmp_path):
    """The dry H200 of the offline check: a host function rewritten to read every tensor as a CUDA one must be the
    one every module calls -- also modules that imported it by name (triton_gemm / triton_stream import
    gemm_shared.num_sms: the split-K plans answered 1 SM there and 27 launches went unchecked) and modules without a
    kernel (gluon_dispatch: the Gluon table entries were never taken). Run in a subprocess: patch_host replaces
    torch.cuda queries process-wide."""
    import subprocess

    probe = tmp_path / "patch_host_probe.py"
    probe.write_text(f"T36_PATH = {str(_PATH)!r}\n" + _PATCH_HOST_PROBE)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = str(_PATH.parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0 and "patched" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
