"""Prototype (issue #5): a Gluon (explicit-layout Triton) W4A16 GEMM for dense decode, M = 1..16, Hopper.

Marlin-style: the NVFP4 weight is stored PRE-PERMUTED (:func:`permute_weight`) so that ONE 16-byte vector load
gives each thread exactly the 32 nibbles of its ``mma.sync m16n8k16`` A fragments for a 64-element K chunk
(weights on the MMA's M side, the few activation rows padded to n = 8 or 16 on its N side). The decoded tile
reaches the MMA with no layout conversion (``convert_layout(..., assert_trivial=True)``: the compile fails
if Triton would move data), and no split-K reduction is needed inside a program.

Permuted layout (16-row groups ``R``, 64-element K chunks ``c``; ``N`` padded to 16, ``K`` to 64 with zero
codes and zero scales):

- ``wq`` int32 ``[NR, C, 32, 4]``: lane ``l = 4 g + t`` (g 0..7, t 0..3), word ``s`` (0..3); nibble
  ``j = rb3 + 2 kb3 + 4 e`` (bits 4j..4j+3) is the code of ``W[16 R + 8 rb3 + g, 64 c + 16 t + 4 s + 2 kb3 + e]``.
  In MMA terms, K-step ``s`` of the chunk (16 "mma-k" positions ``mk = 8 kb3 + 2 t + e``) holds the weights
  of the actual columns ``pi(s, mk) = 16 t + 4 s + 2 kb3 + e``: the activation operand uses the same
  permutation, so the sum is unchanged, and each thread's activation elements (row g, columns
  ``64 c + 16 t + [0, 16)``) are 32 contiguous bytes (two 16-byte loads), and its 32 weights of a chunk
  share ONE 16-block (block ``4 c + t``) per row: two scale bytes per thread and chunk.
- ``sq`` uint8 ``[NR, C, 8, 4, 2]``: ``sq[R, c, g, t, rb3] = block_scale[16 R + 8 rb3 + g, 4 c + t]`` (E4M3 bits).

Decode (per int32 word, 4 pairs): nibbles ``j`` and ``j + 4`` are 16 bits apart, so 2 shifts + 2 masks + 1 or
build both as the two bf16 halves of one register (magnitude bits -> 6..8 / 22..24, sign -> 15 / 31): bf16
``E2M1 * 2**-126`` (code 1 is the bf16 subnormal 2**-127), which is the MMA's register pair (k, k + 1); times
the block-scale multiplier ``bf16(scale * 2**118)`` (exact: E4M3 has 4 significant bits) gives
``E2M1 * scale * 2**-8`` exactly (<= 6 significant bits, >= 2**-18). The float32 accumulator is multiplied by
``256 / global_scale`` (``div_rn(1, gs) * 256``, like the weight-streaming kernel's ``bf16x2`` decode) and
rounded once to bf16. Same bound vs the torch reference (:mod:`verl_quads.rollout.emulation`) as the
other kernels: exact products, float32 summation order (<= 1 bf16 ulp + 4 K eps_f32 |x| |w|).

Split-K across programs (``split``): float32 partials ``[split, M, N]``; the last program of each N tile
(per-tile counter, acq_rel atomic) sums them in the fixed order 0, 1, ... (deterministic; dense kernels:
:func:`split_fixup_v`, 16-byte accesses and the partial loads unrolled). Split-K inside a program
(standard layout, ``GluonConfig.ks``, :func:`_w4a16_ks_kernel`): the K slices are the batch dimension of a 3-D
mma.sync, summed through shared memory in the same fixed order (the same bytes as the global split at the same
slice boundaries, without the global round trip).

Needs triton >= 3.6 with Gluon (``triton.experimental.gluon``) and an sm_80+ GPU (mma.sync). The permuted-layout
kernel is a prototype (not in the dispatch); the standard-layout kernel (:func:`gluon_w4a16_std`) serves the dense
dispatch's ``gluon_dispatch.GLUON_TABLE`` and, through its shared helpers, the grouped kernel of
:mod:`verl_quads.nvfp4.gluon_moe`. ``verl_quads.bench.gluon_probe`` times them; tests/gpu/test_gluon_gemm_gpu.py
checks them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4.format import BLOCK_SIZE, E2M1_VALUES
from verl_quads.nvfp4.gemm_shared import tile_counters

ROWS = 16  # weight rows per row group (the MMA's M)
CHUNK = 64  # K elements per chunk (4 MMA K-steps of 16)

#: Oldest triton these kernels were compiled and tested with (the H200's 3.6.0; offline also 3.9).
MIN_TRITON = (3, 6)

try:  # triton >= 3.6 with Gluon; the torch layout functions below work without it
    import triton as _triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    # CTA barrier: gl.thread_barrier in triton 3.6 (the H200's), gl.barrier in later versions (offline compiles)
    _cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    gluon.jit, gluon.constexpr_function  # noqa: B018 - the decorators below run at import: an older Gluon lacks one
except Exception:  # pragma: no cover - old triton / no triton: this module still imports (torch layout functions)
    gluon = None


@functools.cache
def triton_version() -> tuple[int, int] | None:
    """(major, minor) of the installed triton, or None (read once: the dispatch asks on every call)."""
    try:
        import triton

        return tuple(int(v) for v in triton.__version__.split(".")[:2])
    except Exception:
        return None


@functools.cache
def _gluon_api_missing() -> tuple[str, ...]:
    """The Gluon API pieces the kernels use that the installed triton lacks (read once)."""
    need = ("BlockedLayout", "SliceLayout", "NVMMADistributedLayout", "DotOperandLayout", "inline_asm_elementwise",
            "convert_layout", "join", "permute", "reshape", "atomic_add")
    return tuple(nm for nm in need if not hasattr(gl, nm)) + (() if hasattr(gluon, "constexpr_function") else
                                                               ("constexpr_function",))


def gluon_available() -> tuple[bool, str]:
    """(whether the Gluon kernels can run with the installed triton, why not): Gluon importable, triton >=
    :data:`MIN_TRITON`, and the API pieces the kernels use present."""
    if gluon is None:
        return False, f"triton {'.'.join(map(str, triton_version() or ())) or 'missing'} has no usable Gluon"
    ver = triton_version()
    if ver is None or ver < MIN_TRITON:
        return False, f"triton {_triton.__version__} < {'.'.join(map(str, MIN_TRITON))}"
    missing = _gluon_api_missing()
    if missing:
        return False, f"triton {_triton.__version__} Gluon lacks {', '.join(missing)}"
    return True, ""


# ----------------------------------------------------------------------------------------------- layout (torch)


@dataclass(frozen=True)
class GluonWeight:
    """An NVFP4 weight ``[n, k]`` in the kernel's permuted layout (module docstring); ``fmt`` the bit format of
    a word (:data:`FORMATS`)."""

    wq: torch.Tensor  # int32 [NR, C, 32, 4]
    sq: torch.Tensor  # uint8 [NR, C, 8, 4, 2]
    gs: torch.Tensor  # float32 [1] (encode global scale)
    n: int
    k: int
    fmt: int = 1

    @property
    def nr(self) -> int:
        return self.wq.shape[0]

    @property
    def chunks(self) -> int:
        return self.wq.shape[1]


#: Word bit formats. A word holds 4 register pairs P = rb3 + 2 kb3, elements e = 0, 1 (code j = P + 4 e).
#: 1 ("nibbles"): code j in bits 4j..4j+3. Decode of pair P: 2 shifts + 2 logic ops (magnitudes and signs
#:   moved by different amounts).
#: 2 ("spread"): the 32 code bits pre-placed so that a pair's bf16x2 pattern (magnitude bits 6..8 / 22..24,
#:   signs 15 / 31: mask 0x81C081C0) is ONE rotation away: pair 0 in place (AND), pairs 1, 2 rotated left by
#:   4 / 10 (rotate + AND), pair 3 from two rotations (6: bits 6, 22; 14: bits 7, 8, 15, 23, 24, 31; 4 ops):
#:   9 integer ops per word instead of ~15.
FORMATS = (1, 2)
_PAIR_ROT = {0: ((0, 0x81C081C0),), 1: ((4, 0x81C081C0),), 2: ((10, 0x81C081C0),),
             3: ((6, 0x00400040), (14, 0x81808180))}


def _target_bit(e: int, b: int) -> int:
    """Bit of a bf16x2 pair register that code bit b (0..2 magnitude, 3 sign) of element e decodes to."""
    return 16 * e + (6 + b if b < 3 else 15)


def _bit_map(fmt: int) -> list[int]:
    """``src[j * 4 + b]``: the word bit holding bit b of code j (j = P + 4 e)."""
    src = []
    for j in range(8):
        p, e = j % 4, j // 4
        for b in range(4):
            if fmt == 1:
                src.append(4 * j + b)
            else:
                tau = _target_bit(e, b)
                rot = next(r for r, m in _PAIR_ROT[p] if (m >> tau) & 1)
                src.append((tau - rot) % 32)
    assert sorted(src) == list(range(32))
    return src


def spread_std(packed: torch.Tensor) -> torch.Tensor:
    """Standard-layout NVFP4 codes (uint8 ``[N, K/2]``, low nibble = even element; ``K % 8 == 0``) with the 32 bits of
    every little-endian int32 word (nibble j = element 8 i + j of word i) moved to word bit format 2 ("spread",
    :data:`FORMATS`): what the standard-layout kernels read with decode 2 (one rotation + mask per register pair instead
    of mask + multiply + mask). Same shape and dtype; :func:`unspread_std` inverts it."""
    return _map_std_bits(packed, _bit_map(2), "spread_std")


def adjacent_std(packed: torch.Tensor) -> torch.Tensor:
    """:func:`spread_std` with the codes also reordered inside each word so that format 2's register pair P holds
    elements ``8 i + 2 P`` and ``8 i + 2 P + 1`` (instead of ``8 i + P``, ``8 i + P + 4``): what decode 4 reads (the
    activation then needs no pair permutes). Same shape and dtype."""
    src = _bit_map(2)
    dst = [0] * 32
    for n in range(8):  # plain nibble n = element 8 i + n -> pair P = n // 2, element e = n % 2 -> code j = P + 4 e
        j = n // 2 + 4 * (n % 2)
        for b in range(4):
            dst[4 * n + b] = src[4 * j + b]
    return _map_std_bits(packed, dst, "adjacent_std")


def std_words(packed: torch.Tensor, dec: int) -> torch.Tensor:
    """The standard-layout codes as decode ``dec`` reads them: :func:`spread_std`'s words for 2, :func:`adjacent_std`'s
    for 4, ``packed`` itself for 1 and 3."""
    if dec not in (1, 2, 3, 4):
        raise ValueError(f"std_words: dec must be 1, 2, 3 or 4, got {dec}")
    return spread_std(packed) if dec == 2 else adjacent_std(packed) if dec == 4 else packed


def unspread_std(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`spread_std`: format-2 words back to plain nibble order."""
    src = _bit_map(2)
    inv = [0] * 32
    for i, sb in enumerate(src):
        inv[sb] = i
    return _map_std_bits(packed, inv, "unspread_std")


