"""TriZone decode in plain torch, built for speed on a CPU; :mod:`rdkv.reference` stays the oracle.

Per packed segment the work is a handful of large vectorised ops, whatever the number of width classes:
each V class and K width is unpacked once into one buffer in storage order, which one index copy per zone
scatters to dense per-stream rows; keys stay codes in each stream's packed channel order, the query is
permuted instead (q . k = q[perm] . k[perm]) and each token group's K scales are folded into it, its zero
points into one bias, so no dequantized key is formed; causality is never evaluated on a packed prefix,
whose positions all precede every query; the scores of every segment and of zone C go through one softmax.

:func:`read_segment` is the only function here that knows the packed layout.
Nothing is kept between steps: the cache's bytes are what ``nbytes`` counts.
"""
from __future__ import annotations

import torch

from . import quant, rope
from .dense import allowed_keys
from .reference import queries
from .trizone import V_CLASSES, TriZoneLayer


def _unpack_into(out: torch.Tensor, codes: torch.Tensor, bits: int) -> None:
    """Unpack ``bits``-bit codes uint8 [R, C * bits / 8] into float32 ``out`` [R, C] (quant.pack's layout).

    On a CPU, torch's elementwise ops are fast on contiguous operands and slow when they broadcast over a
    short innermost dim (a byte's 2 or 4 codes, as quant.unpack does). Two-bit rows of whole int32 words
    shift 16 codes per word; otherwise each code position of the byte is shifted over the whole tensor and
    written into its strided slot.
    """
    if bits == 8:
        out.copy_(codes)
        return
    mask = (1 << bits) - 1
    if bits == 2 and codes.shape[-1] % 4 == 0 and codes.is_contiguous() and codes.storage_offset() % 4 == 0:
        shifts = torch.arange(0, 32, 2, dtype=torch.int32, device=codes.device)  # little-endian: lowest code first
        out.copy_(((codes.view(torch.int32).unsqueeze(-1) >> shifts) & mask).flatten(-2))
        return
    per = 8 // bits
    slots = out.view(*codes.shape, per)
    for i in range(per):
        plane = codes >> (bits * i)
        slots[..., i].copy_(plane if i == per - 1 else plane & mask)


def _runs(lengths: torch.Tensor, base: torch.Tensor, step: int = 1) -> torch.Tensor:
    """Concatenated index runs: run j is ``base[j] + step * (0 .. lengths[j] - 1)``."""
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    return step * torch.arange(total, device=lengths.device) + torch.repeat_interleave(
        base - step * starts, lengths, output_size=total)


