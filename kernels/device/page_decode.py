"""Device code of the TriZone decode over the page layout (:mod:`rdkv.pages`); the launcher is
:mod:`rdkv.kernels.page_decode`.

A zone A+B program walks a run of one stream's pages, class by class (V widths 2, 4, 8, 16: four compile-time
copies of the page loop). Every address of a page follows from its base and the stream's section offsets, loaded
once per program, so a page's loads (the K code rows of each width, the K scales and zeros, the 16-bit K rows, the
V codes and their scales, the positions) have no dependence on one another. K is quantized per channel per page,
so its scales fold into q: ``q . (code * s + z) = (q * s) . code + q . z``, one [BLOCK_M, C] product and one dot
per width per page, the codes converted to fp16 by their exact image ``(0x6400 | code) - 1024``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .trizone_decode import _add, _dequant, _online_step, _rope_dot, _store_partial, _visible, _zone_c

# fields of a stream's row in the int32 table the launcher builds (rdkv.kernels.page_decode.stream_table)
F_CHANS = tl.constexpr(0)  # channels of K width 2, 4, 8, 16 (4 fields)
F_CH0 = tl.constexpr(4)  # first permuted channel of K width 2, 4, 8, 16 (4)
F_KOFF = tl.constexpr(8)  # byte offset inside a page of the K sections 2, 4, 8, 16 (4)
F_KMETA = tl.constexpr(12)  # byte offset of the K scales (the zeros follow, 2 bytes per packed channel later)
F_VOFF = tl.constexpr(13)  # byte offset of the V section
F_C0 = tl.constexpr(14)  # channels of K width 0 (their means are outside the pages)
F_MEAN0 = tl.constexpr(15)  # the stream's first channel mean
F_PAGE0 = tl.constexpr(16)  # class boundaries along the stream's pages (5)
F_COUNT = tl.constexpr(21)  # tokens of each class (4)
F_PSIZE = tl.constexpr(25)  # bytes of a page of each class (4)
FIELDS = tl.constexpr(32)


@triton.jit
def _q_cols(qp_rows, row_ok, c0, n, CW: tl.constexpr):
    """q rows [BLOCK_M, CW] at the ``n`` permuted channels from ``c0`` (zero past ``n``)."""
    j = tl.arange(0, CW)
    return tl.load(qp_rows[:, None] + (c0 + j)[None, :], mask=row_ok[:, None] & (j < n)[None, :], other=0.0)


@triton.jit
def _k_codes(pg8, base, off, n, W: tl.constexpr, CW: tl.constexpr, P: tl.constexpr):
    """The codes [CW, P] of a page's ``n`` channels of width ``W`` (zero past ``n``).

    Byte row r of the section holds channels r * 8/W + k (bits k * W) of the page's P tokens, so a row is P
    consecutive bytes and unpacks to [CW, P] without crossing threads."""
    PER: tl.constexpr = 8 // W
    RB: tl.constexpr = CW // PER
    r = tl.arange(0, RB)
    t = tl.arange(0, P)
    byte = tl.load(pg8 + base + off + (r[:, None] * P + t[None, :]), mask=(r < n // PER)[:, None], other=0)
    sh = tl.arange(0, PER) * W
    return tl.reshape((byte.to(tl.int32)[:, None, :] >> sh[None, :, None]) & ((1 << W) - 1), [CW, P])


@triton.jit
def _k_meta(pgh, meta, zoff, n, CW: tl.constexpr):
    """The fp32 scales and zeros [CW] of ``n`` packed channels: ``meta``/``zoff`` are where the scales sit in fp16
    elements of the page buffer and how far the zeros are behind them."""
    j = tl.arange(0, CW)
    sc = tl.load(pgh + meta + j, mask=j < n, other=0.0).to(tl.float32)
    return sc, tl.load(pgh + meta + zoff + j, mask=j < n, other=0.0).to(tl.float32)


@triton.jit
def _k_packed(scores, zsum, qw, pg8, pgh, base, off, meta, zoff, n,
              W: tl.constexpr, CW: tl.constexpr, P: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """Add q . K over a page's ``n`` channels of width ``W`` to ``scores`` [BLOCK_M, P] and q . zero to ``zsum``:
    the channels' scales fold into q (``q . (code * s + z) = (q * s) . code + q . z``), so the codes go to the dot
    as their exact fp16 images ``(0x6400 | code) - 1024``."""
    code = _k_codes(pg8, base, off, n, W, CW, P)
    sc, zp = _k_meta(pgh, meta, zoff, n, CW)
    qf = qw.to(tl.float32)
    zsum += tl.reduce(qf * zp[None, :], 1, _add)
    if DOT == tl.float16:
        x = (code.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        x = code.to(DOT)
    return tl.dot((qf * sc[None, :]).to(DOT), x, scores, input_precision=PREC), zsum


@triton.jit
def _k_rope(scores, pg8, pgh, base, off, meta, zoff, c0, n, kposf, q_row_ptrs, row_ok, perm_ptr, s, rope_ptr, sqd,
            W: tl.constexpr, CW: tl.constexpr, P: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr,
            PREC: tl.constexpr):
    """Add q . RoPE(K) over a page's ``n`` pre-RoPE channels of width ``W`` (permuted channels from ``c0``): the
    keys dequantized in fp32 and rotated to the page's positions (:func:`_rope_dot`)."""
    code = _k_codes(pg8, base, off, n, W, CW, P)
    sc, zp = _k_meta(pgh, meta, zoff, n, CW)
    kt = code.to(tl.float32) * sc[:, None] + zp[:, None]
    return _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, c0, n, rope_ptr, CW, D, sqd, DOT, PREC)