def _map_std_bits(packed: torch.Tensor, dst: list[int], name: str) -> torch.Tensor:
    """Bit i of every int32 word of ``packed`` (uint8 ``[N, K/2]``) moved to bit ``dst[i]``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % 4:
        raise ValueError(f"{name}: uint8 codes [N, K/2] with K % 8 == 0, got {packed.dtype} {tuple(packed.shape)}")
    wd = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(wd)
    for i, d in enumerate(dst):
        out |= ((wd >> i) & 1) << d
    return (out - ((out >> 31) << 32)).to(torch.int32).view(torch.uint8).reshape(packed.shape)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def permute_weight(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                   fmt: int = 1) -> GluonWeight:
    """NVFP4 weight (``packed`` uint8 ``[N, K/2]``, low nibble = even element; ``block_scale`` e4m3
    ``[N, K/16]``; ``global_scale`` float32, one element) -> :class:`GluonWeight` (padded with zero codes and
    zero scales to ``N % 16 == 0``, ``K % 64 == 0``), word bit format ``fmt`` (:data:`FORMATS`)."""
    n, kh = packed.shape
    k = 2 * kh
    if packed.dtype != torch.uint8 or block_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"permute_weight: uint8 codes and e4m3 scales, got {packed.dtype} / {block_scale.dtype}")
    if k % BLOCK_SIZE or tuple(block_scale.shape) != (n, k // BLOCK_SIZE) or global_scale.numel() != 1:
        raise ValueError(f"permute_weight: shapes {tuple(packed.shape)} / {tuple(block_scale.shape)} / "
                         f"{tuple(global_scale.shape)}")
    if fmt not in FORMATS:
        raise ValueError(f"permute_weight: fmt must be one of {FORMATS}, got {fmt}")
    nr, c = -(-n // ROWS), -(-k // CHUNK)
    codes = torch.zeros(nr * ROWS, c * CHUNK, dtype=torch.uint8, device=packed.device)
    codes[:n, :k] = _codes(packed)
    # [R, rb3, g, c, t, s, kb3, e] -> [R, c, g, t, s, e, kb3, rb3] (code j = rb3 + 2 kb3 + 4 e: rb3 fastest)
    v = codes.view(nr, 2, 8, c, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 7, 6, 1).reshape(nr, c, 8, 4, 4, 8).long()
    word = torch.zeros(nr, c, 8, 4, 4, dtype=torch.int64, device=packed.device)
    for i, sb in enumerate(_bit_map(fmt)):
        word |= ((v[..., i // 4] >> (i % 4)) & 1) << sb
    wq = (word - ((word >> 31) << 32)).to(torch.int32).reshape(nr, c, 32, 4)  # two's complement of the 32 bits
    sc = torch.zeros(nr * ROWS, c * 4, dtype=torch.uint8, device=packed.device)
    sc[:n, : k // BLOCK_SIZE] = block_scale.view(torch.uint8)
    sq = sc.view(nr, 2, 8, c, 4).permute(0, 3, 2, 4, 1).contiguous()
    return GluonWeight(wq.contiguous(), sq, global_scale.reshape(1).to(torch.float32).contiguous(), n, k, fmt)


def _words(w: GluonWeight) -> torch.Tensor:
    return w.wq.to(torch.int64) & 0xFFFFFFFF  # [R, c, l, s], the 32 bits unsigned


def unpermute_weight(w: GluonWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`permute_weight`: ``(packed uint8 [n, k/2], block_scale e4m3 [n, k/16])``."""
    nr, c = w.nr, w.chunks
    wd = _words(w)
    src = _bit_map(w.fmt)
    v = torch.stack([sum(((wd >> src[4 * j + b]) & 1) << b for b in range(4)) for j in range(8)], dim=-1)
    v = v.to(torch.uint8).view(nr, c, 8, 4, 4, 2, 2, 2)  # [R, c, g, t, s, e, kb3, rb3]
    codes = v.permute(0, 7, 2, 1, 3, 4, 6, 5).reshape(nr * ROWS, c * CHUNK)[: w.n, : w.k]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sc = w.sq.permute(0, 4, 2, 1, 3).reshape(nr * ROWS, c * 4)[: w.n, : w.k // BLOCK_SIZE]
    return packed.contiguous(), sc.contiguous().view(torch.float8_e4m3fn)


def _pair_bits(wd: torch.Tensor, p: int, fmt: int) -> torch.Tensor:
    """The kernel's integer decode of pair p (int64 holding 32 unsigned bits): the bf16x2 pair register."""
    if fmt == 1:
        a, b = {0: (6, 12), 1: (2, 8), 2: (-2, 4), 3: (-6, 0)}[p]
        mag = (wd << a) if a >= 0 else (wd >> -a)
        return ((mag & 0x01C001C0) | ((wd << b) & 0x80008000)) & 0xFFFFFFFF
    h = torch.zeros_like(wd)
    for rot, mask in _PAIR_ROT[p]:
        h |= (((wd << rot) | (wd >> (32 - rot))) & 0xFFFFFFFF) & mask
    return h


def decode_permuted(w: GluonWeight) -> torch.Tensor:
    """The kernel's decode of the permuted layout, in torch (CPU or GPU): float32 ``[n, k]`` holding the bf16
    values ``E2M1 * block_scale * 2**-8`` the kernel feeds the MMA, times 2**8 (exact): the weight without the
    global scale. Follows the kernel's per-thread arithmetic: per int32 word and pair p (0..3), the bf16 pair
    built by shifts / rotations and masks (per ``fmt``), times ``bf16(scale * 2**118)`` of its row."""
    nr, c = w.nr, w.chunks
    wd = _words(w)
    pairs = []
    for p in range(4):
        h = _pair_bits(wd, p, w.fmt)
        pairs.append(torch.stack([h & 0xFFFF, (h >> 16) & 0xFFFF], dim=-1))  # [R, c, l, s, e]
    bits = torch.stack(pairs, dim=-1)  # [R, c, l, s, e, p]; p = rb3 + 2 kb3
    vals = (bits.to(torch.int32) << 16).view(torch.float32)  # the bf16 values, exactly, as float32
    sc = w.sq.view(torch.float8_e4m3fn).to(torch.float32) * 2.0**118  # [R, c, g, t, rb3]
    mult = sc.to(torch.bfloat16).to(torch.float32).view(nr, c, 32, 1, 1, 1, 2)  # exact (<= 4 significant bits)
    vals = vals.view(nr, c, 32, 4, 2, 2, 2)  # [.., s, e, kb3, rb3]
    prod = (vals * mult).to(torch.bfloat16).to(torch.float32)  # exact in bf16 (the kernel's bf16 multiply)
    full = prod.view(nr, c, 8, 4, 4, 2, 2, 2).permute(0, 7, 2, 1, 3, 4, 6, 5).reshape(nr * ROWS, c * CHUNK)
    return full[: w.n, : w.k] * 256.0


def reference_weight(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """``E2M1(code) * float(block_scale)`` in float32 ``[N, K]`` from the plain NVFP4 layout (exact; no global
    scale): what :func:`decode_permuted` must equal."""
    tab = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    tab = torch.cat([tab, -tab])
    codes = _codes(packed).long()
    s = block_scale.to(torch.float32).repeat_interleave(BLOCK_SIZE, dim=-1)
    return tab[codes] * s


# ----------------------------------------------------------------------------------------------- kernel (Gluon)

if gluon is not None:

    @gluon.constexpr_function
    def _axis_layout(layout, rank, d):
        """The 1-D layout of dimension ``d`` of a rank-``rank`` distributed layout (all other dims sliced)."""
        s = layout
        for i in reversed(range(rank)):
            if i != d:
                s = gl.SliceLayout(i, s)
        return s

    @gluon.constexpr_function
    def mma_layout(nw):
        """mma.sync m16n8k16 accumulator layout: one 16-row group per warp (warps along the MMA's M = weight rows)."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[nw, 1], instr_shape=[16, 8])

    @gluon.constexpr_function
    def dot_layout(nw, operand):
        """bf16 operand ``operand`` (0: A = weights, 1: B = activation) of :func:`mma_layout`."""
        return gl.DotOperandLayout(operand_index=operand, parent=mma_layout(nw), k_width=2)

    @gluon.constexpr_function
    def std_word_layout(nw, wpt):
        """Standard layout weight words ``[NW, 2 rb3, 8 g, 4 t, KC, WPT]``: WPT contiguous int32 per thread and row."""
        return gl.BlockedLayout([1, 1, 1, 1, 1, wpt], [1, 1, 8, 4, 1, 1], [nw, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0])

    @gluon.constexpr_function
    def std_pair_layout(nw, wpt):
        """The same words as ``[NW, 2, 8, 4, KC, WPT / 2 ib, 2 il]`` (ib: the scale block); its slice 6: scales."""
        return gl.BlockedLayout([1, 1, 1, 1, 1, wpt // 2, 2], [1, 1, 8, 4, 1, 1, 1], [nw, 1, 1, 1, 1, 1, 1],
                                [6, 5, 4, 3, 2, 1, 0])

    @gluon.constexpr_function
    def std_x_layout(nw, wpt):
        """Activation bf16 ``[NT, 8 g, 4 t, KC, 8 WPT]``, the same in every warp."""
        return gl.BlockedLayout([1, 1, 1, 1, 8 * wpt], [1, 8, 4, 1, 1], [1, 1, 1, 1, nw], [4, 3, 2, 1, 0])

    @gluon.jit
    def _k_range(pid_k, CPS, C):
        """Chunks ``[c_lo, c_hi)`` of K range ``pid_k``."""
        c_lo = pid_k * CPS
        return c_lo, gl.minimum(c_lo + CPS, C)

    @gluon.jit
    def _iota(n: gl.constexpr, D: gl.constexpr, RANK: gl.constexpr, L: gl.constexpr):
        """``arange(n)`` along dimension D of a rank-RANK tensor in layout L (size 1 elsewhere)."""
        v = gl.arange(0, n, layout=_axis_layout(L, RANK, D))
        for i in gl.static_range(RANK):
            if i != D:
                v = gl.expand_dims(v, i)
        return v

    @gluon.jit
    def _pair(wd, m, P: gl.constexpr):
        """Nibbles P and P + 4 of int32 words ``wd`` as bf16 ``E2M1 * 2**-126`` (two halves of one register),
        each times the bf16 multiplier ``m`` (``scale * 2**118``): ``(lo, hi)`` bf16, exact."""
        if P == 0:
            h = ((wd << 6) & 29360576) | ((wd << 12) & -2147450880)  # 0x01C001C0 magnitudes, 0x80008000 signs
        elif P == 1:
            h = ((wd << 2) & 29360576) | ((wd << 8) & -2147450880)
        elif P == 2:
            h = ((wd >> 2) & 29360576) | ((wd << 4) & -2147450880)
        else:
            h = ((wd >> 6) & 29360576) | (wd & -2147450880)
        lo = h.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (h >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return lo * m, hi * m

    @gluon.jit
    def _pair_asm(wd2, m2, P: gl.constexpr, FMT: gl.constexpr):
        """:func:`_pair` as ONE inline-PTX block per register pair: ``wd2`` the int32 words joined with
        themselves (``[.., 2]``: element e of the pair), ``m2`` the bf16 multiplier likewise; returns bf16
        ``[.., 2]`` (e = 0: nibble P, e = 1: nibble P + 4), each register the MMA's packed pair, scaled by one
        ``mul.rn.bf16x2`` (no flush-to-zero form: code 1's bf16 subnormal is kept). FMT 3: format 1's words (the
        standard nibble order) decoded by mask + multiply: the pair's two nibbles (pairs 2, 3: of the word shifted
        right by 8) masked, times ``2**a + 2**b`` (the magnitude and sign shifts; the two shifted copies do not
        overlap: no carries), masked to the bf16x2 bits -- the same register as format 1's shifts, with 3 integer
        ops (one on the FMA pipe) instead of 4-5."""
        if FMT == 3:
            if P == 0:
                op: gl.constexpr = "and.b32 t, $1, 0x000F000F; mul.lo.u32 t, t, 4160; and.b32 t, t, 0x81C081C0;"
            elif P == 1:
                op: gl.constexpr = "and.b32 t, $1, 0x00F000F0; mul.lo.u32 t, t, 260; and.b32 t, t, 0x81C081C0;"
            elif P == 2:
                op: gl.constexpr = ("shr.u32 t, $1, 8; and.b32 t, t, 0x000F000F; mul.lo.u32 t, t, 4160; "
                                    "and.b32 t, t, 0x81C081C0;")
            else:
                op: gl.constexpr = ("shr.u32 t, $1, 8; and.b32 t, t, 0x00F000F0; mul.lo.u32 t, t, 260; "
                                    "and.b32 t, t, 0x81C081C0;")
        elif FMT == 2 or FMT == 4:  # spread format: rotations (see _PAIR_ROT); 4: the same bits (adjacent_std)
            if P == 0:
                op: gl.constexpr = "and.b32 t, $1, 0x81C081C0;"
            elif P == 1:
                op: gl.constexpr = "shf.l.wrap.b32 t, $1, $1, 4; and.b32 t, t, 0x81C081C0;"
            elif P == 2:
                op: gl.constexpr = "shf.l.wrap.b32 t, $1, $1, 10; and.b32 t, t, 0x81C081C0;"
            else:
                op: gl.constexpr = ("shf.l.wrap.b32 t, $1, $1, 6; shf.l.wrap.b32 u, $1, $1, 14; "
                                    "and.b32 t, t, 0x00400040; and.b32 u, u, 0x81808180; or.b32 t, t, u;")
        else:
            if P == 0:
                sh: gl.constexpr = "shl.b32 t, $1, 6; shl.b32 u, $1, 12;"
            elif P == 1:
                sh: gl.constexpr = "shl.b32 t, $1, 2; shl.b32 u, $1, 8;"
            elif P == 2:
                sh: gl.constexpr = "shr.u32 t, $1, 2; shl.b32 u, $1, 4;"
            else:
                sh: gl.constexpr = "shr.u32 t, $1, 6; mov.b32 u, $1;"
            op: gl.constexpr = sh + " and.b32 t, t, 0x01C001C0; and.b32 u, u, 0x80008000; or.b32 t, t, u;"
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t, u; " + op + " mul.rn.bf16x2 $0, t, $3; }",
            "=r,r,r,r", [wd2, m2], dtype=gl.bfloat16, is_pure=True, pack=2)

    @gluon.jit
    def _chunk_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c, c_hi, K, EVEN: gl.constexpr):
        """Weight words ``[NW, 8, 4, KC, 4]``, scale bytes of rows rb3 = 0 / 1 ``[NW, 8, 4, KC]`` and activation
        bf16 pairs as int32 ``[NT, 8, 4, KC, 8]`` of the KC chunks from chunk ``c``. EVEN: no masks (row groups and activation rows
        are clamped in the offsets; ``c`` is a valid iteration start). Else chunks ``>= c_hi`` and columns
        ``>= K`` read zeros."""
        if EVEN:
            wd = gl.load(w_ptr + woff + c * 128)
            s0 = gl.load(s_ptr + soff + c * 64)
            s1 = gl.load(s_ptr + soff + c * 64 + 1)
            xv = gl.load(x_ptr + xoff + c * 32)
        else:
            wd = gl.load(w_ptr + woff + c * 128, mask=c + kcw < c_hi, other=0)
            s0 = gl.load(s_ptr + soff + c * 64, mask=c + kcs < c_hi, other=0)
            s1 = gl.load(s_ptr + soff + c * 64 + 1, mask=c + kcs < c_hi, other=0)
            # kx: the first pair of each thread's 16 columns (K % 16 == 0: all 16 in or out; vector loads)
            xv = gl.load(x_ptr + xoff + c * 32, mask=c * 64 + 2 * kx < gl.minimum(c_hi * 64, K), other=0)
        return wd, s0, s1, xv

    @gluon.jit
    def _chunk_mma(acc, wd, s0, s1, xv, DA: gl.constexpr, DB: gl.constexpr, NW: gl.constexpr, KC: gl.constexpr,
                   NT: gl.constexpr, ASM: gl.constexpr, FMT: gl.constexpr):
        """Decode the weight words (times the block-scale multipliers) and ``acc += W_tile @ x_tile^T`` on
        mma.sync: A ``[16 NW, 64 KC]`` (rows (w, rb3, g), mma-k (kc, s, kb3, t, e)), B ``[64 KC, 8 NT]`` with the
        same mma-k order (activation column 64 kc + 16 t + 4 s + 2 kb3 + e); both conversions are trivial."""
        m0 = gl.expand_dims((s0.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622896e35)
                            .to(gl.bfloat16), 4)  # scale * 2**118 (exact)
        m1 = gl.expand_dims((s1.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622896e35)
                            .to(gl.bfloat16), 4)
        if ASM:
            wd2 = gl.join(wd, wd)
            m02 = gl.join(m0, m0)
            m12 = gl.join(m1, m1)
            q0 = gl.join(_pair_asm(wd2, m02, 0, FMT), _pair_asm(wd2, m12, 1, FMT))  # [.., s, e, rb3]
            q1 = gl.join(_pair_asm(wd2, m02, 2, FMT), _pair_asm(wd2, m12, 3, FMT))
        else:
            gl.static_assert(FMT == 1, "the Triton-op decode reads format 1 only")
            l0, h0 = _pair(wd, m0, 0)  # rb3 0, kb3 0
            l1, h1 = _pair(wd, m1, 1)  # rb3 1, kb3 0
            l2, h2 = _pair(wd, m0, 2)  # rb3 0, kb3 1
            l3, h3 = _pair(wd, m1, 3)  # rb3 1, kb3 1
            q0 = gl.join(gl.join(l0, h0), gl.join(l1, h1))  # [.., s, e, rb3]
            q1 = gl.join(gl.join(l2, h2), gl.join(l3, h3))
        a = gl.join(q0, q1)  # [NW, g, t, KC, s, e, rb3, kb3]
        a = gl.reshape(gl.permute(a, (0, 6, 1, 3, 4, 7, 2, 5)), (NW * 16, KC * 64))
        a = gl.convert_layout(a, DA, assert_trivial=True)
        xlo, xhi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [xv],
                                             dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        b = gl.reshape(gl.join(xlo, xhi), (NT, 8, 4, KC, 4, 2, 2))  # [nt, g, t, kc, s, kb3, e]
        b = gl.reshape(gl.permute(b, (3, 4, 5, 2, 6, 0, 1)), (KC * 64, NT * 8))
        b = gl.convert_layout(b, DB, assert_trivial=True)
        return mma_v2(a, b, acc)

    @gluon.jit
    def _w4a16_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
                      M, N, K, NR, C, CPS,
                      NW: gl.constexpr, KC: gl.constexpr, NT: gl.constexpr, SPLIT: gl.constexpr,
                      EVEN: gl.constexpr, PF: gl.constexpr, ASM: gl.constexpr, FMT: gl.constexpr = 1):
        """``out[M, N] = bf16(x[M, K] @ W^T)``; program (pid_n, pid_k): row groups ``pid_n * NW + [0, NW)`` (one
        per warp), chunks ``[pid_k * CPS, min(C, (pid_k + 1) * CPS))``, KC chunks (KC 16-byte loads per thread)
        per iteration; NT n-tiles of 8 activation rows (M <= 8 NT). EVEN: the chunk range of every program
        is a multiple of KC and K == 64 C (no masks at all: row groups / activation rows clamped, their
        outputs not stored). PF: register prefetch (:func:`k_loop`)."""
        LW: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 8, 4, 1, 1], [NW, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(4, LW)
        LX: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 8], [1, 8, 4, 1, 1], [1, 1, 1, 1, NW], [4, 3, 2, 1, 0])
        MMA: gl.constexpr = mma_layout(NW)
        BN: gl.constexpr = NW * 16
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        c_lo, c_hi = _k_range(pid_k, CPS, C)

        # weight words [NW, 8 g, 4 t, KC, 4 s]: 16 contiguous bytes per thread and chunk; a row group past the
        # last reads the last one (its outputs are not stored)
        rg = gl.minimum(pid_n * NW + _iota(NW, 0, 5, LW), NR - 1)
        lane = _iota(8, 1, 5, LW) * 4 + _iota(4, 2, 5, LW)
        kcw = _iota(KC, 3, 5, LW)
        woff = (rg * C + kcw) * 128 + lane * 4 + _iota(4, 4, 5, LW)
        # scale bytes [NW, 8, 4, KC] (rb3 = 0; rb3 = 1 at + 1)
        rgs = gl.minimum(pid_n * NW + _iota(NW, 0, 4, LS), NR - 1)
        kcs = _iota(KC, 3, 4, LS)
        soff = (rgs * C + kcs) * 64 + (_iota(8, 1, 4, LS) * 4 + _iota(4, 2, 4, LS)) * 2
        # activation bf16 pairs [NT, 8 g, 4 t, KC, 8 j2] (int32 view of x): row n = 8 nt + g (rows >= M read row
        # M - 1, not stored), columns 64 (c + kc) + 16 t + 2 j2 + (0, 1)
        xn = gl.minimum(_iota(NT, 0, 5, LX) * 8 + _iota(8, 1, 5, LX), M - 1)
        kx = _iota(KC, 3, 5, LX) * 32 + _iota(4, 2, 5, LX) * 8  # int32 (bf16 pair) index of a thread's first pair
        xoff = xn * (K // 2) + kx + _iota(8, 4, 5, LX)

        acc = k_loop(gl.zeros([BN, NT * 8], gl.float32, MMA), w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx,
                     c_lo, c_hi, K, NW, KC, NT, EVEN, PF, False, 4, ASM, FMT)
        _epilogue(acc, gs_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, N, pid_n, pid_k, MMA, BN, NT, SPLIT, False, NW)


    @gluon.jit
    def _load_hint(ptrs, mask, MASKED: gl.constexpr, WEV: gl.constexpr):
        """``gl.load(ptrs)`` (MASKED: ``mask``, other 0) with cache hint WEV (0 none, 1 evict_first, 2 .cg); literal
        strings only (a string constexpr argument broke triton 3.6 once)."""
        if MASKED:
            if WEV == 1:
                return gl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
            elif WEV == 2:
                return gl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
            else:
                return gl.load(ptrs, mask=mask, other=0)
        else:
            if WEV == 1:
                return gl.load(ptrs, eviction_policy="evict_first")
            elif WEV == 2:
                return gl.load(ptrs, cache_modifier=".cg")
            else:
                return gl.load(ptrs)

    @gluon.jit
    def _std_chunk_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kcx, c, c_hi, EVEN: gl.constexpr,
                         WPT: gl.constexpr, WEV: gl.constexpr = 0):
        """Standard layout: weight words ``[NW, 2, 8, 4, KC, WPT]`` (rows g / g + 8, 4 WPT contiguous bytes per
        thread, row and 32 WPT-element chunk), scale bytes ``[NW, 2, 8, 4, KC, WPT / 2]`` and activation bf16
        ``[NT, 8, 4, KC, 8 WPT]`` of the KC chunks from chunk ``c``. Not EVEN: chunks >= c_hi read zeros.
        WEV: cache hint of the (read-once) weight and scale loads -- 0 none, 1 ``evict_first``, 2 ``.cg`` (L2
        only: the streamed weights do not evict the activation, re-read by every warp, from L1)."""
        if EVEN:
            wd = _load_hint(w_ptr + woff + c * (4 * WPT), 0, False, WEV)
            sc = _load_hint(s_ptr + soff + c * (2 * WPT), 0, False, WEV)
            xv = gl.load(x_ptr + xoff + c * (32 * WPT))
        else:
            wd = _load_hint(w_ptr + woff + c * (4 * WPT), c + kcw < c_hi, True, WEV)
            sc = _load_hint(s_ptr + soff + c * (2 * WPT), c + kcs < c_hi, True, WEV)
            xv = gl.load(x_ptr + xoff + c * (32 * WPT), mask=c + kcx < c_hi, other=0.0)
        return wd, sc, xv

    @gluon.jit
    def _decode_words(wd, sc, DEC: gl.constexpr):
        """Standard layout: a thread's weight words ``wd`` (int32, last dim il) and their E4M3 block scales ``sc`` (uint8,
        one per word pair ib) -> the bf16 weights ``wd``'s shape + ``[e, kb3, sh]``: pair P = 2 sh + kb3 of each word
        (nibbles P, P + 4, :func:`_pair_asm` with decode DEC) multiplied by the block scale * 2**118 (exact). Shared by
        the chunk MMAs (:func:`_std_chunk_mma`, :func:`_ks_chunk_mma`), which permute it into their MMA operands."""
        m = gl.expand_dims((sc.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622896e35)
                           .to(gl.bfloat16), 6)  # scale * 2**118 (exact), broadcast over il
        wd2 = gl.join(wd, wd)
        m2 = gl.join(m, m)
        q0 = gl.join(_pair_asm(wd2, m2, 0, DEC), _pair_asm(wd2, m2, 1, DEC))  # [.., e, kb3] (sh 0)
        q1 = gl.join(_pair_asm(wd2, m2, 2, DEC), _pair_asm(wd2, m2, 3, DEC))  # sh 1
        return gl.join(q0, q1)

    @gluon.jit
    def _std_chunk_mma(acc, wd, sc, xv, DA: gl.constexpr, DB: gl.constexpr, NW: gl.constexpr, KC: gl.constexpr,
                       NT: gl.constexpr, WPT: gl.constexpr, DEC: gl.constexpr = 1):
        """Standard layout: word i = 2 ib + il of a thread's 4 WPT bytes of row g (or g + 8) holds elements
        ``8 WPT t + 8 i + [0, 8)``; its pair P (nibbles P, P + 4: the format-1 decode) feeds MMA k-step ``2 i + P // 2``,
        slots ``8 (P % 2) + 2 t + e`` (e = 0: element 8 i + P, e = 1: element 8 i + P + 4); scale block
        ``WPT / 2 t + ib``.
        The activation operand takes the same k order (its registers pair columns j and j + 4: byte permutes).
        DEC: the pair decode of :func:`_pair_asm` (1: shifts, 3: mask + multiply; the same registers; 2: rotation +
        mask of :func:`spread_std`'s words), 4: :func:`adjacent_std`'s words (the same decode as 2, pair P holding
        elements 2P, 2P + 1 of its word), so the activation's registers are used as loaded (no byte permutes)."""
        a = _decode_words(wd, sc, DEC)  # [NW, rb3, g, t, KC, ib, il, e, kb3, sh]
        a = gl.reshape(gl.permute(a, (0, 1, 2, 4, 5, 6, 9, 8, 3, 7)), (NW * 16, KC * 32 * WPT))
        a = gl.convert_layout(a, DA, assert_trivial=True)
        if DEC == 4:
            b = gl.reshape(xv, (NT, 8, 4, KC, WPT // 2, 2, 2, 2, 2))  # [nt, g, t, kc, ib, il, sh, kb3, e]
            b = gl.reshape(gl.permute(b, (3, 4, 5, 6, 7, 2, 8, 0, 1)), (KC * 32 * WPT, NT * 8))
        else:
            b = gl.reshape(xv, (NT, 8, 4, KC, WPT // 2, 2, 2, 2, 2))  # [nt, g, t, kc, ib, il, e, sh, kb3]
            b = gl.reshape(gl.permute(b, (3, 4, 5, 7, 8, 2, 6, 0, 1)), (KC * 32 * WPT, NT * 8))
        b = gl.convert_layout(b, DB, assert_trivial=True)
        return mma_v2(a, b, acc)

    @gluon.jit
    def _loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c, c_hi, K, EVEN: gl.constexpr,
               STD: gl.constexpr, WPT: gl.constexpr, WEV: gl.constexpr = 0):
        """One iteration's operands: :func:`_std_chunk_loads` (STD) or :func:`_chunk_loads` (permuted layout)."""
        if STD:
            return _std_chunk_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c, c_hi, EVEN, WPT, WEV)
        else:
            return _chunk_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c, c_hi, K, EVEN)

    @gluon.jit
    def k_loop(acc, w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c_lo, c_hi, K, NW: gl.constexpr,
               KC: gl.constexpr, NT: gl.constexpr, EVEN: gl.constexpr, PF: gl.constexpr, STD: gl.constexpr,
               WPT: gl.constexpr = 4, ASM: gl.constexpr = True, FMT: gl.constexpr = 1, RG: gl.constexpr = 1,
               WEV: gl.constexpr = 0):
        """``acc += W[rows, chunks c_lo..c_hi) @ x[:, same]^T`` over KC chunks per iteration, for the standard
        (STD) or the permuted layout; PF: the next iteration's operands are loaded before the current ones are
        used (register prefetch; EVEN: the prefetch past the last iteration re-reads it; ptxas issues those loads
        at the end of the iteration, so the gain is small); PF 2: two iterations ahead. Standard layout: RG row groups per warp (the weight
        tensors of :func:`std_weight_offsets` with RG; each warp's activation fragments feed its RG row groups'
        MMAs), WEV the weight loads' cache hint (:func:`_std_chunk_loads`), FMT the pair decode (1 or 3:
        :func:`_pair_asm`)."""
        c_last = c_hi - KC  # EVEN: the last iteration's start
        if PF >= 1:
            nxt = _loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c_lo, c_hi, K, EVEN, STD, WPT, WEV)
        if PF >= 2:  # two iterations ahead (the prefetches past the range: EVEN re-reads the last, else masked)
            c2 = c_lo + KC
            if EVEN:
                c2 = gl.minimum(c2, c_last)
            nxt2 = _loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c2, c_hi, K, EVEN, STD, WPT, WEV)
        for c0 in range(c_lo, c_hi, KC):
            if PF >= 2:
                cur = nxt
                nxt = nxt2
                cn = c0 + 2 * KC
                if EVEN:
                    cn = gl.minimum(cn, c_last)
                nxt2 = _loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, cn, c_hi, K, EVEN, STD, WPT, WEV)
            elif PF == 1:
                cur = nxt
                cn = c0 + KC
                if EVEN:
                    cn = gl.minimum(cn, c_last)
                nxt = _loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, cn, c_hi, K, EVEN, STD, WPT, WEV)
            else:
                cur = _loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kx, c0, c_hi, K, EVEN, STD, WPT, WEV)
            if STD:
                wd, sc, xv = cur
                wd = gl.convert_layout(gl.reshape(wd, (NW * RG, 2, 8, 4, KC, WPT // 2, 2)),
                                       std_pair_layout(NW, WPT), assert_trivial=True)
                acc = _std_chunk_mma(acc, wd, sc, xv, dot_layout(NW, 0), dot_layout(NW, 1), NW * RG, KC, NT, WPT,
                                     FMT)
            else:
                wd, s0, s1, xv = cur
                acc = _chunk_mma(acc, wd, s0, s1, xv, dot_layout(NW, 0), dot_layout(NW, 1), NW, KC, NT, ASM, FMT)
        return acc

    @gluon.jit
    def std_weight_offsets(pid_n, N, KW, KB, NW: gl.constexpr, KC: gl.constexpr, WPT: gl.constexpr,
                           RG: gl.constexpr = 1):
        """Standard layout: ``(woff, kcw, soff, kcs)``, the int32-word offsets ``[R, 2, 8, 4, KC, WPT]`` (R = NW RG
        row groups; the layouts of NW warps wrap: warp w holds row groups w, w + NW, ...) of a program's weight rows
        ``16 (pid_n R + r) + 8 rb3 + g`` (rows past N read row N - 1: not stored) at chunk 0 and the byte offsets
        of their scales ``[R, 2, 8, 4, KC, WPT / 2]`` (rows of KW words / KB scales), with the KC index tensors (for
        masks)."""
        L6: gl.constexpr = std_word_layout(NW, WPT)
        LS: gl.constexpr = gl.SliceLayout(6, std_pair_layout(NW, WPT))
        IB: gl.constexpr = WPT // 2
        R: gl.constexpr = NW * RG
        roww = gl.minimum(pid_n * R * 16 + _iota(R, 0, 6, L6) * 16 + _iota(2, 1, 6, L6) * 8 + _iota(8, 2, 6, L6),
                          N - 1)
        kcw = _iota(KC, 4, 6, L6)
        woff = roww * KW + kcw * (4 * WPT) + _iota(4, 3, 6, L6) * WPT + _iota(WPT, 5, 6, L6)
        rows_s = gl.minimum(pid_n * R * 16 + _iota(R, 0, 6, LS) * 16 + _iota(2, 1, 6, LS) * 8 + _iota(8, 2, 6, LS),
                            N - 1)
        kcs = _iota(KC, 4, 6, LS)
        soff = rows_s * KB + kcs * (2 * WPT) + _iota(4, 3, 6, LS) * IB + _iota(IB, 5, 6, LS)
        return woff, kcw, soff, kcs

    @gluon.jit
    def std_x_rows(NT: gl.constexpr, NW: gl.constexpr, WPT: gl.constexpr):
        """Standard layout: the activation slot ``8 nt + g`` of every element of :func:`std_x_layout`
        ``[NT, 8, 1, 1, 1]`` (the MMA's N index; map it to activation rows, then :func:`std_x_offsets`)."""
        LX: gl.constexpr = std_x_layout(NW, WPT)
        return _iota(NT, 0, 5, LX) * 8 + _iota(8, 1, 5, LX)

    @gluon.jit
    def std_x_offsets(xn, K, NW: gl.constexpr, KC: gl.constexpr, WPT: gl.constexpr):
        """Standard layout: ``(xoff, kcx)``, the bf16 offsets ``[NT, 8, 4, KC, 8 WPT]`` (:func:`std_x_layout`) of
        activation rows ``xn`` ([NT, 8, 1, 1, 1], rows of K elements) at chunk 0 -- thread (g, t) reads elements
        ``32 WPT kc + 8 WPT t + [0, 8 WPT)`` of row ``xn[nt, g]`` -- and the KC index tensor (for masks)."""
        LX: gl.constexpr = std_x_layout(NW, WPT)
        kcx = _iota(KC, 3, 5, LX)
        return xn * K + kcx * (32 * WPT) + _iota(4, 2, 5, LX) * (8 * WPT) + _iota(8 * WPT, 4, 5, LX), kcx

    @gluon.jit
    def split_fixup(y, part_ptr, prow, pcol, PROWS, N, pid_k, om, out_ptr, ooff, cnt_ptr, ci, bias_ptr, cols,
                    SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Deterministic split-K fixup of one tile (float32 partials ``[SPLIT, PROWS, N]``): store this program's
        partial ``y`` at ``[pid_k, prow, pcol]`` (mask ``om``), CTA barrier, acq_rel atomic on counter ``cnt_ptr +
        ci``; the last of the SPLIT programs of the tile sums the partials in the fixed order 0, 1, ..., adds the
        bias of weight rows ``cols`` (HAS_BIAS; [BN], rows >= N read 0), stores bf16 at ``out_ptr + ooff`` (mask
        ``om``) and resets the counter for the next launch (stream order)."""
        gl.store(part_ptr + (pid_k * PROWS + prow) * N + pcol, y, mask=om)
        _cta_barrier()  # every thread's partial stores precede the release below
        done = gl.atomic_add(cnt_ptr + ci, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:  # the last K range of this tile: sum the partials in the fixed order
            z = gl.load(part_ptr + prow * N + pcol, mask=om, other=0.0, cache_modifier=".cg")
            for sk in range(1, SPLIT):
                z += gl.load(part_ptr + (sk * PROWS + prow) * N + pcol, mask=om, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                z += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 1)
            gl.store(out_ptr + ooff, z.to(gl.bfloat16), mask=om)
            gl.store(cnt_ptr + ci, 0)  # ready for the next launch (stream order)

    @gluon.constexpr_function
    def fixup_layout(bn, ntt, nw):
        """Tile ``[bn weight rows, ntt activation rows]`` (weight rows contiguous in memory) with 4 consecutive weight
        rows per thread: 16-byte partial stores / loads (the MMA layout gives each thread 4-byte pieces)."""
        t0 = min(32, bn // 4)
        return gl.BlockedLayout([4, 1], [t0, 32 // t0], [1, nw], [0, 1])

    @gluon.jit
    def split_fixup_v(y, part_ptr, M, N, pid_n, pid_k, out_ptr, cnt_ptr, bias_ptr, BN: gl.constexpr,
                      NTT: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr):
        """:func:`split_fixup` of a dense tile (weight rows ``pid_n BN + [0, BN)``, activation rows ``[0, NTT)``,
        counter ``pid_n``) in :func:`fixup_layout` (16-byte accesses), the last program's SPLIT partial loads unrolled
        (issued together where the registers allow, instead of split_fixup's loop: 4-byte loads, two partials per
        iteration, one L2 round trip each), summed in the same fixed order 0, 1, ... (the same bytes: checked with
        torch.equal on the H200 against split_fixup, session 13 batch E1). The dense kernels' fixup: H200 floor probe
        (gluon_floor, d8192 grid 64 x 8, no weight reads; fixup chain = emptyfM - empty, cold L2) 1 row 1.8 us
        (split_fixup 2.1), 16 rows 4.0 us (split_fixup 7.5: the "M = 16 costs 5 us more" of issue #5). Its unrolled
        loads need registers: at BN 128 and 16 rows the std kernel goes 113 -> 138 registers (3 programs per SM
        instead of 4: 25.6 us vs 21.0 at d8192 M=16) unless capped (GluonConfig.maxnreg 128: no spills, 19.6 us)."""
        LF: gl.constexpr = fixup_layout(BN, NTT, NW)
        z = gl.convert_layout(y, LF)
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LF))
        rows = gl.expand_dims(cols, 1)
        xr = gl.expand_dims(gl.arange(0, NTT, layout=gl.SliceLayout(0, LF)), 0)
        om = (rows < N) & (xr < M)
        off = xr * N + rows
        gl.store(part_ptr + pid_k * M * N + off, z, mask=om)
        _cta_barrier()  # every thread's partial stores precede the release below
        done = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:  # the last K range of this tile: sum the partials in the fixed order
            z = gl.load(part_ptr + off, mask=om, other=0.0, cache_modifier=".cg")
            for sk in gl.static_range(1, SPLIT):
                z += gl.load(part_ptr + sk * M * N + off, mask=om, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                z += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 1)
            gl.store(out_ptr + off, z.to(gl.bfloat16), mask=om)
            gl.store(cnt_ptr + pid_n, 0)  # ready for the next launch (stream order)

    @gluon.jit
    def _epilogue(acc, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, pid_n, pid_k,
                  MMA: gl.constexpr, BN: gl.constexpr, NT: gl.constexpr, SPLIT: gl.constexpr,
                  HAS_BIAS: gl.constexpr, NW: gl.constexpr):
        """acc [BN weight rows, 8 NT activation rows] times ``256 / gs`` (+ bias) -> out[row, n] in bf16; SPLIT > 1:
        float32 partials ``[SPLIT, M, N]`` and :func:`split_fixup_v` (counter ``pid_n``; NW warps)."""
        LR: gl.constexpr = gl.SliceLayout(1, MMA)
        LC: gl.constexpr = gl.SliceLayout(0, MMA)
        gw = gl.load(gs_ptr + gl.arange(0, BN, layout=LR) * 0)
        post = gl.div_rn(gl.full([BN], 1.0, gl.float32, LR), gw) * 256.0
        y = acc * gl.expand_dims(post, 1)
        cols = pid_n * BN + gl.arange(0, BN, layout=LR)
        rows = gl.expand_dims(cols, 1)
        xr = gl.expand_dims(gl.arange(0, NT * 8, layout=LC), 0)
        om = (rows < N) & (xr < M)
        if SPLIT == 1:
            if HAS_BIAS:
                y += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 1)
            gl.store(out_ptr + xr * N + rows, y.to(gl.bfloat16), mask=om)
        else:
            split_fixup_v(y, part_ptr, M, N, pid_n, pid_k, out_ptr, cnt_ptr, bias_ptr, BN, NT * 8, NW, SPLIT, HAS_BIAS)

    @gluon.constexpr_function
    def xs_layout():
        """Shared layout of a staged activation chunk ``[buffers, 32 NT, 32]`` (row ``4 (8 nt + g) + t``: thread (g,
        t)'s 32 elements of a 128-element chunk): 16-byte vectors XOR-swizzled by (row / 2) % 4, so that the 8
        threads of each 16-byte access phase hit distinct banks (rank 2: the leading dim indexes the buffers)."""
        return gl.SwizzledSharedLayout(8, 2, 4, [1, 0])

    @gluon.constexpr_function
    def xs_stage_layout(nw):
        """cp.async layout of one staged chunk ``[32 NT, 32]``: 16 bytes per thread, a warp covers 8 rows (two
        activation rows: 256 contiguous bytes each)."""
        return gl.BlockedLayout([1, 8], [8, 4], [nw, 1], [1, 0])

    @gluon.jit
    def xs_slots(NT: gl.constexpr, NW: gl.constexpr):
        """The activation slot ``8 nt + g`` (the MMA's N index) of every row ``4 (8 nt + g) + t`` of a staged chunk,
        in :func:`xs_stage_layout`'s row slice (map it to activation rows, then :func:`xs_k_loop`)."""
        return gl.arange(0, NT * 32, layout=gl.SliceLayout(1, xs_stage_layout(NW))) // 4

    @gluon.jit
    def _xs_issue(x_s, buf0, x_ptr, off, live, cs, c_hi, NT: gl.constexpr, XC: gl.constexpr):
        """cp.async chunks ``cs .. cs + XC`` (those < c_hi) of the staged rows (``off``: element offsets at chunk 0,
        ``live``: rows to read; the others are left as they are) into rows ``[0, 32 NT)`` of buffers ``buf0 ..`` of
        ``x_s``; one commit group."""
        for c in gl.static_range(XC):
            async_copy.async_copy_global_to_shared(x_s.index(buf0 + c).slice(0, NT * 32), x_ptr + off + (cs + c) * 128,
                                                   mask=live & (cs + c < c_hi))
        async_copy.commit_group()

    @gluon.jit
    def xs_k_loop(acc, w_ptr, s_ptr, x_s, x_ptr, xrow, live, K, woff, soff, c_lo, c_hi, NW: gl.constexpr,
                  NT: gl.constexpr, PF: gl.constexpr, XC: gl.constexpr, XB: gl.constexpr, RG: gl.constexpr = 1,
                  DEC: gl.constexpr = 1, WEV: gl.constexpr = 0, SYNC: gl.constexpr = False):
        """Standard layout K loop (one 128-element chunk per iteration, WPT 4) with the activation staged in shared
        memory ``x_s`` ``[XB XC, >= 32 NT, 32]`` (:func:`xs_layout`; rows ``[0, 32 NT)`` of each buffer used: the
        grouped kernel sizes its buffers for its widest pass) by cp.async, once per program -- coalesced 256-byte
        rows instead of every warp's own 16-byte pieces of 8 rows (4x the L1 wavefronts) -- and the weights from
        global with PF (0, 1, 2) iterations of register prefetch (loads past the range re-read the last chunk: no
        masks). ``xrow`` / ``live`` ([32 NT] in :func:`xs_stage_layout`'s row slice, e.g. from :func:`xs_slots`):
        the activation row of each staged row and whether to read it (rows not read leave their smem as it was:
        their outputs must not be stored). Stages of XC chunks; XB 2: the next stage is copied while this one is
        used. SYNC: a CTA barrier before the first copy (``x_s`` was read before in this program: the grouped
        kernel's passes). Same decode / MMA / summation order as :func:`k_loop` (the same bytes). Also the grouped
        wide kernel's K loop (gluon_moe._wide_pass: ``x_s`` a slice of its buffers, rows from its routing)."""
        LR: gl.constexpr = gl.BlockedLayout([1, 32], [32, 1], [1, NW], [1, 0])
        LX: gl.constexpr = std_x_layout(NW, 4)
        L2: gl.constexpr = xs_stage_layout(NW)
        r2 = gl.arange(0, NT * 32, layout=gl.SliceLayout(1, L2))
        off = (gl.expand_dims(xrow * K + (r2 % 4) * 32, 1)
               + gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, L2)), 0))
        live2 = gl.expand_dims(live, 1)
        if SYNC:
            _cta_barrier()  # the previous readers of x_s are done
        _xs_issue(x_s, 0, x_ptr, off, live2, c_lo, c_hi, NT, XC)
        c_last = c_hi - 1
        if PF >= 1:
            n1w = _load_hint(w_ptr + woff + c_lo * 16, 0, False, WEV)
            n1s = _load_hint(s_ptr + soff + c_lo * 8, 0, False, WEV)
        if PF >= 2:
            c2 = gl.minimum(c_lo + 1, c_last)
            n2w = _load_hint(w_ptr + woff + c2 * 16, 0, False, WEV)
            n2s = _load_hint(s_ptr + soff + c2 * 8, 0, False, WEV)
        for s0 in range(c_lo, c_hi, XC):
            b0 = (((s0 - c_lo) // XC) % XB) * XC
            if XB == 2:
                _xs_issue(x_s, XC - b0, x_ptr, off, live2, s0 + XC, c_hi, NT, XC)  # the next stage (if any)
                async_copy.wait_group(1)
            else:
                async_copy.wait_group(0)
            _cta_barrier()  # every thread's copies of this stage are in smem
            for c0 in range(s0, gl.minimum(s0 + XC, c_hi)):
                if PF == 0:
                    wd = _load_hint(w_ptr + woff + c0 * 16, 0, False, WEV)
                    sc = _load_hint(s_ptr + soff + c0 * 8, 0, False, WEV)
                elif PF == 1:
                    wd = n1w
                    sc = n1s
                    cn = gl.minimum(c0 + 1, c_last)
                    n1w = _load_hint(w_ptr + woff + cn * 16, 0, False, WEV)
                    n1s = _load_hint(s_ptr + soff + cn * 8, 0, False, WEV)
                else:
                    wd = n1w
                    sc = n1s
                    n1w = n2w
                    n1s = n2s
                    cn = gl.minimum(c0 + 2, c_last)
                    n2w = _load_hint(w_ptr + woff + cn * 16, 0, False, WEV)
                    n2s = _load_hint(s_ptr + soff + cn * 8, 0, False, WEV)
                xs = x_s.index(b0 + c0 - s0).slice(0, NT * 32)
                xv = gl.convert_layout(gl.reshape(xs.load(LR), (NT, 8, 4, 1, 32)), LX, assert_trivial=True)
                wd = gl.convert_layout(gl.reshape(wd, (NW * RG, 2, 8, 4, 1, 2, 2)), std_pair_layout(NW, 4),
                                       assert_trivial=True)
                acc = _std_chunk_mma(acc, wd, sc, xv, dot_layout(NW, 0), dot_layout(NW, 1), NW * RG, 1, NT, 4, DEC)
            if XB == 1:
                if s0 + XC < c_hi:
                    _cta_barrier()  # every warp is done with this stage's buffers
                    _xs_issue(x_s, 0, x_ptr, off, live2, s0 + XC, c_hi, NT, XC)
            else:
                _cta_barrier()  # this stage's buffers are refilled (two stages later) only after every warp used them
        return acc

    @gluon.jit
    def _w4a16_std_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
                          M, N, K, KW, KB, C, CPS,
                          NW: gl.constexpr, KC: gl.constexpr, NT: gl.constexpr, SPLIT: gl.constexpr,
                          EVEN: gl.constexpr, PF: gl.constexpr, HAS_BIAS: gl.constexpr, WPT: gl.constexpr = 4,
                          RG: gl.constexpr = 1, WEV: gl.constexpr = 0, DEC: gl.constexpr = 1, XS: gl.constexpr = 0,
                          XC: gl.constexpr = 1, XB: gl.constexpr = 1):
        """The STANDARD NVFP4 layout (``w_ptr``: the packed codes as int32 ``[N, K/8]`` = KW words per row,
        ``s_ptr``: e4m3 bytes ``[N, K/16]`` = KB per row; chunks of 32 WPT elements, K % (32 WPT) == 0, C chunks):
        warp w owns rows ``16 (pid_n NW + w) + [0, 16)``, thread (g, t) loads 4 WPT bytes of rows g and g + 8 per
        chunk (elements ``8 WPT t + [0, 8 WPT)``: 16 or 32 bytes); the K order inside a chunk is permuted
        identically on both MMA operands (:func:`_std_chunk_mma`). Grid, split-K, EVEN, PF as :func:`_w4a16_kernel`.
        RG: row groups per warp (a program: 16 NW RG rows, warp w the groups w, w + NW, ...; each warp's activation
        fragments feed RG MMAs), WEV: the weight loads' cache hint (:func:`_std_chunk_loads`), DEC: the pair decode
        (1 shifts, 3 mask + multiply: :func:`_pair_asm`; the same registers). XS: the activation staged in shared
        memory once per program (:func:`xs_k_loop`: XC chunks per stage, XB stage buffers; KC 1, WPT 4)."""
        MMA: gl.constexpr = mma_layout(NW)
        BN: gl.constexpr = NW * RG * 16
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        c_lo, c_hi = _k_range(pid_k, CPS, C)

        woff, kcw, soff, kcs = std_weight_offsets(pid_n, N, KW, KB, NW, KC, WPT, RG)
        if XS:
            gl.static_assert(KC == 1 and WPT == 4, "activation staging: KC 1, WPT 4")
            x_s = gl.allocate_shared_memory(gl.bfloat16, [XB * XC, NT * 32, 32], xs_layout())
            j = xs_slots(NT, NW)
            acc = xs_k_loop(gl.zeros([BN, NT * 8], gl.float32, MMA), w_ptr, s_ptr, x_s, x_ptr, gl.minimum(j, M - 1),
                            j < M, K, woff, soff, c_lo, c_hi, NW, NT, PF, XC, XB, RG, DEC, WEV)
        else:
            xoff, kcx = std_x_offsets(gl.minimum(std_x_rows(NT, NW, WPT), M - 1), K, NW, KC, WPT)
            acc = k_loop(gl.zeros([BN, NT * 8], gl.float32, MMA), w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs,
                         kcx, c_lo, c_hi, K, NW, KC, NT, EVEN, PF, True, WPT, True, DEC, RG, WEV)
        _epilogue(acc, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, pid_n, pid_k, MMA, BN, NT, SPLIT, HAS_BIAS,
                  NW)

    # ------------------------------------------------------------------- split-K inside the program (GluonConfig.ks)

    @gluon.constexpr_function
    def ks_mma_layout(ks, nwr):
        """3-D (batched) mma.sync accumulator layout ``[KS, rows, activation rows]``: warp ``(s, w)`` holds K slice
        s of row group w (the batch dimension carries the K slices, so each warp has its own activation operand)."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[ks, nwr, 1], instr_shape=[1, 16, 8])

    @gluon.constexpr_function
    def ks_dot_layout(ks, nwr, operand):
        """bf16 operand ``operand`` (0: weights, 1: activation) of :func:`ks_mma_layout`."""
        return gl.DotOperandLayout(operand_index=operand, parent=ks_mma_layout(ks, nwr), k_width=2)

    @gluon.constexpr_function
    def ks_word_layout(ks, nwr):
        """Weight words ``[KS, R, 2 rb3, 8 g, 4 t, 4]`` (one 128-element chunk, 16 bytes per thread and row)."""
        return gl.BlockedLayout([1, 1, 1, 1, 1, 4], [1, 1, 1, 8, 4, 1], [ks, nwr, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0])

    @gluon.constexpr_function
    def ks_pair_layout(ks, nwr):
        """The same words as ``[KS, R, 2, 8, 4, 2 ib, 2 il]`` (ib: the scale block); its slice 6: the scales."""
        return gl.BlockedLayout([1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 8, 4, 1, 1], [ks, nwr, 1, 1, 1, 1, 1],
                                [6, 5, 4, 3, 2, 1, 0])

    @gluon.constexpr_function
    def ks_x_layout(ks, nwr):
        """Activation bf16 ``[KS, NT, 8 g, 4 t, 32]``: thread (g, t) of slice s holds 32 elements of row g."""
        return gl.BlockedLayout([1, 1, 1, 1, 32], [1, 1, 8, 4, 1], [ks, 1, 1, 1, nwr], [4, 3, 2, 1, 0])

    @gluon.constexpr_function
    def ks_out_layout(nt, nw):
        """The summed tile ``[BN weight rows, 8 NT activation rows]`` of :func:`ks_reduce`: a weight row per thread."""
        return gl.BlockedLayout([1, nt * 8], [32, 1], [nw, 1], [0, 1])

    @gluon.jit
    def ks_reduce(acc, gs_ptr, KS: gl.constexpr, NWR: gl.constexpr, BN: gl.constexpr, NT: gl.constexpr):
        """The K slices of a 3-D accumulator ``acc`` float32 ``[KS, BN, 8 NT]`` (:func:`ks_mma_layout`): each slice's
        result times ``256 / gs`` (the epilogue's float32 product), then the KS slices summed in the fixed order 0, 1,
        .. through shared memory (the operations of the split-K fixup without its global round trip): float32
        ``[BN, 8 NT]`` in :func:`ks_out_layout`."""
        MMA: gl.constexpr = ks_mma_layout(KS, NWR)
        LR3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, MMA))
        gw = gl.load(gs_ptr + gl.arange(0, BN, layout=LR3) * 0)
        post = gl.div_rn(gl.full([BN], 1.0, gl.float32, LR3), gw) * 256.0
        y = acc * gl.expand_dims(gl.expand_dims(post, 0), 2)
        red = gl.allocate_shared_memory(gl.float32, [KS, BN, NT * 8], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        red.store(y)
        _cta_barrier()  # every slice's result is in shared memory
        red2 = red.reshape([KS * BN, NT * 8])  # slice s: rows s BN + [0, BN)
        LE: gl.constexpr = ks_out_layout(NT, KS * NWR)
        z = red2.slice(0, BN).load(LE)
        for s in gl.static_range(1, KS):
            z += red2.slice(s * BN, BN).load(LE)
        return z

    @gluon.jit
    def ks_store(z, out_ptr, part_ptr, cnt_ptr, bias_ptr, M, N, pid_n, pid_k, BN: gl.constexpr, NT: gl.constexpr,
                 NW: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr):
        """The summed tile ``z`` of :func:`ks_reduce` (weight rows ``pid_n BN + [0, BN)``, activation rows ``[0, 8 NT)``,
        float32 in :func:`ks_out_layout`) to bf16 ``out[M, N]`` (+ bias; rows / columns past M / N not stored); SPLIT
        > 1: through :func:`split_fixup` (partials ``part_ptr``, counter ``cnt_ptr + pid_n``). The epilogue of the
        in-program split-K kernel and of the TMA kernel (:mod:`verl_quads.nvfp4.gluon_tma`, SPLIT 1)."""
        LE: gl.constexpr = ks_out_layout(NT, NW)
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LE))
        rows = gl.expand_dims(cols, 1)
        xr = gl.expand_dims(gl.arange(0, NT * 8, layout=gl.SliceLayout(0, LE)), 0)
        om = (rows < N) & (xr < M)
        if SPLIT == 1:
            if HAS_BIAS:
                z += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 1)
            gl.store(out_ptr + xr * N + rows, z.to(gl.bfloat16), mask=om)
        else:
            split_fixup(z, part_ptr, xr, rows, M, N, pid_k, om, out_ptr, xr * N + rows, cnt_ptr, pid_n, bias_ptr,
                        cols, SPLIT, HAS_BIAS)

    @gluon.jit
    def _ks_chunk_mma(acc, wd, sc, xv, KS: gl.constexpr, NWR: gl.constexpr, R: gl.constexpr, NT: gl.constexpr,
                      DEC: gl.constexpr):
        """:func:`_std_chunk_mma` (WPT 4, one chunk) with the K slice as the MMA's batch dimension: the same decoded
        registers, the same k order inside the chunk, one mma.sync chain per slice. DEC 4: the words are
        :func:`adjacent_std`'s (the decode of DEC 2; register pair P holds elements 2P, 2P + 1 of its word), so the
        activation's adjacent bf16 pairs are the MMA's B registers as loaded (no byte permutes)."""
        a = _decode_words(wd, sc, DEC)  # [KS, R, rb3, g, t, ib, il, e, kb3, sh]
        a = gl.reshape(gl.permute(a, (0, 1, 2, 3, 5, 6, 9, 8, 4, 7)), (KS, R * 16, 128))
        a = gl.convert_layout(a, ks_dot_layout(KS, NWR, 0), assert_trivial=True)
        if DEC == 4:
            b = gl.reshape(xv, (KS, NT, 8, 4, 2, 2, 2, 2, 2))  # [s, nt, g, t, ib, il, sh, kb3, e]
            b = gl.reshape(gl.permute(b, (0, 4, 5, 6, 7, 3, 8, 1, 2)), (KS, 128, NT * 8))
        else:
            b = gl.reshape(xv, (KS, NT, 8, 4, 2, 2, 2, 2, 2))  # [s, nt, g, t, ib, il, e, sh, kb3]
            b = gl.reshape(gl.permute(b, (0, 4, 5, 7, 8, 3, 6, 1, 2)), (KS, 128, NT * 8))
        b = gl.convert_layout(b, ks_dot_layout(KS, NWR, 1), assert_trivial=True)
        return mma_v2(a, b, acc)

    @gluon.jit
    def _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, j, n, EVEN: gl.constexpr, WEV: gl.constexpr):
        """Local chunk ``j`` of every K slice (offsets at the slice's first chunk; ``lw`` / ``ls`` / ``lx``: the
        slice's first local chunk, per element); not EVEN: chunks at or past ``n`` (the program's range) read
        zeros."""
        if EVEN:
            wd = _load_hint(w_ptr + woff + j * 16, 0, False, WEV)
            sc = _load_hint(s_ptr + soff + j * 8, 0, False, WEV)
            xv = gl.load(x_ptr + xoff + j * 128)
        else:
            wd = _load_hint(w_ptr + woff + j * 16, lw + j < n, True, WEV)
            sc = _load_hint(s_ptr + soff + j * 8, ls + j < n, True, WEV)
            xv = gl.load(x_ptr + xoff + j * 128, mask=lx + j < n, other=0.0)
        return wd, sc, xv

    @gluon.jit
    def _ks_step(acc, wd, sc, xv, KS: gl.constexpr, NWR: gl.constexpr, R: gl.constexpr, NT: gl.constexpr,
                 DEC: gl.constexpr):
        """One loaded chunk of every K slice (``_ks_loads``) decoded and multiplied into acc."""
        wd = gl.convert_layout(gl.reshape(wd, (KS, R, 2, 8, 4, 2, 2)), ks_pair_layout(KS, NWR), assert_trivial=True)
        return _ks_chunk_mma(acc, wd, sc, xv, KS, NWR, R, NT, DEC)

    @gluon.jit
    def _w4a16_ks_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
                         M, N, K, KW, KB, C, CPS, CPSL,
                         KS: gl.constexpr, NWR: gl.constexpr, RG: gl.constexpr, NT: gl.constexpr,
                         SPLIT: gl.constexpr, EVEN: gl.constexpr, PF: gl.constexpr, HAS_BIAS: gl.constexpr,
                         DEC: gl.constexpr = 3, WEV: gl.constexpr = 0, UP: gl.constexpr = 0):
        """The standard-layout kernel (:func:`_w4a16_std_kernel`, one 128-element chunk per iteration, WPT 4) with
        split-K INSIDE the program: KS x NWR warps, warp ``(s, w)`` takes row groups ``w, w + NWR, ..`` (RG of them;
        a program: 16 NWR RG weight rows) over K slice s, chunks ``c_lo + s CPSL + [0, CPSL)`` of the program's range
        ``[c_lo, c_hi)`` (``pid_k`` of SPLIT, CPS chunks). The K slices are the batch dimension of a 3-D mma.sync
        (:func:`ks_mma_layout`); each slice's float32 result times ``256 / gs`` goes to shared memory and the KS
        slices are summed in the fixed order 0, 1, .. -- the operations of the split-K fixup (:func:`split_fixup`)
        without the global round trip (partial stores, acq_rel counter, the last program's re-reads): with SPLIT 1
        and the same slice boundaries the bytes equal the global split's. SPLIT > 1: that sum is the program's
        partial of the global fixup. The activation comes straight from global memory (each warp its slice's
        columns). PF: register prefetch of the next chunk (EVEN: the one past the last re-reads it). UP (2 to 4,
        EVEN, CPSL == UP, no PF): the slice's UP chunks are all loaded before the first is decoded (one DRAM round
        trip per warp instead of UP; the same MMAs in the same order)."""
        MMA: gl.constexpr = ks_mma_layout(KS, NWR)
        R: gl.constexpr = NWR * RG
        BN: gl.constexpr = R * 16
        NW: gl.constexpr = KS * NWR
        L6: gl.constexpr = ks_word_layout(KS, NWR)
        LP: gl.constexpr = ks_pair_layout(KS, NWR)
        LS: gl.constexpr = gl.SliceLayout(6, LP)
        LX: gl.constexpr = ks_x_layout(KS, NWR)
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        c_lo, c_hi = _k_range(pid_k, CPS, C)
        n = c_hi - c_lo

        # weight rows 16 (pid_n R + r) + 8 rb3 + g (past N: row N - 1, not stored) at the slice's first chunk
        lw = _iota(KS, 0, 6, L6) * CPSL
        roww = gl.minimum(pid_n * BN + _iota(R, 1, 6, L6) * 16 + _iota(2, 2, 6, L6) * 8 + _iota(8, 3, 6, L6), N - 1)
        woff = roww * KW + (c_lo + lw) * 16 + _iota(4, 4, 6, L6) * 4 + _iota(4, 5, 6, L6)
        ls = _iota(KS, 0, 6, LS) * CPSL
        rows_s = gl.minimum(pid_n * BN + _iota(R, 1, 6, LS) * 16 + _iota(2, 2, 6, LS) * 8 + _iota(8, 3, 6, LS), N - 1)
        soff = rows_s * KB + (c_lo + ls) * 8 + _iota(4, 4, 6, LS) * 2 + _iota(2, 5, 6, LS)
        # activation rows 8 nt + g (rows >= M read row M - 1: not stored), elements 32 t + [0, 32) of each chunk
        lx = _iota(KS, 0, 5, LX) * CPSL
        xn = gl.minimum(_iota(NT, 1, 5, LX) * 8 + _iota(8, 2, 5, LX), M - 1)
        xoff = xn * K + (c_lo + lx) * 128 + _iota(4, 3, 5, LX) * 32 + _iota(32, 4, 5, LX)

        acc = gl.zeros([KS, BN, NT * 8], gl.float32, MMA)
        if UP > 0:
            w0, s0, x0 = _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, 0, n, EVEN, WEV)
            w1, s1, x1 = _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, 1, n, EVEN, WEV)
            if UP >= 3:
                w2, s2, x2 = _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, 2, n, EVEN, WEV)
            if UP >= 4:
                w3, s3, x3 = _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, 3, n, EVEN, WEV)
            acc = _ks_step(acc, w0, s0, x0, KS, NWR, R, NT, DEC)
            acc = _ks_step(acc, w1, s1, x1, KS, NWR, R, NT, DEC)
            if UP >= 3:
                acc = _ks_step(acc, w2, s2, x2, KS, NWR, R, NT, DEC)
            if UP >= 4:
                acc = _ks_step(acc, w3, s3, x3, KS, NWR, R, NT, DEC)
        else:
            jn = gl.minimum(CPSL, n)  # local chunks of the longest slice
            if PF >= 1:
                nxt = _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, 0, n, EVEN, WEV)
            for j in range(0, jn):
                if PF >= 1:
                    cur = nxt
                    jj = j + 1
                    if EVEN:
                        jj = gl.minimum(jj, jn - 1)
                    nxt = _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, jj, n, EVEN, WEV)
                else:
                    cur = _ks_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, lw, ls, lx, j, n, EVEN, WEV)
                wd, sc, xv = cur
                acc = _ks_step(acc, wd, sc, xv, KS, NWR, R, NT, DEC)

        z = ks_reduce(acc, gs_ptr, KS, NWR, BN, NT)
        ks_store(z, out_ptr, part_ptr, cnt_ptr, bias_ptr, M, N, pid_n, pid_k, BN, NT, NW, SPLIT, HAS_BIAS)


# ----------------------------------------------------------------------------------------------- host


@dataclass(frozen=True)
class GluonConfig:
    """``num_warps`` (row groups per program: BN = 16 num_warps rg weight rows), ``kc`` (chunks per iteration: 64
    elements in the permuted layout, 128 in the standard one), ``split`` (programs along K; 0 = auto: fill ``occ``
    programs per SM), ``prefetch`` (register prefetch of the next iteration), ``maxnreg`` (standard-layout kernel:
    ptxas register cap), ``asm`` (inline-PTX pair decode, permuted layout). Standard-layout kernel only (session
    10): ``rg`` row groups per warp, ``wev`` weight-load cache hint, ``dec`` pair decode (3: mask + multiply),
    ``pfd`` prefetch depth, ``xs`` / ``xsc`` / ``xsb`` activation staged in shared memory -- none changes the bytes
    of the result at a given split (same decoded registers, same MMA / summation order per output row); ``ks`` K
    slices inside a program (split 1: the bytes of the plain kernel at split ``ks`` with the same slice boundaries);
    ``up`` (ks kernel) all ``up`` chunks of a slice loaded before the first is decoded (the same bytes: same order of
    MMAs and sums)."""

    num_warps: int = 4
    kc: int = 2
    split: int = 0
    occ: int = 4
    prefetch: bool = True  # register prefetch of the next iteration's operands
    maxnreg: int = 0  # register cap per thread (ptxas; 0: none). Dense std kernel, H200: slower (spills), unused there
    asm: bool = True  # decode + scale of a register pair as one inline-PTX block (else Triton ops: LLVM re-pairs halves)
    rg: int = 1  # standard-layout kernel: 16-row groups per warp (a program: 16 num_warps rg weight rows)
    wev: int = 0  # standard-layout kernel: weight-load cache hint (0 none, 1 evict_first, 2 .cg: L2 only)
    dec: int = 1  # std kernel: pair decode (1 shifts, 3 mask + multiply; 2 / 4: spread_std / adjacent_std words)
    pfd: int = 0  # register prefetch depth (0: 1 if prefetch else 0; 2: two iterations ahead)
    xs: bool = False  # standard-layout kernel: activation staged in shared memory once per program (kc 1)
    xsc: int = 0  # xs: chunks (128 K elements) staged at a time (0: the program's whole K range, <= 64 KB of smem)
    xsb: int = 1  # xs: stage buffers (2: the next stage is copied while this one is used)
    ks: int = 1  # standard-layout kernel: K slices inside a program (num_warps / ks warps per slice; kc 1, no xs)
    up: int = 0  # ks kernel: every chunk of a slice loaded before any is used (= chunks per slice, 2 to 4; even, pf0)

    @property
    def label(self) -> str:
        return (f"w{self.num_warps} kc{self.kc} s{self.split or 'a'}{self.occ} pf{int(self.prefetch)}"
                f"{f' r{self.maxnreg}' if self.maxnreg else ''}"
                f"{'' if self.asm else ' noasm'}{f' rg{self.rg}' if self.rg != 1 else ''}"
                f"{f' ev{self.wev}' if self.wev else ''}{f' d{self.dec}' if self.dec != 1 else ''}"
                f"{f' pd{self.pfd}' if self.pfd else ''}{' xs' if self.xs else ''}"
                f"{f' xsc{self.xsc}' if self.xsc else ''}{f' xsb{self.xsb}' if self.xsb != 1 else ''}"
                f"{f' ks{self.ks}' if self.ks != 1 else ''}{f' up{self.up}' if self.up else ''}")


def _num_sms(dev: torch.device) -> int:
    """SMs of ``dev`` (CUDA); 132 (the H200's) elsewhere, so offline plans match the measured ones."""
    return di.sm_count(dev) if dev.type == "cuda" else 132


def plan(w: GluonWeight, cfg: GluonConfig, sms: int = 132) -> tuple[int, int, int, bool]:
    """(grid_n, split, chunks per split, even) of a launch."""
    grid_n, split, cps, even = _plan(w.nr, w.chunks, cfg, sms)
    return grid_n, split, cps, even and w.k == w.chunks * CHUNK


def _plan(nr: int, c: int, cfg: GluonConfig, sms: int) -> tuple[int, int, int, bool]:
    """(grid_n, split, chunks per split, every split full) for ``nr`` row groups and ``c`` chunks."""
    grid_n = -(-nr // cfg.num_warps)
    if cfg.split:
        split = cfg.split
    else:  # >= occ programs per SM, preferring a split that divides the iterations evenly (no K masks)
        target = max(1, min(c // cfg.kc, -(-(sms * cfg.occ) // grid_n)))
        its = c // cfg.kc if c % cfg.kc == 0 else 0
        even = [d for d in range(target, min(2 * target, its) + 1) if its % d == 0]
        split = even[0] if even else target
    cps = -(-c // split)
    cps = -(-cps // cfg.kc) * cfg.kc
    split = -(-c // cps)
    return grid_n, split, cps, c % cps == 0


def gluon_w4a16(x: torch.Tensor, w: GluonWeight, cfg: GluonConfig = GluonConfig()) -> torch.Tensor:
    """``x`` bf16 ``[M, K]`` (M <= 16) times the permuted NVFP4 weight: bf16 ``[M, N]``."""
    if gluon is None:
        raise RuntimeError("gluon_w4a16 needs triton >= 3.6 (triton.experimental.gluon)")
    m, k = x.shape
    if k != w.k or x.dtype != torch.bfloat16 or not 1 <= m <= 16:
        raise ValueError(f"gluon_w4a16: x bf16 [M <= 16, {w.k}], got {x.dtype} {tuple(x.shape)}")
    if w.fmt != 1 and not cfg.asm:
        raise ValueError("gluon_w4a16: format 2 needs the inline-PTX decode (asm=True)")
    if cfg.rg != 1 or cfg.wev or cfg.dec != 1 or cfg.pfd or cfg.xs:
        raise ValueError("gluon_w4a16: rg / wev / dec / pfd / xs are options of the standard-layout kernel "
                         "(gluon_w4a16_std)")
    x = x.contiguous()
    nt = 1 if m <= 8 else 2
    grid_n, split, cps, even = plan(w, cfg, _num_sms(x.device))
    out = torch.empty(m, w.n, dtype=torch.bfloat16, device=x.device)
    if split > 1:
        part = torch.empty(split, m, w.n, dtype=torch.float32, device=x.device)
        cnt = tile_counters(x.device, grid_n, "gluon_dense")
        if cnt is None:
            raise RuntimeError("gluon_w4a16: first use of a larger grid inside CUDA-graph capture")
    else:
        part, cnt = out, out
    _w4a16_kernel[(grid_n, split)](
        x.view(torch.int32), w.wq, w.sq, w.gs, out, part, cnt, m, w.n, k, w.nr, w.chunks, cps,
        NW=cfg.num_warps, KC=cfg.kc, NT=nt, SPLIT=split, EVEN=even, PF=int(cfg.prefetch), ASM=cfg.asm, FMT=w.fmt,
        num_warps=cfg.num_warps)
    return out


STD_CHUNK = 128  # K elements per chunk of the standard-layout kernel


def std_supported(x: torch.Tensor, w_packed: torch.Tensor) -> bool:
    """Whether :func:`gluon_w4a16_std` takes this dense GEMM: Gluon importable, bf16 activation of 1..16 rows on a
    CUDA device of compute capability 8.0+ (mma.sync), not under the Triton interpreter, K % 128 == 0."""
    import os

    return (gluon is not None and os.environ.get("TRITON_INTERPRET") != "1" and x.is_cuda
            and x.dtype == torch.bfloat16 and x.dim() == 2 and 1 <= x.shape[0] <= 16 and w_packed.dim() == 2
            and x.shape[1] % STD_CHUNK == 0 and di.capability(x.device)[0] >= 8)



def std_plan(n: int, k: int, cfg: GluonConfig, sms: int = 132) -> tuple[int, int, int, bool]:
    """(grid_n, split, chunks per split, even) of a standard-layout launch for an ``[n, k]`` weight (programs of
    ``cfg.rg`` row groups per warp). ``cfg.ks`` > 1 (K slices inside a program, ``num_warps / ks`` warps each):
    ``split`` programs along K (0 = auto: at least ``occ`` programs per SM), each of ``ks`` slices of
    ``cps / ks`` chunks; ``even``: every slice of every program full."""
    nw = cfg.num_warps
    c = k // STD_CHUNK
    if cfg.ks > 1:
        grid_n = -(-(-(-n // ROWS)) // (nw // cfg.ks * cfg.rg))
        split = cfg.split or max(1, min(c // cfg.ks, -(-(sms * cfg.occ) // grid_n)))
        cpsl = -(-c // (split * cfg.ks))
        cps = cpsl * cfg.ks
        return grid_n, -(-c // cps), cps, c % cps == 0
    grid_n = -(-(-(-n // ROWS)) // (nw * cfg.rg))
    _, split, cps, even = _plan(grid_n * nw, c, cfg, sms)
    return grid_n, split, cps, even


def gluon_w4a16_std(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
                    bias: torch.Tensor | None = None, cfg: GluonConfig = GluonConfig(kc=1)) -> torch.Tensor:
    """``x`` bf16 ``[M, K]`` (M <= 16, K % 128 == 0) times the NVFP4 weight in the STANDARD layout (``w_packed``
    uint8 ``[N, K/2]``, ``w_scale`` e4m3 ``[N, K/16]``, ``w_gs`` float32 one element), plus ``bias`` ``[N]``:
    bf16 ``[M, N]``. ``cfg.dec`` 2 / 4: ``w_packed`` holds :func:`spread_std`'s / :func:`adjacent_std`'s words.
    Raises if Gluon / the shape is not supported (no fallback here)."""
    ok, why = gluon_available()
    if not ok:
        raise RuntimeError(f"gluon_w4a16_std (requested explicitly) cannot run: {why}")
    m, k = x.shape
    n = w_packed.shape[0]
    if not std_supported(x, w_packed) or tuple(w_packed.shape) != (n, k // 2) or tuple(w_scale.shape) != (
            n, k // BLOCK_SIZE) or w_gs.numel() != 1 or w_packed.dtype != torch.uint8:
        raise ValueError(f"gluon_w4a16_std: needs bf16 x [1..16, K % 128 == 0] on CUDA (no interpreter) and a "
                         f"[N, K/2] uint8 weight; got x {x.dtype} {tuple(x.shape)}, w {tuple(w_packed.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gluon_w4a16_std: bias must be [{n}], got {tuple(bias.shape)}")
    if (cfg.rg not in (1, 2, 4) or cfg.wev not in (0, 1, 2) or cfg.dec not in (1, 2, 3, 4) or cfg.pfd not in (0, 1, 2)
            or cfg.xsb not in (1, 2) or cfg.xsc < 0 or (cfg.xs and cfg.kc != 1)):
        raise ValueError(f"gluon_w4a16_std: rg must be 1, 2 or 4, wev 0, 1 or 2, dec 1 to 4, pfd 0, 1 or 2, xsb 1 or "
                         f"2, xs with kc 1; got {cfg.rg} / {cfg.wev} / {cfg.dec} / {cfg.pfd} / {cfg.xsb} / {cfg.kc}")
    if cfg.ks != 1 and (cfg.ks < 1 or cfg.num_warps % cfg.ks or cfg.kc != 1 or cfg.xs or cfg.pfd > 1):
        raise ValueError(f"gluon_w4a16_std: ks (K slices in a program) must divide num_warps, with kc 1, no xs, pfd "
                         f"<= 1; got ks {cfg.ks}, num_warps {cfg.num_warps}, kc {cfg.kc}, xs {cfg.xs}, pfd {cfg.pfd}")
    x = x.contiguous()
    nt = 1 if m <= 8 else 2
    grid_n, split, cps, even = std_plan(n, k, cfg, _num_sms(x.device))
    if cfg.up and (cfg.ks < 2 or cfg.up not in (2, 3, 4) or not even or cps // cfg.ks != cfg.up or cfg.prefetch
                   or cfg.pfd):
        raise ValueError(f"gluon_w4a16_std: up (a slice's chunks loaded up front) needs ks > 1, no prefetch, every "
                         f"slice full and up (2 to 4) == its chunks; got up {cfg.up}, ks {cfg.ks}, prefetch "
                         f"{cfg.prefetch}/{cfg.pfd}, chunks per slice {cps // max(1, cfg.ks)}, full {even} at K={k}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        cnt = tile_counters(x.device, grid_n, "gluon_dense")
        if cnt is None:
            raise RuntimeError("gluon_w4a16_std: first use of a larger grid inside CUDA-graph capture")
    else:
        part, cnt = out, out
    gs = w_gs.reshape(1)
    if cfg.ks > 1:
        _w4a16_ks_kernel[(grid_n, split)](
            x, w_packed.view(torch.int32), w_scale.view(torch.uint8), gs, bias if bias is not None else gs, out, part,
            cnt, m, n, k, k // 8, k // BLOCK_SIZE, k // STD_CHUNK, cps, cps // cfg.ks,
            KS=cfg.ks, NWR=cfg.num_warps // cfg.ks, RG=cfg.rg, NT=nt, SPLIT=split, EVEN=even,
            PF=int(cfg.prefetch or cfg.pfd > 0), HAS_BIAS=bias is not None, DEC=cfg.dec, WEV=cfg.wev, UP=cfg.up,
            num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
        return out
    xc = max(1, min(cfg.xsc or cps, cps, 32 // (cfg.xsb * nt))) if cfg.xs else 1  # <= 64 KB of staged activation
    _w4a16_std_kernel[(grid_n, split)](
        x, w_packed.view(torch.int32), w_scale.view(torch.uint8), gs, bias if bias is not None else gs, out, part,
        cnt, m, n, k, k // 8, k // BLOCK_SIZE, k // STD_CHUNK, cps,
        NW=cfg.num_warps, KC=cfg.kc, NT=nt, SPLIT=split, EVEN=even, PF=cfg.pfd or int(cfg.prefetch),
        HAS_BIAS=bias is not None, RG=cfg.rg, WEV=cfg.wev, DEC=cfg.dec, XS=int(cfg.xs), XC=xc,
        XB=cfg.xsb if cfg.xs else 1, num_warps=cfg.num_warps,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return out


__all__ = ["GluonWeight", "GluonConfig", "permute_weight", "unpermute_weight", "decode_permuted", "spread_std",
           "adjacent_std", "std_words", "unspread_std",
           "reference_weight", "plan", "gluon_w4a16", "std_supported", "std_plan", "gluon_w4a16_std", "STD_CHUNK",
           "MIN_TRITON", "triton_version", "gluon_available"]
