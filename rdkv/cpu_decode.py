"""TriZone decode built for speed on a CPU (numpy bookkeeping, torch, C products); :mod:`rdkv.reference` stays the oracle.

On a small model a decode step is a few hundred torch ops per layer on kilobytes to megabytes, and on a CPU
each op costs microseconds before it touches any data: at 4k tokens the ops' fixed cost is as large as the
work on the data. So the layout's bookkeeping (which stored rows hold each stream's tokens and channel
blocks) is read from the segment's plan in numpy, and the data take a fixed handful of torch ops
per stored tensor, whatever the number of streams, tokens or channel blocks:

* keys are dequantized per (channel block, stream) pair, in storage order: each pair's rows are one window
  of the stored rows, copied whole, turned channel-major and unpacked in place, never moved row by row; the
  query is permuted instead (q . k = q[perm] . k[perm]) and cut into the same blocks;
* values: every class is unpacked into one buffer in storage order, each row's channels split into two
  contiguous halves (undone on the product), then one gather puts the rows in each stream's token order;
* causality is never evaluated on a packed prefix, whose positions all precede every query; the scores of
  every segment and of zone C go through one softmax.

A segment in pages (:mod:`rdkv.pages`) is read a page at a time in C (``rdkv_page_scores``, ``rdkv_page_attend``:
each page's keys and values dequantized into a buffer the L1 cache holds, beside the products), its tokens in
storage order; where no compiler is, from the page oracle :func:`rdkv.pages.dequantize` (correct, not fast).

Where a C compiler is found, the two products over a packed segment run in C instead
(:mod:`rdkv.kernels.cpu_dequant`): the keys and values are dequantized a tile at a time beside the products and
never written out, so a segment costs the numpy bookkeeping, a few torch ops and two C calls. The torch ops
above are the path where no compiler is, and the two are tested equal.

The megabytes a layer dequantizes go into scratch buffers that the layers of one forward pass share
(:func:`scratch`; a layer's values overwrite its keys) instead of allocating them anew in every layer.
:func:`free_scratch` drops them after the last layer, so nothing is kept between steps: the cache's bytes
are what ``nbytes`` counts. :func:`key_scores`, :func:`read_values` and :func:`add_values` (and the C functions
they call) are the only functions here that read a packed segment, through :mod:`rdkv.layout`'s accessors and its
plan of offsets (built once per segment, so a step recomputes none of them). The threads a step runs on are the
caller's (a model's pass through the cache takes those other work leaves free, :mod:`rdkv.contention`).
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple

import numpy as np
import torch

from . import layout, pages, quant, rope
from .dense import allowed_keys
from .kernels import cpu_dequant
from .reference import queries
from .layout import V_CLASSES
from .trizone import TriZoneLayer


def _unpack_channels(out: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """Unpack ``bits``-bit codes uint8 [P, C, N] (a byte per C, quant.pack's layout: code i of byte j is channel
    j * 8 / bits + i) into float32 ``out`` [P, C * 8 / bits, N]: each code position of the byte is shifted and
    masked over the whole byte tensor and converted into its rows of ``out``, N contiguous floats each."""
    if bits == 8:
        out.copy_(codes)
        return
    mask, per = (1 << bits) - 1, 8 // bits
    slots = out.view(codes.shape[0], codes.shape[1], per, -1)
    for i in range(per):
        plane = codes >> (bits * i) if i else codes
        slots[:, :, i].copy_(plane if i == per - 1 else plane & mask)


_SCRATCH = threading.local()  # per thread: two threads may decode two caches at once


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for the role ``name``, carved from a buffer kept until :func:`free_scratch`.

    A buffer grows to a quarter more than asked, so the next layer's slightly larger request fits; what it
    held before is overwritten, so a role's tensor is dead once the same role is asked for again.
    """
    n = math.prod(shape)
    buffers = _SCRATCH.__dict__
    b = buffers.get(name)
    if b is None or b.numel() < n or b.dtype != dtype or b.device != device or \
            b.is_inference() != torch.is_inference_mode_enabled():  # in place on inference tensors: inside only
        b = buffers[name] = torch.empty(n + n // 4, dtype=dtype, device=device)
    return b[:n].view(shape)


def free_scratch() -> None:
    """Drop this thread's scratch buffers (after the last layer of a forward pass)."""
    _SCRATCH.__dict__.clear()


def scratch_bytes() -> int:
    """Bytes this thread's scratch buffers hold now."""
    return sum(b.numel() * b.element_size() for b in _SCRATCH.__dict__.values())


def _index(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64).ravel()).to(device)


