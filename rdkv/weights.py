"""Weight estimators: how much each V token and each K channel matters to attention.

The forms read attention sums over a set of queries; none ever forms a T x T tensor. ``"all"`` is the paper's
form (every prefill query, streamed during prefill: :mod:`rdkv.attention`), ``"window"`` re-attends only the last
W queries, which does not favour early tokens just because more queries can see them (it does under-weight the
last W tokens, which only some window queries see: :func:`per_visible` corrects for that), ``"reconstruct"``
takes the queries of the context repeated after the prefill (:mod:`rdkv.reconstruct`): what a model needs to
reproduce its context, without the question.
"""
from __future__ import annotations

import torch

from .backend import backend, triton_kernel
from .dense import CHUNK_ELEMENTS, AttentionSums, allowed_keys, attend
from .records import LayerStats
from .errors import RDKVError

FORMS = ("all", "window", "reconstruct")


def layer_sums(stats: LayerStats, form: str, start: int | None = None, window: int | None = None) -> AttentionSums:
    """Sums over the chosen query set, with keys restricted to positions ``start`` (default: the
    first the layer's cache holds) and later; ``window`` takes only the last that many recorded queries."""
    start = stats.start if start is None else start
    if form == "all":
        s = stats.sums
        if s is None:
            raise RDKVError("weights='all' needs every prefill query: record with rdkv.record(model, all_queries=True)")
        return AttentionSums(s.mass[..., start:], s.mass2[..., start:], s.q2, s.nq)
    if form == "reconstruct":
        s = stats.recon
        if s is None:
            raise RDKVError("weights='reconstruct' needs the record's reconstruction pass (rdkv.reconstruct.reconstruct), "
                            "which rdkv.compress runs")
        return s.keys(slice(start - stats.start, None))
    if form == "window":
        q, q_pos = window_queries(stats, window)
        k_pos = torch.arange(stats.start, stats.seen, device=q.device)
        sums = _window_sums(stats, q, q_pos, k_pos)
        cut = start - stats.start
        sums.mass, sums.mass2 = sums.mass[..., cut:], sums.mass2[..., cut:]
        return sums
    raise RDKVError(f"unknown weight form {form!r}; choose one of {FORMS}")


def window_queries(stats: LayerStats, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``window`` recorded queries [B, Hq, W, D] (all of them for None) and their positions [W]."""
    q = stats.window_q if window is None else stats.window_q[:, :, -window:]
    return q, torch.arange(stats.seen - q.shape[2], stats.seen, device=q.device)


def per_visible(sums: AttentionSums, stats: LayerStats, start: int, window: int | None = None,
                power: float = 1.0, cap: float | None = None) -> AttentionSums:
    """Window sums rescaled to what a query that can see each token puts on it: multiplied by W / (the number
    of the W window queries that can see the token). A token among the prefill's last W is seen only by the
    window queries from it on, so its plain sum under-weights it, though every later query will see it. On
    Gemma 3 legal text at a 25% budget, one such token drew 60% of the continuation's squared attention on
    the prefix in a sliding layer, and had been given 2 bits (docs/experiments.md, 2026-11-30,
    "Why: causal visibility"). Tokens older than the window, which every window query sees, are
    unchanged. ``power`` < 1 corrects part of the way, (W / seen)^power: the queries that saw a recent token
    saw it close by, where attention is denser than at the distance later queries will see it from.
    ``cap`` bounds the factor W / (seeing queries) before the power, for the last few tokens, whose estimate
    rests on the fewest queries. Not the default: at a 5% budget the correction costs more than it saves on
    SmolLM2, with or without a cap of 4 or 8 (docs/experiments.md).
    """
    q, q_pos = window_queries(stats, window)
    k_pos = torch.arange(start, stats.seen, device=q.device)
    seen_by = allowed_keys(q_pos, k_pos, stats.sliding_window).sum(0).clamp_min(1)  # [T]
    scale = (q.shape[2] / seen_by).to(sums.mass.dtype)
    scale = (scale if cap is None else scale.clamp_max(cap)) ** power
    return AttentionSums(sums.mass * scale, sums.mass2 * scale, sums.q2, sums.nq)


def lifetime(pos: torch.Tensor, seen: int, sliding_window: int, horizon: int) -> torch.Tensor:
    """The share of the next ``horizon`` decode queries of a sliding-window layer that can still see each
    held token at ``pos`` [T] (the cache has seen ``seen`` tokens): query ``seen - 1 + m`` sees positions
    from ``seen + m - sliding_window`` on, so a token stays visible for ``pos + sliding_window - seen`` steps.
    Bits on a token about to leave the window buy little over a long decode; this prices that.
    """
    return ((pos + sliding_window - seen).clamp(0, horizon) / horizon).float()


def _window_sums(stats: LayerStats, q: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> AttentionSums:
    """Sums of the window queries over the layer's keys: the Triton token-weight kernel when
    ``rdkv.backend.backend`` picks triton (CUDA, or ``RDKV_BACKEND=triton``), else :func:`attend`."""
    valid = stats.valid[:, stats.start :]
    if backend(q.device) == "triton":
        return triton_kernel("token_weights")(q, stats.key, q_pos, k_pos, stats.scaling, stats.sliding_window, stats.softcap, valid)
    mask = valid[:, None, None, :].expand(-1, 1, q.shape[2], -1)
    # 64 queries at a time (fewer past 29k tokens): the window's temporaries stay those of a 64-query window,
    # so compress's extra memory stays within the fp16 cache's size (docs/benchmarks.md)
    elements = min(CHUNK_ELEMENTS, 64 * q.shape[0] * q.shape[1] * stats.key.shape[2])
    _, sums = attend(q, stats.key, stats.value, q_pos, k_pos, stats.scaling, stats.sliding_window, stats.softcap, mask,
                     elements)
    return sums


def token_weights(sums: AttentionSums) -> torch.Tensor:
    """w_t [B, H, T]: attention mass each token receives, summed over queries and grouped heads."""
    return sums.mass


def channel_weights(sums: AttentionSums, keys: torch.Tensor) -> torch.Tensor:
    """w_c [B, H, D] = ||Q[:, c]|| * ||K[:, c]|| / sqrt(d), the paper's key-channel weight."""
    return sums.q2.sqrt() * keys.float().square().sum(-2).sqrt() / keys.shape[-1] ** 0.5
