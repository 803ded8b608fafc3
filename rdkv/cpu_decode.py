"""TriZone decode built for speed on a CPU (C products over the pages); :mod:`rdkv.reference` stays the oracle.

A segment's pages (:mod:`rdkv.pages`) are read a page at a time in C (:mod:`rdkv.kernels.cpu_dequant`:
``rdkv_page_scores``, ``rdkv_page_attend``): each page's keys and values are dequantized into a buffer the L1
cache holds, beside the products, and never written out, so a segment costs two C calls and a few torch ops.
Where no C compiler is, the keys and values come from the page oracle :func:`rdkv.pages.dequantize` (correct, not
fast). Causality is never evaluated on a packed prefix, whose positions all precede every query; the scores of
every segment and of zone C go through one softmax.

:func:`key_scores` and :func:`add_values` are the only functions here that read a segment, through
:mod:`rdkv.pages` and its plan of offsets (built once per segment with the C functions' table, so a step
recomputes none of them). The threads a step runs on are the caller's (a model's pass through the cache takes
those other work leaves free, :mod:`rdkv.contention`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import layout, pages, quant, rope
from .dense import allowed_keys
from .kernels import cpu_dequant
from .reference import queries
from .trizone import TriZoneLayer


class Scores(NamedTuple):
    """The query's dot products with one segment's keys: N tokens per stream (its largest count) in storage
    order (by V class, then position)."""

    scores: torch.Tensor  # [S, GL, N] float32, unscaled; anything past a stream's count
    positions: torch.Tensor | None  # [S, N]
    kept: torch.Tensor  # [S, N] bool


def _page_segment(seg: TriZoneLayer) -> cpu_dequant.PageSegment:
    """What the C functions read of a segment (the table built once per segment)."""
    def build() -> cpu_dequant.PageSegment:
        D = seg.head_dim
        return cpu_dequant.PageSegment(pages.buffer(seg), cpu_dequant.page_table(pages.segment_plan(seg)),
                                       pages.k_means(seg), tuple(seg.spec.v_group_of(w) for w in quant.PACKED),
                                       pages.segment_page(seg), D, seg.dtype16 == torch.bfloat16,
                                       layout.pos_bytes(seg.prefix_len))
    return layout.derived(seg, "cpu pages", build)


def key_scores(seg: TriZoneLayer, q: torch.Tensor, positions: bool = True) -> Scores:
    """``q`` [S, GL, D] float32 dotted with the keys of one segment, tokens in storage order: in C
    (:func:`rdkv.kernels.cpu_dequant.page_scores`, the keys never written out; pre-RoPE keys written whole by
    ``page_keys`` and rotated in torch), else from the torch oracle :func:`rdkv.pages.dequantize`. Positions are
    read only when ``positions`` (or to rotate keys)."""
    (S, GL, D), dev = q.shape, seg.device
    n = pages.segment_plan(seg).counts.sum(1)
    N = int(n.max()) if S else 0
    kept = torch.arange(N, device=dev) < n.unsqueeze(1)
    table, perm = layout.rope_table(seg), layout.k_perm(seg).long()
    if dev.type == "cpu" and cpu_dequant.library():
        cs = _page_segment(seg)
        pos = torch.zeros(S, N, dtype=torch.long) if positions or table is not None else None
        if table is None:
            s = torch.zeros(S, GL, N)
            cpu_dequant.page_scores(s, cs, q.gather(2, perm.unsqueeze(1).expand(S, GL, D)).contiguous(), pos)
            return Scores(s, pos, kept)
        K = torch.empty(S, D, N)
        cpu_dequant.page_keys(K, pos, cs)
        K = rope.rotate(torch.empty_like(K).scatter_(1, perm.unsqueeze(2).expand(S, D, N), K).transpose(1, 2), pos,
                        table)
    else:
        K, _, pos, _ = pages.dequantize_segment(seg)  # pre-RoPE keys come back rotated
    return Scores(torch.bmm(q, K.transpose(1, 2)), pos, kept)


def add_values(out: torch.Tensor, p: torch.Tensor, seg: TriZoneLayer) -> None:
    """``out`` [S, GL, D] (channel 2j + i at column i * D/2 + j, the order the C products write) += ``p``
    [S, GL, N] times the values of one segment: in C (:func:`rdkv.kernels.cpu_dequant.page_attend`, the values
    never written out), else the oracle's values and one product."""
    if seg.device.type == "cpu" and cpu_dequant.library():
        cpu_dequant.page_attend(out, p, _page_segment(seg))
    else:
        S, GL, D = out.shape
        v = torch.bmm(p, pages.dequantize_segment(seg)[1])
        out.view(S, GL, 2, D // 2).add_(v.view(S, GL, D // 2, 2).transpose(2, 3))


def trizone_attention(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                      softcap: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract and result as :func:`rdkv.reference.trizone_attention` (to float32 rounding)."""
    q, q_pos, window, m = queries(query, layer, sliding_window, mask)
    (S, GL, D), seq, dev = q.shape, layer.get_seq_length(), query.device

    scores, packed = [], []  # [S, GL, N] and ok [., GL, N] per part; the segments with tokens
    for seg in layer.segments():
        k = key_scores(seg, q, positions=window is not None or m is not None)
        if not k.kept.shape[1]:
            continue
        ok = k.kept.unsqueeze(1)  # packed positions precede every query: only the window and the mask can hide them
        if window is not None:
            ok = ok & (q_pos[:, None] - k.positions.unsqueeze(1) < window)
        if m is not None:
            ok = ok & m.gather(2, k.positions.unsqueeze(1).expand(S, GL, -1))
        scores.append((k.scores, ok))
        packed.append(seg)
    c_pos = torch.arange(layer.c_start, seq, device=dev)
    kc, vc = layout.zone_c(layer)
    if len(c_pos):
        s = torch.bmm(q, kc.float().reshape(S, -1, D).transpose(1, 2))
        ok = allowed_keys(q_pos, c_pos, window).unsqueeze(0)
        if m is not None:
            ok = ok & m[:, :, layer.c_start : seq]
        scores.append((s, ok))
    if not scores:
        return query.new_zeros(query.shape)
    s = torch.cat([x for x, _ in scores], -1) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    ok = torch.cat([o.expand(S, GL, o.shape[-1]) for _, o in scores], -1)
    s = s.masked_fill_(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num_(0.0)  # a query that sees nothing: zero output
    out, a = torch.zeros(S, GL, 2, D // 2, device=dev), 0  # the C products' channel order (add_values)
    for seg, (x, _) in zip(packed, scores):
        N = x.shape[-1]
        add_values(out.view(S, GL, D), p[..., a : a + N], seg)
        a += N
    out = out.transpose(2, 3).reshape(S, GL, D)
    if len(c_pos):
        out.baddbmm_(p[..., a:], vc.float().reshape(S, -1, D))
    return out.reshape(query.shape).to(query.dtype)
