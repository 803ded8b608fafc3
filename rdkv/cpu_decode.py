"""TriZone decode in plain torch, built for speed on a CPU; :mod:`rdkv.reference` stays the oracle.

Per packed segment the work is a handful of large vectorised ops, whatever the number of width classes:
each V class and K width is unpacked once into one buffer in storage order, from which one index gather per
zone reads dense per-stream rows; keys stay codes in each stream's packed channel order, the query is
permuted instead (q . k = q[perm] . k[perm]) and each token group's K scales are folded into it, its zero
points into one bias, so no dequantized key is formed; causality is never evaluated on a packed prefix,
whose positions all precede every query; the scores of every segment and of zone C go through one softmax.

:func:`read_segment` is the only function here that knows the packed layout.
Nothing is kept between steps: the cache's bytes are what ``nbytes`` counts (keeping the gather offsets saved
no measurable time through ``generate``, docs/benchmarks.md).

Steps run on one thread while other work holds the cores (:class:`Contention`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import quant, rope
from .dense import allowed_keys
from .reference import queries
from .trizone import V_CLASSES, TriZoneLayer


def _unpack_into(out: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """Unpack ``bits``-bit codes uint8 [R, C * bits / 8] into float32 ``out`` [R, C] (quant.pack's layout).

    On a CPU, torch's elementwise ops are fast on contiguous operands and slow when they broadcast over a
    short innermost dim (a byte's 2 or 4 codes, as quant.unpack does): each code position of the byte is
    shifted and masked over the whole byte tensor instead, and converted into its strided slot of ``out``.
    """
    if bits == 8:
        out.copy_(codes)
        return
    mask, per = (1 << bits) - 1, 8 // bits
    slots = out.view(*codes.shape, per)
    for i in range(per):
        plane = codes >> (bits * i) if i else codes
        slots[..., i].copy_(plane if i == per - 1 else plane & mask)


def read_segment(seg: TriZoneLayer, positions: bool = True) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Zones A+B of one packed segment as dense float32 tensors, one row per kept token of each stream.

    Returns (K [S, N, D], K scales and zeros [S, N / k_group, 2, D] or None, V [S, N, D], positions [S, N] or
    None, kept [S, N]), N a multiple of ``k_group`` >= every stream's count. With scales, K holds the codes
    (16-bit rows and width-0 channel means as they are, with scale 1 and zero 0) in the stream's packed channel
    order (``k_perm``), and a key is ``code * scale + zero`` with the scale and zero of its token group: the
    caller folds them into the query instead of forming the keys. Without (pre-RoPE keys), K is dequantized,
    in the model's channel order and rotated to its positions. Positions are read only when ``positions`` (or
    to rotate keys). Rows past a stream's count are not kept: their V is zero, their K finite, their position
    that of another kept token.

    Every class is unpacked into one buffer in storage order, ending in zero rows; one index gather per
    zone then reads the dense rows from it (a gather is several times faster than a scatter of the same
    rows on a CPU), so the op count does not grow with the number of classes. The gather indices are
    computed from the per-stream counts and per-block widths with a few broadcasts, never per token run.
    """
    t, D, spec = seg.t, seg.head_dim, seg.spec
    S, dev = seg.batch * seg.heads, seg.device
    kb, kg = spec.k_block, spec.k_group
    nb = D // kb
    counts = t["v_counts"].long()
    n = counts.sum(1)
    total = int(n.sum())
    ngm = -(-int(n.max()) // kg) if S else 0  # K scale groups of the longest stream
    N = ngm * kg  # rows per stream: whole K groups, so every group's rows are one slice
    i = torch.arange(N, device=dev)
    kept = i < n.unsqueeze(1)  # [S, N]
    rope_keys = "rope" in t
    pos = None
    if positions or rope_keys:  # stream s's tokens follow those of the streams before it in ``pos``
        first = (torch.cumsum(n, 0) - n).unsqueeze(1) + i
        pos = t["pos"].long().index_select(0, first.clamp_(max=max(total - 1, 0)).flatten()).view(S, N)

    # V: classes 2, 4, 8, 16 in turn, each stream-major; the i-th token of stream s is in the class c whose
    # bounds hold i, at row (the class's first row) + (its rows in earlier streams) + (i - the class's first
    # index in the stream)
    rows_per_class = counts.sum(0)
    flat = torch.empty(total + 1, D, device=dev)
    flat[total] = 0
    a = 0
    for w, rows in zip(V_CLASSES, rows_per_class.tolist()):
        if not rows:
            continue
        out = flat[a : a + rows]
        if w == 16:
            out.copy_(t["v16"])
        else:
            _unpack_into(out, t[f"v{w}.codes"], w)
            g = out.view(rows, -1, spec.v_group_of(w))
            g.mul_(t[f"v{w}.scale"].unsqueeze(-1)).add_(t[f"v{w}.zero"].unsqueeze(-1))
        a += rows
    bounds = torch.cumsum(counts, 1)
    base = (torch.cumsum(rows_per_class, 0) - rows_per_class) + (torch.cumsum(counts, 0) - counts) - (bounds - counts)
    cls = torch.searchsorted(bounds, i.expand(S, N).contiguous(), right=True).clamp_(max=len(V_CLASSES) - 1)
    V = flat.index_select(0, torch.where(kept, base.gather(1, cls) + i, total).flatten()).view(S, N, D)

    # K: the (block, stream) pairs of each width, block-major, each n[s] rows in the stream's token order
    # (one channel-mean row for width 0), then N zero rows; token i of stream s reads row base + step * i of
    # each block's pair (step 0: the mean), and its group's (scale, zero), or (1, 0) where a block stores values
    bits = t["k_bits"].long()  # [S, nb]
    pw = bits.T.flatten()  # width of pair b * S + s
    pair = torch.argsort(pw * (nb * S) + torch.arange(nb * S, device=dev))  # storage order -> pair b * S + s
    ps, pw = pair % S, pw[pair]  # stream and width of each pair in storage order
    per_width = torch.bincount(pw, minlength=17)[list(quant.WIDTHS)].tolist()
    rows = torch.where(pw == 0, 1, n[ps])  # stored rows per pair
    krows = int(rows.sum())
    flat = torch.empty(krows + N, kb, device=dev)
    flat[krows:] = 0  # rows past a stream's count read on into the next pair's rows or these zeros
    packed = (pw != 0) & (pw != 16)  # pairs whose codes carry a scale and zero per token group
    groups = (n[ps] + kg - 1) // kg * packed
    meta = torch.empty(1 + int(groups.sum()), 2, kb, device=dev)  # row 0: (1, 0) for blocks that store values
    meta[0, 0], meta[0, 1] = 1, 0
    a = p = m = 0
    for w, pairs in zip(quant.WIDTHS, per_width):
        r = int(rows[p : p + pairs].sum()) if pairs else 0
        out = flat[a : a + r]
        if w == 0:
            out.copy_(t["k0.mean"])
        elif w == 16:
            out.copy_(t["k16"])
        elif r:
            _unpack_into(out, t[f"k{w}.codes"], w)
            gw = len(t[f"k{w}.scale"])
            meta[1 + m : 1 + m + gw, 0] = t[f"k{w}.scale"]
            meta[1 + m : 1 + m + gw, 1] = t[f"k{w}.zero"]
            m += gw
        a, p = a + r, p + pairs
    table = torch.empty(3, nb * S, dtype=torch.long, device=dev)  # per pair b * S + s: row base, group base, groups
    table[:, pair] = torch.stack([torch.cumsum(rows, 0) - rows, 1 + torch.cumsum(groups, 0) - groups, groups])
    table = table.view(3, nb, S).transpose(1, 2).unsqueeze(2)  # [3, S, 1, nb]
    # row (s * N + i) * nb + b: block b of token i of stream s
    rows_of = torch.addcmul(table[0].int(), (bits != 0).int().unsqueeze(1), i.int().view(1, N, 1))  # int32: ~3x faster
    K = flat.index_select(0, rows_of.flatten())
    g = torch.arange(ngm, device=dev).view(1, ngm, 1)
    sz = meta.index_select(0, torch.where(g < table[2], table[1] + g, 0).flatten())  # per (stream, group, block)
    if not rope_keys:
        return K.view(S, N, D), sz.view(S, ngm, nb, 2, kb).transpose(2, 3).reshape(S, ngm, 2, D), V, pos, kept
    sz = sz.view(S, ngm, 1, nb, 2, kb)
    K = torch.addcmul(sz[..., 1, :], K.view(S, ngm, kg, nb, kb), sz[..., 0, :]).view(S, N, D)
    K = torch.empty_like(K).scatter_(2, t["k_perm"].long().unsqueeze(1).expand(S, N, D), K)
    return rope.rotate(K, pos, t["rope"]), None, V, pos, kept


@dataclass
class Contention:
    """Whether other work holds this machine's cores, from the CPU time the calling thread got during steps.

    A step is ~250 torch ops of a few to hundreds of microseconds. On an idle machine two threads run it ~1.4x
    faster than one, and the calling thread is on a core for the whole step. When another process keeps the
    cores busy, each op's parallel region waits for a descheduled thread: the calling thread then gets about
    half of the step's wall time, and one thread runs the step 1.5-3x faster (docs/benchmarks.md). ``share``
    is a running mean of that fraction over recent steps of every layer; below ``enter`` the path runs on one
    thread, until it climbs back above ``leave`` (one thread on a contended machine still loses its core now
    and then: ~0.6-0.8).
    """

    share: float = 1.0
    enter: float = 0.85
    leave: float = 0.95
    contended: bool = False

    def threads(self, most: int) -> int:
        return 1 if self.contended else most

    def record(self, cpu_seconds: float, wall_seconds: float) -> None:
        self.share += 0.2 * (min(cpu_seconds / max(wall_seconds, 1e-9), 1.0) - self.share)
        self.contended = self.share < (self.leave if self.contended else self.enter)


CONTENTION = Contention()  # one per process: contention is the machine's, not a layer's


def trizone_attention(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                      softcap: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract and result as :func:`rdkv.reference.trizone_attention` (to float32 rounding), on the threads
    :data:`CONTENTION` picks (torch's setting is restored on return; other Python threads running torch ops
    meanwhile see it too)."""
    most = torch.get_num_threads()
    threads = CONTENTION.threads(most)
    torch.set_num_threads(threads)
    try:
        wall, cpu = time.perf_counter(), time.thread_time()
        out = _attention(query, layer, scaling, sliding_window, softcap, mask)
        if most > 1:
            CONTENTION.record(time.thread_time() - cpu, time.perf_counter() - wall)
    finally:
        torch.set_num_threads(most)
    return out


def _attention(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None,
               softcap: float | None, mask: torch.Tensor | None) -> torch.Tensor:
    q, q_pos, window, m = queries(query, layer, sliding_window, mask)
    (S, GL, D), seq, dev = q.shape, layer.get_seq_length(), query.device

    scores, values = [], []
    for seg in layer.segments():
        K, ksz, V, pos, kept = read_segment(seg, positions=window is not None or m is not None)
        if not K.shape[1]:
            continue
        if ksz is None:
            s = torch.bmm(q, K.transpose(1, 2))
        else:  # per token group g: q . (code * scale_g + zero_g) = (q * scale_g) . code + q . zero_g
            qs = q.gather(2, seg.t["k_perm"].long().unsqueeze(1).expand(S, GL, D))
            G = ksz.shape[1]
            bias = torch.bmm(ksz[:, :, 1], qs.transpose(1, 2)).view(S * G, 1, GL).transpose(1, 2)
            qf = (qs.unsqueeze(1) * ksz[:, :, :1]).view(S * G, GL, D)
            s = torch.baddbmm(bias, qf, K.view(S * G, -1, D).transpose(1, 2))
            s = s.view(S, G, GL, -1).transpose(1, 2).reshape(S, GL, -1)
        ok = kept.unsqueeze(1)  # packed positions precede every query: only the window and the mask can hide them
        if window is not None:
            ok = ok & (q_pos[:, None] - pos.unsqueeze(1) < window)
        if m is not None:
            ok = ok & m.gather(2, pos.unsqueeze(1).expand(S, GL, -1))
        scores.append((s, ok))
        values.append(V)
    c_pos = torch.arange(layer.c_start, seq, device=dev)
    if len(c_pos):
        s = torch.bmm(q, layer.t["kc"].float().reshape(S, -1, D).transpose(1, 2))
        ok = allowed_keys(q_pos, c_pos, window).unsqueeze(0)
        if m is not None:
            ok = ok & m[:, :, layer.c_start : seq]
        scores.append((s, ok))
        values.append(layer.t["vc"].float().reshape(S, -1, D))
    if not scores:
        return query.new_zeros(query.shape)
    s = torch.cat([x for x, _ in scores], -1) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    ok = torch.cat([o.expand(S, GL, o.shape[-1]) for _, o in scores], -1)
    s = s.masked_fill_(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num_(0.0)  # a query that sees nothing: zero output
    out = torch.bmm(p[..., : values[0].shape[1]], values[0])
    a = values[0].shape[1]
    for v in values[1:]:
        out.baddbmm_(p[..., a : a + v.shape[1]], v)
        a += v.shape[1]
    return out.reshape(query.shape).to(query.dtype)
