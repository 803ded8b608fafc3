"""Device code of the fused TriZone decode over the page layout (:mod:`rdkv.pages`); the launcher,
:mod:`rdkv.kernels.page_decode`, plans the work items and calls it.

:func:`_page_attn` computes one work item's partial attention for a block of query rows: a run of one stream's
pages (zones A+B) or a chunk of its zone C tokens; the launcher merges the partials by log-sum-exp
(:mod:`rdkv.kernels.lse_merge`). Scores are in base 2 (q is scaled by ``scaling * log2(e)``), masked by causality,
sliding window and the optional bool mask, and folded into an online softmax.

A zone A+B program walks a run of one stream's pages, class by class (V widths 2, 4, 8, 16: four compile-time
copies of the page loop). Every address of a page follows from its base and the stream's section offsets, loaded
once per program, so a page's loads (the K code rows, the K scales and zeros, the 16-bit K rows, the V codes and
their scales, the positions) have no dependence on one another. K is one [D, tokens] tile whatever the stream's
width mix (:func:`_k_tile`: each permuted channel a row that knows where its bits are), dequantized in fp16 from
the codes' exact image ``(0x6400 | code) - 1024`` and dotted with q once: the registers are bounded by the head
size, not by the channels of each width.
"""
from __future__ import annotations

import triton
import triton.language as tl

from rdkv.kernels.lse_merge import _online_step, _store_partial

# fields of a stream's row in the int32 table the launcher builds (rdkv.kernels.page_decode.stream_table)
F_CHANS = tl.constexpr(0)  # channels of K width 2, 4, 8, 16 (4 fields)
F_CH0 = tl.constexpr(4)  # first permuted channel of K width 2, 4, 8, 16 (4)
F_KOFF = tl.constexpr(8)  # byte offset inside a page of the K sections 2, 4, 8, 16 (4)
F_KMETA = tl.constexpr(12)  # byte offset of the K scales (the zeros follow, 2 bytes per packed channel later)
F_VOFF = tl.constexpr(13)  # byte offset of the V section
F_MEAN0 = tl.constexpr(14)  # the stream's first channel mean (width-0 means are outside the pages)
F_PAGE0 = tl.constexpr(15)  # class boundaries along the stream's pages (5)
F_COUNT = tl.constexpr(20)  # tokens of each class (4)
F_PSIZE = tl.constexpr(24)  # bytes of a page of each class (4)
FIELDS = tl.constexpr(32)


@triton.jit
def _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, c0, n, rope_ptr, CW: tl.constexpr,
              D: tl.constexpr, sqd, DOT: tl.constexpr, PREC: tl.constexpr):
    """Add q . RoPE(kt) for pre-RoPE keys ``kt`` [CW, BLOCK_N] at the ``n`` permuted channels from ``c0`` (rows of
    ``kt`` past ``n`` must be zero).

    Rotate-half RoPE turns channel c of a key at position p into k_c cos(p w_c) -/+ k_partner sin(p w_c), with
    partner = c +/- D/2. Collecting the terms per stored channel, q . RoPE(k) = sum_c k_c (q_c cos + sign_c
    q_partner(c) sin) (sign +1 below D/2, -1 above), so one block is rotated with its own channels only, in
    whatever order the permutation put them: two dots, against k * cos and k * sin. ``rope_ptr`` holds the
    layer's D/2 inverse frequencies, then RoPE's attention scaling (rdkv.rope)."""
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, CW)
    ch = tl.load(perm_ptr + s * D + c0 + j, mask=j < n, other=0).to(tl.int64)
    low = ch < HALF
    partner = tl.where(low, ch + HALF, ch - HALF)
    ok = row_ok[:, None] & (j < n)[None, :]
    qa = tl.load(q_row_ptrs[:, None] + ch[None, :] * sqd, mask=ok, other=0.0).to(tl.float32)
    qp = tl.load(q_row_ptrs[:, None] + partner[None, :] * sqd, mask=ok, other=0.0).to(tl.float32)
    qp = tl.where(low[None, :], qp, -qp)
    ang = tl.load(rope_ptr + ch % HALF)[:, None] * kposf[None, :]  # the same fp32 product rdkv.rope forms
    kt = kt * tl.load(rope_ptr + HALF)
    scores += tl.dot(qa.to(DOT), (kt * tl.cos(ang)).to(DOT), input_precision=PREC)
    scores += tl.dot(qp.to(DOT), (kt * tl.sin(ang)).to(DOT), input_precision=PREC)
    return scores