def _windows(x: torch.Tensor, first: np.ndarray, length: int) -> torch.Tensor:
    """``x[f : f + length]`` for each f in ``first``, stacked [len(first), C, length] (channel-major) from
    ``x`` [R, C]; rows past the end of ``x`` read as zeros. One copy of whole windows out of an overlapping,
    transposed strided view, on the stored dtype (a byte per code for the packed widths)."""
    (R, C), dev = x.shape, x.device
    padded = scratch(f"rows {x.dtype}", (R + length, C), x.dtype, dev)
    padded[:R] = x
    padded[R:] = 0
    view = padded.as_strided((R + 1, C, length), (C, 1, C))
    return torch.index_select(view, 0, _index(first, dev), out=scratch(f"windows {x.dtype}", (len(first), C, length),
                                                                         x.dtype, dev))


class Scores(NamedTuple):
    """The query's dot products with one packed segment's keys: N tokens per stream (a multiple of ``k_group``,
    >= every stream's count) in its stored order."""

    scores: torch.Tensor  # [S, GL, N] float32, unscaled; anything past a stream's count
    positions: torch.Tensor | None  # [S, N]: another kept token's past a stream's count
    kept: torch.Tensor  # [S, N] bool


def _read_keys(K: torch.Tensor, seg: TriZoneLayer, width: np.ndarray, n: np.ndarray, row0: np.ndarray,
               group0: np.ndarray, k_group: int) -> None:
    """The keys of every (channel block, stream) pair into ``K`` [pairs, k_block, N] in torch: pair p (width
    width[p], storage order) takes the N rows and N / k_group groups from its first on (row0[p], group0[p] among its
    width's), reading past its own n[p] into the next pair's or zeros (tokens that are not kept)."""
    _, kb, N = K.shape
    groups_max, dev, a = N // k_group, K.device, 0
    for w in quant.WIDTHS:
        pairs = int((width == w).sum())
        if not pairs:
            continue
        out, at = K[a : a + pairs], slice(a, a + pairs)
        stored = layout.k_rows(seg, w)
        if w == 0:
            out.copy_(stored.values.unsqueeze(2).expand(pairs, kb, N))
        elif w == 16:
            out.copy_(_windows(stored.values, row0[at], N))
        else:
            _unpack_channels(out, _windows(stored.values, row0[at], N), w)
            if len(stored.scale):  # else every pair of this width belongs to an empty stream
                g = _index(np.minimum(group0[at][:, None] + np.arange(groups_max), len(stored.scale) - 1), dev)
                out = out.view(pairs, kb, groups_max, k_group)
                out.mul_(stored.scale.index_select(0, g).view(pairs, groups_max, kb).transpose(1, 2).unsqueeze(3))
                out.add_(stored.zero.index_select(0, g).view(pairs, groups_max, kb).transpose(1, 2).unsqueeze(3))
        a += pairs


