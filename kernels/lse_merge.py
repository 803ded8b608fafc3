"""Split-K partial attention results: how a work item makes one and how the partials merge (shared by the TriZone
and the full-cache kernels).

A work item folds its tiles into an online softmax (:func:`_online_step`, scores in base 2) and writes
(:func:`_store_partial`) a normalised partial output ``o_k`` [G*L, D] (fp32) and its
base-2 log-sum-exp ``lse_k`` [G*L] (``-inf`` when the item saw no key). :func:`_lse_merge` combines the items of
each stream: ``out = sum_k 2^(lse_k - lse) o_k`` with ``lse = log2 sum_k 2^lse_k``, guarding the all-``-inf``
case (output 0). Items are addressed as runs: ``n_seg`` runs given by ``seg_first``/``seg_cnt`` [n_seg, S],
then ``c_chunks`` items per stream from ``c_base + s * c_chunks``.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)

# Only core builtins (tl.full, tl.reduce, ...) are called, not the @jit helpers of triton.language.standard
# (tl.zeros, tl.sum, tl.max): those are decorated when triton is first imported, so if something imported
# triton before TRITON_INTERPRET=1 was set (transformers does) they refuse to run in the interpreter.
# tl.reduce with the standard combine functions is exactly what tl.sum / tl.max expand to, and the
# interpreter recognises these two combiners and reduces with numpy instead of element by element.
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max

MERGE_BLOCK_D = 64  # the merge tiles D too, so its fp32 tiles stay small (no spills at D=256)
MERGE_WARPS = 4


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


@triton.jit
def _store_partial(out_ptr, lse_ptr, pid, GL, m, row_ok, m_i, l_i, acc, D: tl.constexpr):
    """The program's normalised partial output and its base-2 log-sum-exp (-inf when the chunk saw nothing)."""
    d = tl.arange(0, D)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    base = pid.to(tl.int64) * GL
    tl.store(out_ptr + (base + m)[:, None] * D + d[None, :], o, mask=row_ok[:, None])
    tl.store(lse_ptr + base + m, lse, mask=row_ok)


@triton.jit
def _merge_in(p, mx, wsum, acc, part_ptr, lse_ptr, GL, m, d, row_ok, om, D: tl.constexpr):
    """Fold partial result ``p`` into the running (max, weight sum, weighted output) of a merge."""
    lse = tl.load(lse_ptr + p * GL + m, mask=row_ok, other=float("-inf"))
    new = tl.maximum(mx, lse)
    safe = tl.where(new == float("-inf"), 0.0, new)  # -inf - -inf would be NaN
    alpha = tl.exp2(mx - safe)
    w = tl.exp2(lse - safe)
    o = tl.load(part_ptr + (p * GL + m)[:, None] * D + d[None, :], mask=om, other=0.0)
    return new, wsum * alpha + w, acc * alpha[:, None] + w[:, None] * o


@triton.jit
def _lse_merge(part_ptr, lse_ptr, seg_first_ptr, seg_cnt_ptr, n_seg, out_ptr, c_base, c_chunks, H, G, L,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[b, h*G+g, l] = sum_k 2^(lse_k - lse) o_k over stream ``s``'s items (zero if none saw a key): the
    runs ``seg_first``/``seg_cnt`` [n_seg, S], then ``c_chunks`` items from ``c_base + s * c_chunks``.
    Grid (S, query-row blocks x D / BLOCK_D); ``out`` is [B, H*G, L, D] contiguous."""
    s = tl.program_id(0)
    S = tl.num_programs(0)
    ND: tl.constexpr = D // BLOCK_D
    mb = tl.program_id(1) // ND
    GL = G * L
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < GL
    d = (tl.program_id(1) % ND) * BLOCK_D + tl.arange(0, BLOCK_D)
    om = row_ok[:, None] & (d < D)[None, :]
    mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    wsum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for j in range(n_seg):
        first = tl.load(seg_first_ptr + j * S + s)
        for k in range(tl.load(seg_cnt_ptr + j * S + s)):
            mx, wsum, acc = _merge_in((first + k).to(tl.int64), mx, wsum, acc, part_ptr, lse_ptr, GL, m, d, row_ok, om, D)
    for k in range(c_chunks):
        mx, wsum, acc = _merge_in((c_base + s * c_chunks + k).to(tl.int64), mx, wsum, acc, part_ptr, lse_ptr, GL, m, d,
                                  row_ok, om, D)
    res = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
    b = s // H
    h = s % H
    g = m // L
    q_l = m % L
    dst = ((b * H * G + h * G + g).to(tl.int64) * L + q_l)[:, None] * D + d[None, :]
    tl.store(out_ptr + dst, res.to(out_ptr.dtype.element_ty), mask=om)
