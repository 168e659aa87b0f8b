"""One vocabulary and one configuration for both sides.

The user sets ONE switch, ``actor_rollout_ref.actor.quant`` (options under
``actor_rollout_ref.actor.quant_config.*``); :class:`QuantConfig` validates it and derives what
the trainer and the rollout each run:

=============  ==================  ==========================================
``quant``      trainer (QAT) mode  rollout (vLLM ``quads_nvfp4``) mode
=============  ==================  ==========================================
``none``       ``none``            none (stock BF16 vLLM)
``naive``      ``none``            ``naive``  (W4A4, round-to-nearest)
``w4a16``      ``w4a16``           ``w4a16``  (weight-only)
``quads``      ``w4a16``           ``quads``  (W4A4 + residual compensation)
``trace``      ``trace``           ``trace``  (W4A4 + guidance capture)
``w4a4_qat``   ``w4a4_qat``        ``naive``  (the paper's symmetric ablation)
=============  ==================  ==========================================

Scale granularity (both sides must agree; decided here once):

- Weights: one float32 global scale per tensor for linear layers; layers that vLLM fuses into
  one GEMM share one (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``): the amax is taken
  over the group. Routed experts: one global scale per expert, gate and up of an expert
  sharing it (vLLM's NVFP4 MoE kernels take one w13 scale per expert), down per expert.
- Activations (W4A4 modes): one global scale per token (row), computed dynamically from the
  row's amax. This makes a token's quantization independent of what else is in the batch, so
  the trainer can reproduce the rollout's activation codes (needed by TRACE).
- QUADS residual selection (docs/quads_selection.md): per token (row; ``residual_per_token=True``, the
  default): like the per-token global scale, it keeps a token's activation independent of its batch
  mates, so generation is batch-invariant. The unit (``residual_granularity``) is by default
  ``channel_sampled`` (since session 33): single channels of the row whose squared residual reaches the
  row's threshold, the ``round(k * S)``-th largest of a fixed sample of S ~ 512 of its channels (about
  ``k * K`` channels), their residual quantized in the original 16-blocks (a dense second operand: the
  same GEMM work as the block rule at equal k). ``channel`` selects exactly the ``round(k * K)`` channels
  with the largest squared residual; it was the default in sessions 6-32 because it measured best at
  equal k against blocks (realistic H200 model, session 5: k=0.5 closes p99 0.90 / max 0.95 of the naive
  -> floor log-prob gap vs 0.67 / 0.74 for blocks), and the sampled rule replaced it because, paired on
  the same tokens, the two could not be told apart (session 33, 16 batches) while the sampled kernel
  takes about half the time at many rows. ``block`` (opt-in) selects the ``round(k * K / 16)``
  16-channel blocks of the row with the largest residual energy. All three rules run on every rollout
  backend (``torch``, ``triton``, ``native``); on CUDA the channel rules' Triton kernel holds a row on
  chip, so GEMM inputs longer than its ``CHANNEL_CONFIG["max_k"]`` channels are refused when the layer
  is created. ``residual_per_token=False`` selects once per GEMM call (the sum of the block scores over
  the call's rows; DESIGN.md §1's first definition; not batch-invariant); it is defined for blocks only,
  so it needs ``residual_granularity="block"`` set explicitly (with the default it is an error, never a
  silent switch of rule).
- QUADS operand form (``residual_combine``): ``fp4x2`` keeps ``Q(x)`` and ``Q(R_sel)`` as two FP4 GEMM
  operands combined in float32 (the arithmetic of an FP4 tensor-core GEMM); ``bf16`` runs the W4A16 GEMM
  on the core's QDQ activation ``residual_fake_quantize(x)`` = ``Q(x) + Q(R_sel)`` summed in float32 and
  rounded ONCE to the activation dtype (relative <= 2**-8 per element for bf16, 2**-11 for fp16; float32
  activations: no rounding). Same selection, codes and scales. ``auto`` (the default) is resolved ONCE at
  engine start, where the rollout backend is known (:func:`resolve_residual_combine`): ``bf16`` on the
  emulated backends (``torch``, ``triton``), ``fp4x2`` on ``native`` (Blackwell: its FP4 GEMM takes FP4
  operands; an explicit ``bf16`` there is an error). Why ``bf16`` where it can run: on the H200 (session 6,
  block rule, k=0.5) it costs 0.90-0.95x of W4A4-emulated (naive) for the Qwen3-30B-A3B MoE layer and
  0.65-1.09x for a dense 8192x8192 linear at M=1..4096 tokens, while ``fp4x2`` (two operands, two
  accumulators) costs 1.24-2.15x; the QUADS trainer is ``w4a16`` (BF16 activations), so nothing on the
  trainer side depends on the rollout's operand form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

QUANT_MODES = ("none", "naive", "w4a16", "quads", "trace", "w4a4_qat")
TRAINER_MODES = ("none", "w4a16", "w4a4_qat", "trace")
ROLLOUT_MODES = ("none", "w4a16", "naive", "quads", "trace")
BACKENDS = ("auto", "torch", "triton", "native")
#: Values of ``quant_config.residual_combine``: ``auto`` (default, resolved at engine start by
#: :func:`resolve_residual_combine`) or one of the concrete forms :data:`RESIDUAL_COMBINE_FORMS`.
RESIDUAL_COMBINES = ("auto", "fp4x2", "bf16")
#: Concrete QUADS operand forms (== verl_quads.nvfp4.triton_gemm.RESIDUAL_COMBINES): what every layer
#: (:class:`verl_quads.rollout.emulation.ActQuant`) and the NVFP4 core see; never ``auto``.
RESIDUAL_COMBINE_FORMS = ("fp4x2", "bf16")
#: QUADS residual selection granularity (== verl_quads.nvfp4.RESIDUAL_GRANULARITIES; kept here so this module needs no torch).
RESIDUAL_GRANULARITIES = ("block", "channel", "channel_sampled")
#: The product's QUADS selection rule (``QuantConfig.residual_granularity``'s default; every rollout-side default
#: -- ActQuant, the HF emulator, the native ops, the probe's ``quads@R`` -- reads this one name). ``channel_sampled``
#: since session 33: paired on the same tokens it matched the exact ``channel`` rule's log-prob gap on the realistic
#: H200 model (16 batches, docs/quads_selection.md "Sampled threshold") at about half the kernel time at many rows.
DEFAULT_RESIDUAL_GRANULARITY = "channel_sampled"
WEIGHT_QDQS = ("auto", "per_forward", "per_version")

_TRAINER_OF = {"none": "none", "naive": "none", "w4a16": "w4a16", "quads": "w4a16", "trace": "trace", "w4a4_qat": "w4a4_qat"}
_ROLLOUT_OF = {"none": "none", "naive": "naive", "w4a16": "w4a16", "quads": "quads", "trace": "trace", "w4a4_qat": "naive"}

#: Module-name patterns (regular expressions, matched with ``re.search`` against the
#: fully-qualified module name) kept in BF16 by default: embeddings, lm_head, MoE router gates
#: (``mlp.gate`` exactly, not ``gate_proj``/``gate_up_proj``), norms.
DEFAULT_IGNORE = (
    r"(^|\.)embed_tokens$",
    r"(^|\.)lm_head$",
    r"(^|\.)mlp\.gate$",
    r"(^|\.)router$",
    r"norm$",
)


@dataclass(frozen=True)
class QuantConfig:
    """Validated quantization settings (the ``actor.quant`` / ``actor.quant_config`` keys).

    Attributes:
        quant: user-facing mode, one of :data:`QUANT_MODES`.
        residual_ratio: QUADS fraction k of each activation row compensated, in [0, 1]: ``round(k * K)``
            channels (``channel`` rule; about that many under ``channel_sampled``) or ``round(k * K / 16)``
            16-channel blocks (``block`` rule).
        residual_per_token: select the compensated residual per token (default, batch-invariant)
            instead of once per GEMM call (``False``: blocks only, needs ``residual_granularity="block"``).
        residual_granularity: QUADS selection unit, one of :data:`RESIDUAL_GRANULARITIES`:
            ``channel_sampled`` (default, :data:`DEFAULT_RESIDUAL_GRANULARITY`: single channels per token whose
            squared residual reaches the row's threshold, the ``round(k * S)``-th largest of a fixed sample of
            S ~ 512 of its channels: about ``k * K`` channels, no exact rank; docs/quads_selection.md) or
            ``channel`` (the ``round(k * K)`` single channels per token with the largest squared residual) or
            ``block`` (the ``round(k * K / 16)`` 16-channel blocks with the largest residual energy; the only
            unit of per-call selection). Every rollout
            backend runs each (``torch``, ``triton``, ``native``). Only read in the rollout's ``quads`` mode (and
            validated only there).
        guided_layers: TRACE: number of last decoder layers whose GEMM inputs are guided (> 0).
        trace_base_mode: trainer mode for the layers TRACE does not guide (``w4a16`` or ``w4a4_qat``).
        ignore: regex patterns of module names kept in BF16 (see :data:`DEFAULT_IGNORE`).
        backend: kernel backend, one of :data:`BACKENDS` (``auto`` picks by device; asking for one
            that cannot run is an error).
        residual_combine: QUADS operand form, one of :data:`RESIDUAL_COMBINES`: ``auto`` (default: resolved
            once at engine start by :func:`resolve_residual_combine`: ``bf16`` on the ``torch`` and ``triton``
            backends, ``fp4x2`` on ``native``), ``fp4x2`` (two FP4 operands, combined in float32) or ``bf16``
            (the compensated activation rounded once to the activation dtype, then the W4A16 GEMM; see the
            module docstring). Only read in the rollout's ``quads`` mode; the ``native`` backend refuses an
            explicit ``bf16``.
        weight_qdq: when the trainer fake-quantizes its weights, one of :data:`WEIGHT_QDQS`:
            ``auto`` (default: ``per_version`` when the trainer model is FSDP2-sharded and the FSDP2 patch's
            torch guard accepts the installed torch, else ``per_forward``; the choice and its reason are logged
            once, see :func:`verl_quads.qat.fsdp_qdq.setup`), ``per_forward`` (every QAT module QDQs its
            unsharded weight in every forward) or ``per_version`` (FSDP2 only, an error where it cannot run:
            each rank QDQs its weight shard once per weight version and FSDP2 all-gathers the QDQ'd shards; same
            values bit for bit; see :mod:`verl_quads.qat.fsdp_qdq`). Trainer-only; the rollout ignores it.
    """

    quant: str = "none"
    residual_ratio: float = 0.5
    residual_per_token: bool = True
    residual_granularity: str = DEFAULT_RESIDUAL_GRANULARITY
    guided_layers: int = 20
    trace_base_mode: str = "w4a16"
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    backend: str = "auto"
    residual_combine: str = "auto"
    weight_qdq: str = "auto"

    def __post_init__(self) -> None:
        if self.quant not in QUANT_MODES:
            raise ValueError(
                f"actor_rollout_ref.actor.quant={self.quant!r} is not a verl-quads mode; allowed: {', '.join(QUANT_MODES)}"
            )
        if not (isinstance(self.residual_ratio, (int, float)) and 0.0 <= float(self.residual_ratio) <= 1.0):
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config.residual_ratio={self.residual_ratio!r}: must be a number in [0, 1]"
            )
        if self.residual_granularity not in RESIDUAL_GRANULARITIES:
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config.residual_granularity={self.residual_granularity!r}: allowed: "
                f"{', '.join(RESIDUAL_GRANULARITIES)} (channel_sampled: single channels per token over a threshold "
                "from a fixed sample of the row, the default; channel: the row's round(k * K) channels with the "
                "largest squared residual; block: 16-channel blocks)"
            )
        if self.quant == "quads" and self.residual_granularity != "block" and not self.residual_per_token:
            raise ValueError(
                "actor_rollout_ref.actor.quant_config.residual_per_token=false selects once per GEMM call, which is "
                f"defined for 16-channel blocks only, but residual_granularity={self.residual_granularity!r}"
                f"{' (the default)' if self.residual_granularity == DEFAULT_RESIDUAL_GRANULARITY else ''} selects "
                "channels per token: "
                "set actor_rollout_ref.actor.quant_config.residual_granularity=block for per-call selection, or "
                "residual_per_token=true for the channel rules"
            )
        if not isinstance(self.guided_layers, int) or self.guided_layers < 1:
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config.guided_layers={self.guided_layers!r}: must be an integer >= 1"
            )
        if self.trace_base_mode not in ("w4a16", "w4a4_qat"):
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config.trace_base_mode={self.trace_base_mode!r}: allowed: w4a16, w4a4_qat"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config.backend={self.backend!r}: allowed: {', '.join(BACKENDS)}"
            )
        if self.residual_combine not in RESIDUAL_COMBINES:
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config.residual_combine={self.residual_combine!r}: allowed: "
                f"{', '.join(RESIDUAL_COMBINES)} (auto: the default, bf16 on the torch/triton backends and fp4x2 on "
                "native; fp4x2: two FP4 operands combined in float32; bf16: the compensated activation rounded once to "
                "the activation dtype, then the W4A16 GEMM)"
            )
        if self.weight_qdq not in WEIGHT_QDQS:
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config.weight_qdq={self.weight_qdq!r}: allowed: {', '.join(WEIGHT_QDQS)} "
                "(auto: per_version where it can run, else per_forward; per_forward: QDQ the unsharded weight in every "
                "forward; per_version: QDQ each FSDP2 shard once per weight version, before the all-gather)"
            )
        object.__setattr__(self, "ignore", tuple(self.ignore))
        for pat in self.ignore:
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"actor_rollout_ref.actor.quant_config.ignore: bad regex {pat!r}: {e}") from e

    @property
    def trainer_mode(self) -> str:
        """What the trainer's QAT forward runs (one of :data:`TRAINER_MODES`)."""
        return _TRAINER_OF[self.quant]

    @property
    def rollout_mode(self) -> str:
        """What vLLM runs (one of :data:`ROLLOUT_MODES`)."""
        return _ROLLOUT_OF[self.quant]

    def eager_reasons(self, backend: str | None = None) -> list[str]:
        """Why this configuration's vLLM rollout can only run in an eager engine (no torch.compile, no CUDA
        graphs: ``enforce_eager=True``), one entry per setting, naming its key; empty if it can run compiled.

        ``backend``: the rollout backend as resolved on the engine's device (default: this config's
        ``backend``, e.g. ``auto`` in verl's driver, where the device is not known). Called by the vLLM
        config when the engine builds its layers and by verl's rollout config at composition."""
        if self.rollout_mode == "none":
            return []
        backend = self.backend if backend is None else backend
        out = []
        if backend == "torch":
            out.append("quant_config.backend=torch: backend 'torch' (the reference emulation) runs data-dependent "
                       "Python in each forward (per-expert loops, host reads) that torch.compile cannot trace and "
                       "a CUDA graph cannot capture")
        if self.rollout_mode == "quads" and not self.residual_per_token:
            out.append("quant_config.residual_per_token=false reads the experts' token counts on the host in each "
                       "MoE forward (per-call QUADS selection), which a CUDA graph capture forbids")
        return out

    def is_ignored(self, module_name: str) -> bool:
        """True if the module stays BF16."""
        return any(re.search(p, module_name) for p in self.ignore)

    @classmethod
    def from_mapping(cls, quant: str, options: dict | None = None) -> "QuantConfig":
        """Build from verl's ``actor.quant`` value and ``actor.quant_config`` mapping; unknown keys fail."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)} - {"quant"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"actor_rollout_ref.actor.quant_config has unknown key(s) {unknown}; allowed: {sorted(known)}"
            )
        if "ignore" in options and options["ignore"] is not None:
            options["ignore"] = tuple(options["ignore"])
        return cls(quant=quant, **options)

    def to_dict(self) -> dict:
        """Plain dict (JSON-able) of all fields, e.g. to pass to vLLM's quantization config."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


