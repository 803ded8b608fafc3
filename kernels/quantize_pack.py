"""Quantize + pack in one Triton pass: the compress-side twin of :mod:`rdkv.quant`.

Bit-exact with the torch path (``rdkv.quant.quantize`` then ``rdkv.quant.pack``, or
``scale_zero`` / ``codes`` / ``pack`` for K): per group, ``lo`` / ``hi`` are the min / max in fp32,
``zero = fp16(lo)``, ``scale = fp16((hi - float(zero)) / (2^bits - 1))`` (both rounded to fp16 *before*
any code is computed), ``code = clamp(round((x - zero) / (scale if scale > 0 else 1)), 0, 2^bits - 1)``
with round-half-to-even as ``torch.round``, and ``8 / bits`` codes per byte, lowest code in the lowest
bits. Two layouts, one kernel each:

``_quantize_rows`` (``axis=-1``, the V layout)
    ``x [R, n_groups * group]``: groups of ``group`` consecutive columns. One program quantizes
    ``BLOCK_R`` rows x one group; the tile is loaded once as ``[BLOCK_R, bytes, 8/bits]`` (element
    ``(r, j, k)`` is column ``j * 8/bits + k``), so the min/max is a reduction over the last two axes and
    packing is a sum of shifted codes over the last axis: no reshape, no second read.

``_quantize_cols`` (``axis=0``, the K layout)
    ``x [R, C]``: groups of ``group`` consecutive *rows* per channel, restarting at every segment
    boundary (``segments`` = row counts of consecutive segments, e.g. the tokens of each (K block, stream)
    pair in ``rdkv.trizone.pack_layer``; the last group of a segment may be short). Codes are packed along
    the channels, as ``pack(codes [R, C])``; scale/zero are ``[groups, C]``. One program serves one group
    x ``BLOCK_C`` channels and walks the group's rows in chunks twice (min/max, then codes), so the group
    size is a runtime argument and any ``k_group`` runs without recompiling.

Rounding is computed from ``floor`` exactly (``r = floor(y)``, ``f = y - r`` is exact in fp32; round up
if ``f > 1/2`` or ``f == 1/2`` and ``r`` is odd), and the divisions use ``tl.math.div_rn`` (IEEE
round-to-nearest; Triton's plain ``/`` on fp32 compiles to the approximate ``div.full.f32``), so there
is no tie or last-bit mismatch to allow for.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rdkv.errors import RDKVError
from rdkv.quant import FP16_MAX, check_quantize_pack, segment_groups

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW_GROUP = 1024  # axis=-1 keeps one whole group in registers
TILE = 2048  # elements per program tile: 16 per thread at 4 warps, 80-112 registers (4096 needs ~210)

# Only core builtins are called in device code (see kernels/device/page_decode.py: the @jit helpers of
# triton.language.standard refuse to run in the interpreter if triton was imported before
# TRITON_INTERPRET=1 was set); tl.reduce with these combiners is what tl.min / tl.max / tl.sum expand to.
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max
_min = tl.standard._elementwise_min


# ---------------------------------------------------------------------------------------------------
# device code
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _scale_zero(lo, hi, BITS: tl.constexpr):
    """fp16 (scale, zero) of groups with range [lo, hi], as rdkv.quant.scale_zero."""
    zero = lo.to(tl.float16)
    scale = tl.math.div_rn(hi - zero.to(tl.float32), (1 << BITS) - 1.0).to(tl.float16)
    return scale, zero


@triton.jit
def _codes(x, scale, zero, BITS: tl.constexpr):
    """int32 codes of fp32 ``x`` for fp16 scale/zero broadcast to its shape, as rdkv.quant.codes."""
    s = scale.to(tl.float32)
    y = tl.math.div_rn(x - zero.to(tl.float32), tl.where(s > 0, s, 1.0))
    r = tl.floor(y)
    f = y - r  # exact: r and y share sign and magnitude range
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = r + tl.where((f > 0.5) | ((f == 0.5) & odd), 1.0, 0.0)  # round half to even, like torch.round
    r = tl.minimum(tl.maximum(r, 0.0), (1 << BITS) - 1.0)
    return r.to(tl.int32)


@triton.jit
def _quantize_rows(x_ptr, sxr, sxc, out_ptr, scale_ptr, zero_ptr, R, n_groups,
                   GROUP: tl.constexpr, BYTES_PAD: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows ``BLOCK_R * pid0 ...`` x group ``pid1`` of x [R, n_groups * GROUP] (groups along a row)."""
    PER: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = GROUP // PER  # bytes of one packed group
    grp = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < R
    j = tl.arange(0, BYTES_PAD)
    k = tl.arange(0, PER)
    col = grp * GROUP + j[:, None] * PER + k[None, :]  # [BYTES_PAD, PER]
    ok = row_ok[:, None, None] & (j < BYTES)[None, :, None] & (k < PER)[None, None, :]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None, None] * sxr + col.to(tl.int64)[None, :, :] * sxc, mask=ok, other=0.0)
    x = x.to(tl.float32)
    lo = tl.reduce(tl.reduce(tl.where(ok, x, float("inf")), 2, _min), 1, _min)
    hi = tl.reduce(tl.reduce(tl.where(ok, x, float("-inf")), 2, _max), 1, _max)
    lo = tl.where(row_ok, lo, 0.0)  # padding rows: keep the arithmetic finite
    hi = tl.where(row_ok, hi, 0.0)
    scale, zero = _scale_zero(lo, hi, BITS)
    code = _codes(x, scale[:, None, None], zero[:, None, None], BITS)
    byte = tl.reduce(code << (k * BITS)[None, None, :], 2, _add)  # [BLOCK_R, BYTES_PAD]; bits never overlap
    dst = r.to(tl.int64)[:, None] * (n_groups * BYTES) + grp * BYTES + j[None, :]
    tl.store(out_ptr + dst, byte.to(tl.uint8), mask=row_ok[:, None] & (j < BYTES)[None, :])
    meta = r.to(tl.int64) * n_groups + grp
    tl.store(scale_ptr + meta, scale, mask=row_ok)
    tl.store(zero_ptr + meta, zero, mask=row_ok)


