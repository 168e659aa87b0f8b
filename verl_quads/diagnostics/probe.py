"""``verl-quads probe``: measure the rollout-vs-trainer log-prob gap per quantization mode.

For each mode and each of ``seeds`` batches:

1. **Rollout** generates responses to the prompts (sampling, temperature 1, ``ignore_eos``) and
   reports each sampled token's log-prob and its own argmax. Engines: ``vllm`` (the real engine with
   the ``quads_nvfp4`` plugin; one in-process engine at a time) or ``hf`` (verl-quads' rollout
   arithmetic over a HF model, :mod:`.hf_rollout`, KV-cached decoding with eager attention; used
   where vLLM is not installed, and the output says so).
2. **Trainer** recomputes the same tokens' log-probs in one forward (HF model, SDPA attention,
   :func:`verl_quads.qat.apply_qat` in the mode's trainer mode; ``trace`` reads the rollout's guidance
   and replays the rollout's routing, which guided expert rounding requires).
3. **Statistics** (:mod:`.stats`): |gap| max / p99 / mean, k3 KL, argmax-differs, routing
   disagreement (where the rollout's routing is known: always with ``hf``; with ``vllm`` only for
   the layers ``trace`` captures).
4. **Decomposition by ablation** (teacher-forced on the same tokens, rollout side emulated by
   :class:`.hf_rollout.RolloutEmulator`; trainer as in 2): the gap when the rollout differs from the
   trainer in *weights only*, *activations only*, *both*, and *neither* (same quantization choices,
   only the arithmetic differs); plus the engine floor (the real engine in BF16 vs the BF16 trainer,
   from the ``bf16`` mode when it is in the run). Gap statistics are not additive (max, quantiles):
   the parts are reported side by side, not summed.
5. **Per-layer relative output error** of each decoder layer, emulated rollout (both) vs trainer.
6. **Paired rule comparison**: for a mode ``B`` and a variant ``B:v`` of it in the same run (e.g. ``quads@0.5`` and
   ``quads@0.5:channel``), both modes' emulated rollouts (*both*, as in 4) teacher-forced on ``B``'s rollout tokens of
   each batch, each against its own trainer: the per-batch differences (variant - base) of the gap statistics and the
   fraction of tokens where the variant's |gap| is lower, so the rules are compared without the sampling noise of
   two separate rollouts.

Every statistic is reported as mean ± std over the batches (plus min/max in the JSON).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verl_quads.config import DEFAULT_RESIDUAL_GRANULARITY, QuantConfig
from verl_quads.diagnostics import stats as S
from verl_quads.diagnostics.hf_rollout import RolloutEmulator, RolloutSpec, assemble_guidance, assemble_routing

DEFAULT_MODES = ("bf16", "naive", "w4a16", "w4a4_qat", "quads@0.125", "quads@0.25", "quads@0.5", "quads@1.0", "trace")
DEFAULT_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The quick brown fox jumps over the lazy dog. The answer is #### 42. Let's think step by step:",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "import torch\nx = torch.randn(16, 16)\ny = x @ x.T\nprint(",
    "Julie is reading a 120-page book. Yesterday, she was able to read 12 pages and today",
)


@dataclass(frozen=True)
class Mode:
    """A probe mode: its display name and the QuantConfig both sides derive from (bf16 = ``none``)."""

    name: str
    cfg: QuantConfig


#: How the probe's report names each QUADS selection unit.
_UNIT_NAMES = {"channel": "channels", "block": "16-channel blocks", "channel_sampled": "channels (sampled threshold)"}


#: The probe's QUADS rule suffixes -> (residual_per_token, residual_granularity).
_RULE_SUFFIXES = {"channel": (True, "channel"), "sampled": (True, "channel_sampled"), "block": (True, "block"),
                  "call": (False, "block")}


def parse_mode(text: str, *, guided_layers: int = 20) -> Mode:
    """``bf16``/``none``, ``naive``, ``w4a16``, ``w4a4_qat``, ``trace``, ``quads`` or ``quads@<ratio>[:<rule>]``.

    ``quads@<ratio>`` is the product default (:class:`verl_quads.config.QuantConfig`: per token,
    ``residual_granularity=`` :data:`~verl_quads.config.DEFAULT_RESIDUAL_GRANULARITY`, ``channel_sampled`` since
    session 33); a suffix names a rule: ``:sampled`` (per token, single channels over a sampled threshold:
    ``residual_granularity="channel_sampled"``), ``:channel`` (per token, the exact ``round(k * K)`` channels:
    ``residual_granularity="channel"``), ``:block`` (per token, 16-channel blocks: ``residual_granularity="block"``),
    ``:call`` (per-call selection, 16-channel blocks: ``residual_per_token=False, residual_granularity="block"``).
    The display name spells the rule unless it is the default (``quads@0.5:sampled`` is shown as ``quads@0.5``).
    ``:token`` (per-token blocks until session 5) is refused."""
    t = text.strip()
    if t in ("bf16", "none"):
        return Mode("bf16", QuantConfig("none"))
    if t.startswith("quads"):
        ratio, sel = 0.5, None
        if ":" in t:
            t, sel = t.split(":", 1)
            if sel == "token":  # meant per-token BLOCKS until session 5: refused rather than silently re-ruled
                raise ValueError(f"probe: {text!r}: ':token' (per-token 16-channel blocks until session 5) is gone: "
                                 "write quads@R:block for the block rule, quads@R:channel for the exact channel rule")
            if sel not in _RULE_SUFFIXES:
                raise ValueError(f"probe: bad QUADS selection in {text!r} (want quads@0.5 (the default rule, "
                                 f"{DEFAULT_RESIDUAL_GRANULARITY}), quads@0.5:sampled, quads@0.5:channel, "
                                 "quads@0.5:block or quads@0.5:call)")
        if "@" in t:
            try:
                ratio = float(t.split("@", 1)[1])
            except ValueError as e:
                raise ValueError(f"probe: bad QUADS ratio in {text!r} (want quads@0.5)") from e
        per_token, gran = _RULE_SUFFIXES[sel] if sel else (True, DEFAULT_RESIDUAL_GRANULARITY)
        default_rule = per_token and gran == DEFAULT_RESIDUAL_GRANULARITY
        name = f"quads@{ratio:g}" + ("" if default_rule else f":{sel}")
        return Mode(name, QuantConfig("quads", residual_ratio=ratio, residual_per_token=per_token,
                                      residual_granularity=gran))
    if t == "trace":
        return Mode("trace", QuantConfig("trace", guided_layers=guided_layers))
    if t in ("naive", "w4a16", "w4a4_qat"):
        return Mode(t, QuantConfig(t))
    raise ValueError(f"probe: unknown mode {text!r}; allowed: bf16, naive, w4a16, w4a4_qat, "
                     "quads[@ratio][:sampled|:channel|:block|:call], trace")


@dataclass
class Rollout:
    """One generated batch. ``tokens``/``logp``/``argmax``/``mask``: ``[B, T]``."""

    prompt_ids: list[list[int]]
    tokens: torch.Tensor
    logp: torch.Tensor
    argmax: torch.Tensor
    mask: torch.Tensor
    uids: list[str]
    routing: torch.Tensor | None = None  # [B, P+T, L, k] by position, -1 unknown
    guidance: object | None = None  # a GuidanceProvider (trace)
    engine: str = ""


def _trainer_mode_spec(cfg: QuantConfig) -> tuple[bool, str]:
    """(weights quantized, activation handling as a RolloutSpec act) of the trainer mode."""
    tm = cfg.trainer_mode
    if tm == "none":
        return False, "none"
    if tm == "w4a16":
        return True, "none"
    return True, "naive"  # w4a4_qat (RTN) and trace (guided codes = the rollout's RTN codes)


# ------------------------------------------------------------------ engines
def load_hf(model_dir: str | Path, attn: str, device: str, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn)
    return m.to(device).eval()


class HFEngine:
    """Rollout by verl-quads' rollout arithmetic over a HF model (KV-cached decode, eager attention)."""

    name = "hf (verl-quads rollout emulation over Hugging Face; vLLM not used)"

    def __init__(self, model_dir, device: str = "cpu"):
        self.model = load_hf(model_dir, "eager", device)
        self.device = device

    def generate(self, mode: Mode, prompt_ids, max_new: int, seed: int) -> Rollout:
        from transformers import DynamicCache

        spec = RolloutSpec.for_rollout_mode(mode.cfg)
        emu = RolloutEmulator(self.model, spec, mode.cfg)
        b = len(prompt_ids)
        plen = torch.tensor([len(p) for p in prompt_ids])
        width = int(plen.max())
        pad = 0
        ids = torch.full((b, width), pad, dtype=torch.long)
        am = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.tensor(p)
            am[i, width - len(p):] = 1
        pos = (am.cumsum(1) - 1).clamp(min=0)
        g = torch.Generator().manual_seed(seed)
        toks, lps, amx = [], [], []
        past = DynamicCache()
        dev = self.device
        with torch.no_grad(), emu.installed():
            emu.rows = (torch.where(am.bool(), torch.arange(b).unsqueeze(1), -1).flatten(), torch.where(am.bool(), pos, -1).flatten())
            out = self.model(input_ids=ids.to(dev), attention_mask=am.to(dev), position_ids=pos.to(dev), past_key_values=past, use_cache=True)
            logits = out.logits[:, -1]
            cur = plen.clone()
            for t in range(max_new):
                lp = torch.log_softmax(logits.float(), -1).cpu()
                nxt = torch.multinomial(lp.exp(), 1, generator=g).squeeze(1)
                toks.append(nxt)
                lps.append(lp.gather(1, nxt[:, None]).squeeze(1))
                amx.append(lp.argmax(-1))
                if t == max_new - 1:
                    break
                am = torch.cat([am, torch.ones((b, 1), dtype=torch.long)], 1)
                emu.rows = (torch.arange(b), cur.clone())
                out = self.model(input_ids=nxt[:, None].to(dev), attention_mask=am.to(dev), position_ids=cur[:, None].to(dev),
                                 past_key_values=past, use_cache=True)
                logits = out.logits[:, -1]
                cur += 1
        uids = [f"s{seed}/{i}" for i in range(b)]
        top_k = getattr(self.model.config, "num_experts_per_tok", None)
        routing = assemble_routing(emu.routing, b, width + max_new, top_k) if emu.routing.items else None
        guidance = assemble_guidance(emu.guidance, uids) if emu.guidance.items else None
        tokens = torch.stack(toks, 1)
        return Rollout(prompt_ids, tokens, torch.stack(lps, 1), torch.stack(amx, 1), torch.ones_like(tokens, dtype=torch.bool),
                       uids, routing, guidance, self.name)

    def close(self):
        pass


