"""Shared inputs and the output check of the GPU GEMM tests (test_nvfp4_gemm_gpu.py, test_nvfp4_gemm_stream_gpu.py,
test_gluon_gemm_gpu.py, test_gluon_tma_gpu.py): random activations with outlier channels, random weights, the bound vs
the rollout's torch reference: per element |y - ref| <= 1 ulp(ref) of y's dtype + 4 K eps_f32 (|x| @ |w|.T) (products
exact on both sides, float32 summation order differs), a dense W4A16 case built on them, and a CUDA-graph capture."""

import torch

DEV = "cuda"


def rand_x(m, k, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g)
    x[:, ::293] *= 30.0  # outlier channels
    return x.to(dtype)


def rand_w(shape, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g) * 0.02


def check_close(y, ref, xf, wf, what):
    r = ref.float()
    d = (y.float() - r).abs()
    ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-30))) * torch.finfo(y.dtype).eps,
                      torch.full_like(r, torch.finfo(y.dtype).tiny))
    bound = ulp + 4 * xf.shape[1] * torch.finfo(torch.float32).eps * (xf.abs() @ wf.abs().t())
    worst = float((d / ulp).max())
    print(f"{what}: max |diff| {worst:.2f} ulp, {float((y == ref).float().mean()):.2%} bit-equal, "
          f"max err / max |ref| {float(d.max() / r.abs().max().clamp(min=1e-30)):.2e}")
    assert bool((d <= bound).all()), f"{what}: {worst:.2f} ulp"


def w4a16_case(run, m, n, k, what, seed=0, bias=False, w_seed=None):
    """``run(x, packed, block_scale, gs, bias)`` (a dense bf16 W4A16 GEMM) on random inputs -- activation seed ``seed``,
    weight seed ``w_seed`` (default seed + 1), a bf16 bias [n] where asked -- checked with :func:`check_close` against
    the rollout's torch reference; returns (y, the call's inputs ``(x, packed, block_scale, gs, bias)``)."""
    from verl_quads.rollout import emulation as em

    q = em.quantize_weight(rand_w((n, k), seed=seed + 1 if w_seed is None else w_seed))
    gs = q.global_scale.reshape(())
    x = rand_x(m, k, seed)
    b = (rand_w((n,), seed=seed + 7) * 10).to(torch.bfloat16) if bias else None
    xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, False))
    wf = em.weight_f32(q.packed, q.block_scale, gs)
    ref = em.gemm(xf, wf, b, x.dtype)
    y = run(x, q.packed, q.block_scale, gs, b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    check_close(y, ref, xf, wf, f"{what} M={m} N={n} K={k}{' bias' if bias else ''}")
    return y, (x, q.packed, q.block_scale, gs, b)


def capture_graph(run):
    """``run()`` once on a side stream (compiles and warms the allocator outside the capture), then captured:
    returns ``(graph, output tensor of the captured call)``; callers refill the inputs, replay and compare."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out
