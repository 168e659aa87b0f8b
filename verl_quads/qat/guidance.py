"""TRACE guidance on the trainer side: the provider interface and the per-batch token map.

Keying (DESIGN.md §1): one entry per ``(sequence uid, policy version, layer, GEMM)``:

- ``uid``: the sequence's id (verl's ``non_tensor_batch["uid"]`` is per prompt; the rollout side
  must use a per-sequence id, e.g. ``f"{uid}/{sample_index}"``); any string.
- ``policy_version``: int, the trainer step whose weights the rollout ran. A record of another
  version is stale and refused.
- ``layer``: decoder-layer index (0-based, as in ``model.layers.<i>``).
- ``gemm``: the GEMM's module path inside the decoder layer, with vLLM's fused names (the rollout's
  capture uses the same strings): ``self_attn.qkv_proj``, ``self_attn.o_proj``, ``mlp.gate_up_proj``,
  ``mlp.down_proj`` (dense MLP), ``mlp.experts.w13``, ``mlp.experts.w2`` (fused MoE). The trainer
  derives them from its module names (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

An entry holds a :class:`~verl_quads.nvfp4.GuidanceRecord` for the rows of that GEMM's input for
that sequence, in token-position order, with a per-token global scale ``[T, 1]``:

- linear GEMMs and ``*.experts.w13``: shape ``[T, K]`` (one row per token position; w13's input
  is the token's hidden state, the same for all its experts).
- ``*.experts.w2``: shape ``[T, top_k, I]`` (one row per (token, routing slot)), plus
  ``expert_ids`` int64 ``[T, top_k]``: the experts the rollout routed to. The trainer requires the
  same routing (e.g. router replay); any mismatch is an error.

``T`` is the number of positions the rollout ran through the model for the sequence. Since the
rollout never feeds the last sampled token, ``T`` may be the trainer's length ``n`` or ``n - 1``;
the one uncovered last position (whose output enters no log-prob) is rounded to nearest. Any other
length is an error. Padding rows are rounded to nearest (their outputs are masked).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from verl_quads.nvfp4 import GuidanceRecord

#: The GEMM names of the supported families (Qwen3 / Qwen3-MoE / OLMoE / Llama-style layers).
GEMM_NAMES = (
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
    "mlp.experts.w13",
    "mlp.experts.w2",
)


def is_expert_w2(gemm: str) -> bool:
    return gemm.endswith(".w2")


class GuidanceError(RuntimeError):
    """A TRACE guidance record is missing, stale or does not fit (never silently ignored)."""


@dataclass(frozen=True)
class GuidanceKey:
    uid: str
    policy_version: int
    layer: int
    gemm: str

    def __str__(self) -> str:
        return f"(uid={self.uid!r}, policy_version={self.policy_version}, layer={self.layer}, gemm={self.gemm!r})"


@dataclass(frozen=True)
class GuidanceEntry:
    """What the rollout stored for one key: the record, and for ``experts.w2`` the routing."""

    record: GuidanceRecord
    expert_ids: torch.Tensor | None = None


@runtime_checkable
class GuidanceProvider(Protocol):
    """Source of guidance entries. ``get`` raises :class:`GuidanceError` when it has none for
    the key (missing) or only one of another policy version (stale)."""

    def get(self, key: GuidanceKey) -> GuidanceEntry: ...


class InMemoryGuidanceStore:
    """A dict-backed :class:`GuidanceProvider` (what the rollout side fills; used in tests)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int, str], tuple[int, GuidanceEntry]] = {}

    def put(self, key: GuidanceKey, record: GuidanceRecord, expert_ids: torch.Tensor | None = None) -> None:
        """Store (replacing any other version of the same uid/layer/GEMM)."""
        if (is_expert_w2(key.gemm)) != (expert_ids is not None):
            raise ValueError(f"guidance {key}: expert_ids is required for experts' w2 inputs and only for them")
        self._entries[(key.uid, key.layer, key.gemm)] = (key.policy_version, GuidanceEntry(record, expert_ids))

    def get(self, key: GuidanceKey) -> GuidanceEntry:
        hit = self._entries.get((key.uid, key.layer, key.gemm))
        if hit is None:
            raise GuidanceError(f"TRACE: no guidance record for {key}")
        version, entry = hit
        if version != key.policy_version:
            raise GuidanceError(
                f"TRACE: stale guidance for {key}: the record is from policy version {version}, "
                f"the trainer is at {key.policy_version}"
            )
        return entry

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class RolloutGuidanceProvider:
    """A :class:`GuidanceProvider` over the rollout's per-request captures.

    ``requests``: ``{uid: capture}`` where a capture has the attributes of
    ``verl_quads.rollout.capture.RequestGuidance``: ``positions`` int64 ``[T]``, ``records``
    ``{(layer, gemm): GuidanceRecord}`` with leading dimension T, ``expert_ids`` ``{layer: [T, top_k]}``
    and ``policy_version``. Positions must be exactly ``0..T-1`` (a gap, e.g. from vLLM prefix caching,
    is an error, not a silent fallback).
    """

    def __init__(self, requests: dict) -> None:
        self._requests = dict(requests)
        self._contiguous: dict[str, torch.Tensor] = {}  # uid -> the positions tensor already checked

    def get(self, key: GuidanceKey) -> GuidanceEntry:
        cap = self._requests.get(key.uid)
        if cap is None:
            raise GuidanceError(f"TRACE: no rollout capture for sequence {key.uid!r} (wanted {key})")
        if cap.policy_version != key.policy_version:
            raise GuidanceError(
                f"TRACE: stale guidance for {key}: the rollout ran policy version {cap.policy_version}, "
                f"the trainer is at {key.policy_version}"
            )
        if self._contiguous.get(key.uid) is not cap.positions:  # once per sequence's positions tensor
            t = int(cap.positions.numel())
            if not torch.equal(cap.positions.cpu(), torch.arange(t, dtype=cap.positions.dtype)):
                raise GuidanceError(
                    f"TRACE: rollout capture of {key.uid!r} does not cover positions 0..{t - 1} contiguously "
                    "(prefix caching must be off for TRACE)"
                )
            self._contiguous[key.uid] = cap.positions
        rec = cap.records.get((key.layer, key.gemm))
        if rec is None:
            raise GuidanceError(
                f"TRACE: no guidance record for {key}; the capture has {sorted(cap.records, key=str)[:8]}..."
            )
        eids = cap.expert_ids.get(key.layer) if is_expert_w2(key.gemm) else None
        if is_expert_w2(key.gemm) and eids is None:
            raise GuidanceError(f"TRACE: capture for {key} has no expert ids")
        return GuidanceEntry(rec, eids)


