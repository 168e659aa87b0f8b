"""Offline triton 3.6 compile check, for sm_90, of every Triton / Gluon kernel launch verl-quads makes (no GPU).

Why: the H200 runs triton 3.6, this machine triton 3.9. Session 8 shipped a string constexpr default in a
@triton.jit helper that triton 3.9 compiled (also for sm_90 offline) but triton 3.6 rejected at every kernel
that called it ("'str' object has no attribute 'type'"), two commits before an H200 run showed it.

Run it through ``bash scripts/triton36_check.sh`` (it builds the triton 3.6 venv this needs; see its header).
It also runs under another triton (e.g. the main environment's 3.9, for comparison); it relies on the JIT's
``run`` / ``_do_compile`` internals of triton 3.6 - 3.9.

How (a "dry GPU" run: no kernel executes):
1. The active triton driver is replaced by a stub that reports an sm_90 CUDA target, every ``torch.Tensor``
   claims ``is_cuda`` (so ``check_available`` and the dispatch answer as on a GPU; TRITON_INTERPRET must be unset),
   and ``JITFunction._do_compile`` is replaced by a recorder: a launch ``kernel[grid](...)`` goes through triton's
   own ``JITFunction.run`` (its binder: argument types, integer / pointer specialization, constexprs, options incl.
   num_warps / num_stages / maxnreg / enable_fp_fusion) and the recorder keeps what triton would compile
   (deduplicated by triton's own cache key) instead of compiling and launching it.
2. A CPU tensor's ``.device.type`` cannot say "cuda": the kernel modules' host functions that test it are
   re-defined from their source with the test read as true, and the torch.cuda queries they then make answer for
   one H200 (capability 9.0, 132 SMs); see :func:`patch_host`.
3. Scenarios call the public functions (verl_quads.nvfp4 with backend="triton", triton_channel, triton_gemm
   nvfp4_linear / nvfp4_gemm / moe_forward, gluon_gemm, the gemv / gluon probes) at real H200 shapes with the
   default dispatch and with every table entry / named variant: DECODE_TABLE, MID_TABLE, GLUON_TABLE, pick_config,
   KERNELS / RESIDUAL_VARIANTS, CHANNEL_CONFIG + CHANNEL_VARIANTS, the StreamConfig VARIANTS of
   tests/gpu/test_nvfp4_gemm_stream_gpu.py. Kernels do not run: tensors they would fill are allocated as zeros,
   and moe_align returns the torch reference's routing (host code indexes with it).
4. Every recorded launch is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32),
   options=...)`` -- what ``_do_compile`` does on the H200 -- in worker processes; by default one per (kernel,
   argument types, constexprs, options), i.e. launches that differ only in which pointers / integers are multiples
   of 16 share one compile (``--all-alignments``: all). One line per compile (ok / FAIL + the error), then the
   launchable kernels (a name ending in ``_kernel`` or launched as ``name[``) that no scenario reached.

Exit status: 0 = every compile passed, every launchable kernel was reached and every scenario ran; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_SMS = 132
KERNEL_MODULES_DIR = os.path.join(ROOT, "verl_quads")

RECORDS: dict = {}  # (jit fn, 3.6 cache key) -> record
SCENARIO = ["?"]  # the scenario running now (recorded with each launch)
DRIVE_ERRORS: list[tuple[str, str]] = []


# --------------------------------------------------------------------------------------------------------------
# 1. the dry GPU
# --------------------------------------------------------------------------------------------------------------

def install_dry_gpu():
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("triton36_check: unset TRITON_INTERPRET (this check records compiled-mode launches)")
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", 90, 32)

    class DryDriver:  # what JITFunction.run / create_binder ask of the active driver
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return target

    driver.set_active(DryDriver())

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        RECORDS.setdefault((self, key), dict(fn=self, signature=signature, constexprs=constexprs, attrs=attrs,
                                             options=options, scenario=SCENARIO[0], count=0))["count"] += 1
        return None  # JITFunction.run returns before any launch

    JITFunction._do_compile = record
    torch.Tensor.is_cuda = property(lambda self: True)  # every tensor "is on the GPU" (dispatch only)
    return triton, target


def kernel_modules() -> list[str]:
    """Every verl_quads module whose source defines a @triton.jit function."""
    mods = []
    for dirpath, _, files in os.walk(KERNEL_MODULES_DIR):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    text = fh.read()
                    if "@triton.jit" in text or "@gluon.jit" in text:
                        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                        mods.append(rel)
    return sorted(mods)


def host_modules(mods: list[str]) -> list[str]:
    """The modules :func:`patch_host` rewrites: the kernel modules ``mods`` and every imported module of
    verl_quads.nvfp4 (host-only ones too: gluon_dispatch's table lookups test the device)."""
    return sorted(set(mods) | {m for m in sys.modules if m.startswith("verl_quads.nvfp4.")})


_DEVICE_TEST = re.compile(r"""(?<![\w.])([A-Za-z_][\w.]*?)\.type\s*(==|!=)\s*(["'])cuda\3""")


def _replace_everywhere(name: str, old, new) -> None:
    """``new`` for ``old`` under ``name`` in every loaded verl_quads module that holds it: the defining module and
    those that imported it by name (triton_gemm / triton_stream call gemm_shared.num_sms, triton_gemm.moe_forward
    calls moe_routing.moe_align through their own bindings)."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("verl_quads.") and vars(mod).get(name) is old:
            setattr(mod, name, new)


def patch_host(mods) -> list[str]:
    """The host-side answers of the H200. ``check_available`` / ``interpreting`` already answer as on a GPU (no
    TRITON_INTERPRET, every tensor ``is_cuda``). A CPU tensor's ``.device.type`` cannot say "cuda": every module-level
    function of ``mods`` that tests ``<expr>.type == "cuda"`` (or ``!=``) is re-defined from its source with
    that test replaced by True (False), and the torch.cuda queries it may then make answer for one H200 (sm_90,
    132 SMs, no graph capture). Returns the rewritten functions' names."""
    import __future__
    import types

    import torch

    from verl_quads.nvfp4 import moe_routing as mr

    class Props:
        multi_processor_count = H200_SMS
        major, minor = 9, 0
        name = "NVIDIA H200 (dry run)"

    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: Props()
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    rewritten = []
    for mod in mods:
        m = sys.modules[mod]
        for name, fn in list(vars(m).items()):
            if not isinstance(fn, types.FunctionType) or fn.__module__ != mod:
                continue
            try:
                src, line = inspect.getsourcelines(fn)
            except (OSError, TypeError):
                continue
            src = "".join(src)
            if not _DEVICE_TEST.search(src) or src[:1].isspace() or src.startswith("@"):
                continue
            new = _DEVICE_TEST.sub(lambda mt: "True" if mt.group(2) == "==" else "False", src)
            code = compile("\n" * (line - 1) + new, m.__file__, "exec", __future__.annotations.compiler_flag,
                           dont_inherit=True)
            ns: dict = {}
            exec(code, m.__dict__, ns)
            _replace_everywhere(name, fn, ns[name])
            rewritten.append(f"{mod.rsplit('.', 1)[-1]}.{name}")

    # moe_align's routing feeds host code (quads per-call selection indexes with sorted_slots): record its
    # launches, return the torch reference's routing (same layout, real values)
    orig_align = mr.moe_align

    def moe_align(expert_ids, num_experts, block_m):
        orig_align(expert_ids, num_experts, block_m)
        return mr.moe_align_reference(expert_ids, num_experts, block_m)

    _replace_everywhere("moe_align", orig_align, moe_align)

    # the decode-once path's cuBLAS call (aten::mm.dtype exists for CUDA only): its float32 product as zeros, like
    # every kernel output here, so that the launches around it (block values, scale epilogue) are recorded
    from verl_quads.nvfp4 import dequant_gemm as dg

    dg._mm_f32 = lambda a, w: torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32)
    return rewritten