def read_segment(seg: TriZoneLayer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    """Zones A+B of one packed segment as dense float32 tensors, one row per kept token of each stream.

    Returns (K [S, N, D], K scales and zeros [S, N / k_group, 2, D] or None, V [S, N, D], positions [S, N],
    kept [S, N]), N a multiple of ``k_group`` >= every stream's count. With scales, K holds the codes (16-bit
    rows and width-0 channel means as they are, with scale 1 and zero 0) in the stream's packed channel order
    (``k_perm``), and a key is ``code * scale + zero`` with the scale and zero of its token group: the caller
    folds them into the query instead of forming the keys. Without (pre-RoPE keys), K is dequantized,
    in the model's channel order and rotated to its positions. Rows past a stream's count are not kept:
    their V is zero, their K and position undefined.

    Every class is unpacked into its slice of one buffer in storage order, which a single index copy
    then scatters to the dense rows, so the op count does not grow with the number of classes.
    """
    t, D, spec = seg.t, seg.head_dim, seg.spec
    S, dev = seg.batch * seg.heads, seg.device
    kb, kg = spec.k_block, spec.k_group
    nb = D // kb
    counts = t["v_counts"].long()
    n = counts.sum(1)
    ngm = -(-int(n.max()) // kg) if S else 0  # K scale groups of the longest stream
    N = ngm * kg  # rows per stream: whole K groups, so every group's rows are one slice
    row0 = torch.arange(S, device=dev) * N  # first dense row of each stream
    kept = torch.arange(N, device=dev) < n.unsqueeze(1)
    pos = torch.zeros(S * N, dtype=torch.long, device=dev)
    pos[_runs(n, row0)] = t["pos"].long()

    # V: class rows are stream-major within a class; the dense row of a class's j-th row in stream s is
    # s * N + (the class's first index in the stream) + j
    first = torch.cumsum(counts, 1) - counts
    flat = torch.empty(int(n.sum()), D, device=dev)
    a = 0
    for w, rows in zip(V_CLASSES, counts.sum(0).tolist()):
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
    V = torch.zeros(S * N, D, device=dev)
    V.index_copy_(0, _runs(counts.T.flatten(), (row0.unsqueeze(0) + first.T).flatten()), flat)

    # K: the (block, stream) pairs of each width, block-major, each n[s] rows in the stream's token order;
    # codes (or 16-bit rows, or channel means) first, then one multiply-add with every block's scale and zero
    # laid out per (stream, token group, block): 1 and 0 where a block stores values
    bits = t["k_bits"].long()  # [S, nb]
    order = torch.searchsorted(torch.tensor(quant.WIDTHS, device=dev), bits.T.flatten())  # width index per pair
    pair = torch.argsort(order * (nb * S) + torch.arange(nb * S, device=dev), stable=True)
    blk, s = pair // S, pair % S
    per_width = torch.bincount(order, minlength=len(quant.WIDTHS)).tolist()
    flat = torch.empty(int(n[s].sum()), kb, device=dev)
    a = p = 0
    for w, pairs in zip(quant.WIDTHS, per_width):
        rows = int(n[s[p : p + pairs]].sum()) if pairs else 0
        out = flat[a : a + rows]
        if w == 0:
            out.copy_(torch.repeat_interleave(t["k0.mean"], n[s[p : p + pairs]], dim=0, output_size=rows))
        elif w == 16:
            out.copy_(t["k16"])
        elif rows:
            _unpack_into(out, t[f"k{w}.codes"], w)
        a, p = a + rows, p + pairs
    K = torch.empty(S * N * nb, kb, device=dev)  # row (s * N + i) * nb + b: block b of token i of stream s
    K.index_copy_(0, _runs(n[s], row0[s] * nb + blk, step=nb), flat)
    width = bits.T.flatten()[pair]
    packed = (width != 0) & (width != 16)  # pairs whose codes carry a scale and zero per token group
    sz = torch.ones(S * ngm * nb, 2, kb, device=dev)  # (scale, zero) per (stream, token group, block)
    sz[:, 1] = 0
    if bool(packed.any()):
        meta = torch.cat([torch.stack([t[f"k{w}.scale"], t[f"k{w}.zero"]], 1) for w in quant.PACKED
                          if per_width[quant.WIDTHS.index(w)]]).float()
        ps, pb = s[packed], blk[packed]
        sz.index_copy_(0, _runs(-(-n[ps] // kg), ps * ngm * nb + pb, step=nb), meta)  # groups restart per pair
    V, pos = V.view(S, N, D), pos.view(S, N)
    if "rope" not in t:
        return K.view(S, N, D), sz.view(S, ngm, nb, 2, kb).transpose(2, 3).reshape(S, ngm, 2, D), V, pos, kept
    sz = sz.view(S, ngm, 1, nb, 2, kb)
    K = torch.addcmul(sz[..., 1, :], K.view(S, ngm, kg, nb, kb), sz[..., 0, :]).view(S, N, D)
    K = torch.empty_like(K).scatter_(2, t["k_perm"].long().unsqueeze(1).expand(S, N, D), K)
    return rope.rotate(K, pos, t["rope"]), None, V, pos, kept


def trizone_attention(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                      softcap: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract and result as :func:`rdkv.reference.trizone_attention` (to float32 rounding)."""
    q, q_pos, window, m = queries(query, layer, sliding_window, mask)
    (S, GL, D), seq, dev = q.shape, layer.get_seq_length(), query.device

    scores, values = [], []
    for seg in layer.segments():
        K, ksz, V, pos, kept = read_segment(seg)
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