class VLLMEngine:
    """Rollout by real vLLM (in-process, one engine alive at a time), ``quads_nvfp4`` plugin."""

    name = "vllm"

    def __init__(self, model_dir):
        import vllm

        self.vllm = vllm
        self.model_dir = str(model_dir)
        self.name = f"vllm {vllm.__version__} (real engine, quads_nvfp4 plugin)"
        self.llm, self.key = None, None

    def _get(self, mode: Mode, max_len: int):
        key = mode.name
        if self.key == key:
            return self.llm
        self.close()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: guidance fetch without pickling
        kw = {}
        if mode.cfg.rollout_mode != "none":
            qc = {"quant_method": "quads_nvfp4", **mode.cfg.to_dict()}
            kw = dict(quantization="quads_nvfp4", hf_overrides={"quantization_config": qc})
        self.llm = self.vllm.LLM(self.model_dir, enforce_eager=True, dtype="bfloat16", max_model_len=max_len, seed=0,
                                 enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, **kw)
        self.key = key
        return self.llm

    def generate(self, mode: Mode, prompt_ids, max_new: int, seed: int) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        width = max(len(p) for p in prompt_ids)
        llm = self._get(mode, max(128, 1 << (width + max_new).bit_length()))
        sp = SamplingParams(temperature=1.0, max_tokens=max_new, min_tokens=max_new, ignore_eos=True, logprobs=1, seed=seed)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sp, use_tqdm=False)
        b = len(prompt_ids)
        tokens = torch.zeros((b, max_new), dtype=torch.long)
        logp = torch.zeros((b, max_new), dtype=torch.float32)
        amx = torch.zeros((b, max_new), dtype=torch.long)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            if len(c.token_ids) != max_new:
                raise RuntimeError(f"probe: vLLM returned {len(c.token_ids)} tokens, wanted {max_new}")
            for t, (tok, lpd) in enumerate(zip(c.token_ids, c.logprobs)):
                tokens[i, t] = tok
                logp[i, t] = lpd[tok].logprob
                amx[i, t] = next(k for k, v in lpd.items() if v.rank == 1)
        uids = [o.request_id for o in outs]
        guidance, routing = None, None
        if mode.cfg.rollout_mode == "trace":
            from verl_quads.qat import RolloutGuidanceProvider
            from verl_quads.rollout.capture import collect_guidance

            caps = collect_guidance(llm)
            by_uid = {}
            for rid, cap in caps.items():
                by_uid[cap.external_id if cap.external_id in uids else rid] = cap
            missing = [u for u in uids if u not in by_uid]
            if missing:
                raise RuntimeError(f"probe: no guidance captured for requests {missing}; captured {sorted(by_uid)}")
            for cap in by_uid.values():
                cap.policy_version = 0
            guidance = RolloutGuidanceProvider(by_uid)
            layers = sorted({l for cap in by_uid.values() for l in cap.expert_ids})
            if layers:
                k = next(iter(by_uid.values())).expert_ids[layers[0]].shape[-1]
                n_layers = int(llm.llm_engine.model_config.hf_text_config.num_hidden_layers)
                routing = torch.full((b, width + max_new, n_layers, k), -1, dtype=torch.long)
                for i, u in enumerate(uids):
                    cap = by_uid[u]
                    for l, e in cap.expert_ids.items():
                        routing[i, cap.positions, l] = e.long()
        return Rollout(prompt_ids, tokens, logp, amx, torch.ones_like(tokens, dtype=torch.bool), uids, routing, guidance, self.name)

    def close(self):
        if self.llm is not None:
            del self.llm
            self.llm, self.key = None, None
            gc.collect()


