"""The token-weight pass in Triton: attention column sums without a T x T tensor.

Computes what :func:`rdkv.dense.attend` accumulates into :class:`~rdkv.dense.AttentionSums`
(without the attention output): for queries q [B, Hq, M, D] over keys k [B, H, T, D] (GQA: ``Hq = H *
G``), with causality from absolute positions, an optional sliding window, softcap and key-validity mask,

* ``mass[b, h, t]``  = sum over the G grouped heads and M queries of the softmax probability p on key t,
* ``mass2[b, h, t]`` = the same sum of p^2,
* ``q2[b, h, d]``    = sum of q^2 over the (head, query) rows that see at least one key,
* ``nq[b]``          = the number of those rows (counted once, for KV head 0, as ``attend`` does).

Two launches, nothing of size M x T ever leaves registers:

1. ``_tw_rows``, grid ``(row blocks, B * H)``: one program takes ``BLOCK_M`` of the ``G * M`` query rows
   of one KV head (head-major, as the decode kernel) and walks all keys in tiles of ``BLOCK_N`` with an
   online softmax, writing each row's max (base 2) and denominator, ``[B * H, G * M]`` fp32 each, plus
   its block's partial ``q2`` ``[B * H, row blocks, D]`` (summed over blocks by the launcher).
2. ``_tw_cols``, grid ``(key tiles, B * H)``: one program owns ``BLOCK_N`` keys, keeps their K tile in
   registers, and walks every row block, recomputing the scores and normalising them with the row
   statistics of pass 1; column sums of p and p^2 accumulate in registers and are written once, so no
   atomics are needed and the result is deterministic.

Scores are ``q.k * scaling`` in fp32 (``tl.dot`` in the input dtype with fp32 accumulation: fp16 / bf16
products are exact in fp32, fp32 inputs use "ieee" dots), optionally soft-capped (``softcap *
tanh(s / softcap)``), then converted to base 2 for ``exp2``. Positions, window and key mask are
compile-time flags and runtime values; T and the window are not value-specialised, so a model compiles
one variant per (D, dtype, flags) and never recompiles as its context grows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rdkv.dense import AttentionSums
from rdkv.errors import RDKVError

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# core builtins only (see kernels/device/page_decode.py): tl.reduce with the standard combiners
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max


# ---------------------------------------------------------------------------------------------------
# device code
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _tile_scores(qv, kt, qpos, kpos, row_ok, tok_ok, b, scaling, window, softcap, mask_ptr, smb, smt, t,
                 DOT: tl.constexpr, PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """Base-2 scores [BLOCK_M, BLOCK_N] of query rows ``qv`` against the key tile ``kt`` [D_PAD, BLOCK_N],
    and which of them are visible (causal by position, window, key mask)."""
    s = tl.dot(qv.to(DOT), kt.to(DOT), input_precision=PREC) * scaling
    if SOFTCAP:
        e = tl.exp(2.0 * (s / softcap))
        s = softcap * (1.0 - 2.0 / (e + 1.0))  # softcap * tanh(s / softcap); exp overflow gives +-softcap
    s = s * LOG2E_C
    ok = row_ok[:, None] & tok_ok[None, :] & (kpos[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        ok = ok & (qpos[:, None] - kpos[None, :] < window)
    if HAS_MASK:
        valid = tl.load(mask_ptr + b * smb + t.to(tl.int64) * smt, mask=tok_ok, other=0)
        ok = ok & (valid != 0)[None, :]
    return s, ok


@triton.jit
def _q_rows(q_ptr, sqb, sqh, sqm, sqd, b, h, G, M, r, row_ok, d, d_ok):
    """Query rows ``r`` (head-major over the G heads of KV head h) and their positions' index l."""
    g = r // M
    l = r % M
    base = b.to(tl.int64) * sqb + (h * G + g).to(tl.int64) * sqh + l.to(tl.int64) * sqm
    qv = tl.load(q_ptr + base[:, None] + d[None, :].to(tl.int64) * sqd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return qv, l


@triton.jit(do_not_specialize=["T", "window"])
def _tw_rows(q_ptr, sqb, sqh, sqm, sqd, k_ptr, skb, skh, skt, skd, qpos_ptr, kpos_ptr, mask_ptr, smb, smt,
             mrow_ptr, lrow_ptr, q2_ptr, H, G, M, T, scaling, window, softcap,
             D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             DOT: tl.constexpr, PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
             SOFTCAP: tl.constexpr):
    """Pass 1: per query row, the running max (base 2) and softmax denominator over all T keys."""
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    GM = G * M
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < GM
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    qv, l = _q_rows(q_ptr, sqb, sqh, sqm, sqd, b, h, G, M, r, row_ok, d, d_ok)
    qpos = tl.load(qpos_ptr + l, mask=row_ok, other=0)
    k_base = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    for t0 in range(0, T, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tok_ok = t < T
        kt = tl.load(k_base + t[None, :].to(tl.int64) * skt + d[:, None] * skd, mask=tok_ok[None, :] & d_ok[:, None], other=0.0)
        kpos = tl.load(kpos_ptr + t, mask=tok_ok, other=0)
        s, ok = _tile_scores(qv, kt, qpos, kpos, row_ok, tok_ok, b, scaling, window, softcap, mask_ptr, smb, smt, t,
                             DOT, PREC, HAS_WINDOW, HAS_MASK, SOFTCAP)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: no -inf - -inf
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.reduce(p, 1, _add)
        m_i = m_new
    row = bh.to(tl.int64) * GM + r
    tl.store(mrow_ptr + row, m_i, mask=row_ok)
    tl.store(lrow_ptr + row, l_i, mask=row_ok)
    qf = qv.to(tl.float32)
    live = l_i > 0  # the row saw at least one key
    q2 = tl.reduce(tl.where(live[:, None], qf * qf, 0.0), 0, _add)
    tl.store(q2_ptr + (bh.to(tl.int64) * tl.num_programs(0) + rb) * D + d, q2, mask=d_ok)


@triton.jit(do_not_specialize=["T", "window"])
def _tw_cols(q_ptr, sqb, sqh, sqm, sqd, k_ptr, skb, skh, skt, skd, qpos_ptr, kpos_ptr, mask_ptr, smb, smt,
             mrow_ptr, lrow_ptr, mass_ptr, mass2_ptr, H, G, M, T, scaling, window, softcap,
             D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             DOT: tl.constexpr, PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr,
             SOFTCAP: tl.constexpr):
    """Pass 2: column sums of the normalised p and p^2 for one tile of keys over every query row."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    GM = G * M
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tok_ok = t < T
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    k_base = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    kt = tl.load(k_base + t[None, :].to(tl.int64) * skt + d[:, None] * skd, mask=tok_ok[None, :] & d_ok[:, None], other=0.0)
    kpos = tl.load(kpos_ptr + t, mask=tok_ok, other=0)
    mass = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    mass2 = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for r0 in range(0, GM, BLOCK_M):
        r = r0 + tl.arange(0, BLOCK_M)
        row_ok = r < GM
        qv, l = _q_rows(q_ptr, sqb, sqh, sqm, sqd, b, h, G, M, r, row_ok, d, d_ok)
        qpos = tl.load(qpos_ptr + l, mask=row_ok, other=0)
        s, ok = _tile_scores(qv, kt, qpos, kpos, row_ok, tok_ok, b, scaling, window, softcap, mask_ptr, smb, smt, t,
                             DOT, PREC, HAS_WINDOW, HAS_MASK, SOFTCAP)
        row = bh.to(tl.int64) * GM + r
        m = tl.load(mrow_ptr + row, mask=row_ok, other=0.0)
        den = tl.load(lrow_ptr + row, mask=row_ok, other=0.0)
        m = tl.where(m == float("-inf"), 0.0, m)
        inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
        p = tl.where(ok, tl.exp2(s - m[:, None]), 0.0) * inv[:, None]
        mass += tl.reduce(p, 0, _add)
        mass2 += tl.reduce(p * p, 0, _add)
    dst = bh.to(tl.int64) * T + t
    tl.store(mass_ptr + dst, mass, mask=tok_ok)
    tl.store(mass2_ptr + dst, mass2, mask=tok_ok)


# ---------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------
def _pow2(x: int) -> int:
    return 1 << max(0, (max(1, x) - 1).bit_length())


_DOT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def launch_config(D: int, rows: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tiles sized so no variant spills (scripts/compile_check.py)."""
    d_pad = max(16, _pow2(D))
    block_m = min(64, max(16, _pow2(rows)))
    block_n = 64 if d_pad <= 128 else 32
    if dtype == torch.float32:  # fp32 tiles take twice the registers
        block_m, block_n = min(block_m, 32), block_n // 2
    warps = 4 if d_pad <= 64 else 8
    return block_m, block_n, warps


def check(q, k, q_pos, k_pos, window, softcap, key_mask) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise RDKVError(f"token weights take q [B, Hq, M, D] and k [B, H, T, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, M, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or k.shape[1] == 0 or Hq % k.shape[1]:
        raise RDKVError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}: same batch and head_dim, Hq a "
                        "multiple of the KV heads")
    if q.dtype not in DTYPES or k.dtype not in DTYPES:
        raise RDKVError(f"token weights support fp16/bf16/fp32, got q {q.dtype}, k {k.dtype}")
    if not 1 <= D <= 256:
        raise RDKVError(f"token weights keep a K tile in registers: head_dim must be <= 256, got {D}")
    if q.device != k.device:
        raise RDKVError(f"q is on {q.device}, k on {k.device}")
    T = k.shape[2]
    if q_pos.shape != (M,) or k_pos.shape != (T,):
        raise RDKVError(f"q_pos must be [M={M}] and k_pos [T={T}], got {tuple(q_pos.shape)} and {tuple(k_pos.shape)}")
    if q_pos.dtype.is_floating_point or k_pos.dtype.is_floating_point:
        raise RDKVError("q_pos / k_pos must be integer positions")
    if softcap is not None and not softcap > 0:
        raise RDKVError(f"softcap must be positive, got {softcap}")
    if window is not None and not window > 0:
        raise RDKVError(f"sliding window must be positive, got {window}")
    if key_mask is not None:
        if key_mask.dtype != torch.bool or key_mask.dim() != 2 or key_mask.shape[0] not in (1, B) or key_mask.shape[1] != T:
            raise RDKVError(f"key mask must be bool [B or 1, T={T}], got {key_mask.dtype} {tuple(key_mask.shape)}")
        if key_mask.device != q.device:
            raise RDKVError(f"key mask is on {key_mask.device}, q on {q.device}")


def attention_sums(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scaling: float,
                   window: int | None = None, softcap: float | None = None,
                   key_mask: torch.Tensor | None = None) -> AttentionSums:
    """AttentionSums of queries q [B, Hq, M, D] (absolute positions q_pos [M]) over keys k [B, H, T, D]
    (positions k_pos [T]); ``key_mask`` [B or 1, T] bool marks keys that may be attended at all.

    Equal, up to fp32 summation order, to the sums of :func:`rdkv.dense.attend` called with
    ``mask = key_mask[:, None, None, :]`` broadcast over the queries (``rdkv.weights``' window form).
    """
    check(q, k, q_pos, k_pos, window, softcap, key_mask)
    B, Hq, M, D = q.shape
    H, T = k.shape[1], k.shape[2]
    G, GM = Hq // H, (Hq // H) * M
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    mass, mass2 = torch.zeros(B, H, T, **f32), torch.zeros(B, H, T, **f32)
    q2, nq = torch.zeros(B, H, D, **f32), torch.zeros(B, **f32)
    if not (M and T and Hq):
        return AttentionSums(mass, mass2, q2, nq)
    dot_t = q.dtype if q.dtype == k.dtype else torch.float32
    block_m, block_n, warps = launch_config(D, GM, dot_t)
    n_rb = triton.cdiv(GM, block_m)
    mrow, lrow = torch.empty(B * H, GM, **f32), torch.empty(B * H, GM, **f32)
    q2_part = torch.empty(B * H, n_rb, D, **f32)
    qp, kp = q_pos.to(device=dev, dtype=torch.int32).contiguous(), k_pos.to(device=dev, dtype=torch.int32).contiguous()
    if key_mask is not None:
        m8 = key_mask.view(torch.uint8)
        mask_args = (m8, m8.stride(0) if key_mask.shape[0] > 1 else 0, m8.stride(1))
    else:
        mask_args = (qp, 0, 0)
    common = (q, *q.stride(), k, *k.stride(), qp, kp, *mask_args, mrow, lrow)
    runtime = (H, G, M, T, float(scaling), int(window) if window is not None else 0,
               float(softcap) if softcap is not None else 1.0)
    consts = dict(D=D, D_PAD=max(16, _pow2(D)), BLOCK_M=block_m, BLOCK_N=block_n, DOT=_DOT[dot_t],
                  PREC="ieee" if dot_t == torch.float32 else "tf32", HAS_WINDOW=window is not None,
                  HAS_MASK=key_mask is not None, SOFTCAP=softcap is not None, num_warps=warps, num_stages=1)
    _tw_rows[(n_rb, B * H)](*common, q2_part, *runtime, **consts)
    _tw_cols[(triton.cdiv(T, block_n), B * H)](*common, mass, mass2, *runtime, **consts)
    q2 = q2_part.sum(1).view(B, H, D)
    nq = (lrow.view(B, H, GM)[:, 0] > 0).sum(-1).to(torch.float32)
    return AttentionSums(mass, mass2, q2, nq)
