"""Asymmetric uniform quantization and dense bit packing.

Every width in {2, 4, 8} stores codes packed densely into uint8 (2-bit: four codes per byte) plus one
scale and one zero point per group, both float16. 16 bits means the tensor is kept in its 16-bit dtype
and 0 means it is not stored. The byte formulas here are the ones the allocator charges, so the budget
it solves for is the budget the cache really holds.
"""
from __future__ import annotations

import torch

from .errors import RDKVError

WIDTHS = (0, 2, 4, 8, 16)
OPTION = {w: i for i, w in enumerate(WIDTHS)}  # width -> option index, the solver's unit
PACKED = (2, 4, 8)
META_DTYPE = torch.float16
META_BYTES = 2 * 2  # one fp16 scale + one fp16 zero point per group
FP16_MAX = 65504.0


def option_of(widths: torch.Tensor) -> torch.Tensor:
    """Option indices (into ``WIDTHS``) of a tensor of widths; -1 for a width that is not an option."""
    lookup = torch.full((max(WIDTHS) + 1,), -1, dtype=torch.long, device=widths.device)
    lookup[list(WIDTHS)] = torch.arange(len(WIDTHS), device=widths.device)
    return lookup[widths.long()]


def scale_zero(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and zero point for groups with range [lo, hi] (a constant group gets scale 0)."""
    big = torch.maximum(lo.abs().amax() if lo.numel() else lo.new_zeros(()), hi.abs().amax() if hi.numel() else hi.new_zeros(()))
    if not torch.isfinite(big) or big > FP16_MAX:
        raise ValueError("cannot quantize: values are not finite or exceed the fp16 range (|x| > 65504)")
    zero = lo.to(META_DTYPE)
    return ((hi - zero.float()) / ((1 << bits) - 1)).to(META_DTYPE), zero


def codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``x`` for scale/zero of the same shape as ``x`` (already broadcast per element)."""
    s = scale.float()
    q = ((x.float() - zero.float()) / torch.where(s > 0, s, 1.0)).round_()
    return q.clamp_(0, (1 << bits) - 1).to(torch.uint8)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups along the last dim of ``x`` [..., g] to ``bits``-bit codes.

    Returns (codes uint8 [..., g], scale fp16 [...], zero fp16 [...]). Scale and zero are rounded to
    fp16 *before* the codes are computed, so dequantization reproduces exactly what was measured.
    """
    x = x.float()
    scale, zero = scale_zero(x.amin(-1), x.amax(-1), bits)
    return codes(x, scale.unsqueeze(-1), zero.unsqueeze(-1), bits), scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize` in float32."""
    return codes.float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize-dequantize groups along the last dim (what a width costs in accuracy)."""
    return dequantize(*quantize(x, bits))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes along the last dim into bytes, lowest code in the lowest bits."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per} codes per byte at {bits} bits")
    if bits == 8:
        return codes.to(torch.uint8)
    c = codes.to(torch.int32).unflatten(-1, (-1, per))
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.int32)
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 [..., n * bits / 8] -> codes uint8 [..., n]."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def row_bytes(width: int, dim: int, group: int) -> int:
    """Bytes of one row of ``dim`` values quantized in groups of ``group`` along the row."""
    if width == 0:
        return 0
    if width == 16:
        return 2 * dim
    return dim * width // 8 + (dim // group) * META_BYTES


# --- quantize + pack in one call (the compress path; Triton on GPU) ---------------------------------------
def check_quantize_pack(x: torch.Tensor, bits: int, group: int, axis: int = -1,
                        segments: torch.Tensor | None = None) -> int:
    """Validate the arguments of :func:`rdkv.layout.quantize_pack`; returns the axis as -1 or 0."""
    if bits not in PACKED:
        raise RDKVError(f"quantize_pack packs bits in {PACKED}, got {bits}")
    if not isinstance(group, int) or group <= 0:
        raise RDKVError(f"group must be a positive int, got {group!r}")
    per = 8 // bits
    if axis in (-1, x.dim() - 1) and x.dim() >= 1:
        if segments is not None:
            raise RDKVError("segments apply to axis=0 (groups along rows) only")
        if x.shape[-1] % group:
            raise RDKVError(f"last dim {x.shape[-1]} is not a multiple of group={group}")
        if group % per:
            raise RDKVError(f"group={group} must be a multiple of {per} codes per byte at {bits} bits "
                            "(a byte may not straddle two groups)")
        return -1
    if axis != 0 or x.dim() != 2:
        raise RDKVError(f"quantize_pack takes axis=-1 (groups along the last dim) or axis=0 with x [R, C] "
                        f"(groups along rows), got axis={axis} for shape {tuple(x.shape)}")
    if x.shape[1] % per:
        raise RDKVError(f"C={x.shape[1]} channels are not a multiple of {per} codes per byte at {bits} bits")
    if segments is not None:
        if segments.dim() != 1 or segments.dtype.is_floating_point or segments.dtype == torch.bool:
            raise RDKVError(f"segments must be a 1-d integer tensor of row counts, got {segments.dtype} "
                            f"{tuple(segments.shape)}")
        if segments.numel() and (int(segments.sum()) != x.shape[0] or bool((segments < 0).any())):
            raise RDKVError(f"segments must be non-negative row counts summing to R={x.shape[0]}")
        if not segments.numel() and x.shape[0]:
            raise RDKVError(f"no segments for R={x.shape[0]} rows")
    return 0


def segment_groups(lens: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First row (int64) and row count of every group when segments of ``lens`` rows are cut into groups
    of ``group`` rows (a segment's last group may be short), ordered segment by segment."""
    lens = lens.long()
    ng = torch.div(lens + group - 1, group, rounding_mode="floor")
    total = int(ng.sum()) if ng.numel() else 0
    seg = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), ng, output_size=total)
    j = torch.arange(total, device=lens.device) - (torch.cumsum(ng, 0) - ng)[seg]
    start = (torch.cumsum(lens, 0) - lens)[seg] + j * group
    return start, torch.minimum(lens[seg] - j * group, torch.full_like(start, group))


def quantize_pack_torch(x: torch.Tensor, bits: int, group: int, axis: int = -1,
                        segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path of :func:`rdkv.layout.quantize_pack` (and the reference of its Triton kernel)."""
    axis = check_quantize_pack(x, bits, group, axis, segments)
    if axis == -1:
        c, scale, zero = quantize(x.unflatten(-1, (-1, group)), bits)
        return pack(c.flatten(-2), bits), scale, zero
    R, C = x.shape
    x = x.float()
    start, glen = segment_groups(segments if segments is not None else torch.tensor([R], device=x.device), group)
    gid = torch.repeat_interleave(torch.arange(len(start), device=x.device), glen, output_size=R)
    idx = gid.unsqueeze(-1).expand_as(x)
    lo = x.new_full((len(start), C), float("inf")).scatter_reduce(0, idx, x, "amin")
    hi = x.new_full((len(start), C), float("-inf")).scatter_reduce(0, idx, x, "amax")
    scale, zero = scale_zero(lo, hi, bits)
    return pack(codes(x, scale[gid], zero[gid], bits), bits), scale, zero