# --------------------------------------------------------------------------------------------------------------
# 2. scenarios: real calls at H200 shapes
# --------------------------------------------------------------------------------------------------------------

DTYPES = ("bfloat16", "float16", "float32")
DENSE = {"d4096": (4096, 4096), "d8192": (8192, 8192), "qkv": (5120, 2048), "o_proj": (2048, 4096)}
MOE = dict(experts=128, hidden=2048, inter=768, top_k=8)  # Qwen3-30B-A3B


@contextlib.contextmanager
def scenario(name):
    """One drive step. Tensors that kernels would fill are allocated as zeros (``torch.empty`` -> ``torch.zeros``):
    host code that reads them (block tables, amaxes) gets in-range values; the kernels themselves never run."""
    import torch

    SCENARIO[0] = name
    saved = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty, torch.empty_like = torch.zeros, torch.zeros_like
    torch.Tensor.new_empty = torch.Tensor.new_zeros
    try:
        yield
    except Exception as e:  # a drive failure: the scenario's later launches were not recorded
        DRIVE_ERRORS.append((name, f"{type(e).__name__}: {e}".splitlines()[0][:300]))
        with open(LOG[0], "a") as f:
            f.write(f"=== drive error in {name}\n{traceback.format_exc()}\n")
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved


LOG = [os.path.join(tempfile.gettempdir(), "triton36_check.log")]
_CACHE: dict = {}


def _x(m, k, dtype="bfloat16", seed=0):
    import torch

    key = ("x", m, k, dtype, seed)
    if key not in _CACHE:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=g)
        x[:, ::293] *= 30.0
        _CACHE[key] = x.to(getattr(torch, dtype))
    return _CACHE[key]


