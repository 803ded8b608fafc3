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
    peak: torch.Tensor | None = None  # [B, H, T] the largest probability any one query (and grouped head) put on each key
    # [B, H, T] sum_q p_qt^2 ||v_t - o_q||^2 / mass2: each key's squared distance to the outputs of the queries that
    # read it, what a key error costs them (rdkv.distortion); NaN where no query reads the key, None = not measured
    drift: torch.Tensor | None = None

    def keys(self, cut: slice) -> AttentionSums:
        """The same sums over the keys ``cut`` selects."""
        peak, drift = (None if x is None else x[..., cut] for x in (self.peak, self.drift))
        return AttentionSums(self.mass[..., cut], self.mass2[..., cut], self.q2, self.nq, peak, drift)


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
    drift: bool = False,
) -> tuple[torch.Tensor, AttentionSums]:
    """Exact attention of q [B, Hq, q, D] over k, v [B, H, Tk, D] plus the weight statistics.

    Runs in query chunks so the score tensor never exceeds ``elements``. ``mask`` is an optional
    bool [B, 1, q, Tk] (True = may attend) combined with causality from the positions. Queries that may
    attend to nothing (left padding) get a zero output and contribute nothing to the sums. When the key positions
    are one ascending run (every caller's), a chunk reads only the keys causality and the window let it see: a
    causal pass costs half the scores of a full one, and a sliding-window layer's cost grows with the window,
    not with the context. ``drift`` also sums each key's distance to the outputs that read it
    (:attr:`AttentionSums.drift`), at the cost of one more product of the chunk's size.
    """
    B, Hq, L, D = q.shape
    H, Tk = k.shape[1], k.shape[2]
    G = Hq // H
    kf, vf = k.float(), v.float()
    out = q.new_empty(B, Hq, L, D)
    sums = AttentionSums(
        mass=kf.new_zeros(B, H, Tk), mass2=kf.new_zeros(B, H, Tk), q2=kf.new_zeros(B, H, D), nq=kf.new_zeros(B),
        peak=kf.new_zeros(B, H, Tk))
    readers = kf.new_zeros(B, H, D + 1, Tk) if drift else None
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
        torch.maximum(sums.peak[..., lo:hi], p.amax((2, 3)), out=sums.peak[..., lo:hi])
        sums.q2 += (qc.square() * live.unsqueeze(-1)).sum((2, 3))
        sums.nq += live[:, 0].sum((1, 2))
        if readers is not None:
            readers[..., lo:hi] += reader_sums(p.square(), o)
    if readers is not None:
        sums.drift = reader_drift(vf, sums.mass2, readers)
    return out, sums


def reader_sums(p2: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """[B, H, D + 1, t]: sum_q p_qt^2 o_q and sum_q p_qt^2 ||o_q||^2 for squared probabilities p2 [B, H, G, c, t]
    and outputs o [B, H, G, c, D] (float32), one product: with :func:`reader_drift` they give each key's distance
    to its readers' outputs, sum_q p_qt^2 ||v_t - o_q||^2, without forming a distance per (query, key)."""
    o = o.flatten(2, 3)
    return torch.cat([o, o.square().sum(-1, keepdim=True)], -1).transpose(-1, -2) @ p2.flatten(2, 3)


def reader_drift(v: torch.Tensor, mass2: torch.Tensor, readers: torch.Tensor) -> torch.Tensor:
    """:attr:`AttentionSums.drift` of values v [B, H, T, D] from the keys' ``mass2`` and their :func:`reader_sums`
    summed over every query: (||v_t||^2 mass2_t - 2 v_t . sum_q p^2 o_q + sum_q p^2 ||o_q||^2) / mass2_t, NaN for
    keys no query reads (squared weights that underflow to zero)."""
    drift2 = v.square().sum(-1) * mass2 - 2 * (v.transpose(-1, -2) * readers[..., :-1, :]).sum(-2) + readers[..., -1, :]
    return torch.where(mass2 > 0, drift2.clamp_min(0.0) / mass2, float("nan"))


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
