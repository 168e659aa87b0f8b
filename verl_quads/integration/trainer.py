"""Trainer-side registration with verl 0.9.1: the config key and the QAT-enabled FSDP engine.

:func:`register_trainer` (called from the ``verl.plugins`` entry point, so in the driver and in
every Ray worker on ``import verl``):

1. installs the Hydra patch that adds ``actor_rollout_ref.actor.quant`` / ``quant_config`` to verl's
   FSDP actor config (``verl_quads/patches/hydra_actor_quant_key.py``);
2. once verl imports its FSDP engine module, registers :class:`QuadsFSDPEngineWithLMHead` through
   verl's ``EngineRegistry`` for ``(cuda, nvidia)`` (preferred over verl's device-only ``cuda``
   entry by the registry's lookup) and for ``cpu`` (if nothing is registered there yet, so the CPU
   platform's registration then keeps ours).

The engine is verl's ``FSDPEngineWithLMHead`` plus one step: before FSDP wrapping, if the actor
config carried a ``QuantConfig`` (``engine_config._verl_quads_quant``, set by
``QuadsFSDPActorConfig``) with a trainer mode other than ``none``, :func:`verl_quads.qat.apply_qat`
runs on the module. With ``quant=naive`` (trainer mode ``none``, NVFP4 rollout) no QAT is applied
(the forward is verl's), but the weight sync is planned before wrapping
(:func:`verl_quads.sync.trainer.plan_for_stock_trainer`) and sends packed NVFP4 (round-to-nearest of
the trainer's weights), the only stream a ``quads_nvfp4`` engine loads. With ``quant=none`` (or for
the ref model, whose config has no such attribute) it behaves exactly like verl's engine.

Routing consistency (every mode with an NVFP4 rollout): when the rollout attached routing records
(``extra_fields["quads_routing"]``, on by default, ``VERL_QUADS_ROUTING=0`` in the rollout workers
turns them off; ``layers * top_k`` bytes per token: 8 B on the demo model, 384 B on Qwen3-30B-A3B),
the actor's log-prob pass (``forward_only=True``) runs a
:class:`~verl_quads.integration.trace.RoutingSession` (forward hooks on the routers, one comparison
per micro-batch) and the next update pass of the same step reports ``quads/routing_disagreement``
(verl logs it as ``actor/quads/routing_disagreement``), ``quads/routing_compared_tokens``,
``quads/routing_uncovered_frac``, ``quads/routing_bytes_per_token`` and, in ``trace``,
``quads/routing_disagreement_replayed``. Each data-parallel rank reports its own shard's fraction
(verl averages the ranks' values).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("verl_quads")

FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"

_engine_classes: dict[str, type] = {}


def make_engine_class(stock: type) -> type:
    """A subclass of verl's ``FSDPEngineWithLMHead`` that applies verl-quads QAT before FSDP wrapping."""
    if "lm" in _engine_classes:
        return _engine_classes["lm"]

    class QuadsFSDPEngineWithLMHead(stock):
        """verl's FSDP LM engine + verl-quads NVFP4 QAT (``actor_rollout_ref.actor.quant``)."""

        def _build_fsdp_module(self, module):
            qc = getattr(self.engine_config, "_verl_quads_quant", None)
            if qc is not None and qc.trainer_mode == "none" and qc.rollout_mode != "none" and not self.engine_config.forward_only:
                # naive: stock forward, packed NVFP4 sync (planned on the bare module, before wrapping)
                if getattr(self, "_is_lora", False):
                    raise NotImplementedError(f"verl-quads actor.quant={qc.quant} with LoRA adapters is not supported yet")
                strategy = getattr(self.engine_config, "strategy", None)
                if strategy != "fsdp2":
                    raise ValueError(
                        f"verl-quads actor.quant={qc.quant} (packed NVFP4 weight sync) needs "
                        f"actor_rollout_ref.actor.strategy=fsdp2, got {strategy!r}"
                    )
                from verl_quads.sync.trainer import plan_for_stock_trainer

                self._verl_quads_sync_plan = plan_for_stock_trainer(module, qc)
                logger.warning(
                    "verl-quads: %s: stock trainer forward (no QAT); weight sync packs %d modules to NVFP4 "
                    "(round-to-nearest, rollout mode %s)",
                    qc.quant, len(self._verl_quads_sync_plan.vllm_modules()), qc.rollout_mode,
                )
            if qc is not None and qc.trainer_mode != "none" and not self.engine_config.forward_only:
                from verl_quads.qat import apply_qat

                if getattr(self, "_qat_enabled", False):
                    raise ValueError(
                        "verl-quads: actor_rollout_ref.actor.quant and fsdp_config.qat.enable are both set; "
                        "disable verl's QAT (fsdp_config.qat.enable=false)"
                    )
                if getattr(self, "_is_lora", False):
                    raise NotImplementedError("verl-quads QAT with LoRA adapters is not supported yet")
                strategy = getattr(self.engine_config, "strategy", None)
                if strategy != "fsdp2":
                    raise ValueError(f"verl-quads QAT needs actor_rollout_ref.actor.strategy=fsdp2, got {strategy!r}")
                state = apply_qat(module, qc)
                if qc.trainer_mode == "trace":
                    from verl_quads.qat.replay import install_router_replay

                    self._verl_quads_replay = install_router_replay(module, state)
                n_lin = sum(1 for v in state.modules.values() if v[0] == "linear")
                n_exp = sum(1 for v in state.modules.values() if v[0] == "experts")
            module = super()._build_fsdp_module(module)
            if qc is not None and qc.trainer_mode != "none" and not self.engine_config.forward_only:
                # weight_qdq per_version (or auto where it can run): QDQ each FSDP2 shard once per weight version,
                # before the all-gather (verl_quads/qat/fsdp_qdq.py); the weights were loaded into the shards by
                # verl inside _build_fsdp_module
                from verl_quads.qat import fsdp_qdq

                wq = fsdp_qdq.setup(module)
                logger.warning(
                    "verl-quads: QAT %s (trainer mode %s, weight_qdq %s) on %d linear and %d fused-expert modules",
                    qc.quant, qc.trainer_mode, f"auto -> {wq}" if qc.weight_qdq == "auto" else wq, n_lin, n_exp,
                )
            return module

        def to(self, device, model=True, optimizer=True, grad=True):
            super().to(device, model=model, optimizer=optimizer, grad=grad)
            from verl.utils.device import get_device_name

            if model and device == "cpu" and get_device_name() != "cpu" and not self.engine_config.forward_only:
                # param offload: drop the per-version QDQ caches (device memory) with the master shards
                from verl_quads.qat import fsdp_qdq

                fsdp_qdq.release(getattr(self.module, "_fsdp_wrapped_module", self.module))

        def optimizer_step(self):
            grad_norm = super().optimizer_step()
            # the step changed the master shards, so the per-version QDQ caches are stale: free them now (the next
            # root forward remakes them, as it would anyway) instead of holding them through the rollout
            from verl_quads.qat import fsdp_qdq

            fsdp_qdq.release(getattr(self.module, "_fsdp_wrapped_module", self.module))
            return grad_norm

        # ---- TRACE (issue 6): the rollout's guidance records drive the guided layers of each micro-batch
        def _verl_quads_trace_state(self):
            inner = getattr(self.module, "_fsdp_wrapped_module", self.module)
            state = getattr(inner, "_verl_quads_qat", None)
            return state if state is not None and state.config.trainer_mode == "trace" else None

        # ---- routing consistency (issue 6/7): quads/routing_disagreement in every quantized mode
        def _verl_quads_routing_session(self, data, forward_only: bool):
            """A RoutingSession for the actor's log-prob pass when the rollout attached routing records."""
            qc = getattr(self.engine_config, "_verl_quads_quant", None)
            if not forward_only or qc is None or qc.rollout_mode == "none" or self.engine_config.forward_only:
                return None
            from verl_quads.integration.trace import RoutingSession, batch_routing

            if not any(isinstance(w, dict) for w in batch_routing(data)):
                return None  # rollout workers run with VERL_QUADS_ROUTING=0 (or not quads_nvfp4)
            if getattr(self, "use_ulysses_sp", False):
                raise NotImplementedError(
                    "verl-quads routing metric with Ulysses sequence parallelism is not supported; "
                    "set VERL_QUADS_ROUTING=0"
                )
            return RoutingSession(self.module, replayed=getattr(self, "_verl_quads_replay", None) is not None)

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            routing = self._verl_quads_routing_session(data, forward_only)
            if routing is None:
                out = self._verl_quads_forward_backward(data, loss_function, forward_only)
            else:
                with routing:
                    self._verl_quads_routing = routing
                    try:
                        out = self._verl_quads_forward_backward(data, loss_function, forward_only)
                    finally:
                        self._verl_quads_routing = None
                # verl 0.9.1's v1 trainer drops the log-prob pass's metrics: kept here, reported with the
                # next update pass (same step) as actor/quads/routing_*
                self._verl_quads_routing_metrics = routing.metrics()
                logger.warning("verl-quads routing (log-prob pass, %d micro-batches): %s", routing.micro_batches,
                               self._verl_quads_routing_metrics)
                return out
            pending = getattr(self, "_verl_quads_routing_metrics", None)
            if not forward_only and pending and isinstance(out, dict) and isinstance(out.get("metrics"), dict):
                out["metrics"].update({k: [v] for k, v in pending.items()})
                self._verl_quads_routing_metrics = None
            return out

        def _verl_quads_forward_backward(self, data, loss_function, forward_only):
            state = self._verl_quads_trace_state()
            if state is None:
                out = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
                qat = getattr(getattr(self.module, "_fsdp_wrapped_module", self.module), "_verl_quads_qat", None)
                if qat is not None:  # deferred NaN/Inf weight check of the pass (one sync; trace: in trace_pass)
                    qat.verify()
                return out
            from verl_quads.integration.trace import trace_pass

            replay = getattr(self, "_verl_quads_replay", None)
            t0, c0 = (replay.tokens, replay.changed) if replay else (0, 0)
            with trace_pass(self, state, data, forward_only) as session:
                self._verl_quads_trace_session = session
                try:
                    out = super().forward_backward_batch(data, loss_function, forward_only=forward_only)
                finally:
                    self._verl_quads_trace_session = None
                    if replay:
                        session.replay_tokens, session.replay_disagree = replay.tokens - t0, replay.changed - c0
            if isinstance(out, dict) and isinstance(out.get("metrics"), dict):
                # as a micro-batch list, like verl's own metrics (its worker gathers over dp, then chains)
                out["metrics"].update({k: [v] for k, v in session.metrics().items()})
            return out

        def prepare_model_inputs(self, micro_batch):
            model_inputs, output_args = super().prepare_model_inputs(micro_batch)
            session = getattr(self, "_verl_quads_trace_session", None)
            if session is not None:
                session.begin_micro_batch(micro_batch, model_inputs, output_args)
            routing = getattr(self, "_verl_quads_routing", None)
            if routing is not None:
                routing.begin_micro_batch(micro_batch, model_inputs)
            return model_inputs, output_args

        def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
            # verl-quads weight sync (issue 6): a QAT actor sends the packed NVFP4 its forward uses.
            # quant=naive: a stock forward, but the packed stream planned in _build_fsdp_module.
            inner = getattr(self.module, "_fsdp_wrapped_module", self.module)
            plan = getattr(self, "_verl_quads_sync_plan", None)
            if getattr(inner, "_verl_quads_qat", None) is None and plan is None:
                return super().get_per_tensor_param(layered_summon=layered_summon, base_sync_done=base_sync_done, **kwargs)
            from verl_quads.sync.trainer import engine_per_tensor_param

            return engine_per_tensor_param(self, plan), None

    QuadsFSDPEngineWithLMHead.__module__ = __name__
    _engine_classes["lm"] = QuadsFSDPEngineWithLMHead
    return QuadsFSDPEngineWithLMHead


