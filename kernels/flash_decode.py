"""Split-K flash-decoding over a full 16-bit KV cache: the anchor every TriZone speed ratio is measured against.

``flash_decode(q [B, Hq, L, D], k, v [B, H, T, D], scaling) -> [B, Hq, L, D]`` is causal attention of the L
newest positions (``T - L .. T - 1``) over the whole cache, grouped-query (``Hq = G * H``). It is built to
stream the cache at the memory-bandwidth limit, so that "x times faster than the full cache" means faster
than a good kernel, not than a weak one:

* **Work items.** Each (batch, KV head) stream's T tokens are cut into ``split`` tokens; one program per
  (item, query-row block). ``split`` is chosen so the grid holds about ``WAVES`` programs per SM, which keeps
  every SM busy at batch 1 (where one program per stream would use 8 of 132 SMs) and caps the partials the
  merge reads at batch 8.
* **Query rows.** The ``G`` heads sharing a KV head and the ``L`` positions are ``G * L`` rows of one tile
  (padded to 16 for ``tl.dot``), so K and V are read once per stream, not once per query head.
* **Tiles.** ``BLOCK_N`` tokens x D channels of K and V, rows contiguous, loaded with ``tl.range(...,
  num_stages=NUM_STAGES)`` so the next tiles' loads are in flight while this one is computed (cp.async on
  sm_80+); the bytes in flight per SM are what Little's law needs to cover DRAM latency (docs/kernels.md).
* Scores in base 2, online softmax in fp32, dots in the cache dtype with fp32 accumulation; the partials go
  through :func:`rdkv.kernels.lse_merge._lse_merge`, the same merge the TriZone kernel uses.

The reference is :func:`rdkv.dense.attend` (exact attention in torch).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rdkv.errors import RDKVError
from rdkv.kernels.lse_merge import LOG2E, MERGE_BLOCK_D, MERGE_WARPS, _lse_merge, _online_step, _store_partial

WAVES = 4  # programs per SM the split aims for
_DOT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["T", "SPLIT"])
def _flash_decode(q_ptr, sqb, sqh, sql, k_ptr, skb, skh, skn, v_ptr, svb, svh, svn, out_ptr, lse_ptr,
                  T, SPLIT, n_split, scale2, H, G, L,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                  PREC: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Partial attention of one stream's query rows over tokens [j * SPLIT, (j + 1) * SPLIT) (pid = s * n_split + j).
    The last dim of q, k, v is contiguous (the launcher checks)."""
    pid = tl.program_id(0)
    s = pid // n_split
    j = pid % n_split
    b = s // H
    h = s % H
    GL = G * L
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < GL
    q_l = m % L
    q_pos = T - L + q_l
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + (h * G + m // L).to(tl.int64)[:, None] * sqh + (q_l * sql)[:, None]
                + d[None, :], mask=row_ok[:, None], other=0.0)
    q = (q.to(tl.float32) * scale2).to(DOT)  # base-2 scores from one dot
    k_base = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + h.to(tl.int64) * svh
    lo = j * SPLIT
    hi = tl.minimum(lo + SPLIT, T)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, D], 0.0, dtype=tl.float32)
    for t0 in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        n = t0 + tl.arange(0, BLOCK_N)
        tok_ok = n < hi
        rows = n.to(tl.int64)
        kt = tl.load(k_base + rows[None, :] * skn + d[:, None], mask=tok_ok[None, :], other=0.0)
        vt = tl.load(v_base + rows[:, None] * svn + d[None, :], mask=tok_ok[:, None], other=0.0)
        scores = tl.dot(q, kt.to(DOT), input_precision=PREC)
        ok = tok_ok[None, :] & row_ok[:, None] & (n[None, :] <= q_pos[:, None])
        p, m_i, l_i, alpha = _online_step(scores, ok, m_i, l_i, False, 1.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vt.to(DOT), input_precision=PREC)
    _store_partial(out_ptr, lse_ptr, pid, GL, m, row_ok, m_i, l_i, acc, D)


def default_split(streams: int, T: int, block_n: int, device: torch.device) -> int:
    """Tokens per work item: about ``WAVES`` programs per SM over all streams, at least one tile."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    items = max(1, -(-WAVES * sms // max(1, streams)))
    split = max(block_n, -(-T // items))
    return -(-split // block_n) * block_n


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *, block_n: int | None = None,
                 num_warps: int = 4, num_stages: int = 3, split: int | None = None) -> torch.Tensor:
    """Causal grouped-query attention of q [B, Hq, L, D] (positions T-L..T-1) over the full cache k, v [B, H, T, D].

    ``block_n``/``num_warps``/``num_stages``/``split`` are the launch settings (``block_n``: 64 tokens, 16 for fp32,
    whose 64-token tiles spill at head_dim 256 (scripts/compile_check.py); ``split``: tokens per work item, default
    :func:`default_split`). Raises :class:`rdkv.RDKVError` for shapes or dtypes it does not serve.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise RDKVError(f"flash_decode takes q [B, Hq, L, D] and k, v [B, H, T, D]; got {tuple(q.shape)}, "
                        f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, L, D = q.shape
    H, T = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hq % H:
        raise RDKVError(f"q {tuple(q.shape)} does not fit k/v {tuple(k.shape)} (batch, head_dim, or Hq % H)")
    if q.dtype not in _DOT or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RDKVError(f"flash_decode needs q, k, v in one of fp16/bf16/fp32, got {q.dtype}/{k.dtype}/{v.dtype}")
    if D < 16 or D > 256 or D & (D - 1):
        raise RDKVError(f"flash_decode supports head_dim a power of two in 16..256, got {D}")
    if not 1 <= L <= T:
        raise RDKVError(f"flash_decode needs 1 <= L <= T query positions, got L={L}, T={T}")
    block_n = block_n or (16 if q.dtype == torch.float32 else 64)
    if block_n < 16 or block_n & (block_n - 1):
        raise RDKVError(f"block_n must be a power of two >= 16, got {block_n}")
    if q.device != k.device or v.device != k.device:
        raise RDKVError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        raise RDKVError("flash_decode needs the last dim of q, k and v contiguous")
    G, S, GL = Hq // H, B * H, (Hq // H) * L
    block_m = min(64, max(16, 1 << math.ceil(math.log2(GL))))
    m_blocks = -(-GL // block_m)
    split = -(-split // block_n) * block_n if split else default_split(S, T, block_n, k.device)
    n_split = -(-T // split)
    part = torch.empty(S * n_split, GL, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(S * n_split, GL, dtype=torch.float32, device=q.device)
    _flash_decode[(S * n_split, m_blocks)](
        q, q.stride(0), q.stride(1), q.stride(2), k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2), part, lse, T, split, n_split, float(scaling) * LOG2E, H, G, L,
        D=D, BLOCK_M=block_m, BLOCK_N=block_n, DOT=_DOT[q.dtype], PREC="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_STAGES=num_stages, num_warps=num_warps)
    out = torch.empty(B, Hq, L, D, dtype=q.dtype, device=q.device)
    block_d = min(D, MERGE_BLOCK_D)
    no_runs = torch.zeros(1, dtype=torch.int32, device=q.device)  # every item is one of n_split per stream
    _lse_merge[(S, m_blocks * (D // block_d))](part, lse, no_runs, no_runs, 0, out, 0, n_split, H, G, L, D=D,
                                               BLOCK_D=block_d, BLOCK_M=block_m, num_warps=MERGE_WARPS)
    return out
