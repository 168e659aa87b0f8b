"""Weight sync trainer -> vLLM in packed NVFP4 (issue 6; DESIGN.md §3-§5).

- :mod:`.format`: the wire format (header tensor, vLLM parameter names and layouts), errors.
- :mod:`.trainer`: the trainer's packed stream (:func:`~.trainer.pack_for_rollout`, the verl engine
  hook :func:`~.trainer.engine_per_tensor_param`), byte counts.
- :mod:`.receiver`: vLLM worker side: stage, validate everything, then copy in place.
- :mod:`.bench`: ``verl-quads bench sync``.

Wiring: ``QuadsFSDPEngineWithLMHead.get_per_tensor_param`` (verl_quads/integration/trainer.py) and the
patch ``verl_quads/patches/vllm_packed_weight_sync.py`` (applied by the vLLM plugin entry point).
"""