@triton.jit
def _quantize_cols(x_ptr, sxr, sxc, out_ptr, scale_ptr, zero_ptr, gstart_ptr, glen_ptr, C,
                   BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """Group ``pid0`` (rows gstart..gstart+glen of x [R, C]) x channels of byte block ``pid1``."""
    PER: tl.constexpr = 8 // BITS
    g = tl.program_id(0)
    row0 = tl.load(gstart_ptr + g)  # int64
    n = tl.load(glen_ptr + g)
    nbytes = C // PER
    j = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    k = tl.arange(0, PER)
    col = j[:, None] * PER + k[None, :]  # [BLOCK_B, PER]
    col_ok = (j < nbytes)[:, None] & (k < PER)[None, :]
    i = tl.arange(0, BLOCK_R)
    lo = tl.full([BLOCK_B, PER], float("inf"), dtype=tl.float32)
    hi = tl.full([BLOCK_B, PER], float("-inf"), dtype=tl.float32)
    for i0 in range(0, n, BLOCK_R):
        rows = row0 + i0 + i
        ok = ((i0 + i) < n)[:, None, None] & col_ok[None, :, :]
        x = tl.load(x_ptr + rows[:, None, None] * sxr + col.to(tl.int64)[None, :, :] * sxc, mask=ok, other=0.0)
        x = x.to(tl.float32)
        lo = tl.minimum(lo, tl.reduce(tl.where(ok, x, float("inf")), 0, _min))
        hi = tl.maximum(hi, tl.reduce(tl.where(ok, x, float("-inf")), 0, _max))
    lo = tl.where(col_ok, lo, 0.0)
    hi = tl.where(col_ok, hi, 0.0)
    scale, zero = _scale_zero(lo, hi, BITS)
    meta = g.to(tl.int64) * C + col
    tl.store(scale_ptr + meta, scale, mask=col_ok)
    tl.store(zero_ptr + meta, zero, mask=col_ok)
    for i0 in range(0, n, BLOCK_R):  # second walk: the group was just read, so this hits the cache
        rows = row0 + i0 + i
        row_ok = (i0 + i) < n
        ok = row_ok[:, None, None] & col_ok[None, :, :]
        x = tl.load(x_ptr + rows[:, None, None] * sxr + col.to(tl.int64)[None, :, :] * sxc, mask=ok, other=0.0)
        code = _codes(x.to(tl.float32), scale[None, :, :], zero[None, :, :], BITS)
        byte = tl.reduce(code << (k * BITS)[None, None, :], 2, _add)  # [BLOCK_R, BLOCK_B]
        tl.store(out_ptr + rows[:, None] * nbytes + j[None, :], byte.to(tl.uint8), mask=row_ok[:, None] & (j < nbytes)[None, :])


# ---------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------
def _pow2(x: int) -> int:
    return 1 << max(0, (max(1, x) - 1).bit_length())


def rows_config(group: int, bits: int, R: int) -> tuple[int, int, int]:
    """(BYTES_PAD, BLOCK_R, num_warps) for axis=-1: one group per tile, ~TILE elements per program."""
    per = 8 // bits
    bytes_pad = _pow2(group // per)
    block_r = max(1, min(TILE // (bytes_pad * per), _pow2(R), 256))
    return bytes_pad, block_r, 4


def cols_config(group: int, bits: int, C: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_B, num_warps) for axis=0: every channel of a row (up to 1024 / (8/bits) bytes)
    in one program, rows in chunks so the tile stays ~TILE elements."""
    per = 8 // bits
    block_b = min(_pow2(C // per), max(1, 1024 // per))
    block_r = max(1, min(_pow2(group), TILE // (block_b * per)))
    return block_r, block_b, 4


def check(x: torch.Tensor, bits: int, group: int, axis: int, segments: torch.Tensor | None) -> int:
    """Shape/dtype checks of the kernel on top of :func:`rdkv.quant.check_quantize_pack`; returns the
    normalised axis (-1 or 0)."""
    axis = check_quantize_pack(x, bits, group, axis, segments)
    if x.dtype not in DTYPES:
        raise RDKVError(f"the Triton quantize kernel takes fp16/bf16/fp32 input, got {x.dtype}")
    if axis == -1 and group > MAX_ROW_GROUP:
        raise RDKVError(f"the Triton quantize kernel keeps a row group in registers: group={group} > "
                        f"{MAX_ROW_GROUP}; use the torch path (rdkv.quant.quantize_pack_torch)")
    if segments is not None and segments.device != x.device:
        raise RDKVError(f"segments are on {segments.device}, x on {x.device}")
    return axis


def _check_range(x: torch.Tensor) -> None:
    if x.numel():
        big = x.detach().abs().amax().float()
        if not torch.isfinite(big) or big > FP16_MAX:
            raise RDKVError("cannot quantize: values are not finite or exceed the fp16 range (|x| > 65504)")


def quantize_pack(x: torch.Tensor, bits: int, group: int, axis: int = -1,
                  segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups of ``x`` to ``bits`` in {2, 4, 8} and pack the codes, in one kernel.

    ``axis=-1``: x [..., n * group], groups along the last dim -> (packed uint8 [..., n * group * bits / 8],
    scale fp16 [..., n], zero fp16 [..., n]); equal to ``quantize(x.unflatten(-1, (-1, group)), bits)`` then
    ``pack(codes.flatten(-2), bits)``.

    ``axis=0``: x [R, C], groups of ``group`` rows per channel (restarting at each segment of
    ``segments``, int row counts summing to R; default one segment) -> (packed uint8 [R, C * bits / 8],
    scale fp16 [groups, C], zero fp16 [groups, C]), groups ordered segment by segment.

    Raises :class:`rdkv.RDKVError` for bad shapes, dtypes, or values outside the fp16 range (one
    device-wide max, the only host synchronisation besides ``axis=0``'s group count).
    """
    axis = check(x, bits, group, axis, segments)
    _check_range(x)
    dev = x.device
    per = 8 // bits
    if axis == -1:
        lead, N = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, N)
        R, n_groups = x2.shape[0], N // group
        out = torch.empty(R, N // per, dtype=torch.uint8, device=dev)
        scale = torch.empty(R, n_groups, dtype=torch.float16, device=dev)
        zero = torch.empty(R, n_groups, dtype=torch.float16, device=dev)
        if R and n_groups:
            bytes_pad, block_r, warps = rows_config(group, bits, R)
            _quantize_rows[(triton.cdiv(R, block_r), n_groups)](
                x2, *x2.stride(), out, scale, zero, R, n_groups,
                GROUP=group, BYTES_PAD=bytes_pad, BITS=bits, BLOCK_R=block_r, num_warps=warps)
        return out.view(*lead, N // per), scale.view(*lead, n_groups), zero.view(*lead, n_groups)
    R, C = x.shape
    lens = segments if segments is not None else torch.tensor([R], device=dev)
    gstart, glen = segment_groups(lens, group)
    G = gstart.numel()
    out = torch.empty(R, C // per, dtype=torch.uint8, device=dev)
    scale = torch.empty(G, C, dtype=torch.float16, device=dev)
    zero = torch.empty(G, C, dtype=torch.float16, device=dev)
    if G and C:
        block_r, block_b, warps = cols_config(group, bits, C)
        _quantize_cols[(G, triton.cdiv(C // per, block_b))](
            x, *x.stride(), out, scale, zero, gstart, glen.to(torch.int32), C,
            BITS=bits, BLOCK_R=block_r, BLOCK_B=block_b, num_warps=warps)
    return out, scale, zero