def _register_engines(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    cls = make_engine_class(module.FSDPEngineWithLMHead)
    registry = EngineRegistry._engines.setdefault("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        have = registry.get(backend, {})
        if have.get(("cuda", "nvidia")) is not cls:
            EngineRegistry.register(model_type="language_model", backend=backend, device="cuda", vendor="nvidia")(cls)
        if "cpu" not in have:
            EngineRegistry.register(model_type="language_model", backend=backend, device="cpu")(cls)
        elif have["cpu"] is not cls:
            raise RuntimeError(
                f"verl-quads: an engine ({have['cpu'].__name__}) is already registered for language_model/{backend}/cpu; "
                "verl-quads' trainer registration must run first (verl_plugin.load)"
            )


def register_trainer() -> None:
    """Config key + engine registration (idempotent)."""
    from verl_quads.patches import hydra_actor_quant_key
    from verl_quads.patches._post_import import when_imported

    hydra_actor_quant_key.apply()
    from verl_quads.patches import verl_rollout_guidance

    verl_rollout_guidance.register()  # vLLM server returns each sequence's TRACE record (post-import hook)
    if "lm" not in _engine_classes:
        when_imported(FSDP_ENGINE_MODULE, _register_engines)


__all__ = ["register_trainer", "make_engine_class", "FSDP_ENGINE_MODULE"]
