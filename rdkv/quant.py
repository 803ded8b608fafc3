"""Asymmetric uniform quantization and dense bit packing.

Every width in {2, 4, 8} stores codes packed densely into uint8 (2-bit: four codes per byte) plus one
scale and one zero point per group, both float16. 16 bits means the tensor is kept in its 16-bit dtype
and 0 means it is not stored. The byte formulas here are the ones the allocator charges, so the budget
it solves for is the budget the cache really holds.
"""
from __future__ import annotations

import torch

WIDTHS = (0, 2, 4, 8, 16)
PACKED = (2, 4, 8)
META_DTYPE = torch.float16
META_BYTES = 2 * 2  # one fp16 scale + one fp16 zero point per group
FP16_MAX = 65504.0


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
