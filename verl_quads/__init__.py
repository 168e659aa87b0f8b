"""verl-quads: NVFP4 rollouts for verl that train like BF16 (QUADS and TRACE).

Concerns live in one sub-package each: ``nvfp4`` (the format and its kernels, shared by both
sides), ``qat`` (trainer side), ``rollout`` (vLLM side), ``sync`` (weights down, guidance up),
``integration`` (verl glue), ``diagnostics`` (log-prob gap measurement).
"""

__version__ = "0.1.0.dev0"
