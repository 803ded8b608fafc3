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
from ..pages import page_tokens
from ..weights import layer_sums
from .base import Allocation, HeldLayer, Method, identity_perm


def keep_counts(layers: list[HeldLayer], fp16: list[int], budget: float, spec) -> list[list[int]]:
    """Tokens each head of each layer may keep in fp16, per sequence ([layer][sequence]): the same share of
    what each layer holds, in whole pages (:mod:`rdkv.pages`), the largest share within ``budget`` x the
    sequence's fp16 bytes."""
    per_token = fp16_token_bytes(layers[0].k.shape[-1], layers[0].stats.seen)
    held = [h.present[:, 0].sum(-1).tolist() for h in layers]  # tokens per head, one count per sequence
    page = [page_tokens(h.k.shape[-1], spec, h.present.shape[-1]) for h in layers]
    fixed = sum(fixed_bytes(h.k.shape[1], h.k.shape[-1], spec) for h in layers)
    if any(budget * f < fixed for f in fp16):
        f = min(fp16)
        raise Infeasible(f"the per-head metadata alone takes {fixed} bytes", fixed, budget * f)

    def counts(share: float, b: int) -> list[int]:
        return [min(int(share * n[b]), n[b]) // p * p for n, p in zip(held, page)]

    def spent(c: list[int]) -> float:
        return fixed + per_token * sum(h.k.shape[1] * n for h, n in zip(layers, c))

    out = []
    for b, f in enumerate(fp16):
        lo, hi = 0.0, 1.0
        for _ in range(40):  # the largest share whose whole pages fit
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if spent(counts(mid, b)) <= budget * f else (lo, mid)
        c = counts(lo, b)
        # then one more page per head for the layers that rounded down the most, while the bytes allow
        for i in sorted(range(len(layers)), key=lambda i: c[i] - lo * held[i][b]):
            more = c[:i] + [c[i] + page[i]] + c[i + 1:]
            if c[i] + page[i] <= held[i][b] and spent(more) <= budget * f:
                c = more
        out.append(c)
    return [[c[i] for c in out] for i in range(len(layers))]


def whole_pages(keep: torch.Tensor, score: torch.Tensor, page: int) -> torch.Tensor:
    """``keep`` [B, H, T] less each head's lowest-scoring kept tokens past its last whole page: the budget counts
    tokens at their fp16 bytes, which a stored page matches only when it is full (:mod:`rdkv.pages`)."""
    extra = keep.sum(-1, keepdim=True) % page
    by_score = score.argsort(dim=-1, stable=True)
    kept_first = by_score.gather(-1, (~keep).gather(-1, by_score).byte().argsort(dim=-1, stable=True))
    return keep & (kept_first.argsort(-1) >= extra)  # the rank of each token among the kept ones


@dataclass(frozen=True)
class Evict(Method):
    """Keep each head's highest-scoring tokens (:meth:`scores`); ``window`` last tokens are always kept."""

    def scores(self, h: HeldLayer) -> torch.Tensor:
        raise NotImplementedError

    def always_kept(self) -> int:
        return 0

    def keep(self, score: torch.Tensor, count: int, page: int) -> torch.Tensor:
        """[H, T] keep mask of one sequence's layer, ``count`` tokens per head (a multiple of ``page``)."""
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
            page = page_tokens(h.k.shape[-1], self.spec, T)
            keep = whole_pages(torch.stack([self.keep(score[b], count[b], page) for b in range(B)]) & h.present, score,
                               page)
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

    def keep(self, score: torch.Tensor, count: int, page: int) -> torch.Tensor:
        H, T = score.shape
        count = min(count, T)
        floor = int(count * self.min_share)
        keep = super().keep(score, floor, page)
        rest = score.masked_fill(keep, float("-inf")).flatten()
        n = min(count * H - floor * H, int((rest > float("-inf")).sum()))
        keep.view(-1)[rest.topk(n).indices] = True
        # whole pages: each head's count to a multiple of the page, the pages rounding takes given back to the heads
        # with the largest remainders, then each head's best tokens up to its pages
        n_h = keep.sum(-1)
        pages = n_h // page
        spare = int(keep.sum()) // page - int(pages.sum())
        pages[(n_h % page).argsort(descending=True)[:spare]] += 1
        first = torch.arange(T, device=score.device) < (pages.clamp(max=T // page) * page).unsqueeze(-1)
        return torch.zeros_like(keep).scatter_(-1, score.argsort(-1, descending=True), first)


@dataclass(frozen=True)
class KeyNorm(Evict):
    """The tokens with the lowest key norm."""

    def scores(self, h: HeldLayer) -> torch.Tensor:
        return -h.k.float().norm(dim=-1)