@dataclass
class TraceBatch:
    """Which sequence and position each token row of the current forward belongs to.

    Attributes:
        provider: where records come from.
        policy_version: the trainer's current policy version.
        uids: one id per sequence in the batch.
        row_seq: int64 ``[N]``: for each flattened token row of the model input (``input_ids``
            flattened in row-major order), the index into ``uids``, or -1 for padding.
        row_pos: int64 ``[N]``: the row's position within its sequence (0-based).
    """

    provider: GuidanceProvider
    policy_version: int
    uids: list[str]
    row_seq: torch.Tensor
    row_pos: torch.Tensor
    #: If set, guided layers do NOT read guidance: they round to nearest and store what they
    #: chose here (under this batch's keys). For tests and diagnostics (a trainer-made record is
    #: what a rollout with identical activations would store); never used in training.
    record_into: "InMemoryGuidanceStore | None" = None

    @classmethod
    def padded(
        cls, provider: GuidanceProvider, policy_version: int, uids: list[str], attention_mask: torch.Tensor
    ) -> "TraceBatch":
        """Padded batch ``[B, S]``: row ``b`` is sequence ``uids[b]``; its valid tokens (mask 1, any
        left/right padding) are positions 0, 1, ... in order."""
        if attention_mask.dim() != 2 or attention_mask.shape[0] != len(uids):
            raise ValueError(f"TraceBatch.padded: attention_mask {tuple(attention_mask.shape)} vs {len(uids)} uids")
        m = attention_mask.bool()
        pos = torch.cumsum(m.long(), dim=1) - 1
        seq = torch.arange(len(uids)).unsqueeze(1).expand_as(m)
        return cls(provider, policy_version, list(uids), torch.where(m, seq, -1).flatten(), torch.where(m, pos, -1).flatten())

    @classmethod
    def packed(cls, provider: GuidanceProvider, policy_version: int, uids: list[str], seq_lens: list[int], total_rows: int | None = None) -> "TraceBatch":
        """Packed (remove-padding) batch ``[1, sum(seq_lens)]``; trailing rows up to ``total_rows`` are padding."""
        seq = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(seq_lens)])
        pos = torch.cat([torch.arange(n) for n in seq_lens])
        pad = (total_rows or len(seq)) - len(seq)
        if pad < 0:
            raise ValueError(f"TraceBatch.packed: total_rows={total_rows} < sum(seq_lens)={len(seq)}")
        return cls(provider, policy_version, list(uids), torch.cat([seq, torch.full((pad,), -1)]), torch.cat([pos, torch.full((pad,), -1)]))

    def store(self, layer: int, gemm: str, record: GuidanceRecord, expert_ids: torch.Tensor | None = None) -> None:
        """Split a record over all token rows ``[N, ..., K]`` per sequence into ``record_into``."""
        if self.record_into is None:
            raise RuntimeError("TraceBatch.store: record_into is not set")
        for i, uid in enumerate(self.uids):
            rows = torch.nonzero(self.row_seq == i).flatten()
            rows = rows[torch.argsort(self.row_pos[rows])]
            dev = record.bits.device
            r = rows.to(dev)
            rec = GuidanceRecord(
                record.bits[r],
                record.block_scale.view(torch.uint8)[r].view(torch.float8_e4m3fn),
                record.global_scale[r],
                torch.Size((len(rows), *record.shape[1:])),
            )
            eids = None if expert_ids is None else expert_ids[rows.to(expert_ids.device)]
            self.record_into.put(GuidanceKey(uid, self.policy_version, layer, gemm), rec, eids)

    def __post_init__(self) -> None:
        # Host-side row map, built once per batch (a micro-batch), so that no forward needs the host to
        # read device data: the per-GEMM gathers below only index with tensors computed here.
        seq = self.row_seq.detach().to("cpu", torch.long)
        pos = self.row_pos.detach().to("cpu", torch.long)
        if seq.shape != pos.shape or seq.dim() != 1:
            raise ValueError(f"TraceBatch: row_seq {tuple(seq.shape)} and row_pos {tuple(pos.shape)} must be equal 1-D")
        self._seq_h, self._pos_h = seq, pos
        self._lengths: list[int] = torch.bincount(seq[seq >= 0], minlength=len(self.uids)).tolist()
        self._n_pad = int((seq < 0).sum())
        self._index_cache: dict = {}
        self._checks: list = []

    def seq_lengths(self) -> torch.Tensor:
        """int64 ``[len(uids)]``: token rows of each sequence (host tensor)."""
        return torch.tensor(self._lengths, dtype=torch.long)

    def _rows_index(self, t: tuple[int, ...], device: torch.device) -> "_RowsIndex":
        """Where each token row's guidance lives once the sequences' records (``t[i]`` rows each) are
        concatenated (see :class:`_RowsIndex`), all on ``device``. Computed on the host from the row map
        and cached per ``(t, device)``; the copy to a CUDA device is asynchronous (pinned memory), so no
        sync."""
        key = (t, str(device))
        hit = self._index_cache.get(key)
        if hit is None:
            n_seq = len(self.uids)
            seq, pos = self._seq_h, self._pos_h
            s = torch.where(seq >= 0, seq, n_seq)
            tt = torch.tensor(list(t) + [0], dtype=torch.long)
            offs = torch.tensor([0, *itertools.accumulate(t)], dtype=torch.long)  # offs[n_seq] = fill row
            cov = (seq >= 0) & (pos < tt[s])
            src = torch.where(cov, offs[s] + pos, offs[n_seq])
            # the uncovered rows, ascending: their number is host arithmetic (padding + n_i - t_i per
            # sequence), their indices the first ones of a stable sort by coverage
            n_unc = self._n_pad + sum(max(0, n - ti) for n, ti in zip(self._lengths, t))
            unc = torch.argsort(cov.to(torch.uint8), stable=True)[:n_unc]
            hit = _RowsIndex(_to_device(src, device), _to_device(cov, device), _to_device(unc, device),
                             _to_device(torch.where(cov, src, 0), device) if sum(t) else None)
            self._index_cache[key] = hit
        return hit

    def _entries(self, layer: int, gemm: str) -> list[tuple[GuidanceKey, GuidanceEntry]]:
        return [(k, self.provider.get(k)) for k in (GuidanceKey(u, self.policy_version, layer, gemm) for u in self.uids)]

    def defer_check(self, bad_rows: torch.Tensor, describe) -> None:
        """Register a check that needs the host: ``bad_rows`` (bool, on the device) marks failing rows;
        :meth:`verify` reads all registered checks in one device sync and raises
        ``GuidanceError(describe(count))`` for the first one with failing rows."""
        self._checks.append((bad_rows, describe))

    def verify(self) -> None:
        """Run the deferred checks of the forwards (and recomputes) done under this batch: one device
        sync, none if nothing was registered. Called by :func:`verl_quads.qat.trace_context` on exit and
        by verl-quads' verl integration once per micro-batch; raises :class:`GuidanceError`."""
        if not self._checks:
            return
        checks, self._checks = self._checks, []
        counts = torch.stack([b.sum() for b, _ in checks]).tolist()
        for (_, describe), n in zip(checks, counts):
            if n:
                raise GuidanceError(describe(int(n)))

    def routing(self, layer: int, gemm: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout's routing over the token rows of the current forward (router replay).

        Returns ``(expert_ids, covered)``: int64 ``[N, top_k]`` (-1 where not covered) and bool ``[N]``,
        from the ``expert_ids`` stored beside ``gemm``'s (an ``experts.w2``) records; same checks as
        :meth:`gather` (missing / stale / wrong length raise :class:`GuidanceError`). No device sync.
        """
        if not is_expert_w2(gemm):
            raise ValueError(f"TraceBatch.routing: {gemm!r} is not an experts' w2 GEMM")
        dev = torch.device(device)
        ts, ids_all = [], []
        for (key, entry), n in zip(self._entries(layer, gemm), self._lengths):
            ids = entry.expert_ids
            if ids is None or ids.dim() != 2 or ids.shape[0] not in (n, n - 1):
                raise GuidanceError(
                    f"TRACE: routing for {key}: expert ids {None if ids is None else tuple(ids.shape)}, the "
                    f"trainer needs [T, top_k] with T in ({n}, {n - 1})"
                )
            ts.append(int(ids.shape[0]))
            ids_all.append(ids)
        if not ids_all:
            raise GuidanceError(f"TRACE: routing for layer {layer} {gemm}: the TraceBatch has no sequences")
        idx = self._rows_index(tuple(ts), dev)
        src, covered = idx.src, idx.covered
        eids = _gather_rows(ids_all, src, -1, torch.long, dev)
        return eids, covered

    def gather(
        self, layer: int, gemm: str, rows_shape: tuple[int, ...], k: int, device: torch.device | str = "cpu"
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor | None, bool]:
        """Assemble, for the current forward, one record over all token rows of a GEMM input.

        Returns ``(parts, covered, expert_ids, uncovered)`` where ``parts`` is a GuidanceRecord-like
        tuple of tensors laid out over ``[N, *rows_shape[1:], K]`` (``bits`` uint8, ``block_scale`` e4m3,
        ``global_scale`` float32 ``[..., 1]``) holding, where not covered, some other row's record
        (unspecified: every caller replaces or masks those rows, see :func:`~verl_quads.qat.activations.merged_record`
        and the routing check), ``covered`` bool ``[N]``, ``expert_ids`` int64 ``[N, top_k]`` (likewise
        unspecified where not covered) or None, all on
        ``device``, and ``uncovered`` int64 ``[U]`` on ``device``: the rows without a record (U, its
        length, is known on the host; 0 = every row covered). Records should live on
        ``device`` (the verl integration moves them there once per micro-batch); records elsewhere are
        concatenated there and copied once per part. No device sync: shapes are checked on the host, the
        rows are gathered with one ``index_select`` per part (index built once per batch; no fill row, so a
        single sequence's record is gathered without any concatenation).
        """
        n_rows = self.row_seq.numel()
        if rows_shape[0] != n_rows:
            raise GuidanceError(
                f"TRACE: layer {layer} {gemm}: the GEMM input has {rows_shape[0]} token rows but the TraceBatch "
                f"maps {n_rows}; the TraceBatch does not describe this forward"
            )
        inner = tuple(rows_shape[1:])
        dev = torch.device(device)
        ts, recs, eids_all = [], [], []
        for (key, entry), n in zip(self._entries(layer, gemm), self._lengths):
            rec = entry.record
            t = rec.shape[0] if len(rec.shape) else 0
            want = (t,) + inner + (k,)
            if tuple(rec.shape) != want or t not in (n, n - 1) or tuple(rec.global_scale.shape) != (t,) + inner + (1,):
                raise GuidanceError(
                    f"TRACE: guidance for {key} has shape {tuple(rec.shape)} (global scale "
                    f"{tuple(rec.global_scale.shape)}); the trainer needs [T, {', '.join(map(str, inner + (k,)))}] with "
                    f"T in ({n}, {n - 1}) for this sequence of {n} tokens and a per-token global scale [T, ..., 1]"
                )
            ts.append(t)
            recs.append(rec)
            eids_all.append(entry.expert_ids)
        idx = self._rows_index(tuple(ts), dev)
        src, covered, uncovered = idx.src, idx.covered, idx.uncovered
        fill = {}  # the fill values where no record row exists at all (then every row is uncovered)
        src0 = idx.src_nofill if recs else None
        if src0 is not None:
            src = src0
            fill = dict.fromkeys(("bits", "bscale", "gscale", "eids"), None)
        elif not recs:
            src = torch.zeros(n_rows, dtype=torch.long, device=dev)
        bits = _gather_rows([r.bits for r in recs], src, fill.get("bits", 0), torch.uint8, dev, inner + (k // 8,))
        bscale = _gather_rows([r.block_scale.view(torch.uint8) for r in recs], src, fill.get("bscale", 0), torch.uint8,
                              dev, inner + (k // 16,))
        gscale = _gather_rows([r.global_scale for r in recs], src, fill.get("gscale", 1.0), torch.float32, dev,
                              inner + (1,))
        eids = None
        if recs and all(e is not None for e in eids_all):
            eids = _gather_rows(eids_all, src, fill.get("eids", -1), torch.long, dev)
        elif any(e is not None for e in eids_all):
            raise GuidanceError(f"TRACE: layer {layer} {gemm}: expert ids are stored for some sequences only")
        return (bits, bscale.view(torch.float8_e4m3fn), gscale), covered, eids, uncovered


class _RowsIndex(NamedTuple):
    """Row map of one forward onto the concatenated records of its sequences (all int64/bool, on the
    GEMM's device; N token rows of the forward, U of them without a record)."""

    #: int64 ``[N]``: each row's record row; uncovered rows point at the fill row ``sum(t)``.
    src: torch.Tensor
    #: bool ``[N]``: the row has a record.
    covered: torch.Tensor
    #: int64 ``[U]``: the uncovered rows, ascending.
    uncovered: torch.Tensor
    #: int64 ``[N]``: ``src`` with the uncovered rows sent to row 0 instead of the fill row (a gather with it
    #: needs no fill row, i.e. no ``full`` + ``cat`` launches; callers replace or mask those rows anyway);
    #: None when no sequence has a record row.
    src_nofill: torch.Tensor | None


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to CUDA through pinned memory and ``non_blocking`` (no stream sync)."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _gather_rows(parts: list[torch.Tensor], src: torch.Tensor, fill, dtype: torch.dtype, device: torch.device,
                 row_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``cat(parts + [fill row])[src]`` in ``dtype`` on ``device``: the rows of the sequences' records for
    every token row, the fill value where ``src`` points past the records. One ``cat`` and one
    ``index_select`` (on ``device``; parts elsewhere are concatenated there and copied once).
    ``fill=None``: no fill row (``src`` stays inside the records); one part is then gathered directly,
    without a ``cat``."""
    if row_shape is None:
        row_shape = tuple(parts[0].shape[1:]) if parts else ()
    home = parts[0].device if parts and all(p.device == parts[0].device for p in parts) else torch.device("cpu")
    if fill is None and len(parts) == 1 and parts[0].dtype == dtype:
        return _to_device(parts[0], device).index_select(0, src)
    extra = [] if fill is None else [torch.full((1, *row_shape), fill, dtype=dtype, device=home)]
    cat = torch.cat([p.to(home, dtype) for p in parts] + extra)
    return _to_device(cat, device).index_select(0, src)


__all__ = [
    "GEMM_NAMES",
    "GuidanceError",
    "GuidanceKey",
    "GuidanceEntry",
    "GuidanceProvider",
    "InMemoryGuidanceStore",
    "RolloutGuidanceProvider",
    "TraceBatch",
    "is_expert_w2",
]