def _weight(n, k, experts=None):
    """Packed weight / e4m3 scales / global scale(s) of an [N, K] (or [E, N, K]) NVFP4 weight (values never read)."""
    import torch

    key = ("w", n, k, experts)
    if key not in _CACHE:
        lead = () if experts is None else (experts,)
        packed = torch.zeros(*lead, n, k // 2, dtype=torch.uint8)
        scale = torch.zeros(*lead, n, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
        gs = torch.full(lead, 100.0, dtype=torch.float32)
        _CACHE[key] = (packed, scale, gs)
    return _CACHE[key]


def _ids(t, seed=0, local=True, experts=None):
    import torch

    g = torch.Generator().manual_seed(seed)
    e = experts or MOE["experts"]
    ids = torch.stack([torch.randperm(e, generator=g)[: MOE["top_k"]] for _ in range(t)]).to(torch.int32)
    if not local:  # expert parallel: some slots on no local expert
        ids[::3, 0] = -1
    return ids


def scenarios_core():
    """verl_quads.nvfp4 on the triton backend: quantize / QDQ / dequantize (KERNELS default, v1, int bf16 store),
    residual block rule (the "auto" default by row length, per call, the long-row multi-kernel path, every
    RESIDUAL_VARIANTS entry and "row", the Gluon kernel "gluon" with its VARIANTS), guided quantize."""
    import torch

    from verl_quads import nvfp4
    from verl_quads.nvfp4 import triton_kernels as tk

    def quant_all(x, m):
        q = None
        for gs in (None, "row", x.abs().amax().float(), torch.tensor(10.0), torch.full((m, 1), 10.0)):
            amax = gs if isinstance(gs, str) or gs is None or gs.dim() == 0 and gs is not None and gs.item() != 10.0 \
                else None
            g = None if amax is not None or gs is None else gs
            q = nvfp4.quantize(x, g, amax=amax, backend="triton")
            nvfp4.fake_quantize(x, g, amax=amax, backend="triton")
        return q

    for kind, store, dts, shapes in [("v2", "native", DTYPES, [(1, 2048), (16, 4096), (256, 8192), (4, 768)]),
                                     ("v1", "native", DTYPES, [(16, 4096)]),
                                     ("v2", "int", ("bfloat16",), [(16, 4096)])]:
        for m, k in shapes:
            for dt in dts:
                with scenario(f"core quantize {kind} {store} {dt} {m}x{k}"):
                    old = dict(tk.KERNELS)
                    tk.KERNELS.update(quantize=kind, fake_quantize=kind, bf16_store=store)
                    try:
                        q = quant_all(_x(m, k, dt), m)
                        for out in DTYPES:
                            nvfp4.dequantize(q, getattr(torch, out), backend="triton")
                    finally:
                        tk.KERNELS.clear()
                        tk.KERNELS.update(old)
    with scenario("core quantize per-expert 3-D"):  # a weight's layout: per-expert global scales
        w = torch.randn(4, 256, 2048).to(torch.bfloat16)
        nvfp4.quantize(w, torch.full((4, 1, 1), 10.0), backend="triton")
        nvfp4.fake_quantize(w, torch.full((4, 1, 1), 10.0), backend="triton")

    def residual(x, per_token=True, amax="row", sw=None, ratio=0.5):
        nvfp4.residual_quantize(x, ratio, amax=amax, per_token=per_token, score_weight=sw, backend="triton",
                                granularity="block")
        nvfp4.residual_fake_quantize(x, ratio, amax=amax, per_token=per_token, score_weight=sw, backend="triton",
                                     granularity="block")

    long_k = 16 * (tk.TILED_CONFIG["max_blocks"] + 8)  # past the fused kernels: the multi-kernel path
    for m, k in [(1, 1024), (16, 2048), (64, 4096), (256, 8192), (2, 16384), (2, long_k)]:
        for dt in DTYPES if (m, k) == (16, 2048) else ("bfloat16",):
            x = _x(m, k, dt)
            with scenario(f"core residual auto {dt} {m}x{k}"):
                residual(x)
                residual(x, per_token=False)
                residual(x, amax=None)
                residual(x, per_token=False, amax=None)
                if (m, k) in ((16, 2048), (2, long_k)):
                    residual(x, sw=torch.rand(k) + 0.5)
                    residual(x, per_token=False, sw=torch.rand(k) + 0.5)
                    nvfp4.residual_fake_quantize(x, 0.5, torch.tensor(10.0), per_token=True, backend="triton",
                                                 granularity="block")
    for var in ["row"] + list(tk.RESIDUAL_VARIANTS):
        for m, k in [(16, 2048), (64, 8192)]:
            with scenario(f"core residual {var} bfloat16 {m}x{k}"):
                if var == "row":
                    old = tk.KERNELS["residual_per_token"]
                    tk.KERNELS["residual_per_token"] = "row"
                    try:
                        residual(_x(m, k))
                    finally:
                        tk.KERNELS["residual_per_token"] = old
                else:
                    with tk.residual_variant(var):
                        residual(_x(m, k))

    # the Gluon residual kernel (gluon_residual, KERNELS["residual_per_token"] = "gluon"; QDQ, bf16): every CONFIG
    # row length, its VARIANTS, and the STOP probes of bench nvfp4 --residual-probe
    from verl_quads.nvfp4 import gluon_residual as gr

    for m, k in [(8192, 8192), (32768, 2048)]:  # the "auto" default takes it at these sizes (GLUON_RESIDUAL_AUTO)
        with scenario(f"core residual auto (Gluon) bfloat16 {m}x{k}"):
            residual(_x(m, k))
            residual(_x(m, k), ratio=0.25)
    for name in gr.VARIANTS:
        for m, k in [(4, 512), (4, 1024), (16, 2048), (16, 4096), (64, 8192), (2, 16384), (3, 4144)]:
            with scenario(f"core residual gluon {name} bfloat16 {m}x{k}"):
                old = tk.KERNELS["residual_per_token"]
                tk.KERNELS["residual_per_token"] = "gluon"
                try:
                    with gr.variant(name):
                        for ratio in (0.5, 0.25):
                            nvfp4.residual_fake_quantize(_x(m, k), ratio, amax="row", backend="triton",
                                                         granularity="block")
                        if name == "gluon":
                            for stop in (1, 2, 3):
                                x = _x(m, k)
                                tk._residual_rows(x, nvfp4.per_row_global_scale(x), x, 0.5, None, packed=False,
                                                  stop=stop)
                finally:
                    tk.KERNELS["residual_per_token"] = old

    for m, k in [(1, 2048), (16, 4096)]:
        for dt in DTYPES:
            with scenario(f"core guided {dt} {m}x{k}"):
                x = _x(m, k, dt)
                rec = nvfp4.extract_guidance(nvfp4.quantize(x, amax="row", backend="torch"))
                nvfp4.quantize_guided(x, rec, backend="triton")
                nvfp4.fake_quantize_guided(x, rec, backend="triton")


def scenarios_channel():
    """QUADS channel rule (triton_channel): CHANNEL_CONFIG at the rollout's shapes (bf16, amax="row", per token),
    score weights / given scales at two, fp16 / fp32 at one, every CHANNEL_VARIANTS entry at four (the "sampled ..."
    entries with granularity="channel_sampled", also at 4096 rows), granularity="channel_sampled" at six."""
    import torch

    from verl_quads import nvfp4
    from verl_quads.nvfp4 import triton_channel as tc

    def channel(x, amax="row", sw=None, gs=None, granularity="channel"):
        nvfp4.residual_quantize(x, 0.5, gs, amax=amax, per_token=True, score_weight=sw, backend="triton",
                                granularity=granularity)
        nvfp4.residual_fake_quantize(x, 0.5, gs, amax=amax, per_token=True, score_weight=sw, backend="triton",
                                     granularity=granularity)

    for m, k in [(1, 768), (1, 2048), (16, 2048), (16, 8192), (64, 4096), (256, 768), (256, 8192), (1024, 2048),
                 (1024, 4096), (4, 32768)]:
        with scenario(f"channel CHANNEL_CONFIG bfloat16 {m}x{k}"):
            channel(_x(m, k))
    for m, k in [(16, 2048), (16, 8192)]:
        with scenario(f"channel CHANNEL_CONFIG bfloat16 {m}x{k} amax/gs/score_weight"):
            x = _x(m, k)
            channel(x, amax=None)
            channel(x, sw=torch.rand(k) + 0.5)
            channel(x, amax=None, gs=torch.tensor(10.0))
    for dt in ("float16", "float32"):  # (the slowest kernel to compile: 5-25 s each; other dtypes at one shape)
        with scenario(f"channel CHANNEL_CONFIG {dt} 16x8192"):
            channel(_x(16, 8192, dt))
    for vname, over in tc.CHANNEL_VARIANTS.items():
        sampled = vname.startswith("sampled")
        shapes = [(1, 2048), (16, 8192), (256, 2048), (256, 8192)] + ([(4096, 4096), (4096, 8192)] if sampled else [])
        for m, k in shapes:
            with scenario(f"channel CHANNEL_VARIANTS[{vname!r}] bfloat16 {m}x{k}"):
                with tc.channel_config(**over):
                    channel(_x(m, k), granularity="channel_sampled" if sampled else "channel")
    for m, k in [(1, 4096), (1, 8192), (1024, 4096), (1024, 8192), (4096, 4096), (4096, 8192)]:
        with scenario(f"channel_sampled CHANNEL_CONFIG bfloat16 {m}x{k}"):
            channel(_x(m, k), granularity="channel_sampled")


ACT_VARIANTS = [  # (act_mode, residual_per_token, residual_combine, residual_granularity)
    ("w4a16", False, "fp4x2", "block"),
    ("quads", True, "bf16", "channel"),  # the rollout's default on the triton backend
    ("naive", False, "fp4x2", "block"), ("trace", False, "fp4x2", "block"),
    ("quads", True, "fp4x2", "block"), ("quads", False, "fp4x2", "block"), ("quads", True, "bf16", "block"),
    ("quads", False, "bf16", "block"),
]


def scenarios_gemm():
    """triton_gemm: dense nvfp4_linear and moe_forward with the default dispatch (DECODE_TABLE, MID_TABLE,
    pick_config), every table entry explicitly, the GPU test's StreamConfig VARIANTS, the gemv probes."""
    import torch

    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.nvfp4 import triton_stream as ts

    # dense, default dispatch: the w4a16 / rollout-default activation forms at every M bucket that has a table entry
    # or a pick_config tile, the other forms at decode / mid / prefill M
    for name, (n, k) in DENSE.items():
        w = _weight(n, k)
        for m in (1, 3, 4, 16, 64, 256, 4096):
            for i, (mode, pt, comb, gran) in enumerate(ACT_VARIANTS):
                if i >= 2 and m not in (1, 16, 256):
                    continue
                with scenario(f"linear {name} M={m} {mode} pt={pt} {comb} {gran}"):
                    tg.nvfp4_linear(_x(m, k), *w, None, mode, residual_per_token=pt, residual_combine=comb,
                                    residual_granularity=gran)
    # the same calls with dequant_gemm.DEQUANT_MIN_ROWS emptied where it routes them to the decode-once path: the fused
    # kernels these rows take where torch lacks mm's out_dtype
    from verl_quads.nvfp4 import dequant_gemm as dg

    saved = dict(dg.DEQUANT_MIN_ROWS)
    dg.DEQUANT_MIN_ROWS.clear()
    try:
        for name, (n, k) in DENSE.items():
            w = _weight(n, k)
            for m in (256, 4096):
                for i, (mode, pt, comb, gran) in enumerate(ACT_VARIANTS):
                    if i >= 2 and m != 256:
                        continue
                    with scenario(f"linear {name} M={m} {mode} pt={pt} {comb} {gran} (fused: no DEQUANT_MIN_ROWS)"):
                        tg.nvfp4_linear(_x(m, k), *w, None, mode, residual_per_token=pt, residual_combine=comb,
                                        residual_granularity=gran)
    finally:
        dg.DEQUANT_MIN_ROWS.update(saved)
    for m in (1, 4, 16, 256):
        n, k = DENSE["d4096"]
        with scenario(f"linear d4096 M={m} w4a16 fp16/fp32/bias"):
            bias = torch.zeros(n, dtype=torch.bfloat16)
            tg.nvfp4_linear(_x(m, k, "float16"), *_weight(n, k), None, "w4a16")
            tg.nvfp4_linear(_x(m, k, "float32"), *_weight(n, k), None, "w4a16")
            tg.nvfp4_linear(_x(m, k), *_weight(n, k), bias, "w4a16")
            tg.nvfp4_linear(_x(m, k), *_weight(n, k), bias, "naive")

    # MoE, default dispatch (routing kernels, gate, combine, both grouped GEMMs)
    e, h, inter = MOE["experts"], MOE["hidden"], MOE["inter"]
    w13 = _weight(2 * inter, h, e)
    w2 = _weight(h, inter, e)
    for t in (1, 2, 4, 16, 64, 256, 1024):
        for local in (True, False):
            ids = _ids(t, local=local)
            sw = torch.rand(t, MOE["top_k"])
            for i, (mode, pt, comb, gran) in enumerate(ACT_VARIANTS):
                if (i >= 2 and t not in (1, 16, 256)) or (not local and i >= 2):
                    continue
                for dt in DTYPES if (i == 0 and local and t in (1, 16)) else ("bfloat16",):
                    with scenario(f"moe T={t} local={local} {mode} pt={pt} {comb} {gran} {dt}"):
                        tg.moe_forward(_x(t, h, dt), sw, ids, *w13, *w2, mode, residual_per_token=pt,
                                       residual_combine=comb, residual_granularity=gran)
    with scenario("moe_align 512 experts"):  # decode with more experts than the moe scenarios': the one launch
        for t in (1, 16):
            mr.moe_align(_ids(t, experts=512), 512, 16)
    with scenario("moe_align past MOE_ALIGN_ONE_LAUNCH_MAX slots"):  # the two launches: histogram, scan + scatter
        mr.moe_align(_ids(mr.MOE_ALIGN_ONE_LAUNCH_MAX // MOE["top_k"] + 1), MOE["experts"], 128)

    # every DECODE_TABLE / MID_TABLE entry at its own shape, explicitly
    for (grouped, b, n, k), cfg in ts.DECODE_TABLE.items():
        for dt in DTYPES:
            with scenario(f"DECODE_TABLE {(grouped, b, n, k)} {dt}"):
                _gemm(tg, grouped, b, n, k, ts.decode_config(b, n, k, grouped, getattr(torch, dt)), dt)
    for (grouped, b, n, k, a4), cfg in tg.MID_TABLE.items():
        with scenario(f"MID_TABLE {(grouped, b, n, k, a4)}"):
            _gemm(tg, grouped, b * e if grouped else b, n, k, cfg, "bfloat16", mode="naive" if a4 else "w4a16")

    # the StreamConfig variants of the GPU stream tests (tests/gpu/test_nvfp4_gemm_stream_gpu.py): at two of its dense
    # shapes (M=1 d8192; M=3 d4096 with bias), fp16 at its small shape, the MoE w13 GEMM at 4 tokens
    variants = []
    with scenario("stream VARIANTS (read from the GPU test)"):
        variants = _gpu_stream_variants(tg)
    for i, cfg in enumerate(variants):
        with scenario(f"stream VARIANTS[{i}] {cfg.label}"):
            for m, n, k in [(1, 8192, 8192), (3, 4096, 4096)]:
                bias = torch.zeros(n, dtype=torch.bfloat16) if m == 3 else None
                tg.nvfp4_linear(_x(m, k), *_weight(n, k), bias, "w4a16", config=cfg)
            tg.nvfp4_linear(_x(4, 1024, "float16"), *_weight(256, 1024), None, "w4a16", config=cfg)
            _gemm(tg, True, 4 * MOE["top_k"], 2 * inter, h, cfg, "bfloat16")

    # gemv probes (verl-quads bench rollout --gemv-roofline): each CUDA-core DECODE_TABLE tiling at stages 0-2 and
    # the read-only variants of the bench; the flat read
    from dataclasses import replace

    from verl_quads.bench import gemv_probe as gp

    for c in dict.fromkeys(c for c in ts.DECODE_TABLE.values() if c.mma == 0):
        for grouped, n, k in ((False, 8192, 8192), (True, 2 * inter, h)):
            with scenario(f"gemv probe {c.label} grouped={grouped} {n}x{k}"):
                wp, ws, _ = _weight(n, k, e if grouped else None)
                rows = MOE["top_k"] if grouped else 1
                x, ex = _x(rows, k), torch.arange(rows, dtype=torch.int32)
                runs = [(c, s, {}) for s in (0, 1, 2)] + [(c, 0, dict(scales=s)) for s in (0, 2)]
                runs += [(c, 0, dict(cache=".cg")), (c, 0, dict(evict="evict_first"))]
                runs += [(replace(c, occ=o), 0, {}) for o in (1, 2, 8)]
                runs += [(replace(c, prefetch=False), 0, dict(unroll=u)) for u in (1, 2, 4)]
                runs += [(replace(c, prefetch=False, pipe=3), 0, {})]
                for cc, stage, kw in runs:
                    gp.make_probe(cc, stage, wp, ws, x, ex, ex, **kw)[0]()
    with scenario("gemv flat read"):
        words = _weight(8192, 8192)[0]
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
            for ppsm in (1, 8):
                for unroll in (1, 2):
                    gp.make_flat_read(words, ppsm * H200_SMS, block, unroll, warps)[0]()


def _gemm(tg, grouped, rows, n, k, cfg, dt, mode="w4a16"):
    """One nvfp4_gemm of ``rows`` rows (grouped: token-slots over the MoE experts) with ``cfg``."""
    from verl_quads.nvfp4 import moe_routing as mr

    e = MOE["experts"]
    if grouped:
        t = max(1, rows // MOE["top_k"])
        ids = _ids(t)
        s = ids.numel()
        bm = cfg.block_m if isinstance(cfg, tg.GemmConfig) else tg.grouped_block_m(-(-s // min(e, s)))
        routing = mr.moe_align(ids, e, bm)
        act, _ = tg.quantize_activation(_x(t, k, dt), mode)
        tg.nvfp4_gemm(act, *_weight(n, k, e), routing=routing, a_rows=routing.sorted_tokens, out_rows=s, config=cfg)
    else:
        act, _ = tg.quantize_activation(_x(rows, k, dt), mode)
        tg.nvfp4_gemm(act, *_weight(n, k), config=cfg)


def _gpu_stream_variants(tg):
    """``VARIANTS`` of tests/gpu/test_nvfp4_gemm_stream_gpu.py, read from its source (the list expression evaluated
    with ``SC`` = StreamConfig; the test module itself is not imported: it needs pytest and the GPU tests' helpers)."""
    import ast

    from verl_quads.nvfp4 import triton_stream as ts

    path = os.path.join(ROOT, "tests", "gpu", "test_nvfp4_gemm_stream_gpu.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "VARIANTS" for t in node.targets):
            expr = compile(ast.Expression(node.value), path, "eval")
            return list(eval(expr, {"SC": ts.StreamConfig, "tg": tg, "ts": ts}))  # noqa: S307 (the repo's own test source)
    raise RuntimeError(f"no VARIANTS list in {path}")


def scenarios_gluon():
    """The Gluon W4A16 kernels (gluon_gemm): the dense dispatch's GLUON_TABLE entries (bf16, M <= 16, sm_90), with
    bias, and the configurations of the Gluon probe (verl_quads.bench.gluon_probe): standard layout and the
    permuted-layout prototype (both weight formats)."""
    import torch

    from verl_quads.bench import gluon_probe
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import gluon_gemm as gg
    from verl_quads.nvfp4 import triton_gemm as tg

    for (b, n, k), cfg in gd.GLUON_TABLE.items():
        with scenario(f"GLUON_TABLE {(b, n, k)} via nvfp4_linear (default dispatch)"):
            w = _weight(n, k)
            for m in sorted({max(1, b // 2 + 1), b}):
                tg.nvfp4_linear(_x(m, k), *w, None, "w4a16")
                tg.nvfp4_linear(_x(m, k), *w, torch.zeros(n, dtype=torch.bfloat16), "w4a16")
    for kind, cfg, fmt in gluon_probe._configs("all"):
        for n, k in ((8192, 8192), (4096, 4096)):
            for m in (1, 16):
                with scenario(f"gluon probe {kind} {cfg.label} fmt{fmt} M={m} {n}x{k}"):
                    wp, ws, gs = _weight(n, k)
                    if kind == "std":
                        gg.gluon_w4a16_std(_x(m, k), wp, ws, gs.reshape(1), None, cfg)
                    else:
                        key = ("perm", n, k, fmt)
                        if key not in _CACHE:
                            _CACHE[key] = gg.permute_weight(wp, ws, gs.reshape(1), fmt=fmt)
                        gg.gluon_w4a16(_x(m, k), _CACHE[key], cfg)


def scenarios_gluon_moe():
    """The grouped Gluon W4A16 kernel (gluon_moe.gluon_w4a16_grouped) at the configs of its probe
    (verl_quads.bench.gluon_moe_probe, "all"), both MoE GEMMs, routing block_m 8 / 16 / 32."""
    from verl_quads.bench import gluon_moe_probe
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import gluon_moe as gm
    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg

    e = MOE["experts"]
    for cfg in gluon_moe_probe._configs("all"):
        for gemm, (n, k) in gluon_moe_probe.SHAPES.items():
            for t, bm in ((1, 8), (4, 16), (64, 32)):
                with scenario(f"gluon moe {cfg.label} {gemm} T={t} block_m={bm}"):
                    if getattr(cfg, "nt", 0) and (gm.BLOCK_M_NT[bm] % cfg.nt):
                        continue
                    ids = _ids(t)
                    routing = mr.moe_align(ids, e, bm)
                    rows = t if gemm == "w13" else ids.numel()
                    a_rows = routing.sorted_tokens if gemm == "w13" else None
                    gm.gluon_w4a16_grouped(_x(rows, k), *_weight(n, k, e), routing, a_rows=a_rows,
                                           out_rows=ids.numel(), cfg=cfg, zero_unrouted=False)
    # every GLUON_MOE_TABLE entry at its own bucket, routing as moe_forward builds it where both GEMMs run on the Gluon
    # kernel (moe_block_m: GLUON_MOE_ROUTING_BLOCK_M, else grouped_block_m), with the w13 gate fused into the epilogue
    # (silu_mul) and without
    for (bucket, n, k), cfg in sorted(gd.GLUON_MOE_TABLE.items()):
        t = max(1, bucket // MOE["top_k"])
        gemm = "w13" if k == MOE["hidden"] else "w2"
        with scenario(f"GLUON_MOE_TABLE {(bucket, n, k)} {gemm} {cfg.label} unfused / fused gate"):
            ids = _ids(t)
            bm = gd.GLUON_MOE_ROUTING_BLOCK_M.get(bucket) or tg.grouped_block_m(-(-ids.numel() // min(e, ids.numel())))
            routing = mr.moe_align(ids, e, bm)
            rows = t if gemm == "w13" else ids.numel()
            a_rows = routing.sorted_tokens if gemm == "w13" else None
            for fuse in ((False, True) if gemm == "w13" and not gm.silu_mul_refusal(n, k, min(e, ids.numel()), cfg)
                         else (False,)):
                gm.gluon_w4a16_grouped(_x(rows, k), *_weight(n, k, e), routing, a_rows=a_rows,
                                       out_rows=ids.numel(), cfg=cfg, silu_mul=fuse)


def scenarios_floor():
    """The dense Gluon kernel's weight-read floor probe (verl_quads.bench.gluon_floor): every mode kind at the probe's
    default grids, d8192 and d4096; the feasibility probe's read / empty kernels (verl_quads.bench.dense_floor)."""
    from verl_quads.bench import dense_floor as df
    from verl_quads.bench import gluon_floor as gf
    from verl_quads.bench.gluon_probe import parse_std
    from verl_quads.nvfp4 import gluon_gemm as gg

    import torch

    for cfg in parse_std("w4:rg2:o2,w4:o2"):
        for n, k in ((8192, 8192), (4096, 4096)):
            for spec in ("empty", "reg1", "reg2", "reg4", "ring3", "ring5", "emptyf", "reg2f", "emptyf16"):
                with scenario(f"floor {cfg.label} {spec} {n}x{k}"):
                    wp, ws, _ = _weight(n, k)
                    grid_n, split, cps, _ = gg.std_plan(n, k, cfg, 132)
                    out = torch.empty(grid_n * split, dtype=torch.int32)
                    mode = gf.parse_mode(spec)
                    if mode[0] == 1 and cps > mode[1]:  # a ring loads <= UNR chunks' scales up front: not this grid
                        continue
                    gf.floor_launch(wp, ws, cfg, mode, out,
                                    gf.fix_buffers(n, grid_n, split, wp.device, mode[4]) if mode[3] else None)
    for rc in df.READ_CONFIGS:
        with scenario(f"dense_floor read {rc.label}"):
            df.read_sum(torch.zeros(df.weight_words(4096, 4096), dtype=torch.int32), rc)
    with scenario("dense_floor empty"):
        df.empty_launch(torch.empty(df.EMPTY_PROGRAMS, dtype=torch.int32))


def scenarios_tma():
    """The TMA-fed dense Gluon kernel (verl_quads.nvfp4.gluon_tma): its probe configurations at the dense shapes,
    M = 1, 4, 9, 16, with and without bias."""
    import torch

    from verl_quads.bench import gluon_probe
    from verl_quads.nvfp4 import gluon_tma as gt

    for cfg in gluon_probe.TMA_CONFIGS:
        for name, (n, k) in DENSE.items():
            for m in (1, 4, 9, 16):
                with scenario(f"tma {cfg.label} M={m} {name}"):
                    if cfg.smem_bytes(m) > gt.SMEM_LIMIT:
                        continue
                    wp, ws, gs = _weight(n, k)
                    bias = torch.zeros(n, dtype=torch.bfloat16) if m == 4 else None
                    gt.gluon_w4a16_tma(_x(m, k), wp, ws, gs.reshape(1), bias, cfg)


SCENARIO_GROUPS = {"core": scenarios_core, "channel": scenarios_channel, "gemm": scenarios_gemm,
                   "gluon": scenarios_gluon, "gluon_moe": scenarios_gluon_moe, "floor": scenarios_floor,
                   "tma": scenarios_tma}


# --------------------------------------------------------------------------------------------------------------
# 3. compile with triton 3.6 for sm_90
# --------------------------------------------------------------------------------------------------------------

_JOBS: list = []
RESOURCES = [False]  # --resources: report each compile's registers / spills / shared memory (cuobjdump of the cubin)


def _resources(ck) -> str:
    """``REG:n STACK:n SHARED:n LOCAL:n`` of a compiled kernel's cubin (``cuobjdump --dump-resource-usage``, the
    cuobjdump bundled with triton): registers per thread decide how many programs an SM holds at once."""
    import subprocess

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:\d+.*", out)
    return m.group(0).strip() if m else "resources: not found in cuobjdump output"


def _compile_one(i):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    r = _JOBS[i]
    t0 = time.time()
    # MLIR / ptxas diagnostics go to file descriptor 2 (C++): captured per compile, the first "error:" line reported
    err = tempfile.TemporaryFile(mode="w+")
    saved = os.dup(2)
    os.dup2(err.fileno(), 2)
    try:
        src_cls = getattr(r["fn"], "ASTSource", ASTSource)  # GluonASTSource for @gluon.jit kernels (set by the binder)
        ck = triton.compile(src_cls(r["fn"], r["signature"], r["constexprs"], r["attrs"]),
                            target=GPUTarget("cuda", 90, 32), options=r["options"].__dict__)
        return i, True, _resources(ck) if RESOURCES[0] else "", time.time() - t0
    except Exception as e:
        lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
        short = lines[0] if lines else type(e).__name__
        if re.match(r"^\w+: at \d+:\d+:$", short):  # CompilationError (maybe nested at call sites): the root cause
            root = e
            while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
                root = root.__cause__ or root.__context__
            cause = [ln.strip() for ln in str(root).splitlines() if ln.strip().strip("^~")]
            short = f"{short} ... {cause[-1] if cause else type(root).__name__}"
        sys.stderr.flush()
        err.seek(0)
        diag = err.read()
        first = next((ln.strip() for ln in diag.splitlines() if "error:" in ln), "")
        if first:
            short = f"{short} -- {first}"
        return i, False, short[:600] + "\n" + traceback.format_exc() + diag[-4000:], time.time() - t0
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        err.close()


def run_jobs(fn, n_jobs: int, workers: int):
    """Yield ``fn(i)`` (a tuple ``(i, ok, msg, seconds)``) for i in range(n_jobs), computed in ``workers`` forked
    processes, in completion order. A job that kills its process (triton 3.6 aborts the process on some LLVM
    assertions, e.g. a 3-D shared-memory slice along dim 1) is reported as a failure of that job: a multiprocessing.Pool
    would wait forever for the dead worker's task. After a death, the jobs not yet finished run again one per process,
    so the failure names the job that kills its process, not its neighbours."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp.get_context("fork")
    pending = set(range(n_jobs))
    with ProcessPoolExecutor(max(1, workers), mp_context=ctx) as ex:
        futures = [ex.submit(fn, i) for i in range(n_jobs)]
        try:
            for f in as_completed(futures):
                res = f.result()
                pending.discard(res[0])
                yield res
        except BrokenProcessPool:
            pass
    for i in sorted(pending):
        t0 = time.time()
        with ProcessPoolExecutor(1, mp_context=ctx) as ex:
            try:
                res = ex.submit(fn, i).result()
            except BrokenProcessPool:
                res = (i, False, "the compiling process died (an abort in triton / LLVM: its message went to that "
                              "process's stderr)\n", time.time() - t0)
        yield res


def _describe(r) -> str:
    fn = r["fn"]
    name = f"{fn.module.rsplit('.', 1)[-1]}.{fn.__name__}"
    o = r["options"]
    opts = f"w{o.num_warps} s{o.num_stages}" + (f" maxnreg={o.maxnreg}" if getattr(o, "maxnreg", None) else "")
    opts += "" if getattr(o, "enable_fp_fusion", True) else " nofma"
    names = list(r["signature"])
    cx = {names[p[0]]: v for p, v in r["constexprs"].items() if len(p) == 1}
    cx_s = ",".join(f"{k}={_short(v)}" for k, v in cx.items() if r["signature"][k] == "constexpr")
    spec1 = [k for k, v in cx.items() if r["signature"][k] != "constexpr"]  # integer args specialized to 1
    div = [names[p[0]] for p in r["attrs"]]
    sig = ",".join(v for v in r["signature"].values() if v != "constexpr")
    return (f"{name} [{opts}] {{{cx_s}}} sig({sig})" + (f" =1:{','.join(spec1)}" if spec1 else "")
            + f" div16:{len(div)}  <- {r['scenario']}")


def _coarse_key(r):
    """The record without its divisibility / alignment attributes: kernel, argument types, constexprs (incl.
    integers specialized to 1), options."""
    return (r["fn"], tuple(r["signature"].values()), tuple(sorted((p, repr(v)) for p, v in r["constexprs"].items())),
            repr(r["options"]))


def _short(v):
    s = repr(v)
    return s if len(s) <= 12 else s[:12] + "~"


def launchable_kernels(mods) -> dict:
    """{(module, name): JITFunction} of the jit functions that are launched (``name[`` in verl_quads' sources, or a
    name ending in ``_kernel``); the others are device helpers, compiled inside the kernels that call them."""
    from triton.runtime.jit import JITFunction

    text = ""
    for dirpath, _, files in os.walk(KERNEL_MODULES_DIR):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    text += fh.read()
    out = {}
    for mod in mods:
        for name, obj in vars(sys.modules[mod]).items():
            if isinstance(obj, JITFunction) and obj.module == mod:
                if name.endswith("_kernel") or re.search(rf"\b{re.escape(name)}\[", text):
                    out[(mod, name)] = obj
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default=",".join(SCENARIO_GROUPS), help="scenario groups (default: all)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument("--list", action="store_true", help="record and list the launches, compile nothing")
    ap.add_argument("--all-alignments", action="store_true",
                    help="compile every recorded specialization (default: one per kernel / constexprs / dtypes / "
                         "options; the others differ only in which pointers and integers are multiples of 16)")
    ap.add_argument("--kernels", default="", help="compile only kernels whose name matches this regex")
    ap.add_argument("--limit", type=int, default=0, help="compile only the first N unique launches (trials)")
    ap.add_argument("--fresh", action="store_true", help="compile into an empty temporary triton cache")
    ap.add_argument("--resources", action="store_true",
                    help="print each compile's registers / spills / shared memory (cuobjdump of its cubin)")
    ap.add_argument("--log", default=LOG[0], help="full tracebacks of failures (default %(default)s)")
    args = ap.parse_args()
    LOG[0] = args.log
    RESOURCES[0] = args.resources
    if args.fresh:
        import atexit
        import shutil

        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton36-cache-")
        atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], True)
    open(LOG[0], "w").close()

    t0 = time.time()
    sys.path.insert(0, ROOT)
    triton, _ = install_dry_gpu()
    mods = []
    for mod in kernel_modules():
        try:
            importlib.import_module(mod)
            mods.append(mod)
        except Exception as e:  # reported as a drive error: its kernels are not checked
            DRIVE_ERRORS.append((f"import {mod}", f"{type(e).__name__}: {e}".splitlines()[0][:300]))
    rewritten = patch_host(host_modules(mods))
    print(f"triton36_check: triton {triton.__version__} (sm_90 offline), kernel modules: {', '.join(mods)}; "
          f"device-type tests read as CUDA in: {', '.join(rewritten)}", flush=True)
    for g in args.groups.split(","):
        with scenario(f"group {g}"):  # e.g. an import inside the group that fails: a drive error, the rest goes on
            SCENARIO_GROUPS[g]()
    t_rec = time.time() - t0
    jobs = list(RECORDS.values())
    n_unique = len(jobs)
    if not args.all_alignments:  # one compile per (kernel, constexprs, dtypes, options): the first one recorded
        coarse: dict = {}
        for r in jobs:
            coarse.setdefault(_coarse_key(r), dict(r, count=0, variants=0))
            coarse[_coarse_key(r)]["count"] += r["count"]
            coarse[_coarse_key(r)]["variants"] += 1
        jobs = list(coarse.values())
    jobs.sort(key=lambda r: (r["fn"].module, r["fn"].__name__, _describe(r)))
    print(f"recorded {sum(r['count'] for r in jobs)} launches: {n_unique} unique (kernel, specialization), "
          f"{len(jobs)} to compile{'' if args.all_alignments else ' (one per alignment / divisibility pattern)'}, in "
          f"{t_rec:.0f} s; {len(DRIVE_ERRORS)} drive errors", flush=True)
    for name, err in DRIVE_ERRORS:
        print(f"DRIVE-FAIL {name}: {err}", flush=True)

    reached = {(r["fn"].module, r["fn"].__name__) for r in jobs}
    missing = sorted(set(launchable_kernels(mods)) - reached)
    if args.list:
        for r in jobs:
            print("  " + _describe(r))
    n_fail = 0
    if not args.list:
        if args.kernels:
            jobs = [r for r in jobs if re.search(args.kernels, r["fn"].__name__)]
        if args.limit:
            jobs = jobs[: args.limit]
        _JOBS.extend(jobs)
        t1 = time.time()
        for i, ok, msg, dt in run_jobs(_compile_one, len(jobs), args.jobs):
            r = jobs[i]
            if ok:
                print(f"ok   {dt:5.1f}s {_describe(r)}" + (f"\n     {msg}" if msg else ""), flush=True)
            else:
                n_fail += 1
                short, full = msg.split("\n", 1)
                print(f"FAIL {dt:5.1f}s {_describe(r)}\n     {short}", flush=True)
                with open(LOG[0], "a") as f:
                    f.write(f"=== FAIL {_describe(r)}\n{full}\n")
        print(f"compiled {len(jobs) - n_fail} ok, {n_fail} FAIL of {len(jobs)} in {time.time() - t1:.0f} s "
              f"({args.jobs} processes)")
    per_kernel: dict = {}
    for r in jobs:
        per_kernel[f"{r['fn'].module.rsplit('.', 1)[-1]}.{r['fn'].__name__}"] = per_kernel.get(
            f"{r['fn'].module.rsplit('.', 1)[-1]}.{r['fn'].__name__}", 0) + 1
    print(f"kernels reached ({len(per_kernel)}): " + ", ".join(f"{k} x{v}" for k, v in sorted(per_kernel.items())))
    for mod, name in missing:
        print(f"NOT-COVERED {mod}.{name}: launchable, but no scenario launched it "
              "(add one to scripts/triton36_check.py)")
    bad = n_fail or missing or DRIVE_ERRORS
    print(f"triton36_check: {'FAILED' if bad else 'passed'} ({n_fail} compile failures, {len(missing)} kernels not "
          f"covered, {len(DRIVE_ERRORS)} drive errors; {time.time() - t0:.0f} s; details {LOG[0]})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
