"""Fused TriZone decode attention in Triton (flash-decoding split-K over zones A, B and C).

One launch of :func:`_trizone_attn` computes partial attention for every *work item*; one launch of
:func:`rdkv.kernels.lse_merge._lse_merge` combines the partials of each stream by log-sum-exp and writes the output.

Work items
    Zone A+B: the kept tokens of stream ``s`` (ordered by V width class, then position) are cut into
    chunks of ``split`` tokens; each chunk is one program. Zone C: the ``n`` fresh tokens of every
    stream are cut into chunks of ``split`` the same way. A second grid axis tiles the query rows
    (``G`` grouped heads x ``L`` query positions, head-major) into blocks of ``BLOCK_M >= 16`` rows, so
    one program serves every query head that shares its KV head.

Inside a zone A+B program
    The chunk is walked class by class (V widths 2, 4, 8, 16 are four compile-time copies of the tile
    loop, so every V tile has one static dequantization path). For each tile of ``BLOCK_N`` tokens the
    score is a sum of one ``tl.dot`` per K channel block: the block's channels are gathered from q with
    the stream's permutation (``k_perm``), its codes are dequantized in registers with the per-channel
    scale/zero of their token group, and width-0 blocks add the constant ``q . mean``. Scores are in base
    2 (q is scaled by ``scaling * log2(e)``), masked by causality / sliding window / the optional bool
    mask, and folded into an online softmax; V rows are dequantized per row (scale/zero per
    ``v_group`` channels), one code plane at a time, and accumulated with a ``tl.dot`` per plane (see
    :func:`_ab_class`). Keys packed before RoPE (a layer with
    a ``rope`` table) take two dots per block instead, against the block rotated to each token's position
    (``_rope_dot``); their width-0 blocks are rotated means, so they are scored per tile, not as a constant.

The launcher derives the small per-stream offset tables (class starts, row bases of every (block,
stream) K pair, work items) from ``v_counts`` and ``k_bits`` with a few vectorised torch ops. They are
kept in a side cache keyed by the identity of the layer's ``v_counts`` tensor (dropped when that tensor
dies), never in the layer, so the layer's ``nbytes`` stays exactly what the cache holds; they are a few
integers per stream and K block.
"""
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from rdkv.errors import RDKVError
from rdkv.kernels.lse_merge import MERGE_BLOCK_D, MERGE_WARPS, _lse_merge
from rdkv.trizone import TriZoneLayer