@triton.jit
def _dequant(code, scale, zero, DOT: tl.constexpr):
    """``code * scale + zero`` as the dot operand: integer codes, fp16 scale and zero (broadcast to the codes).

    For fp16 dots it is computed in fp16 from the code's exact fp16 image: the bits ``0x6400 | code`` are
    1024 + code, so one OR, one subtraction and one fma per element, two elements per instruction, and no
    conversion afterwards (the fma rounds once, as fp32 arithmetic rounded to fp16 does). Other dtypes
    dequantize in fp32."""
    if DOT == tl.float16:
        x = (code.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        return x * scale + zero
    else:
        return (code.to(tl.float32) * scale.to(tl.float32) + zero.to(tl.float32)).to(DOT)


@triton.jit
def _visible(kpos, tok_ok, row_ok, q_pos, q_l, b, window, mask_ptr, smb, sml, smk,
             HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr):
    """Which (query row, key) pairs may attend: causal by position, sliding window, optional bool mask
    read at the key's absolute position (the kernel's twin of rdkv.dense.allowed_keys)."""
    ok = tok_ok[None, :] & row_ok[:, None] & (kpos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        ok = ok & (q_pos[:, None] - kpos[None, :] < window)
    if HAS_MASK:
        mv = tl.load(mask_ptr + b * smb + q_l[:, None] * sml + kpos[None, :].to(tl.int64) * smk,
                     mask=tok_ok[None, :] & row_ok[:, None], other=0)
        ok = ok & (mv != 0)
    return ok


@triton.jit
def _zone_c(m_i, l_i, acc, cid, c_chunks, SPLIT, n_c, H, G, g, q_l, q_pos, row_ok,
            q_ptr, sqb, sqh, sql, sqd, kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
            c_start, scale2, window, softcap, mask_ptr, smb, sml, smk,
            D: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
            HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr):
    """Zone C work item ``cid``: tokens [lo, lo + SPLIT) of one stream's fresh 16-bit keys and values."""
    s = cid // c_chunks
    lo = (cid % c_chunks) * SPLIT
    hi = tl.minimum(lo + SPLIT, n_c)
    b = s // H
    h = s % H
    d = tl.arange(0, D)
    q_ptrs = q_ptr + b * sqb + (h * G + g).to(tl.int64)[:, None] * sqh + (q_l * sql)[:, None] + d[None, :] * sqd
    qf = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    qf = qf.to(DOT)
    k_base_c = kc_ptr + b.to(tl.int64) * skb + h * skh
    v_base_c = vc_ptr + b.to(tl.int64) * svb + h * svh
    for t0 in range(lo, hi, BLOCK_N):
        j = t0 + tl.arange(0, BLOCK_N)
        tok_ok = j < hi
        kt = tl.load(k_base_c + j[None, :] * skn + d[:, None] * skd, mask=tok_ok[None, :], other=0.0)
        scores = tl.dot(qf, kt.to(DOT), input_precision=PREC) * scale2
        kpos = c_start + j
        ok = _visible(kpos, tok_ok, row_ok, q_pos, q_l, b, window, mask_ptr, smb, sml, smk, HAS_WINDOW, HAS_MASK)
        p, m_i, l_i, alpha = _online_step(scores, ok, m_i, l_i, SOFTCAP, softcap)
        acc = acc * alpha[:, None]
        v = tl.load(v_base_c + j[:, None] * svn + d[None, :] * svd, mask=tok_ok[:, None], other=0.0)
        acc += tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
    return m_i, l_i, acc


@triton.jit
def _bytes(word):
    """int32 words [R, N] -> their bytes [R, 4 N] (byte j of word u at 4 u + j) as uint8: truncations, so
    ptxas picks each byte with one PRMT (masking with 0xFF costs a mask register and an instruction)."""
    R: tl.constexpr = word.shape[0]
    N: tl.constexpr = word.shape[1]
    lo = tl.join(word.to(tl.uint8), (word >> 16).to(tl.uint8))
    hi = tl.join((word >> 8).to(tl.uint8), (word >> 24).to(tl.uint8))
    return tl.reshape(tl.join(lo, hi), [R, 4 * N])


@triton.jit
def _k_tile(pg32, pgh, pg16, base, t0, kro, ksh, kmask, kmi, zoff, meta, packed, wide, mean,
            PT: tl.constexpr, KQ: tl.constexpr, K16: tl.constexpr, OUT: tl.constexpr):
    """The page's keys [KC, PT] at tokens ``t0`` + [0, PT), at the stream's permuted channels the row tables
    describe (:func:`_row_tables`), as ``OUT``.

    Every channel is one row, whatever its width: a packed row reads the byte row that holds it (``kro``: its
    byte offset in the page; the codes of ``8 / w`` channels share a byte, so neighbouring rows read the same
    bytes, from L1) and takes its bits (``ksh``, ``kmask``: the mask in every byte of a word); its scale and
    zero are the page's (``kmi``: its index among the packed channels). A 16-bit row reads its values; a width-0 row is its channel mean
    (scale 0, zero = mean). So one dot per tile covers every width, and the registers do not depend on how
    the stream's channels split between widths."""
    t = t0 + tl.arange(0, PT)
    KC: tl.constexpr = mean.shape[0]
    if KQ:  # four tokens' bytes per int32 word: shifted and masked a word at a time, then split into bytes
        u = t0 // 4 + tl.arange(0, PT // 4)
        word = tl.load(pg32 + (base // 4 + kro // 4)[:, None] + u[None, :], mask=packed[:, None], other=0)
        code = _bytes((word >> ksh[:, None]) & kmask[:, None])
        sc = tl.load(pgh + meta + kmi, mask=packed, other=0.0)
        zp = tl.where(packed, tl.load(pgh + meta + zoff + kmi, mask=packed, other=0.0), mean)
        kt = _dequant(code, sc[:, None], zp[:, None], OUT)
    else:
        kt = tl.broadcast_to(mean.to(OUT)[:, None], [KC, PT])
    if K16:  # the packed part of a 16-bit row is 0 * code + 0: add its values (x + 0 = x)
        kt += tl.load(pg16 + (base // 2 + kro // 2)[:, None] + t[None, :], mask=wide[:, None], other=0.0).to(OUT)
    return kt


@triton.jit
def _page_class(m_i, l_i, acc, lo, hi, st, cbase_ptr, s, b, qk, row_ok, q_pos, q_l,
                kro, ksh, kmask, kmi, zoff, packed, wide, mean,
                pg8, pg32, pgh, pg16, pgpos, mask_ptr, smb, sml, smk, window, softcap, scale2,
                q_row_ptrs, qp_rows, sqd, perm_ptr, rope_ptr, kmean_ptr,
                C: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PT: tl.constexpr, KC: tl.constexpr, KQ: tl.constexpr,
                K16: tl.constexpr, VG2: tl.constexpr, VG4: tl.constexpr, VG8: tl.constexpr,
                POS_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ROPE: tl.constexpr):
    """The pages of V class ``C`` (width 2 << C) among pages [lo, hi) of stream ``s``, ``PT`` tokens at a time.

    K: one [D, PT] tile per step (:func:`_k_tile`) and one dot with the permuted q, or ``KC`` channels at a time
    where a whole tile would spill (fp32 dots, head_dim 256; ``ROPE``: keys packed before RoPE, dequantized in fp32
    and rotated to their positions). V is dequantized per code plane where rows are at least 16 bytes and the
    program holds 16 query rows (one dot per plane, the planes interleaved back once per class), else unpacked to
    [PT, D] (also for pre-RoPE keys above head_dim 128: their fp32 rotation leaves no registers for the planes'
    accumulators, which spill on sm_80)."""
    VW: tl.constexpr = 2 << C
    SUB: tl.constexpr = P // PT
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
        PLANES: tl.constexpr = (D * VW // 8 >= 16) & (BLOCK_M == 16) & ((D <= 128) | (not ROPE))
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
    kmeta = tl.multiple_of(tl.load(st + F_KMETA), 16)
    voff = tl.multiple_of(tl.load(st + F_VOFF), 16)
    t = tl.arange(0, PT)
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
    for i in range(a * SUB, e * SUB):
        pg = i // SUB
        t0 = (i % SUB) * PT
        base = tl.multiple_of(cbase + (pg - p0) * psize, 16)  # int64 byte offset of the page
        tok = t0 + t
        tok_ok = tok < count - (pg - p0) * P
        kpos = tl.load(pgpos + (base + voff + VSEC) // POS_BYTES + tok).to(tl.int32)
        scores = tl.full([BLOCK_M, PT], 0.0, dtype=tl.float32)
        meta = (base + kmeta) // 2
        if KC == D and not ROPE:  # the tables and q, held by the program
            kt = _k_tile(pg32, pgh, pg16, base, t0, kro, ksh, kmask, kmi, zoff, meta, packed, wide, mean, PT, KQ, K16,
                         DOT)
            scores = tl.dot(qk, kt, scores, input_precision=PREC)
        else:  # KC channels at a time, their tables and q columns read again each step
            for c0 in range(0, D, KC):  # a loop, not unrolled: the tables of every chunk would be hoisted
                kro, ksh, kmask, kmi, packed, wide, mean = _row_tables(st, kmean_ptr, c0, KC, P)
                if ROPE:
                    kt = _k_tile(pg32, pgh, pg16, base, t0, kro, ksh, kmask, kmi, zoff, meta, packed, wide, mean, PT,
                                 KQ, K16, tl.float32)
                    scores = _rope_dot(scores, kt, kpos.to(tl.float32), q_row_ptrs, row_ok, perm_ptr, s, c0, KC,
                                       rope_ptr, KC, D, sqd, DOT, PREC)
                else:
                    kt = _k_tile(pg32, pgh, pg16, base, t0, kro, ksh, kmask, kmi, zoff, meta, packed, wide, mean, PT,
                                 KQ, K16, DOT)
                    qc = tl.load(qp_rows[:, None] + (c0 + tl.arange(0, KC))[None, :], mask=row_ok[:, None], other=0.0)
                    scores = tl.dot(qc.to(DOT), kt, scores, input_precision=PREC)
        scores = scores * scale2  # base-2 units
        ok = _visible(kpos, tok_ok, row_ok, q_pos, q_l, b, window, mask_ptr, smb, sml, smk, HAS_WINDOW, HAS_MASK)
        p, m_i, l_i, alpha = _online_step(scores, ok, m_i, l_i, SOFTCAP, softcap)
        vb = base + voff
        if PLANES:  # one dot per code plane; acc itself is rescaled once, after the loop
            run = run * alpha
            pd = p.to(DOT)
            # the codes as int32 words (a row is >= 16 bytes), each plane masked a word at a time
            word = tl.load(pg32 + vb // 4 + (tok[:, None] * (RB // 4) + tl.arange(0, RB // 4)[None, :]))
            sz = (vb + P * RB) // 2 + (tok[:, None] * NG + ng[None, :])
            sc = tl.load(pgh + sz)
            zp = tl.load(pgh + sz + P * NG)
            # plane k holds channels byte * PER + k, whose group is byte // (V_GROUP / PER) for every k
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [PT, NG, V_GROUP // PER]), [PT, RB])
            zp = tl.reshape(tl.broadcast_to(zp[:, :, None], [PT, NG, V_GROUP // PER]), [PT, RB])
            if PER == 1:
                a0 = tl.dot(pd, _dequant(_bytes(word), sc, zp, DOT), a0 * alpha[:, None], input_precision=PREC)
            else:
                MASK4: tl.constexpr = MASK * 0x01010101
                a0 = tl.dot(pd, _dequant(_bytes(word & MASK4), sc, zp, DOT), a0 * alpha[:, None],
                            input_precision=PREC)
            if PER >= 2:
                a1 = tl.dot(pd, _dequant(_bytes((word >> VW) & MASK4), sc, zp, DOT), a1 * alpha[:, None],
                            input_precision=PREC)
            if PER == 4:
                a2 = tl.dot(pd, _dequant(_bytes((word >> 4) & MASK4), sc, zp, DOT), a2 * alpha[:, None],
                            input_precision=PREC)
                a3 = tl.dot(pd, _dequant(_bytes((word >> 6) & MASK4), sc, zp, DOT), a3 * alpha[:, None],
                            input_precision=PREC)
        else:
            acc = acc * alpha[:, None]
            if VW == 16:
                v = tl.load(pg16 + vb // 2 + (tok[:, None] * D + d[None, :]))
            else:  # rows too short for a dot per plane: [PT, RB] -> [PT, RB, PER] -> [PT, D] in registers
                byte = tl.load(pg8 + vb + (tok[:, None] * RB + rb[None, :]))
                sh = tl.arange(0, PER) * VW
                code = tl.reshape((byte.to(tl.int32)[:, :, None] >> sh[None, None, :]) & MASK, [PT, D])
                sz = (vb + P * RB) // 2 + (tok[:, None] * NG + ng[None, :])
                sc = tl.reshape(tl.broadcast_to(tl.load(pgh + sz)[:, :, None], [PT, NG, V_GROUP]), [PT, D])
                zp = tl.reshape(tl.broadcast_to(tl.load(pgh + sz + P * NG)[:, :, None], [PT, NG, V_GROUP]), [PT, D])
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


@triton.jit
def _row_tables(st, kmean_ptr, c0, KC: tl.constexpr, P: tl.constexpr):
    """Where each of the stream's permuted channels [c0, c0 + KC) sits in a page, as [KC] vectors: the byte offset
    of its row (packed: the byte row holding it; 16-bit: its values), its bit shift and mask, its index among the
    packed channels (for its scale and zero), whether it is packed or 16-bit, and its mean (width 0)."""
    c = c0 + tl.arange(0, KC)
    f2, f4, f8, f16 = tl.load(st + F_CH0), tl.load(st + F_CH0 + 1), tl.load(st + F_CH0 + 2), tl.load(st + F_CH0 + 3)
    k = (c >= f2).to(tl.int32) + (c >= f4).to(tl.int32) + (c >= f8).to(tl.int32) + (c >= f16).to(tl.int32)
    k1 = tl.maximum(k - 1, 0)  # the K section of a packed or 16-bit channel: widths 2, 4, 8, 16
    first = tl.load(st + F_CH0 + k1)
    w = 1 << (k1 + 1)
    j = c - first
    per = 8 // tl.minimum(w, 8)
    packed = (k > 0) & (k < 4)
    wide = k == 4
    kro = tl.load(st + F_KOFF + k1) + tl.where(wide, j * (2 * P), (j // per) * P)
    ksh = tl.where(packed, (j % per) * w, 0)
    kmask = tl.where(packed, ((1 << w) - 1) * 0x01010101, 0)  # in each byte of a word
    mean = tl.load(kmean_ptr + tl.load(st + F_MEAN0) + c, mask=k == 0, other=0.0)
    return tl.multiple_of(kro, 16), ksh, kmask, c - f2, packed, wide, mean


@triton.jit(do_not_specialize=["n_ab", "n_c", "c_chunks", "c_start", "seq_len", "window"])
def _page_attn(
    q_ptr, sqb, sqh, sql, sqd, qp_ptr, out_ptr, lse_ptr,
    pg8, pg32, pgh, pg16, pgpos, kmean_ptr, st_ptr, cbase_ptr, wi_s_ptr, wi_lo_ptr,
    kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
    mask_ptr, smb, sml, smk, perm_ptr, rope_ptr,
    n_ab, n_c, c_chunks, c_start, seq_len, scale2, window, softcap,
    H, G, L, SPLIT, SPLIT_C,
    D: tl.constexpr, P: tl.constexpr, PT: tl.constexpr, KC: tl.constexpr, KQ: tl.constexpr, K16: tl.constexpr,
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
        zoff = tl.load(st + F_CHANS) + tl.load(st + F_CHANS + 1) + tl.load(st + F_CHANS + 2)  # scale -> zero
        kro, ksh, kmask, kmi, packed, wide, mean = _row_tables(st, kmean_ptr, 0, KC, P)
        qk = tl.load(qp_rows[:, None] + tl.arange(0, KC)[None, :], mask=row_ok[:, None], other=0.0).to(DOT)
        for c in tl.static_range(4):
            m_i, l_i, acc = _page_class(m_i, l_i, acc, lo, hi, st, cbase_ptr, s, b, qk, row_ok, q_pos, q_l,
                                        kro, ksh, kmask, kmi, zoff, packed, wide, mean,
                                        pg8, pg32, pgh, pg16, pgpos, mask_ptr, smb, sml, smk, window, softcap, scale2,
                                        q_row_ptrs, qp_rows, sqd, perm_ptr, rope_ptr, kmean_ptr, c, D, P, PT, KC, KQ,
                                        K16, VG2, VG4, VG8,
                                        POS_BYTES, BLOCK_M, DOT, PREC, HAS_WINDOW, HAS_MASK, SOFTCAP, ROPE)
    else:
        m_i, l_i, acc = _zone_c(m_i, l_i, acc, pid - n_ab, c_chunks, SPLIT_C, n_c, H, G, g, q_l, q_pos, row_ok,
                                q_ptr, sqb, sqh, sql, sqd, kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
                                c_start, scale2, window, softcap, mask_ptr, smb, sml, smk, D, PT, DOT, PREC,
                                HAS_WINDOW, HAS_MASK, SOFTCAP)
    _store_partial(out_ptr, lse_ptr, pid, GL, m, row_ok, m_i, l_i, acc, D)
