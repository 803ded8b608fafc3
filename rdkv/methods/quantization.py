"""Fixed-rate quantization baselines: every token and channel at one width.

``KIVI`` follows KIVI: K per channel and V per token in groups of 32, the last ``residual`` tokens' V in
fp16. The packed format has no per-token K precision, so those tokens' keys stay quantized: a deviation
from KIVI that can only hurt the baseline.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .. import quant
from ..errors import RDKVError
from ..records import Record
from ..layout import PackSpec
from .base import Allocation, HeldLayer, Method, identity_perm


@dataclass(frozen=True)
class Uniform(Method):
    """Every V row and K channel at ``bits`` (int8, int4), except the last ``residual`` tokens' V rows, in 16 bits."""

    bits: int = 4
    residual: int = 0
    fixed_rate: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.bits not in quant.PACKED:
            raise RDKVError(f"bits must be one of {quant.PACKED}, got {self.bits!r}")

    def allocate(self, rec: Record, layers: list[HeldLayer], fp16: list[int], budget: float | None) -> Allocation:
        v, k = [], []
        for h in layers:
            pos = torch.arange(h.start, h.stats.seen, device=h.k.device)
            recent = pos >= h.stats.seen - self.residual
            w = torch.where(recent, quant.OPTION[16], quant.OPTION[self.bits]).expand_as(h.present)
            v.append(torch.where(h.present, w, quant.OPTION[0]))
            k.append(torch.full((*h.present.shape[:2], h.k.shape[-1] // self.spec.k_block), quant.OPTION[self.bits],
                                device=h.k.device))
        return Allocation(v, k, identity_perm(layers))


@dataclass(frozen=True)
class KIVI(Uniform):
    """KIVI at ``bits``: groups of 32, the last ``residual`` tokens' V rows in 16 bits."""

    bits: int = 2
    residual: int = 128
    spec: PackSpec = field(default_factory=lambda: PackSpec(v_group=32, k_group=32))