#: What ``residual_combine="auto"`` resolves to per concrete rollout backend (see :func:`resolve_residual_combine`).
AUTO_RESIDUAL_COMBINE = {"torch": "bf16", "triton": "bf16", "native": "fp4x2"}


def resolve_residual_combine(value: str, backend: str) -> str:
    """The concrete QUADS operand form (one of :data:`RESIDUAL_COMBINE_FORMS`) of ``quant_config.residual_combine``
    ``value`` on the concrete rollout ``backend`` (``torch``, ``triton`` or ``native``; the HF emulator of the
    diagnostics runs the ``torch`` arithmetic). ``auto`` -> ``bf16`` on ``torch``/``triton`` (the W4A16 GEMM on
    the compensated activation: measured at or below W4A4-emulated cost on the H200, module docstring),
    ``fp4x2`` on ``native`` (its FP4 GEMM takes FP4 operands); a concrete value is returned as it is (whether
    it can run on ``backend`` is the engine's check: ``native`` refuses ``bf16``). Called once at engine start."""
    if backend not in AUTO_RESIDUAL_COMBINE:
        raise ValueError(
            f"resolve_residual_combine: backend must be a concrete rollout backend, one of "
            f"{', '.join(AUTO_RESIDUAL_COMBINE)}; got {backend!r} (resolve quant_config.backend first)"
        )
    if value not in RESIDUAL_COMBINES:
        raise ValueError(
            f"actor_rollout_ref.actor.quant_config.residual_combine={value!r}: allowed: {', '.join(RESIDUAL_COMBINES)}"
        )
    return AUTO_RESIDUAL_COMBINE[backend] if value == "auto" else value


__all__ = ["QUANT_MODES", "TRAINER_MODES", "ROLLOUT_MODES", "BACKENDS", "RESIDUAL_COMBINES", "RESIDUAL_COMBINE_FORMS",
           "AUTO_RESIDUAL_COMBINE", "RESIDUAL_GRANULARITIES", "WEIGHT_QDQS", "DEFAULT_IGNORE", "QuantConfig",
           "resolve_residual_combine"]