@triton.jit
def _page_class(m_i, l_i, acc, lo, hi, st, cbase_ptr, s, b, q2, q4, q8, q16, bias, row_ok, q_pos, q_l,
                pg8, pgh, pg16, pgpos, mask_ptr, smb, sml, smk, window, softcap, scale2,
                q_row_ptrs, sqd, perm_ptr, rope_ptr, kmean_ptr,
                C: tl.constexpr, D: tl.constexpr, P: tl.constexpr, C0: tl.constexpr, C2: tl.constexpr,
                C4: tl.constexpr, C8: tl.constexpr, C16: tl.constexpr, K2: tl.constexpr, K4: tl.constexpr,
                K8: tl.constexpr, K16: tl.constexpr, VG2: tl.constexpr, VG4: tl.constexpr, VG8: tl.constexpr,
                POS_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ROPE: tl.constexpr):
    """The pages of V class ``C`` (width 2 << C) among pages [lo, hi) of stream ``s``.

    V is dequantized as in the packed kernel (:func:`rdkv.kernels.device.trizone_decode._ab_class`): per code plane
    where rows are at least 16 bytes and the program holds 16 query rows, else unpacked to [P, D]. ``ROPE``: the
    keys were packed before RoPE and are rotated to each page's positions, the width-0 means included."""
    VW: tl.constexpr = 2 << C
    if VW == 2:
        V_GROUP: tl.constexpr = VG2
    elif VW == 4:
        V_GROUP: tl.constexpr = VG4
    else:
        V_GROUP: tl.constexpr = VG8
    if VW == 16:
        PER: tl.constexpr = 1
        PLANES: tl.constexpr = False
        RB: tl.constexpr = 2 * D
        VSEC: tl.constexpr = 2 * P * D
    else:
        PER: tl.constexpr = 8 // VW
        PLANES: tl.constexpr = (D * VW // 8 >= 16) & (BLOCK_M == 16)
        RB: tl.constexpr = D * VW // 8
        VSEC: tl.constexpr = P * RB + 4 * P * (D // V_GROUP)
    NG: tl.constexpr = D // V_GROUP
    MASK: tl.constexpr = (1 << VW) - 1
    p0 = tl.load(st + F_PAGE0 + C)
    a = tl.maximum(lo, p0)
    e = tl.minimum(hi, tl.load(st + F_PAGE0 + C + 1))
    count = tl.load(st + F_COUNT + C)
    psize = tl.multiple_of(tl.load(st + F_PSIZE + C).to(tl.int64), 16)
    cbase = tl.multiple_of(tl.load(cbase_ptr + s * 4 + C), 16)
    n2, n4, n8, n16 = tl.load(st + F_CHANS), tl.load(st + F_CHANS + 1), tl.load(st + F_CHANS + 2), tl.load(st + F_CHANS + 3)
    # every section starts on 16 bytes (rdkv.pages): the hints let the loads be 16-byte vectors
    o2, o4 = tl.multiple_of(tl.load(st + F_KOFF), 16), tl.multiple_of(tl.load(st + F_KOFF + 1), 16)
    o8, o16 = tl.multiple_of(tl.load(st + F_KOFF + 2), 16), tl.multiple_of(tl.load(st + F_KOFF + 3), 16)
    kmeta = tl.multiple_of(tl.load(st + F_KMETA), 16)
    voff = tl.multiple_of(tl.load(st + F_VOFF), 16)
    zoff = n2 + n4 + n8  # fp16 elements from a channel's scale to its zero
    t = tl.arange(0, P)
    d = tl.arange(0, D)
    rb = tl.arange(0, RB)
    ng = tl.arange(0, NG)
    if PLANES:
        run = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        a0 = tl.full([BLOCK_M, RB], 0.0, dtype=tl.float32)
        if PER >= 2:
            a1 = tl.full([BLOCK_M, RB], 0.0, dtype=tl.float32)
        if PER == 4:
            a2 = tl.full([BLOCK_M, RB], 0.0, dtype=tl.float32)
            a3 = tl.full([BLOCK_M, RB], 0.0, dtype=tl.float32)
    for pg in range(a, e):
        base = tl.multiple_of(cbase + (pg - p0) * psize, 16)  # int64 byte offset of the page
        tok_ok = t < count - (pg - p0) * P
        kpos = tl.load(pgpos + (base + voff + VSEC) // POS_BYTES + t).to(tl.int32)
        scores = tl.full([BLOCK_M, P], 0.0, dtype=tl.float32)
        zsum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        meta = (base + kmeta) // 2
        if ROPE:
            kposf = kpos.to(tl.float32)
            if C0 > 0:
                n0 = tl.load(st + F_C0)
                j0 = tl.arange(0, C0)
                mean = tl.load(kmean_ptr + tl.load(st + F_MEAN0) + j0, mask=j0 < n0, other=0.0).to(tl.float32)
                kt = tl.broadcast_to(mean[:, None], [C0, P])
                scores = _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, 0, n0, rope_ptr, C0, D, sqd,
                                   DOT, PREC)
            if K2:
                scores = _k_rope(scores, pg8, pgh, base, o2, meta, zoff, tl.load(st + F_CH0), n2, kposf, q_row_ptrs,
                                 row_ok, perm_ptr, s, rope_ptr, sqd, 2, C2, P, D, DOT, PREC)
            if K4:
                scores = _k_rope(scores, pg8, pgh, base, o4, meta + n2, zoff, tl.load(st + F_CH0 + 1), n4, kposf,
                                 q_row_ptrs, row_ok, perm_ptr, s, rope_ptr, sqd, 4, C4, P, D, DOT, PREC)
            if K8:
                scores = _k_rope(scores, pg8, pgh, base, o8, meta + n2 + n4, zoff, tl.load(st + F_CH0 + 2), n8, kposf,
                                 q_row_ptrs, row_ok, perm_ptr, s, rope_ptr, sqd, 8, C8, P, D, DOT, PREC)
            if K16:
                j = tl.arange(0, C16)
                kt = tl.load(pg16 + (base + o16) // 2 + (j[:, None] * P + t[None, :]), mask=(j < n16)[:, None],
                             other=0.0)
                scores = _rope_dot(scores, kt.to(tl.float32), kposf, q_row_ptrs, row_ok, perm_ptr, s,
                                   tl.load(st + F_CH0 + 3), n16, rope_ptr, C16, D, sqd, DOT, PREC)
        if K2 and not ROPE:
            scores, zsum = _k_packed(scores, zsum, q2, pg8, pgh, base, o2, meta, zoff, n2, 2, C2, P, DOT, PREC)
        if K4 and not ROPE:
            scores, zsum = _k_packed(scores, zsum, q4, pg8, pgh, base, o4, meta + n2, zoff, n4, 4, C4, P, DOT, PREC)
        if K8 and not ROPE:
            scores, zsum = _k_packed(scores, zsum, q8, pg8, pgh, base, o8, meta + n2 + n4, zoff, n8, 8, C8, P, DOT,
                                     PREC)
        if K16 and not ROPE:
            j = tl.arange(0, C16)
            kt = tl.load(pg16 + (base + o16) // 2 + (j[:, None] * P + t[None, :]), mask=(j < n16)[:, None], other=0.0)
            scores = tl.dot(q16.to(DOT), kt.to(DOT), scores, input_precision=PREC)
        scores = (scores + zsum[:, None]) * scale2 + bias[:, None]  # base-2 units
        ok = _visible(kpos, tok_ok, row_ok, q_pos, q_l, b, window, mask_ptr, smb, sml, smk, HAS_WINDOW, HAS_MASK)
        p, m_i, l_i, alpha = _online_step(scores, ok, m_i, l_i, SOFTCAP, softcap)
        vb = base + voff
        if PLANES:  # one dot per code plane; acc itself is rescaled once, after the loop
            run = run * alpha
            pd = p.to(DOT)
            byte = tl.load(pg8 + vb + (t[:, None] * RB + rb[None, :]))
            sz = (vb + P * RB) // 2 + (t[:, None] * NG + ng[None, :])
            sc = tl.load(pgh + sz)
            zp = tl.load(pgh + sz + P * NG)
            # plane k holds channels byte * PER + k, whose group is byte // (V_GROUP / PER) for every k
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [P, NG, V_GROUP // PER]), [P, RB])
            zp = tl.reshape(tl.broadcast_to(zp[:, :, None], [P, NG, V_GROUP // PER]), [P, RB])
            a0 = tl.dot(pd, _dequant(byte & MASK, sc, zp, DOT), a0 * alpha[:, None], input_precision=PREC)
            if PER >= 2:
                a1 = tl.dot(pd, _dequant((byte >> VW) & MASK, sc, zp, DOT), a1 * alpha[:, None], input_precision=PREC)
            if PER == 4:
                a2 = tl.dot(pd, _dequant((byte >> 4) & MASK, sc, zp, DOT), a2 * alpha[:, None], input_precision=PREC)
                a3 = tl.dot(pd, _dequant(byte >> 6, sc, zp, DOT), a3 * alpha[:, None], input_precision=PREC)
        else:
            acc = acc * alpha[:, None]
            if VW == 16:
                v = tl.load(pg16 + vb // 2 + (t[:, None] * D + d[None, :]))
            else:  # rows too short for a dot per plane: [P, RB] -> [P, RB, PER] -> [P, D] in registers
                byte = tl.load(pg8 + vb + (t[:, None] * RB + rb[None, :]))
                sh = tl.arange(0, PER) * VW
                code = tl.reshape((byte.to(tl.int32)[:, :, None] >> sh[None, None, :]) & MASK, [P, D])
                sz = (vb + P * RB) // 2 + (t[:, None] * NG + ng[None, :])
                sc = tl.reshape(tl.broadcast_to(tl.load(pgh + sz)[:, :, None], [P, NG, V_GROUP]), [P, D])
                zp = tl.reshape(tl.broadcast_to(tl.load(pgh + sz + P * NG)[:, :, None], [P, NG, V_GROUP]), [P, D])
                v = _dequant(code, sc, zp, DOT)
            acc += tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
    if PLANES:  # interleave the planes back to channel order (channel = byte * PER + k), once per class
        if PER == 4:
            v = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [BLOCK_M, D])
        elif PER == 2:
            v = tl.reshape(tl.join(a0, a1), [BLOCK_M, D])
        else:
            v = a0
        acc = acc * run[:, None] + v
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["n_ab", "n_c", "c_chunks", "c_start", "seq_len", "window"])
def _page_attn(
    q_ptr, sqb, sqh, sql, sqd, qp_ptr, out_ptr, lse_ptr,
    pg8, pgh, pg16, pgpos, kmean_ptr, st_ptr, cbase_ptr, wi_s_ptr, wi_lo_ptr,
    kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
    mask_ptr, smb, sml, smk, perm_ptr, rope_ptr,
    n_ab, n_c, c_chunks, c_start, seq_len, scale2, window, softcap,
    H, G, L, SPLIT, SPLIT_C,
    D: tl.constexpr, P: tl.constexpr, C0: tl.constexpr, C2: tl.constexpr, C4: tl.constexpr, C8: tl.constexpr,
    C16: tl.constexpr, K2: tl.constexpr, K4: tl.constexpr, K8: tl.constexpr, K16: tl.constexpr,
    VG2: tl.constexpr, VG4: tl.constexpr, VG8: tl.constexpr, POS_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
):
    pid = tl.program_id(0)
    mb = tl.program_id(1)
    GL = G * L
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < GL
    g = m // L
    q_l = m % L
    q_pos = seq_len - L + q_l
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, dtype=tl.float32)
    if pid < n_ab:
        s = tl.load(wi_s_ptr + pid)
        st = st_ptr + s * FIELDS
        lo = tl.load(wi_lo_ptr + pid)
        hi = tl.minimum(lo + SPLIT, tl.load(st + F_PAGE0 + 4))
        b = s // H
        q_row_ptrs = q_ptr + b * sqb + ((s % H) * G + g).to(tl.int64) * sqh + q_l * sql
        qp_rows = qp_ptr + (s * GL + m).to(tl.int64) * D  # q in the stream's permuted channel order [S, GL, D]
        # width-0 channels: every kept token has the channel means, a constant score per query row (unless ROPE
        # rotates them to each token's position: then _page_class adds them per page)
        bias = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        if C0 > 0 and not ROPE:
            n0 = tl.load(st + F_C0)
            j = tl.arange(0, C0)
            mean = tl.load(kmean_ptr + tl.load(st + F_MEAN0) + j, mask=j < n0, other=0.0).to(tl.float32)
            bias = tl.reduce(_q_cols(qp_rows, row_ok, 0, n0, C0).to(tl.float32) * mean[None, :], 1, _add) * scale2
        # the q columns of each K width, loaded once per program
        q2 = _q_cols(qp_rows, row_ok, tl.load(st + F_CH0), tl.load(st + F_CHANS), C2)
        q4 = _q_cols(qp_rows, row_ok, tl.load(st + F_CH0 + 1), tl.load(st + F_CHANS + 1), C4)
        q8 = _q_cols(qp_rows, row_ok, tl.load(st + F_CH0 + 2), tl.load(st + F_CHANS + 2), C8)
        q16 = _q_cols(qp_rows, row_ok, tl.load(st + F_CH0 + 3), tl.load(st + F_CHANS + 3), C16)
        for c in tl.static_range(4):
            m_i, l_i, acc = _page_class(m_i, l_i, acc, lo, hi, st, cbase_ptr, s, b, q2, q4, q8, q16, bias, row_ok,
                                        q_pos, q_l, pg8, pgh, pg16, pgpos, mask_ptr, smb, sml, smk, window, softcap,
                                        scale2, q_row_ptrs, sqd, perm_ptr, rope_ptr, kmean_ptr, c, D, P, C0, C2, C4,
                                        C8, C16, K2, K4, K8, K16, VG2, VG4, VG8, POS_BYTES, BLOCK_M, DOT, PREC,
                                        HAS_WINDOW, HAS_MASK, SOFTCAP, ROPE)
    else:
        m_i, l_i, acc = _zone_c(m_i, l_i, acc, pid - n_ab, c_chunks, SPLIT_C, n_c, H, G, g, q_l, q_pos, row_ok,
                                q_ptr, sqb, sqh, sql, sqd, kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
                                c_start, scale2, window, softcap, mask_ptr, smb, sml, smk, D, D, P, DOT, PREC,
                                HAS_WINDOW, HAS_MASK, SOFTCAP)
    _store_partial(out_ptr, lse_ptr, pid, GL, m, row_ok, m_i, l_i, acc, D, D)
