"""Device code of the fused TriZone decode attention (the launcher, :mod:`rdkv.kernels.trizone_decode`, plans and
calls it).

:func:`_trizone_attn` computes one work item's partial attention: a chunk of a stream's kept tokens (zones A+B,
class by class, :func:`_ab_class`) or of its zone C tokens, for a block of its query rows; the launcher merges the
partials by log-sum-exp (:mod:`rdkv.kernels.lse_merge`). See the launcher's docstring for the work items and the
tables, and docs/kernels.md for the layout and the instruction counts.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Only core builtins (tl.full, tl.reduce, ...) are called, not the @jit helpers of triton.language.standard
# (tl.zeros, tl.sum, tl.max): those are decorated when triton is first imported, so if something imported
# triton before TRITON_INTERPRET=1 was set (transformers does) they refuse to run in the interpreter.
# tl.reduce with the standard combine functions is exactly what tl.sum / tl.max expand to, and the
# interpreter recognises these two combiners and reduces with numpy instead of element by element.
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max


@triton.jit
def _q_block(qp_rows, row_ok, blk, KB: tl.constexpr):
    """q rows [BLOCK_M, KB] at the channels of block ``blk``: ``qp_rows`` point at the program's query rows already
    in the stream's permuted channel order (the launcher permutes q once per step), so a block is contiguous."""
    return tl.load(qp_rows[:, None] + (blk * KB + tl.arange(0, KB))[None, :], mask=row_ok[:, None], other=0.0)


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
def _k_scores(scores, q_row_ptrs, qp_rows, row_ok, perm_ptr, s, i, tok_ok, tab_base,
              krow_ptr, kgrp_ptr, kcls_ptr,
              codes_ptr, scale_ptr, zero_ptr, sqd,
              W: tl.constexpr, WI: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
              K_GROUP: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_N: tl.constexpr,
              ROPE: tl.constexpr, kposf, rope_ptr):
    """Add q . K over the K blocks of width ``W`` (class index ``WI`` in 0,2,4,8,16) to ``scores``.

    ``i`` [BLOCK_N] are the tile's token indices inside the stream (int32). A stream's blocks are stored sorted by
    width, so the blocks of width W are the consecutive run ``kcls[s, WI:WI + 2]``. Codes are dequantized first
    (:func:`_dequant`), then dotted in the query dtype. Addresses are a scalar int64 base per block plus int32
    offsets per element. Scales and zeros are gathered per element, in the codes' register layout: a tile's one or
    two groups loaded as [KB] vectors need a layout change to broadcast over the tokens, which costs more
    (docs/kernels.md, "Bandwidth model").
    ``ROPE``: the keys were packed before RoPE; each dequantized block is rotated to the tile's positions
    ``kposf`` (:func:`_rope_dot`), width-0 blocks (the channel means, ``codes_ptr``) included."""
    j_lo = tl.load(kcls_ptr + s * 6 + WI)
    j_hi = tl.load(kcls_ptr + s * 6 + WI + 1)
    c = tl.arange(0, KB)
    for blk in range(j_lo, j_hi):
        row0 = tl.load(krow_ptr + tab_base + blk)  # int64 row of this (block, stream) pair's token 0
        if W == 0:  # only with ROPE: a mean's score depends on the position it is rotated to
            mean = tl.load(codes_ptr + row0 * KB + c).to(tl.float32)
            kt = tl.where(tok_ok[None, :], mean[:, None], 0.0)
            scores = _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, blk * KB, KB, rope_ptr, KB, D, sqd, DOT, PREC)
        elif W == 16:
            kt = tl.load(codes_ptr + row0 * KB + (i[None, :] * KB + c[:, None]), mask=tok_ok[None, :], other=0.0)
            if ROPE:
                scores = _rope_dot(scores, kt.to(tl.float32), kposf, q_row_ptrs, row_ok, perm_ptr, s, blk * KB, KB,
                                   rope_ptr, KB, D, sqd, DOT, PREC)
            else:
                qb = _q_block(qp_rows, row_ok, blk, KB)
                scores += tl.dot(qb.to(DOT), kt.to(DOT), input_precision=PREC)
        else:
            # packed bytes [RB, BN] unpacked in registers to [RB, PER, BN] -> [KB, BN] (channel = byte * PER + k)
            PER: tl.constexpr = 8 // W
            RB: tl.constexpr = KB * W // 8
            rb = tl.arange(0, RB)
            byte = tl.load(codes_ptr + row0 * RB + (i[None, :] * RB + rb[:, None]), mask=tok_ok[None, :], other=0)
            sh = tl.arange(0, PER) * W
            code = tl.reshape((byte.to(tl.int32)[:, None, :] >> sh[None, :, None]) & ((1 << W) - 1), [KB, BLOCK_N])
            gbase = tl.load(kgrp_ptr + tab_base + blk)  # int64 first scale/zero group of the pair
            sz = gbase * KB + ((i // K_GROUP)[None, :] * KB + c[:, None])
            sc = tl.load(scale_ptr + sz, mask=tok_ok[None, :], other=0.0)
            zp = tl.load(zero_ptr + sz, mask=tok_ok[None, :], other=0.0)
            if ROPE:  # rotated in fp32
                kt = _dequant(code, sc, zp, tl.float32)
                scores = _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, blk * KB, KB, rope_ptr, KB, D,
                                   sqd, DOT, PREC)
            else:
                kt = _dequant(code, sc, zp, DOT)
                qb = _q_block(qp_rows, row_ok, blk, KB)
                scores += tl.dot(qb.to(DOT), kt, input_precision=PREC)
    return scores


@triton.jit
def _online_step(scores, ok, m_i, l_i, SOFTCAP: tl.constexpr, softcap):
    """Fold a tile of base-2 scores into the running (max, sum); returns (p, m, l, alpha), alpha being the
    factor that rescales what was accumulated under the old max."""
    if SOFTCAP:
        # scores are base 2: convert to natural units, cap with tanh, convert back
        x = scores / (LOG2E_C * softcap)
        t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        scores = t * (softcap * LOG2E_C)
    scores = tl.where(ok, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(scores, 1, _max))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.reduce(p, 1, _add)
    return p, m_new, l_i, alpha


LOG2E_C = tl.constexpr(LOG2E)


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
def _ab_class(m_i, l_i, acc, lo, hi, c_lo, c_hi, vbase,
              q_row_ptrs, qp_rows, row_ok, q_pos, bias, perm_ptr, s, b, tok0, tab_base,
              pos_ptr, mask_ptr, smb, sml, smk, q_l,
              krow_ptr, kgrp_ptr, kcls_ptr,
              k0m, k2c, k2s, k2z, k4c, k4s, k4z, k8c, k8s, k8z, k16,
              vc_ptr, vs_ptr, vz_ptr, sqd, window, softcap,
              VW: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, NB: tl.constexpr,
              K_GROUP: tl.constexpr, VG2: tl.constexpr, VG4: tl.constexpr, VG8: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT: tl.constexpr, PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
              SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, scale2, ROPE: tl.constexpr, rope_ptr):
    """The tiles of one V width class ``VW`` inside [lo, hi) of a stream's kept tokens.

    Packed V rows hold ``PER = 8 / VW`` codes per byte, channel ``byte * PER + k`` in bits ``k * VW``. Unpacking a
    [BLOCK_N, RB] byte tile into [BLOCK_N, D] channels takes a register layout change (a shared-memory round
    trip) per tile, so when a row has at least 16 bytes (a dot's minimum width) and a program holds 16 query
    rows (at 32 the plane accumulators spill registers) each code plane k is
    dequantized where it was loaded and accumulated by its own dot into ``a_k`` [BLOCK_M, RB]; the planes are
    interleaved into ``acc`` once, after the loop, with ``run`` (the product of the tiles' rescaling factors)
    applied to what ``acc`` held before."""
    a = tl.maximum(lo, c_lo)
    e = tl.minimum(hi, c_hi)
    d = tl.arange(0, D_PAD)
    if VW == 2:
        V_GROUP: tl.constexpr = VG2
    elif VW == 4:
        V_GROUP: tl.constexpr = VG4
    else:
        V_GROUP: tl.constexpr = VG8  # (unused at 16 bits)
    if VW == 16:
        PER: tl.constexpr = 1
        PLANES: tl.constexpr = False
    else:
        PER: tl.constexpr = 8 // VW
        PLANES: tl.constexpr = (D * VW // 8 >= 16) & (BLOCK_M == 16)  # 32 query rows: too many registers
    RB: tl.constexpr = D * VW // 8
    NG: tl.constexpr = D // V_GROUP
    MASK: tl.constexpr = (1 << VW) - 1
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
    for t0 in range(a, e, BLOCK_N):
        i = t0 + tl.arange(0, BLOCK_N)
        tok_ok = i < e
        kpos = tl.load(pos_ptr + tok0 + i, mask=tok_ok, other=0).to(tl.int32)
        kposf = kpos.to(tl.float32)
        scores = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        if ROPE:  # without it, width-0 blocks are the constant ``bias``
            scores = _k_scores(scores, q_row_ptrs, qp_rows, row_ok, perm_ptr, s, i, tok_ok, tab_base, krow_ptr,
                               kgrp_ptr, kcls_ptr, k0m, k0m, k0m, sqd, 0, 0, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                               ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, qp_rows, row_ok, perm_ptr, s, i, tok_ok, tab_base, krow_ptr,
                           kgrp_ptr, kcls_ptr, k2c, k2s, k2z, sqd, 2, 1, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                           ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, qp_rows, row_ok, perm_ptr, s, i, tok_ok, tab_base, krow_ptr,
                           kgrp_ptr, kcls_ptr, k4c, k4s, k4z, sqd, 4, 2, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                           ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, qp_rows, row_ok, perm_ptr, s, i, tok_ok, tab_base, krow_ptr,
                           kgrp_ptr, kcls_ptr, k8c, k8s, k8z, sqd, 8, 3, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                           ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, qp_rows, row_ok, perm_ptr, s, i, tok_ok, tab_base, krow_ptr,
                           kgrp_ptr, kcls_ptr, k16, k16, k16, sqd, 16, 4, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                           ROPE, kposf, rope_ptr)
        scores = scores * scale2 + bias[:, None]  # base-2 units; q stays exactly as given
        ok = _visible(kpos, tok_ok, row_ok, q_pos, q_l, b, window, mask_ptr, smb, sml, smk, HAS_WINDOW, HAS_MASK)
        p, m_i, l_i, alpha = _online_step(scores, ok, m_i, l_i, SOFTCAP, softcap)
        if PLANES:  # accumulate per code plane; acc itself is rescaled once, after the loop
            run = run * alpha
            pd = p.to(DOT)
            byte = tl.load(vc_ptr + vbase * RB + (i[:, None] * RB + rb[None, :]), mask=tok_ok[:, None], other=0)
            sz = i[:, None] * NG + ng[None, :]
            sc = tl.load(vs_ptr + vbase * NG + sz, mask=tok_ok[:, None], other=0.0)
            zp = tl.load(vz_ptr + vbase * NG + sz, mask=tok_ok[:, None], other=0.0)
            # plane k holds channels byte * PER + k, whose group is byte // (V_GROUP / PER) for every k
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, NG, V_GROUP // PER]), [BLOCK_N, RB])
            zp = tl.reshape(tl.broadcast_to(zp[:, :, None], [BLOCK_N, NG, V_GROUP // PER]), [BLOCK_N, RB])
            a0 = tl.dot(pd, _dequant(byte & MASK, sc, zp, DOT), a0 * alpha[:, None], input_precision=PREC)
            if PER >= 2:
                a1 = tl.dot(pd, _dequant((byte >> VW) & MASK, sc, zp, DOT), a1 * alpha[:, None], input_precision=PREC)
            if PER == 4:
                a2 = tl.dot(pd, _dequant((byte >> 4) & MASK, sc, zp, DOT), a2 * alpha[:, None], input_precision=PREC)
                a3 = tl.dot(pd, _dequant(byte >> 6, sc, zp, DOT), a3 * alpha[:, None], input_precision=PREC)
        else:
            acc = acc * alpha[:, None]
            if VW == 16:  # row of token i of the class: vbase + i (an int64 scalar base, int32 offsets)
                v = tl.load(vc_ptr + vbase * D + (i[:, None] * D + d[None, :]), mask=tok_ok[:, None], other=0.0)
            else:
                # rows too short for a dot per plane: [BN, RB] -> [BN, RB, PER] -> [BN, D] in registers
                byte = tl.load(vc_ptr + vbase * RB + (i[:, None] * RB + rb[None, :]), mask=tok_ok[:, None], other=0)
                sh = tl.arange(0, PER) * VW
                code = tl.reshape((byte.to(tl.int32)[:, :, None] >> sh[None, None, :]) & MASK, [BLOCK_N, D])
                sz = i[:, None] * NG + ng[None, :]
                sc = tl.load(vs_ptr + vbase * NG + sz, mask=tok_ok[:, None], other=0.0)
                zp = tl.load(vz_ptr + vbase * NG + sz, mask=tok_ok[:, None], other=0.0)
                sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, NG, V_GROUP]), [BLOCK_N, D])
                zp = tl.reshape(tl.broadcast_to(zp[:, :, None], [BLOCK_N, NG, V_GROUP]), [BLOCK_N, D])
                v = _dequant(code, sc, zp, DOT)
            acc += tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)  # v16 rows are already DOT or fp16
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
def _trizone_attn(
    q_ptr, sqb, sqh, sql, sqd, qp_ptr,
    out_ptr, lse_ptr,
    pos_ptr, perm_ptr, tok0_ptr, vcls_ptr, vbase_ptr,
    krow_ptr, kgrp_ptr, kcls_ptr,
    wi_s_ptr, wi_lo_ptr,
    k0m, k2c, k2s, k2z, k4c, k4s, k4z, k8c, k8s, k8z, k16,
    v2c, v2s, v2z, v4c, v4s, v4z, v8c, v8s, v8z, v16,
    kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
    mask_ptr, smb, sml, smk, rope_ptr,
    n_ab, n_c, c_chunks, c_start, seq_len, scale2, window, softcap,
    H, G, L, SPLIT,
    K_GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr,
    VG2: tl.constexpr, VG4: tl.constexpr, VG8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
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
    acc = tl.full([BLOCK_M, D_PAD], 0.0, dtype=tl.float32)

    if pid < n_ab:
        s = tl.load(wi_s_ptr + pid)
        lo = tl.load(wi_lo_ptr + pid)
        b = s // H
        h = s % H
        tok0 = tl.load(tok0_ptr + s)  # int64 index of the stream's first kept token
        hi = tl.minimum(lo + SPLIT, tl.load(vcls_ptr + s * 5 + 4))
        q_row_ptrs = q_ptr + b * sqb + (h * G + g).to(tl.int64) * sqh + q_l * sql
        qp_rows = qp_ptr + (s * GL + m).to(tl.int64) * D  # q permuted per stream [S, GL, D] (not with ROPE)
        tab_base = s * NB
        # width-0 K blocks: every kept token has the channel means, a constant score per query row
        # (unless ROPE rotates the means to each token's position: then _k_scores adds them per tile)
        bias = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        if not ROPE:
            cK = tl.arange(0, KB)
            for blk in range(tl.load(kcls_ptr + s * 6), tl.load(kcls_ptr + s * 6 + 1)):
                row0 = tl.load(krow_ptr + tab_base + blk)
                qb = _q_block(qp_rows, row_ok, blk, KB).to(tl.float32)
                mean = tl.load(k0m + row0 * KB + cK).to(tl.float32)
                bias += tl.reduce(qb * mean[None, :], 1, _add)
            bias = bias * scale2
        for c in tl.static_range(4):  # V width classes 2, 4, 8, 16: one dequantisation path each
            if c == 0:
                vc, vs, vz = v2c, v2s, v2z
            elif c == 1:
                vc, vs, vz = v4c, v4s, v4z
            elif c == 2:
                vc, vs, vz = v8c, v8s, v8z
            else:
                vc, vs, vz = v16, v16, v16
            m_i, l_i, acc = _ab_class(m_i, l_i, acc, lo, hi, tl.load(vcls_ptr + s * 5 + c),
                                      tl.load(vcls_ptr + s * 5 + c + 1), tl.load(vbase_ptr + s * 4 + c), q_row_ptrs,
                                      qp_rows, row_ok, q_pos, bias, perm_ptr, s, b, tok0, tab_base, pos_ptr, mask_ptr,
                                      smb, sml, smk, q_l, krow_ptr, kgrp_ptr, kcls_ptr, k0m, k2c, k2s, k2z, k4c, k4s,
                                      k4z, k8c, k8s, k8z, k16, vc, vs, vz, sqd, window, softcap, 2 << c, KB, D, D_PAD,
                                      NB, K_GROUP, VG2, VG4, VG8, BLOCK_N, DOT, PREC, HAS_WINDOW, HAS_MASK, SOFTCAP,
                                      BLOCK_M, scale2, ROPE, rope_ptr)
    else:
        m_i, l_i, acc = _zone_c(m_i, l_i, acc, pid - n_ab, c_chunks, SPLIT, n_c, H, G, g, q_l, q_pos, row_ok,
                                q_ptr, sqb, sqh, sql, sqd, kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
                                c_start, scale2, window, softcap, mask_ptr, smb, sml, smk, D, D_PAD, BLOCK_N, DOT,
                                PREC, HAS_WINDOW, HAS_MASK, SOFTCAP)
    _store_partial(out_ptr, lse_ptr, pid, GL, m, row_ok, m_i, l_i, acc, D, D_PAD)


@triton.jit
def _zone_c(m_i, l_i, acc, cid, c_chunks, SPLIT, n_c, H, G, g, q_l, q_pos, row_ok,
            q_ptr, sqb, sqh, sql, sqd, kc_ptr, skb, skh, skn, skd, vc_ptr, svb, svh, svn, svd,
            c_start, scale2, window, softcap, mask_ptr, smb, sml, smk,
            D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
            HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr):
    """Zone C work item ``cid``: tokens [lo, lo + SPLIT) of one stream's fresh 16-bit keys and values."""
    s = cid // c_chunks
    lo = (cid % c_chunks) * SPLIT
    hi = tl.minimum(lo + SPLIT, n_c)
    b = s // H
    h = s % H
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_ptrs = q_ptr + b * sqb + (h * G + g).to(tl.int64)[:, None] * sqh + (q_l * sql)[:, None] + d[None, :] * sqd
    qf = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qf = qf.to(DOT)
    k_base_c = kc_ptr + b.to(tl.int64) * skb + h * skh
    v_base_c = vc_ptr + b.to(tl.int64) * svb + h * svh
    for t0 in range(lo, hi, BLOCK_N):
        j = t0 + tl.arange(0, BLOCK_N)
        tok_ok = j < hi
        kt = tl.load(k_base_c + j[None, :] * skn + d[:, None] * skd, mask=tok_ok[None, :] & d_ok[:, None], other=0.0)
        scores = tl.dot(qf, kt.to(DOT), input_precision=PREC) * scale2
        kpos = c_start + j
        ok = _visible(kpos, tok_ok, row_ok, q_pos, q_l, b, window, mask_ptr, smb, sml, smk, HAS_WINDOW, HAS_MASK)
        p, m_i, l_i, alpha = _online_step(scores, ok, m_i, l_i, SOFTCAP, softcap)
        acc = acc * alpha[:, None]
        v = tl.load(v_base_c + j[:, None] * svn + d[None, :] * svd, mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
    return m_i, l_i, acc


@triton.jit
def _store_partial(out_ptr, lse_ptr, pid, GL, m, row_ok, m_i, l_i, acc, D: tl.constexpr, D_PAD: tl.constexpr):
    """The program's normalised partial output and its base-2 log-sum-exp (-inf when the chunk saw nothing)."""
    d = tl.arange(0, D_PAD)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    base = pid.to(tl.int64) * GL
    tl.store(out_ptr + (base + m)[:, None] * D + d[None, :], o, mask=row_ok[:, None] & (d < D)[None, :])
    tl.store(lse_ptr + base + m, lse, mask=row_ok)