LOG2E = 1.4426950408889634
K_WIDTHS = (0, 2, 4, 8, 16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------
# device code
# ---------------------------------------------------------------------------------------------------
# Only core builtins (tl.full, tl.reduce, ...) are called, not the @jit helpers of triton.language.standard
# (tl.zeros, tl.sum, tl.max): those are decorated when triton is first imported, so if something imported
# triton before TRITON_INTERPRET=1 was set (transformers does) they refuse to run in the interpreter.
# tl.reduce with the standard combine functions is exactly what tl.sum / tl.max expand to, and the
# interpreter recognises these two combiners and reduces with numpy instead of element by element.
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max


@triton.jit
def _q_block(q_row_ptrs, row_ok, perm_ptr, s, blk, KB: tl.constexpr, D: tl.constexpr, sqd, DOT: tl.constexpr):
    """q rows [BLOCK_M, KB] at the channels of permuted block ``blk`` of stream ``s``."""
    c = tl.arange(0, KB)
    ch = tl.load(perm_ptr + s * D + blk * KB + c).to(tl.int64)
    return tl.load(q_row_ptrs[:, None] + ch[None, :] * sqd, mask=row_ok[:, None], other=0.0)


@triton.jit
def _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, blk, rope_ptr, KB: tl.constexpr, D: tl.constexpr,
              sqd, DOT: tl.constexpr, PREC: tl.constexpr):
    """Add q . RoPE(kt) for pre-RoPE keys ``kt`` [KB, BLOCK_N] at the channels of permuted block ``blk``.

    Rotate-half RoPE turns channel c of a key at position p into k_c cos(p w_c) -/+ k_partner sin(p w_c), with
    partner = c +/- D/2. Collecting the terms per stored channel, q . RoPE(k) = sum_c k_c (q_c cos + sign_c
    q_partner(c) sin) (sign +1 below D/2, -1 above), so one block is rotated with its own channels only, in
    whatever order the permutation put them: two dots, against k * cos and k * sin. ``rope_ptr`` holds the
    layer's D/2 inverse frequencies, then RoPE's attention scaling (rdkv.rope)."""
    HALF: tl.constexpr = D // 2
    ch = tl.load(perm_ptr + s * D + blk * KB + tl.arange(0, KB)).to(tl.int64)
    low = ch < HALF
    partner = tl.where(low, ch + HALF, ch - HALF)
    qa = tl.load(q_row_ptrs[:, None] + ch[None, :] * sqd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qp = tl.load(q_row_ptrs[:, None] + partner[None, :] * sqd, mask=row_ok[:, None], other=0.0).to(tl.float32)
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
def _k_scores(scores, q_row_ptrs, row_ok, perm_ptr, s, i, tok_ok, tab_base,
              kord_ptr, krow_ptr, kgrp_ptr, kcls_ptr,
              codes_ptr, scale_ptr, zero_ptr, sqd,
              W: tl.constexpr, WI: tl.constexpr, KB: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
              K_GROUP: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_N: tl.constexpr,
              ROPE: tl.constexpr, kposf, rope_ptr):
    """Add q . K over the K blocks of width ``W`` (class index ``WI`` in 0,2,4,8,16) to ``scores``.

    ``i`` [BLOCK_N] are the tile's token indices inside the stream (int32). Codes are dequantized first
    (:func:`_dequant`), then dotted in the query dtype. Addresses are a scalar int64 base per block plus int32
    offsets per element. (Loading a tile's at most two scale groups as two [KB] vectors and selecting per token
    compiled to more instructions than this per-element gather: 1,326 against 1,099 per tile.)
    ``ROPE``: the keys were packed before RoPE; each dequantized block is rotated to the tile's positions
    ``kposf`` (:func:`_rope_dot`), width-0 blocks (the channel means, ``codes_ptr``) included."""
    j_lo = tl.load(kcls_ptr + s * 6 + WI)
    j_hi = tl.load(kcls_ptr + s * 6 + WI + 1)
    c = tl.arange(0, KB)
    for j in range(j_lo, j_hi):
        blk = tl.load(kord_ptr + tab_base + j)
        row0 = tl.load(krow_ptr + tab_base + j)  # int64 row of this (block, stream) pair's token 0
        if W == 0:  # only with ROPE: a mean's score depends on the position it is rotated to
            mean = tl.load(codes_ptr + row0 * KB + c).to(tl.float32)
            kt = tl.where(tok_ok[None, :], mean[:, None], 0.0)
            scores = _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, blk, rope_ptr, KB, D, sqd, DOT, PREC)
        elif W == 16:
            kt = tl.load(codes_ptr + row0 * KB + (i[None, :] * KB + c[:, None]), mask=tok_ok[None, :], other=0.0)
            if ROPE:
                scores = _rope_dot(scores, kt.to(tl.float32), kposf, q_row_ptrs, row_ok, perm_ptr, s, blk, rope_ptr,
                                   KB, D, sqd, DOT, PREC)
            else:
                qb = _q_block(q_row_ptrs, row_ok, perm_ptr, s, blk, KB, D, sqd, DOT)
                scores += tl.dot(qb.to(DOT), kt.to(DOT), input_precision=PREC)
        else:
            # packed bytes [RB, BN] unpacked in registers to [RB, PER, BN] -> [KB, BN] (channel = byte * PER + k)
            PER: tl.constexpr = 8 // W
            RB: tl.constexpr = KB * W // 8
            rb = tl.arange(0, RB)
            byte = tl.load(codes_ptr + row0 * RB + (i[None, :] * RB + rb[:, None]), mask=tok_ok[None, :], other=0)
            sh = tl.arange(0, PER) * W
            code = tl.reshape((byte.to(tl.int32)[:, None, :] >> sh[None, :, None]) & ((1 << W) - 1), [KB, BLOCK_N])
            gbase = tl.load(kgrp_ptr + tab_base + j)  # int64 first scale/zero group of the pair
            sz = gbase * KB + ((i // K_GROUP)[None, :] * KB + c[:, None])
            sc = tl.load(scale_ptr + sz, mask=tok_ok[None, :], other=0.0)
            zp = tl.load(zero_ptr + sz, mask=tok_ok[None, :], other=0.0)
            if ROPE:  # rotated in fp32
                kt = _dequant(code, sc, zp, tl.float32)
                scores = _rope_dot(scores, kt, kposf, q_row_ptrs, row_ok, perm_ptr, s, blk, rope_ptr, KB, D, sqd,
                                   DOT, PREC)
            else:
                kt = _dequant(code, sc, zp, DOT)
                qb = _q_block(q_row_ptrs, row_ok, perm_ptr, s, blk, KB, D, sqd, DOT)
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
              q_row_ptrs, row_ok, q_pos, bias, perm_ptr, s, b, tok0, tab_base,
              pos_ptr, mask_ptr, smb, sml, smk, q_l,
              kord_ptr, krow_ptr, kgrp_ptr, kcls_ptr,
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
            scores = _k_scores(scores, q_row_ptrs, row_ok, perm_ptr, s, i, tok_ok, tab_base, kord_ptr, krow_ptr,
                               kgrp_ptr, kcls_ptr, k0m, k0m, k0m, sqd, 0, 0, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                               ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, row_ok, perm_ptr, s, i, tok_ok, tab_base, kord_ptr, krow_ptr,
                           kgrp_ptr, kcls_ptr, k2c, k2s, k2z, sqd, 2, 1, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                           ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, row_ok, perm_ptr, s, i, tok_ok, tab_base, kord_ptr, krow_ptr,
                           kgrp_ptr, kcls_ptr, k4c, k4s, k4z, sqd, 4, 2, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                           ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, row_ok, perm_ptr, s, i, tok_ok, tab_base, kord_ptr, krow_ptr,
                           kgrp_ptr, kcls_ptr, k8c, k8s, k8z, sqd, 8, 3, KB, D, NB, K_GROUP, DOT, PREC, BLOCK_N,
                           ROPE, kposf, rope_ptr)
        scores = _k_scores(scores, q_row_ptrs, row_ok, perm_ptr, s, i, tok_ok, tab_base, kord_ptr, krow_ptr,
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
    q_ptr, sqb, sqh, sql, sqd,
    out_ptr, lse_ptr,
    pos_ptr, perm_ptr, tok0_ptr, vcls_ptr, vbase_ptr,
    kord_ptr, krow_ptr, kgrp_ptr, kcls_ptr,
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
    d = tl.arange(0, D_PAD)
    d_ok = d < D

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
        tab_base = s * NB
        # width-0 K blocks: every kept token has the channel means, a constant score per query row
        # (unless ROPE rotates the means to each token's position: then _k_scores adds them per tile)
        bias = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        if not ROPE:
            cK = tl.arange(0, KB)
            for j in range(tl.load(kcls_ptr + s * 6), tl.load(kcls_ptr + s * 6 + 1)):
                blk = tl.load(kord_ptr + tab_base + j)
                row0 = tl.load(krow_ptr + tab_base + j)
                qb = _q_block(q_row_ptrs, row_ok, perm_ptr, s, blk, KB, D, sqd, DOT).to(tl.float32)
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
                                      row_ok, q_pos, bias, perm_ptr, s, b, tok0, tab_base, pos_ptr, mask_ptr, smb, sml,
                                      smk, q_l, kord_ptr, krow_ptr, kgrp_ptr, kcls_ptr, k0m, k2c, k2s, k2z, k4c, k4s,
                                      k4z, k8c, k8s, k8z, k16, vc, vs, vz, sqd, window, softcap, 2 << c, KB, D, D_PAD,
                                      NB, K_GROUP, VG2, VG4, VG8, BLOCK_N, DOT, PREC, HAS_WINDOW, HAS_MASK, SOFTCAP,
                                      BLOCK_M, scale2, ROPE, rope_ptr)
    else:
        cid = pid - n_ab
        s = cid // c_chunks
        lo = (cid % c_chunks) * SPLIT
        hi = tl.minimum(lo + SPLIT, n_c)
        b = s // H
        h = s % H
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

    # normalised partial output and its base-2 log-sum-exp (-inf when the chunk saw nothing)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    base = pid.to(tl.int64) * GL
    tl.store(out_ptr + (base + m)[:, None] * D + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + base + m, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------
@dataclass
class Tables:
    """Per-layer offsets derived from ``v_counts`` / ``k_bits`` (see module docstring)."""

    tok0: torch.Tensor  # [S] int64 first kept token of each stream (index into pos)
    vcls: torch.Tensor  # [S, 5] int32 class boundaries inside the stream (0, c2, c2+c4, ..., n)
    vbase: torch.Tensor  # [S, 4] int64 row of token i of class c in v{w} is vbase[s, c] + i
    kord: torch.Tensor  # [S, NB] int32 permuted block indices sorted by width
    krow: torch.Tensor  # [S, NB] int64 row base (pair index for width 0) per entry of kord
    kgrp: torch.Tensor  # [S, NB] int64 scale/zero group base per entry of kord
    kcls: torch.Tensor  # [S, 6] int32 boundaries of widths 0,2,4,8,16 inside kord
    wi_s: torch.Tensor  # [n_ab] int32 stream of each zone A+B work item
    wi_lo: torch.Tensor  # [n_ab] int32 first token of each work item
    ab_first: torch.Tensor  # [S] int32 first work item of each stream
    ab_cnt: torch.Tensor  # [S] int32 work items of each stream
    n_ab: int
    split: int


_TABLES: dict[tuple, tuple[weakref.ref, Tables]] = {}


def _excl(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def build_tables(layer: TriZoneLayer, split: int) -> Tables:
    t, spec = layer.t, layer.spec
    dev = t["v_counts"].device
    S = layer.batch * layer.heads
    NB = layer.head_dim // spec.k_block
    counts = t["v_counts"].long()  # [S, 4]
    n = counts.sum(1)
    tok0 = _excl(n)
    cstart = _excl(counts, 1)
    vcls = torch.cat([cstart, n.unsqueeze(1)], 1).to(torch.int32)
    vbase = _excl(counts, 0) - cstart  # row = (rows of class c in earlier streams) + (i - class start)
    k_bits = t["k_bits"].long()
    kord = torch.zeros(S, NB, dtype=torch.long, device=dev)
    krow = torch.zeros(S, NB, dtype=torch.long, device=dev)
    kgrp = torch.zeros(S, NB, dtype=torch.long, device=dev)
    widx = torch.full_like(k_bits, -1)
    for wi, w in enumerate(K_WIDTHS):
        widx[k_bits == w] = wi
    if (widx < 0).any():
        raise RDKVError(f"k_bits holds widths outside {K_WIDTHS}: the layer is corrupt")
    kord = (widx * NB + torch.arange(NB, device=dev)).argsort(1)  # stable: blocks sorted by width
    kcnt = torch.stack([(widx == wi).sum(1) for wi in range(len(K_WIDTHS))], 1)
    kcls = torch.cat([torch.zeros(S, 1, dtype=torch.long, device=dev), kcnt.cumsum(1)], 1).to(torch.int32)
    for w in K_WIDTHS:
        blk, s = torch.nonzero(k_bits.T == w, as_tuple=True)  # pairs of width w, block-major
        rows = n[s]
        groups = torch.div(rows + spec.k_group - 1, spec.k_group, rounding_mode="floor")
        base = torch.arange(len(s), device=dev) if w == 0 else _excl(rows)
        krow_full = torch.zeros(S, NB, dtype=torch.long, device=dev)
        kgrp_full = torch.zeros(S, NB, dtype=torch.long, device=dev)
        krow_full[s, blk] = base
        kgrp_full[s, blk] = _excl(groups)
        sel = k_bits.gather(1, kord) == w
        krow = torch.where(sel, krow_full.gather(1, kord), krow)
        kgrp = torch.where(sel, kgrp_full.gather(1, kord), kgrp)
    chunks = torch.div(n + split - 1, split, rounding_mode="floor")
    n_ab = int(chunks.sum())
    wi_s = torch.repeat_interleave(torch.arange(S, device=dev), chunks)
    ab_first = _excl(chunks)
    wi_lo = (torch.arange(n_ab, device=dev) - ab_first[wi_s]) * split
    i32 = torch.int32
    return Tables(tok0, vcls, vbase, kord.to(i32).contiguous(), krow.contiguous(), kgrp.contiguous(), kcls.contiguous(),
                  wi_s.to(i32), wi_lo.to(i32), ab_first.to(i32), chunks.to(i32), n_ab, split)


def tables(layer: TriZoneLayer, split: int) -> Tables:
    """The layer's offset tables, built once per (layer tensors, split) and dropped with the layer."""
    vc = layer.t["v_counts"]
    key = (id(vc), split)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is vc:
        return hit[1]
    tab = build_tables(layer, split)
    _TABLES[key] = (weakref.ref(vc), tab)
    weakref.finalize(vc, _TABLES.pop, key, None)
    return tab


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of the decode kernel; a field left ``None`` takes the default of :func:`launch_config`.

    ``block_n``: tokens per tile (a power of two >= 16); ``num_warps``; ``num_stages``: software pipelining
    depth of the tile loops; ``maxnreg``: register cap per thread (lets ptxas use every register instead of
    spilling, or trades registers for programs per SM); ``split``: tokens per work item (a multiple of
    ``block_n`` after rounding up). ``scripts/bench_decode.py --sweep`` times a list of these.
    """

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    maxnreg: int | None = None
    split: int | None = None

    def check(self) -> None:
        for f in fields(self):
            name, x = f.name, getattr(self, f.name)
            if x is not None and (not isinstance(x, int) or isinstance(x, bool) or x < 1):
                raise RDKVError(f"LaunchConfig.{name} must be a positive int or None, got {x!r}")
        if self.block_n is not None and (self.block_n < 16 or self.block_n & (self.block_n - 1)):
            raise RDKVError(f"LaunchConfig.block_n must be a power of two >= 16 (a tl.dot shape), got {self.block_n}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise RDKVError(f"LaunchConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise RDKVError(f"LaunchConfig.maxnreg must be in 24..255 (registers per thread), got {self.maxnreg}")


def launch_config(D: int, block_m: int, dtype: torch.dtype = torch.float16, rope: bool = False,
                  override: LaunchConfig | None = None) -> LaunchConfig:
    """Launch settings per head_dim, query-row block, dtype and key layout (``rope``: pre-RoPE keys), chosen so
    no variant spills registers (checked by scripts/compile_check.py); fields set in ``override`` win.
    ``split`` stays ``None`` unless overridden (:func:`choose_split` picks it per layer)."""
    o = override or LaunchConfig()
    o.check()
    block_n = 64 if D <= 128 else 32
    warps = o.num_warps or (4 if D <= 64 else 8)
    maxnreg = None
    if dtype == torch.float32:  # fp32 operands take twice the registers of fp16 ones
        block_n, maxnreg = 16, min(255, 65536 // (32 * warps))
    elif rope:  # left alone, ptxas stops at 168 registers and spills ~1 KB at head_dim 64 (sm_90)
        maxnreg = 255
    return LaunchConfig(o.block_n or block_n, warps, o.num_stages or 1, o.maxnreg or maxnreg, o.split)


def block_m_for(rows: int, dtype: torch.dtype = torch.float16) -> int:
    """Query rows per program: >= 16 for tl.dot, <= 32 (16 for fp32) to bound registers; more rows tile
    the second grid axis."""
    return min(16 if dtype == torch.float32 else 32, max(16, _pow2(rows)))


def choose_split(layer: TriZoneLayer, q: torch.Tensor, cfg: LaunchConfig) -> int:
    """Tokens per zone A+B work item (``cfg.split`` if set): about two work items per SM over the whole layer,
    >= 256, rounded up to whole tiles."""
    split = cfg.split
    if not split:
        n_tok = int(layer.t["pos"].numel())
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        split = min(max(-(-n_tok // max(1, 2 * sms)), 256), 8192)
    return -(-split // cfg.block_n) * cfg.block_n


_DOT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def check(query: torch.Tensor, layer: TriZoneLayer, softcap, mask) -> None:
    if not isinstance(layer, TriZoneLayer):
        raise RDKVError(f"the Triton decode kernel takes a TriZoneLayer, got {type(layer).__name__}")
    if query.dim() != 4:
        raise RDKVError(f"query must be [B, Hq, L, D], got shape {tuple(query.shape)}")
    B, Hq, L, D = query.shape
    if B != layer.batch or D != layer.head_dim or Hq % layer.heads:
        raise RDKVError(f"query [B={B}, Hq={Hq}, L={L}, D={D}] does not fit the layer (batch {layer.batch}, "
                        f"{layer.heads} KV heads, head_dim {layer.head_dim})")
    if query.dtype not in DTYPES:
        raise RDKVError(f"Triton decode supports fp16/bf16/fp32 queries, got {query.dtype}")
    if query.device != layer.device:
        raise RDKVError(f"query is on {query.device}, the cache on {layer.device}")
    kb = layer.spec.k_block
    if kb < 16 or kb & (kb - 1):
        raise RDKVError(f"Triton decode needs k_block a power of two >= 16 (tl.dot shapes), the layer has k_block={kb}")
    if D > 256 or D < 16 or D & (D - 1):
        raise RDKVError(f"Triton decode supports head_dim a power of two in 16..256, got {D}")
    vg = layer.spec.v_group
    if any(g & (g - 1) for g in ([vg] if isinstance(vg, int) else vg)):
        raise RDKVError(f"Triton decode needs v_group a power of two (register unpacking), the layer has v_group={vg}")
    if L < 1:
        raise RDKVError("Triton decode needs at least one query position")
    rope = layer.t.get("rope")
    if rope is not None and (rope.dtype != torch.float32 or rope.shape != (D // 2 + 1,)):
        raise RDKVError(f"the layer's RoPE table must be float32 [head_dim/2 + 1] = [{D // 2 + 1}], got {rope.dtype} "
                        f"{tuple(rope.shape)}: the cache is corrupt")
    if softcap is not None and not softcap > 0:
        raise RDKVError(f"softcap must be positive, got {softcap}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise RDKVError(f"Triton decode expects a boolean attention mask, got {mask.dtype}")
        seq = layer.get_seq_length()
        if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] != 1 or mask.shape[2] != L or mask.shape[3] < seq:
            raise RDKVError(f"attention mask must be [B, 1, L, >= {seq}], got {tuple(mask.shape)}")


def trizone_decode(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                   softcap: float | None = None, mask: torch.Tensor | None = None,
                   launch: LaunchConfig | None = None) -> torch.Tensor:
    """query [B, Hq, L, D] (the L newest tokens, already appended to zone C) -> out [B, Hq, L, D].

    Same contract as :func:`rdkv.reference.trizone_attention`, computed by the fused kernel; ``launch``
    overrides the default launch settings (:class:`LaunchConfig`).
    """
    check(query, layer, softcap, mask)
    B, Hq, L, D = query.shape
    H = layer.heads
    G, S = Hq // H, B * H
    t, spec = layer.t, layer.spec
    GL = G * L
    block_m = block_m_for(GL, query.dtype)
    m_blocks = -(-GL // block_m)
    cfg = launch_config(D, block_m, query.dtype, override=launch)
    segs = layer.segments()
    tabs = [tables(seg, choose_split(seg, query, cfg)) for seg in segs]
    seq = layer.get_seq_length()
    window = sliding_window if layer.sliding_window is None else layer.sliding_window
    kc, vc = t["kc"], t["vc"]
    n_c = kc.shape[2]
    split_c = tabs[0].split
    c_chunks = -(-n_c // split_c)
    # partial results: segment 0's chunks, zone C's, then each fold's
    sizes = [tabs[0].n_ab + S * c_chunks] + [tab.n_ab for tab in tabs[1:]]
    offs = [0] + list(itertools.accumulate(sizes))[:-1]
    n_prog = sum(sizes)
    out = torch.empty(B, Hq, L, D, dtype=query.dtype, device=query.device)
    part = torch.empty(max(1, n_prog), GL, D, dtype=torch.float32, device=query.device)
    lse = torch.empty(max(1, n_prog), GL, dtype=torch.float32, device=query.device)
    dev = query.device

    if mask is not None:
        m8 = mask.view(torch.uint8)  # same element size: a view for any strides
        smb = m8.stride(0) if mask.shape[0] > 1 else 0
        mask_args = (m8, smb, m8.stride(2), m8.stride(3))
    else:
        mask_args = (out, 0, 0, 0)
    for j, (seg, tab, off, size) in enumerate(zip(segs, tabs, offs, sizes)):
        if not size:
            continue
        st = seg.t

        def get(name: str, dtype=torch.float16) -> torch.Tensor:
            x = st.get(name)
            return x if x is not None and x.numel() else torch.zeros(1, dtype=dtype, device=dev)

        seg_cfg = launch_config(D, block_m, query.dtype, "rope" in st, launch)
        _trizone_attn[(size, m_blocks)](
            query, *query.stride(), part[off:], lse[off:],
            st["pos"], st["k_perm"], tab.tok0, tab.vcls, tab.vbase, tab.kord, tab.krow, tab.kgrp, tab.kcls,
            tab.wi_s, tab.wi_lo,
            get("k0.mean"),
            get("k2.codes", torch.uint8), get("k2.scale"), get("k2.zero"),
            get("k4.codes", torch.uint8), get("k4.scale"), get("k4.zero"),
            get("k8.codes", torch.uint8), get("k8.scale"), get("k8.zero"), get("k16", layer.dtype16),
            get("v2.codes", torch.uint8), get("v2.scale"), get("v2.zero"),
            get("v4.codes", torch.uint8), get("v4.scale"), get("v4.zero"),
            get("v8.codes", torch.uint8), get("v8.scale"), get("v8.zero"), get("v16", layer.dtype16),
            kc, *kc.stride(), vc, *vc.stride(), *mask_args, get("rope", torch.float32),
            tab.n_ab, n_c if j == 0 else 0, max(1, c_chunks), layer.c_start, seq, float(scaling) * LOG2E,
            int(window) if window is not None else 0, float(softcap) if softcap is not None else 1.0,
            H, G, L, tab.split,
            K_GROUP=spec.k_group, D=D, D_PAD=_pow2(D), KB=spec.k_block, NB=D // spec.k_block,
            VG2=spec.v_group_of(2), VG4=spec.v_group_of(4), VG8=spec.v_group_of(8), BLOCK_M=block_m, BLOCK_N=cfg.block_n, DOT=_DOT[query.dtype],
            PREC="ieee" if query.dtype == torch.float32 else "tf32",
            HAS_WINDOW=window is not None, HAS_MASK=mask is not None, SOFTCAP=softcap is not None,
            ROPE="rope" in st, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **({"maxnreg": seg_cfg.maxnreg} if seg_cfg.maxnreg else {}),
        )
    if len(tabs) == 1:
        seg_first, seg_cnt = tabs[0].ab_first, tabs[0].ab_cnt
    else:
        seg_first = torch.stack([tab.ab_first + off for tab, off in zip(tabs, offs)])
        seg_cnt = torch.stack([tab.ab_cnt for tab in tabs])
    block_d = min(D, MERGE_BLOCK_D)
    _lse_merge[(S, m_blocks * (D // block_d))](part, lse, seg_first, seg_cnt, len(tabs), out, tabs[0].n_ab,
                                  c_chunks, H, G, L, D=D, BLOCK_D=block_d, BLOCK_M=block_m,
                                  num_warps=MERGE_WARPS)
    return out