def make_engine(kind: str, model_dir, device: str = "cpu"):
    """``auto`` -> vllm if importable else hf (the caller prints which one ran)."""
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm"
        except ImportError:
            kind = "hf"
    if kind == "vllm":
        return VLLMEngine(model_dir)
    if kind == "hf":
        return HFEngine(model_dir, device)
    raise ValueError(f"probe: unknown engine {kind!r}; allowed: auto, vllm, hf")


# ------------------------------------------------------------------ trainer side
def _full_batch(r: Rollout):
    """Right-padded prompt+response ``[B, S]``, attention mask, and response-start per row."""
    seqs = [list(p) + r.tokens[i].tolist() for i, p in enumerate(r.prompt_ids)]
    s = max(len(x) for x in seqs)
    ids = torch.zeros((len(seqs), s), dtype=torch.long)
    am = torch.zeros((len(seqs), s), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        am[i, : len(x)] = 1
    return ids, am, [len(p) for p in r.prompt_ids]


def _response_logp(logits: torch.Tensor, r: Rollout, starts: list[int]):
    t = r.tokens.shape[1]
    lp = torch.zeros_like(r.logp, dtype=torch.float32)
    amx = torch.zeros_like(r.argmax)
    for i, p in enumerate(starts):
        lg = torch.log_softmax(logits[i, p - 1 : p - 1 + t].float(), -1).cpu()
        lp[i] = lg.gather(1, r.tokens[i][:, None]).squeeze(1)
        amx[i] = lg.argmax(-1)
    return lp, amx


class _LayerTap:
    """Forward hooks: decoder-layer outputs, and MoE router choices (optionally replaced = router replay)."""

    def __init__(self, model, replay: torch.Tensor | None = None):
        self.outs: dict[int, torch.Tensor] = {}
        self.routing: dict[int, torch.Tensor] = {}
        self.replay = replay  # [N_rows, L, k] (-1 = keep own)
        self.hooks = []
        for name, mod in model.named_modules():
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit():
                self.hooks.append(mod.register_forward_hook(self._out_hook(int(parts[-1]))))
            if name.endswith("mlp.gate") and "layers." in name:
                li = int(name.split("layers.")[1].split(".")[0])
                self.hooks.append(mod.register_forward_hook(self._gate_hook(li)))

    def _out_hook(self, li):
        def h(_m, _i, out):
            self.outs[li] = (out[0] if isinstance(out, tuple) else out).detach()

        return h

    def _gate_hook(self, li):
        def h(_m, _i, out):
            if not (isinstance(out, tuple) and len(out) == 3):
                return None
            logits, scores, idx = out
            self.routing[li] = idx.detach().cpu()
            if self.replay is None:
                return None
            want = self.replay[:, li].to(idx.device)
            keep = (want < 0).any(-1, keepdim=True)
            new_idx = torch.where(keep, idx, want)
            probs = torch.softmax(logits.float(), -1).gather(1, new_idx)
            if getattr(_m, "norm_topk_prob", True):
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(scores.dtype), new_idx

        return h

    def close(self):
        for h in self.hooks:
            h.remove()


@dataclass
class Scored:
    logp: torch.Tensor
    argmax: torch.Tensor
    layer_outs: dict[int, torch.Tensor]
    routing: dict[int, torch.Tensor]
    valid_rows: torch.Tensor


def score_trainer(model, mode: Mode, r: Rollout, *, device: str = "cpu") -> Scored:
    """Trainer log-probs of the rollout's tokens (QAT in the mode's trainer mode, applied and removed here)."""
    from verl_quads.qat import TraceBatch, apply_qat, remove_qat, trace_context

    ids, am, starts = _full_batch(r)
    replay = None
    tm = mode.cfg.trainer_mode
    if tm == "trace":
        if r.routing is None:
            raise RuntimeError("probe: trace needs the rollout's routing (router replay), the engine gave none")
        n = ids.shape[1]
        rt = r.routing[:, :n] if r.routing.shape[1] >= n else torch.nn.functional.pad(r.routing, (0, 0, 0, 0, 0, n - r.routing.shape[1]), value=-1)
        replay = rt.reshape(-1, rt.shape[2], rt.shape[3])
    tap = _LayerTap(model, replay)
    apply_qat(model, mode.cfg, backend="torch" if device == "cpu" else "auto")
    try:
        with torch.no_grad():
            if tm == "trace":
                tb = TraceBatch.padded(r.guidance, 0, r.uids, am)
                with trace_context(model, tb):
                    out = model(input_ids=ids.to(device), attention_mask=am.to(device))
            else:
                out = model(input_ids=ids.to(device), attention_mask=am.to(device))
    finally:
        remove_qat(model)
        tap.close()
    lp, amx = _response_logp(out.logits, r, starts)
    return Scored(lp, amx, tap.outs, tap.routing, am.flatten().bool())


def score_emulated(model, spec: RolloutSpec, cfg: QuantConfig, r: Rollout, *, device: str = "cpu") -> Scored:
    """Teacher-forced rollout-side log-probs under ``spec`` (for the ablations and per-layer errors)."""
    ids, am, starts = _full_batch(r)
    b, s = ids.shape
    emu = RolloutEmulator(model, spec, cfg)
    tap = _LayerTap(model)
    try:
        with torch.no_grad(), emu.installed():
            m = am.bool()
            emu.rows = (torch.where(m, torch.arange(b).unsqueeze(1), -1).flatten(), torch.where(m, torch.arange(s), -1).flatten())
            out = model(input_ids=ids.to(device), attention_mask=am.to(device))
    finally:
        tap.close()
    lp, amx = _response_logp(out.logits, r, starts)
    return Scored(lp, amx, tap.outs, tap.routing, am.flatten().bool())


def _routing_stats(r_ids: torch.Tensor, t_routing: dict[int, torch.Tensor], starts, t_resp: int):
    """Routing disagreement over response positions (rollout ids by position ``[B, P, L, k]``)."""
    b = r_ids.shape[0]
    layers = sorted(t_routing)
    s = t_routing[layers[0]].shape[0] // b
    tr = torch.stack([t_routing[l].reshape(b, s, -1) for l in layers], 2)  # [B, S, L, k]
    rows_r, rows_t = [], []
    for i, p in enumerate(starts):
        # the router inputs that produce response tokens: positions p-1 .. p+T-2
        rr = r_ids[i, p - 1 : p - 1 + t_resp][:, layers]
        tt = tr[i, p - 1 : p - 1 + t_resp]
        rows_r.append(rr)
        rows_t.append(tt)
    rr, tt = torch.cat(rows_r), torch.cat(rows_t)
    known = (rr >= 0).all(-1)  # [N, L]
    if not bool(known.any()):
        return None
    a = rr[known]
    c = tt[known]
    return S.routing_disagreement(a, c)


# ------------------------------------------------------------------ main loop
@dataclass
class ProbeResult:
    engine: str
    model_dir: str
    modes: list[str]
    seeds: list[int]
    n_prompts: int
    max_new_tokens: int
    per_mode: dict = field(default_factory=dict)  # mode -> {"total": summary, "decomposition": {...}, "layers": ..., "runs": [...]}
    gaps: dict = field(default_factory=dict)  # mode -> list of |gap| values (all batches), for the plot
    notes: list[str] = field(default_factory=list)
    #: QUADS modes -> their selection rule: {"residual_ratio", "residual_per_token", "residual_granularity"}
    quads_rules: dict = field(default_factory=dict)
    #: QUADS modes -> their operand form: {"residual_combine": the config value, "rollout": the concrete form the
    #: rollout engine runs, "emulated": the form of the emulated rollout (decomposition; the hf engine)}
    quads_operand: dict = field(default_factory=dict)
    #: "variant vs base" -> {"base", "variant", "runs": per batch {"seed", "base", "variant" (gap stats on the same
    #: tokens), "tokens_variant_lower", "tokens_equal"}, "summary": :func:`.stats.paired_difference`} (step 6)
    paired: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("gaps")
        return d


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:  # pragma: no cover - tqdm ships with transformers
        raise RuntimeError("probe: tqdm is required for the progress bar (it ships with transformers)") from None


def run_probe(
    model_dir: str | Path,
    *,
    modes=DEFAULT_MODES,
    prompts=DEFAULT_PROMPTS,
    seeds=(0, 1, 2),
    max_new_tokens: int = 16,
    engine: str = "auto",
    device: str = "cpu",
    guided_layers: int = 20,
    decompose: bool = True,
) -> ProbeResult:
    """Run the probe (see module docstring); returns a :class:`ProbeResult`."""
    if len(seeds) < 3:
        raise ValueError(f"probe: need >= 3 seeds/batches to report a spread, got {list(seeds)}")
    from transformers import AutoTokenizer

    mode_objs = [parse_mode(m, guided_layers=guided_layers) for m in modes]
    names = [m.name for m in mode_objs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:  # e.g. quads@0.5 and quads@0.5:sampled name the same mode (the default rule)
        raise ValueError(f"probe: modes {list(modes)} name the same mode more than once: {dup}")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = [tok(p).input_ids for p in prompts]
    eng = make_engine(engine, model_dir, device)
    trainer = load_hf(model_dir, "sdpa", device)
    pairs = variant_pairs(mode_objs)
    emu_model = load_hf(model_dir, "sdpa", device) if decompose or pairs else None
    res = ProbeResult(eng.name, str(model_dir), [m.name for m in mode_objs], list(seeds), len(prompts), max_new_tokens)
    res.quads_rules = {m.name: {k: getattr(m.cfg, k) for k in ("residual_ratio", "residual_per_token",
                                                              "residual_granularity")}
                       for m in mode_objs if m.cfg.quant == "quads"}
    res.quads_operand = {m.name: _quads_operand(eng, m.cfg) for m in mode_objs if m.cfg.quant == "quads"}
    if isinstance(eng, HFEngine):
        res.notes.append("vLLM is not installed (or engine=hf): the rollout is verl-quads' own rollout arithmetic "
                         "(verl_quads.diagnostics.hf_rollout) over a Hugging Face model, KV-cached decoding with eager "
                         "attention; the trainer uses SDPA attention and one full-sequence forward.")
    n_steps = len(mode_objs) * len(seeds)
    bar = _progress(n_steps, "probe")
    floor_runs = None
    kept = {}  # (pair base, seed) -> (its rollout, its trainer's log-probs), for the paired comparison
    bases = {b.name for b, _ in pairs}
    try:
        for mode in mode_objs:
            runs, decomp_runs, layer_runs, gaps = [], {}, [], []
            for seed in seeds:
                bar.set_postfix_str(f"{mode.name} seed={seed}")
                r = eng.generate(mode, prompt_ids, max_new_tokens, seed)
                tr = score_trainer(trainer, mode, r, device=device)
                row = S.gap_stats(r.logp, tr.logp, r.mask)
                row["argmax_differs"] = S.argmax_differs(r.argmax, tr.argmax, r.mask)
                if r.routing is not None and tr.routing:
                    rs = _routing_stats(r.routing, tr.routing, [len(p) for p in prompt_ids], max_new_tokens)
                    if rs is not None:
                        row.update(rs)
                gaps.extend(S.logp_gap(r.logp, tr.logp, r.mask).tolist())
                runs.append(row)
                if mode.name in bases:
                    kept[(mode.name, seed)] = (r, tr.logp)
                if decompose and mode.cfg.trainer_mode != "trace":
                    _decompose(emu_model, mode, r, tr, device, decomp_runs, layer_runs)
                bar.update(1)
            entry = {"total": S.summarize(runs), "runs": runs}
            if decompose and decomp_runs:
                entry["decomposition"] = {k: S.summarize(v) for k, v in decomp_runs.items()}
                entry["layer_rel_error"] = S.summarize(layer_runs)
            elif decompose:
                entry["decomposition_note"] = ("not computed for trace: its trainer follows the real rollout's codes, "
                                               "which a teacher-forced emulated rollout does not reproduce")
            if mode.name == "bf16":
                floor_runs = entry["total"]
            res.per_mode[mode.name] = entry
            res.gaps[mode.name] = gaps
    finally:
        bar.close()
        eng.close()
    for base, var in pairs:
        res.paired[f"{var.name} vs {base.name}"] = _paired_same_tokens(
            emu_model, trainer, base, var, [(seed, *kept[(base.name, seed)]) for seed in seeds], device)
    if floor_runs is not None:
        for entry in res.per_mode.values():
            entry.setdefault("decomposition", {})["engine_floor"] = floor_runs
    _add_closure(res)
    return res


def _quads_operand(eng, cfg: QuantConfig) -> dict:
    """The QUADS operand form (``residual_combine``, resolved as at engine start) of the rollout engine ``eng``
    (hf: the emulated torch arithmetic; vllm: the plugin's backend for ``cfg.backend`` on this device) and of the
    emulated rollout of the decomposition."""
    from verl_quads.config import resolve_residual_combine
    from verl_quads.diagnostics.hf_rollout import EMULATED_BACKEND

    emulated = resolve_residual_combine(cfg.residual_combine, EMULATED_BACKEND)
    if isinstance(eng, HFEngine):
        rollout = emulated
    else:
        from verl_quads.rollout.backend import resolve_backend

        rollout = resolve_residual_combine(cfg.residual_combine, resolve_backend(cfg.backend))
    return {"residual_combine": cfg.residual_combine, "rollout": rollout, "emulated": emulated}


def variant_pairs(modes: list[Mode]) -> list[tuple[Mode, Mode]]:
    """(base, variant) for every mode named ``base:suffix`` whose ``base`` is also in ``modes`` (step 6), trace
    excluded (its emulated rollout does not reproduce the real rollout's codes)."""
    by_name = {m.name: m for m in modes}
    out = []
    for m in modes:
        base = by_name.get(m.name.rpartition(":")[0]) if ":" in m.name else None
        if base is not None and "trace" not in (base.cfg.trainer_mode, m.cfg.trainer_mode):
            out.append((base, m))
    return out


def _paired_same_tokens(model, trainer, base: Mode, var: Mode, kept: list, device) -> dict:
    """Step 6 for one (base, variant) pair; ``kept``: per batch (seed, the base's rollout, its trainer's log-probs)."""
    runs = []
    spec_b, spec_v = _ablation_specs(base)["both"], _ablation_specs(var)["both"]
    for seed, r, lp_base in kept:
        lp_var = score_trainer(trainer, var, r, device=device).logp
        sb = score_emulated(model, spec_b, base.cfg, r, device=device)
        sv = score_emulated(model, spec_v, var.cfg, r, device=device)
        gb, gv = S.logp_gap(sb.logp, lp_base, r.mask), S.logp_gap(sv.logp, lp_var, r.mask)
        runs.append({"seed": seed, "base": S.gap_stats(sb.logp, lp_base, r.mask),
                     "variant": S.gap_stats(sv.logp, lp_var, r.mask),
                     "tokens_variant_lower": float((gv < gb).double().mean()),
                     "tokens_equal": float((gv == gb).double().mean())})
    summary = S.paired_difference([x["base"] for x in runs], [x["variant"] for x in runs])
    summary.update(S.summarize([{k: x[k] for k in ("tokens_variant_lower", "tokens_equal")} for x in runs]))
    return {"base": base.name, "variant": var.name, "runs": runs, "summary": summary}


def _ablation_specs(mode: Mode) -> dict[str, RolloutSpec]:
    """The emulated rollouts of step 4 for ``mode``: neither / weights_only / activations_only / both."""
    rspec = RolloutSpec.for_rollout_mode(mode.cfg)
    tw, ta = _trainer_mode_spec(mode.cfg)
    ratio, per_tok, gran = mode.cfg.residual_ratio, mode.cfg.residual_per_token, mode.cfg.residual_granularity
    kw = dict(residual_granularity=gran, residual_combine=mode.cfg.residual_combine)
    r_act = rspec.act if rspec.act != "trace" else "naive"
    return {
        "neither": RolloutSpec(tw, ta, ratio, per_tok, **kw),
        "weights_only": RolloutSpec(rspec.weights, ta, ratio, per_tok, **kw),
        "activations_only": RolloutSpec(tw, r_act, ratio, per_tok, **kw),
        "both": RolloutSpec(rspec.weights, r_act, ratio, per_tok, **kw),
    }


def _decompose(model, mode: Mode, r: Rollout, tr: Scored, device, decomp_runs: dict, layer_runs: list) -> None:
    for name, spec in _ablation_specs(mode).items():
        sc = score_emulated(model, spec, mode.cfg, r, device=device)
        row = S.gap_stats(sc.logp, tr.logp, r.mask)
        row["argmax_differs"] = S.argmax_differs(sc.argmax, tr.argmax, r.mask)
        decomp_runs.setdefault(name, []).append(row)
        if name == "both":
            layer_runs.append({f"layer{l}": S.relative_error(tr.layer_outs[l].reshape(-1, tr.layer_outs[l].shape[-1]),
                                                             sc.layer_outs[l].reshape(-1, sc.layer_outs[l].shape[-1]), tr.valid_rows)
                               for l in sorted(tr.layer_outs)})


def _add_closure(res: ProbeResult) -> None:
    pm = res.per_mode
    if "bf16" not in pm or "naive" not in pm:
        return
    for name, entry in pm.items():
        entry["closure"] = {
            k: S.closure(entry["total"][k]["mean"], pm["naive"]["total"][k]["mean"], pm["bf16"]["total"][k]["mean"])
            for k in ("logp_gap_max", "logp_gap_p99", "logp_gap_mean")
        }


# ------------------------------------------------------------------ output
def _pm(s: dict) -> str:
    return f"{s['mean']:.4f}±{s['std']:.4f}"


def format_tables(res: ProbeResult) -> str:
    """Human-readable tables (mean ± std over the batches)."""
    lines = [f"engine: {res.engine}", f"model: {res.model_dir}",
             f"{res.n_prompts} prompts x {res.max_new_tokens} new tokens, seeds {res.seeds} (mean±std over seeds)"]
    lines += [f"NOTE: {n}" for n in res.notes]
    if res.quads_rules:
        ops = res.quads_operand

        def _op(n: str) -> str:
            o = ops.get(n)
            if not o:
                return ""
            emu = "" if o["emulated"] == o["rollout"] else f", emulated (decomposition) {o['emulated']}"
            return f", operand {o['rollout']} (residual_combine={o['residual_combine']}{emu})"

        lines.append("QUADS selection: " + "; ".join(
            f"{n}: k={r['residual_ratio']:g} {'per token' if r['residual_per_token'] else 'per call'} "
            f"{_UNIT_NAMES[r['residual_granularity']]}{_op(n)}"
            for n, r in res.quads_rules.items())
            + (" [operand bf16: Q(x)+Q(R_sel) summed in float32, rounded once to the activation dtype, then the "
               "W4A16 GEMM (what residual_combine=auto runs on the emulated torch/triton backends); fp4x2: two FP4 "
               "operands summed in float32 (auto on native)]" if ops else ""))
    w = max([12] + [len(n) for n in res.per_mode])  # mode column width (e.g. quads@0.125:block)
    hdr = f"{'mode':{w}s} {'max|gap|':>16s} {'p99|gap|':>16s} {'mean|gap|':>16s} {'k3 KL':>16s} {'argmax!=':>16s} {'routing!=':>16s} {'closure p99':>11s}"
    lines += ["", "== total gap (rollout engine vs trainer) ==", hdr]
    for name, e in res.per_mode.items():
        t = e["total"]
        rt = _pm(t["routing_set_differs"]) if "routing_set_differs" in t else "n/a"
        cl = e.get("closure", {}).get("logp_gap_p99")
        lines.append(f"{name:{w}s} {_pm(t['logp_gap_max']):>16s} {_pm(t['logp_gap_p99']):>16s} {_pm(t['logp_gap_mean']):>16s} "
                     f"{_pm(t['k3_kl']):>16s} {_pm(t['argmax_differs']):>16s} {rt:>16s} {('%.3f' % cl) if cl is not None else 'n/a':>11s}")
    if any("decomposition" in e for e in res.per_mode.values()):
        lines += ["", "== decomposition by ablation (p99 |gap| / mean |gap|; rollout side emulated, teacher-forced) =="]
        parts = ("engine_floor", "neither", "weights_only", "activations_only", "both")
        lines.append(f"{'mode':{w}s} " + " ".join(f"{p:>24s}" for p in parts))
        for name, e in res.per_mode.items():
            d = e.get("decomposition", {})
            cells = [(f"{d[p]['logp_gap_p99']['mean']:.4f}/{d[p]['logp_gap_mean']['mean']:.4f}" if p in d else "n/a") for p in parts]
            lines.append(f"{name:{w}s} " + " ".join(f"{c:>24s}" for c in cells))
        lines += ["", "== per-layer relative output error (emulated rollout 'both' vs trainer; mean over seeds) =="]
        for name, e in res.per_mode.items():
            le = e.get("layer_rel_error", {})
            lines.append(f"{name:{w}s} " + " ".join(f"{k}={v['mean']:.4f}" for k, v in le.items()))
    if res.paired:
        lines += ["", "== paired on the same tokens (per batch: the base's rollout tokens; both modes' emulated "
                  "rollouts teacher-forced, each vs its trainer; diff = variant - base, lower is better) =="]
        wp = max(len(k) for k in res.paired)
        lines.append(f"{'pair':{wp}s} {'metric':>9s} {'base':>9s} {'variant':>9s} {'diff (mean±std)':>20s} "
                     f"{'variant lower':>13s}")
        for key, pr in res.paired.items():
            sm = pr["summary"]
            for k, label in (("logp_gap_max", "max|gap|"), ("logp_gap_p99", "p99|gap|"),
                             ("logp_gap_mean", "mean|gap|"), ("k3_kl", "k3 KL")):
                d = sm[k]
                lines.append(f"{key:{wp}s} {label:>9s} {d['base']:9.5f} {d['variant']:9.5f} "
                             f"{d['diff']:+10.5f}±{d['diff_std']:.5f} {d['variant_lower']:>6d}/{d['n']} batches")
            lines.append(f"{key:{wp}s} tokens where the variant's |gap| is lower: {sm['tokens_variant_lower']['mean']:.3f}"
                         f", equal: {sm['tokens_equal']['mean']:.3f} (mean over batches)")
    return "\n".join(lines)


def plot(res: ProbeResult, path: str | Path) -> Path:
    """PNG: |gap| distribution per mode (log-x histogram) and per-layer relative error per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("probe: matplotlib is needed for the plot (it is in scripts/requirements-cpu.txt); "
                           "pass --no-plot to skip it") from e
    import numpy as np

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    bins = np.logspace(-6, 1.5, 60)
    for name, g in res.gaps.items():
        v = np.clip(np.asarray(g, dtype=float), 1e-6, None)
        a1.hist(v, bins=bins, histtype="step", label=name, linewidth=1.4)
    a1.set_xscale("log")
    a1.set_xlabel("|log-prob gap| per token (rollout vs trainer)")
    a1.set_ylabel("tokens")
    a1.set_title("gap distribution per mode")
    a1.legend(fontsize=7)
    for name, e in res.per_mode.items():
        le = e.get("layer_rel_error")
        if not le:
            continue
        ks = sorted(le, key=lambda k: int(k[5:]))
        a2.errorbar([int(k[5:]) for k in ks], [le[k]["mean"] for k in ks], yerr=[le[k]["std"] for k in ks], marker="o", label=name, capsize=2)
    a2.set_yscale("symlog", linthresh=1e-4)
    a2.set_xlabel("decoder layer")
    a2.set_ylabel("relative output error (rollout vs trainer)")
    a2.set_title("error vs layer")
    a2.legend(fontsize=7)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_outputs(res: ProbeResult, out_dir: str | Path, *, make_plot: bool = True) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "probe.json", "txt": out / "probe.txt"}
    paths["json"].write_text(json.dumps(res.to_json(), indent=1, default=float))
    paths["txt"].write_text(format_tables(res) + "\n")
    if make_plot:
        paths["png"] = plot(res, out / "probe.png")
    return paths


def load_prompts(path: str | Path) -> tuple[str, ...]:
    """Prompts from ``path``: a ``.json`` file holding a list of strings, else one prompt per non-empty line."""
    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list) or not data or not all(isinstance(x, str) and x for x in data):
            raise ValueError(f"--prompts {path}: a .json prompts file must hold a non-empty list of non-empty strings")
        return tuple(data)
    prompts = tuple(l.rstrip("\n") for l in path.read_text().splitlines() if l.strip())
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt in the file")
    return prompts


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="verl-quads probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF checkpoint directory (default: build the tiny random Qwen3-MoE with outlier channels)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma list: bf16,naive,w4a16,w4a4_qat,quads@R[:sampled|:channel|:block|:call],trace "
                        "(quads@R: the product default rule, per-token channels over a sampled threshold = :sampled; "
                        ":channel the exact per-token top-k channels; :block per-token 16-channel blocks; :call "
                        "per-call blocks; a mode and its :rule variant in one run are also compared paired on the "
                        "same tokens)")
    p.add_argument("--prompts", help="file with one prompt per line, or a .json file holding a list of prompt strings "
                                     "(e.g. the prompts.json `python -m verl_quads.diagnostics.realistic` writes: "
                                     "its held-out prompts, which may span lines) (default: built-in set)")
    p.add_argument("--seeds", type=int, default=3, help="number of sampled batches (>= 3)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--guided-layers", type=int, default=20)
    p.add_argument("--no-decompose", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", default="probe_out")
    a = p.parse_args(argv)
    model = a.model
    if model is None:
        from verl_quads.diagnostics.outliers import build_tiny_with_outliers

        model = str(build_tiny_with_outliers(Path(a.out) / "tiny_model"))
        print(f"model: tiny random Qwen3-MoE with injected outlier channels, built at {model}")
    prompts = DEFAULT_PROMPTS
    if a.prompts:
        prompts = load_prompts(a.prompts)
    t0 = time.perf_counter()
    res = run_probe(model, modes=a.modes.split(","), prompts=prompts, seeds=tuple(range(a.seeds)),
                    max_new_tokens=a.max_new_tokens, engine=a.engine, device=a.device,
                    guided_layers=a.guided_layers, decompose=not a.no_decompose)
    print(format_tables(res))
    paths = write_outputs(res, a.out, make_plot=not a.no_plot)
    print(f"\nwrote {', '.join(str(v) for v in paths.values())} in {time.perf_counter() - t0:.1f}s")


__all__ = ["DEFAULT_MODES", "DEFAULT_PROMPTS", "Mode", "ProbeResult", "format_tables", "load_prompts", "main",
           "parse_mode", "plot", "run_probe", "score_emulated", "score_trainer", "variant_pairs", "write_outputs"]
