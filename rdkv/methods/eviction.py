"""Eviction baselines: kept tokens in fp16, the rest dropped, ragged per head so the savings are real.

Each layer keeps the same share of the tokens it holds, as kvpress's presses do (``compression_ratio`` per
layer), that share as large as the budget pays for at fp16 (V row, position and K row); AdaKV shares one
count over a layer's heads. A sliding-window layer holds only its window, so it keeps fewer tokens than a
global layer: one count for every layer would spend most of a hybrid model's bytes on its window layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import quant
from ..records import Record
from ..solvers.mckp import Infeasible
from ..layout import fixed_bytes, fp16_token_bytes
from ..weights import layer_sums
from .base import Allocation, HeldLayer, Method, identity_perm


def keep_counts(layers: list[HeldLayer], fp16: list[int], budget: float, spec) -> list[list[int]]:
    """Tokens each head of each layer may keep in fp16, per sequence ([layer][sequence]): the same share of
    what each layer holds, within ``budget`` x the sequence's fp16 bytes."""
    per_token = fp16_token_bytes(layers[0].k.shape[-1], layers[0].stats.seen)
    held = [h.present[:, 0].sum(-1).tolist() for h in layers]  # tokens per head, one count per sequence
    fixed = sum(fixed_bytes(h.k.shape[1], h.k.shape[-1], spec) for h in layers)
    if any(budget * f < fixed for f in fp16):
        f = min(fp16)
        raise Infeasible(f"the per-head metadata alone takes {fixed} bytes", fixed, budget * f)
    slots = [sum(h.present.shape[1] * n[b] for h, n in zip(layers, held)) for b in range(len(fp16))]
    share = [(budget * f - fixed) / (per_token * s) for f, s in zip(fp16, slots)]
    return [[int(share[b] * n[b]) for b in range(len(fp16))] for n in held]


@dataclass(frozen=True)
class Evict(Method):
    """Keep each head's highest-scoring tokens (:meth:`scores`); ``window`` last tokens are always kept."""

    def scores(self, h: HeldLayer) -> torch.Tensor:
        raise NotImplementedError

    def always_kept(self) -> int:
        return 0

    def keep(self, score: torch.Tensor, count: int) -> torch.Tensor:
        """[H, T] keep mask of one sequence's layer, ``count`` tokens per head."""
        keep = torch.zeros_like(score, dtype=torch.bool)
        return keep.scatter_(-1, score.topk(min(count, score.shape[-1]), -1).indices, True)

    def allocate(self, rec: Record, layers: list[HeldLayer], fp16: list[int], budget: float | None) -> Allocation:
        counts = keep_counts(layers, fp16, budget, self.spec)
        v, k = [], []
        for h, count in zip(layers, counts):
            B, H, T = h.present.shape
            score = self.scores(h).masked_fill(~h.present, float("-inf"))
            if self.always_kept():
                score[..., max(0, T - self.always_kept()) :] = float("inf")
            keep = torch.stack([self.keep(score[b], count[b]) for b in range(B)]) & h.present
            v.append(torch.where(keep, quant.OPTION[16], quant.OPTION[0]))
            k.append(torch.full((B, H, h.k.shape[-1] // self.spec.k_block), quant.OPTION[16], device=score.device))
        return Allocation(v, k, identity_perm(layers))


@dataclass(frozen=True)
class StreamingLLM(Evict):
    """The first ``sinks`` real tokens and the most recent ones."""

    sinks: int = 4

    def scores(self, h: HeldLayer) -> torch.Tensor:
        pos = torch.arange(h.start, h.stats.seen, device=h.k.device, dtype=torch.float32)
        rel = pos - (h.present.cumsum(-1) == 0).sum(-1, keepdim=True)  # sinks count from the first real token
        return torch.where(rel < self.sinks, float(h.stats.seen), pos).expand_as(h.present).clone()


@dataclass(frozen=True)
class SnapKV(Evict):
    """Attention of the last ``window`` prefill queries, average-pooled over ``kernel`` tokens; the
    observation window itself is always kept."""

    window: int = 64
    kernel: int = 7

    def scores(self, h: HeldLayer) -> torch.Tensor:
        mass = layer_sums(h.stats, "window", h.start, self.window).mass
        return F.avg_pool1d(mass.flatten(0, 1).unsqueeze(1), self.kernel, 1, self.kernel // 2,
                            count_include_pad=False).view_as(mass)

    def always_kept(self) -> int:
        return self.window


@dataclass(frozen=True)
class AdaKV(SnapKV):
    """SnapKV's scores, one top-k over all heads of a layer, each head keeping at least ``min_share`` of
    the uniform count."""

    min_share: float = 0.2

    def keep(self, score: torch.Tensor, count: int) -> torch.Tensor:
        H, T = score.shape
        count = min(count, T)
        floor = int(count * self.min_share)
        keep = super().keep(score, floor)
        rest = score.masked_fill(keep, float("-inf")).flatten()
        n = min(count * H - floor * H, int((rest > float("-inf")).sum()))
        keep.view(-1)[rest.topk(n).indices] = True
        return keep


@dataclass(frozen=True)
class KeyNorm(Evict):
    """The tokens with the lowest key norm."""

    def scores(self, h: HeldLayer) -> torch.Tensor:
        return -h.k.float().norm(dim=-1)