def key_scores(seg: TriZoneLayer, q: torch.Tensor, positions: bool = True) -> Scores:
    """``q`` [S, GL, D] float32 dotted with the keys of one packed segment, per (channel block, stream) pair.

    The pairs of each width are stored block-major, each with n[s] rows in its stream's token order (one
    channel-mean row for width 0) and its scale groups likewise. The query is permuted into each stream's packed
    channel order (q . k = q[perm] . k[perm]) and cut into the same blocks; each pair's block of the query meets
    its keys, and the products of a stream's pairs add up. With the C functions
    (:func:`rdkv.kernels.cpu_dequant.scores`) the keys are dequantized a tile at a time beside the product and
    never written out; in torch (:func:`_read_keys`) they are dequantized channel-major (each pair [k_block, N]: the
    product's operand as the BLAS wants it, 2.3-2.8x faster than [N, k_block] on a 2-core EPYC, docs/benchmarks.md). Pre-RoPE keys are dequantized whole, put in the model's channel order and rotated to
    their positions. Positions are read only when ``positions`` (or to rotate keys).
    """
    if pages.paged(seg):
        return _page_key_scores(seg, q, positions)
    D, spec, plan = seg.head_dim, seg.spec, layout.plan(seg).host
    (S, GL, _), dev = q.shape, seg.device
    kb, kg = spec.k_block, spec.k_group
    nb = D // kb
    n = plan.n  # tokens per stream
    groups_max = -(-int(n.max()) // kg) if S else 0
    N = groups_max * kg  # whole K groups, so every group's rows are one slice
    i = np.arange(N)
    kept = torch.from_numpy(i < n[:, None]).to(dev)
    table = layout.rope_table(seg)
    pos = None
    if positions or table is not None:
        first = np.minimum(plan.tok0[:, None] + i, max(int(n.sum()) - 1, 0))
        pos = layout.positions(seg).index_select(0, _index(first, dev)).long().view(S, N)
    ps, pw = plan.pair_stream, plan.pair_width  # storage order
    block = ps * nb + plan.pair_block  # row of the query's [S * nb, ., kb] block view each pair meets
    perm = layout.k_perm(seg)
    if table is None:  # the query in each stream's packed channel order, in blocks
        qv = q.gather(2, perm.long().unsqueeze(1).expand(S, GL, D)).view(S, GL, nb, kb)
        qv = qv.transpose(1, 2).reshape(S * nb, GL, kb)
    native = dev.type == "cpu" and cpu_dequant.library()
    if native:
        pairs = dict(stored={w: layout.k_rows(seg, w) for w in set(pw.tolist())}, k_group=kg, width=pw,
                     row0=plan.pair_row0, n=n[ps], group0=plan.pair_group0)
    if native and table is None:
        s = torch.zeros(S, GL, N, device=dev)
        cpu_dequant.scores(s, **pairs, stream=ps, query=qv.index_select(0, _index(block, dev)))
        return Scores(s, pos, kept)
    K = scratch("dequantized", (nb * S, kb, N), torch.float32, dev)  # pair p's channel block, tokens 0..N-1 of its stream
    if native:
        cpu_dequant.keys(K, **pairs)
    else:
        _read_keys(K, seg, pw, n[ps], plan.pair_row0, plan.pair_group0, kg)
    block = _index(block, dev)
    if table is None:
        part = torch.bmm(qv.index_select(0, block), K)
        return Scores(part.new_zeros(S, GL, N).index_add_(0, _index(ps, dev), part), pos, kept)
    dense = torch.empty(S * nb, kb, N, device=dev).index_copy_(0, block, K).view(S, D, N)  # packed channel order
    dense = torch.empty_like(dense).scatter_(1, perm.long().unsqueeze(2).expand(S, D, N), dense)
    return Scores(torch.bmm(q, rope.rotate(dense.transpose(1, 2), pos, table).transpose(1, 2)), pos, kept)


def _page_segment(seg: TriZoneLayer) -> cpu_dequant.PageSegment:
    """What the C functions read of a paged segment (the table built once per segment)."""
    def build() -> cpu_dequant.PageSegment:
        D = seg.head_dim
        return cpu_dequant.PageSegment(pages.buffer(seg), cpu_dequant.page_table(pages.segment_plan(seg)),
                                       pages.k_means(seg), tuple(seg.spec.v_group_of(w) for w in quant.PACKED),
                                       pages.segment_page(seg), D, seg.dtype16 == torch.bfloat16,
                                       layout.pos_bytes(seg.prefix_len))
    return layout.derived(seg, "cpu pages", build)


def _page_key_scores(seg: TriZoneLayer, q: torch.Tensor, positions: bool) -> Scores:
    """:func:`key_scores` of a paged segment, tokens in storage order: in C (:func:`rdkv.kernels.cpu_dequant.page_scores`,
    the keys never written out; pre-RoPE keys written whole by ``page_keys`` and rotated in torch), else from the
    torch oracle :func:`rdkv.pages.dequantize` (the path where no compiler is: correct, not fast)."""
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


def _unpack_halves(out: torch.Tensor, stored: torch.Tensor, bits: int) -> None:
    """Rows of ``stored`` (codes of ``bits`` bits, or 16-bit values) into float32 ``out`` [rows, D] with channel
    2j + i at i * D/2 + j: at 4 bits the two codes of a byte land in two contiguous halves of the row, where
    the model's channel order would interleave them (1.2-1.9x slower to write on a 2-core EPYC,
    docs/benchmarks.md)."""
    rows, D = out.shape
    halves = out.view(rows, 2, D // 2)
    if bits >= 8:
        halves.copy_(stored.view(rows, D // 2, 2).transpose(1, 2))
        return
    per = 8 // bits  # code k of byte b is channel per * b + k
    slots = halves.view(rows, 2, stored.shape[1], per // 2)
    for k in range(per):
        plane = stored >> (bits * k) if k else stored
        slots[:, k % 2, :, k // 2].copy_(plane if k == per - 1 else plane & (1 << bits) - 1)


def read_values(seg: TriZoneLayer, N: int) -> torch.Tensor:
    """The values of one packed segment [S, N, D] float32 in each stream's token order, zero past its count, with
    channel 2j + i at i * D/2 + j (:func:`_unpack_halves`; undo it on the product, not on the values).

    Classes 2, 4, 8, 16 are stored in turn, each stream-major, and a stream's tokens are ordered by class: the
    tokens of class c of stream s are one run of stored rows. Every class is unpacked into one buffer in storage
    order, ending in a zero row, and one gather reads the rows of every stream's tokens from it.
    """
    D, spec, plan = seg.head_dim, seg.spec, layout.plan(seg).host
    S, dev, counts = seg.batch * seg.heads, seg.device, plan.counts
    n, per_class = plan.n, counts.sum(0)
    total = int(n.sum())
    flat = scratch("stored values", (total + 1, D), torch.float32, dev)
    flat[total] = 0
    a = 0
    for w, rows in zip(V_CLASSES, per_class.tolist()):
        if not rows:
            continue
        out = flat[a : a + rows]
        stored = layout.v_rows(seg, w)
        _unpack_halves(out, stored.values, w)
        if w != 16:  # channel 2j + i is in group (2j + i) // g = j // (g / 2), in both halves
            g = spec.v_group_of(w)
            groups = out.view(rows, 2, D // g, g // 2)
            groups.mul_(stored.scale.view(rows, 1, D // g, 1)).add_(stored.zero.view(rows, 1, D // g, 1))
        a += rows
    # token j of class c of stream s: stored row (rows of earlier classes) + (class c rows of earlier streams) + j
    run = (np.cumsum(per_class) - per_class) + plan.class_row0  # [S, 4]: first row
    within = np.arange(total) - np.repeat(np.cumsum(counts.ravel()) - counts.ravel(), counts.ravel())
    index = np.full((S, N), total)
    index[np.arange(N) < n[:, None]] = np.repeat(run.ravel(), counts.ravel()) + within
    out = scratch("dequantized", (S * N, D), torch.float32, dev)
    return torch.index_select(flat, 0, _index(index, dev), out=out).view(S, N, D)


def add_values(out: torch.Tensor, p: torch.Tensor, seg: TriZoneLayer) -> None:
    """``out`` [S, GL, D] (channel 2j + i at column i * D/2 + j) += ``p`` [S, GL, N] times the values of one packed
    segment: in C (:func:`rdkv.kernels.cpu_dequant.attend`, the values never written out), else
    :func:`read_values` and one product."""
    if pages.paged(seg):
        if seg.device.type == "cpu" and cpu_dequant.library():
            cpu_dequant.page_attend(out, p, _page_segment(seg))
        else:  # the oracle's values, channels into the halves order
            S, GL, D = out.shape
            v = torch.bmm(p, pages.dequantize_segment(seg)[1])
            out.view(S, GL, 2, D // 2).add_(v.view(S, GL, D // 2, 2).transpose(2, 3))
        return
    if seg.device.type == "cpu" and cpu_dequant.library():
        cpu_dequant.attend(out, p, {w: layout.v_rows(seg, w) for w in V_CLASSES},
                           {w: seg.spec.v_group_of(w) for w in quant.PACKED}, layout.plan(seg).host.counts)
    else:
        out.baddbmm_(p, read_values(seg, p.shape[-1]))


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
    out, a = torch.zeros(S, GL, 2, D // 2, device=dev), 0  # packed values' channel order (add_values)
    for seg, (x, _) in zip(packed, scores):
        N = x.shape[-1]
        add_values(out.view(S, GL, D), p[..., a : a + N], seg)
        a += N
    out = out.transpose(2, 3).reshape(S, GL, D)
    if len(c_pos):
        out.baddbmm_(p[..., a:], vc.float().reshape(S, -1, D))
    return out.reshape(query.shape).to(query.dtype)
