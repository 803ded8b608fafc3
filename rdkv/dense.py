"""Exact attention over dense keys and values in torch, and the sums the weight estimator streams from it.

A recorded prefill (:mod:`rdkv.attention`), window weights (:mod:`rdkv.weights`), distortion
tables and folds use it; the decode paths read packed segments instead. It runs in query chunks, so the
score tensor never exceeds ``elements`` (memory O(T * chunk), never T x T).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 24  # score elements per query chunk (64 MB in fp32)


@dataclass
class AttentionSums:
    """Sums over a set of queries, per (batch, kv head): the statistics behind token and channel weights."""

    mass: torch.Tensor  # [B, H, T] sum over queries (and grouped heads) of the attention probability on each key
    mass2: torch.Tensor  # [B, H, T] the same sum of squared probabilities (second-order error weights)
    q2: torch.Tensor  # [B, H, D] sum of squared query components
    nq: torch.Tensor  # [B] number of (query, grouped-head) pairs that attended to something


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility [..., q, k] from absolute positions."""
    ok = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if window is not None:
        ok &= q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2) < window
    return ok


def probabilities(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scaling: float,
                  window: int | None = None, softcap: float | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention probabilities [B, H, G, c, Tk] of grouped queries q [B, H, G, c, D] over k [B, H, Tk, D] (both
    float32), and which keys each query may see [B, 1, 1, c, Tk]: causality (and the sliding window) from the
    positions, and ``mask`` [B, 1, c, Tk] (True = may attend). A query that may see nothing gets all zeros."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    ok = allowed_keys(q_pos, k_pos, window)
    ok = ok.expand(q.shape[0], 1, 1, *ok.shape)
    if mask is not None:
        ok = ok & mask[:, None]
    s = s.masked_fill(~ok, float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    p = (s - m).exp()
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny), ok


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, AttentionSums]:
    """Exact attention of q [B, Hq, q, D] over k, v [B, H, Tk, D] plus the weight statistics.

    Runs in query chunks so the score tensor never exceeds ``elements``. ``mask`` is an optional
    bool [B, 1, q, Tk] (True = may attend) combined with causality from the positions. Queries that may
    attend to nothing (left padding) get a zero output and contribute nothing to the sums. When the key positions
    are one ascending run (every caller's), a chunk reads only the keys causality and the window let it see: a
    causal pass costs half the scores of a full one, and a sliding-window layer's cost grows with the window,
    not with the context.
    """
    B, Hq, L, D = q.shape
    H, Tk = k.shape[1], k.shape[2]
    G = Hq // H
    kf, vf = k.float(), v.float()
    out = q.new_empty(B, Hq, L, D)
    sums = AttentionSums(
        mass=kf.new_zeros(B, H, Tk), mass2=kf.new_zeros(B, H, Tk), q2=kf.new_zeros(B, H, D), nq=kf.new_zeros(B))
    chunk = max(1, elements // max(1, B * Hq * Tk))
    starts = range(0, L, chunk)
    for a, (lo, hi) in zip(starts, key_ranges(q_pos, k_pos, window, starts, chunk)):
        qc = q[:, :, a : a + chunk].float().unflatten(1, (H, G))  # [B, H, G, c, D]
        if hi <= lo:  # the chunk sees no key
            out[:, :, a : a + chunk] = 0
            continue
        p, ok = probabilities(qc, kf[:, :, lo:hi], q_pos[a : a + chunk], k_pos[lo:hi], scaling, window, softcap,
                              None if mask is None else mask[:, :, a : a + chunk, lo:hi])
        o = torch.einsum("bhgqk,bhkd->bhgqd", p, vf[:, :, lo:hi])
        out[:, :, a : a + chunk] = o.flatten(1, 2).to(out.dtype)
        live = ok.any(-1)  # [B, 1|H, 1|G, c] query attends to something
        live = live.expand(B, H, G, live.shape[-1])
        sums.mass[..., lo:hi] += p.sum((2, 3))
        sums.mass2[..., lo:hi] += p.square().sum((2, 3))
        sums.q2 += (qc.square() * live.unsqueeze(-1)).sum((2, 3))
        sums.nq += live[:, 0].sum((1, 2))
    return out, sums


def key_ranges(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, starts: range,
                chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) of the keys each query chunk may see, when the key positions ascend (else every key): keys up to
    the chunk's last query and, with a window, from its first query's window on. One host sync."""
    Tk = k_pos.shape[-1]
    if k_pos.dim() != 1 or q_pos.dim() != 1 or Tk < 2 or not bool((k_pos[1:] >= k_pos[:-1]).all()):
        return [(0, Tk)] * len(starts)
    first = torch.stack([q_pos[a : a + chunk].amin() for a in starts])
    last = torch.stack([q_pos[a : a + chunk].amax() for a in starts])
    lo = torch.searchsorted(k_pos, first - window + 1) if window is not None else torch.zeros_like(first)
    hi = torch.searchsorted(k_pos, last, right=True)
    return list(zip(lo.tolist(), hi.tolist()))
