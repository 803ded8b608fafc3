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

The device code is :mod:`rdkv.kernels.device.trizone_decode`. The launcher reads a segment through
:mod:`rdkv.layout` only: its tensors width by width (the kernel's arguments follow ``quant.WIDTHS`` and the V
classes) and its offsets (:func:`rdkv.layout.plan`), to which it adds the work items of a ``split``. They are kept
beside the segment (:func:`rdkv.layout.derived`: dropped with its tensors, never in the layer, so the layer's
``nbytes`` stays exactly what the cache holds); they are a few integers per stream and K block.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import torch
import triton.language as tl

from rdkv import layout, pages, quant
from rdkv.errors import RDKVError
from rdkv.kernels.device.trizone_decode import LOG2E, _trizone_attn
from rdkv.kernels.lse_merge import MERGE_BLOCK_D, MERGE_WARPS, _lse_merge
from rdkv.layout import V_CLASSES
from rdkv.trizone import TriZoneLayer

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Tables:
    """What a launch over one packed segment reads besides the cache: the segment's offsets (:func:`rdkv.layout.plan`)
    as the kernel indexes them, and its work items for one ``split``."""

    tok0: torch.Tensor  # [S] int64 first kept token of each stream (index into the positions)
    vcls: torch.Tensor  # [S, 5] int32 class boundaries inside the stream (0, c2, c2+c4, ..., n)
    vbase: torch.Tensor  # [S, 4] int64 row of token i of class c among class c's rows is vbase[s, c] + i
    krow: torch.Tensor  # [S, NB] int64 row base (pair index for width 0) of each block (sorted by width)
    kgrp: torch.Tensor  # [S, NB] int64 scale/zero group base of each block
    kcls: torch.Tensor  # [S, 6] int32 boundaries of widths 0,2,4,8,16 along the blocks
    wi_s: torch.Tensor  # [n_ab] int32 stream of each zone A+B work item
    wi_lo: torch.Tensor  # [n_ab] int32 first token of each work item
    ab_first: torch.Tensor  # [S] int32 first work item of each stream
    ab_cnt: torch.Tensor  # [S] int32 work items of each stream
    n_ab: int
    split: int


def build_tables(layer: TriZoneLayer, split: int) -> Tables:
    p = layout.plan(layer)
    S, dev, i32 = len(p.n), p.n.device, torch.int32
    chunks = torch.div(p.n + split - 1, split, rounding_mode="floor")
    n_ab = int(chunks.sum())
    wi_s = torch.repeat_interleave(torch.arange(S, device=dev), chunks)
    ab_first = torch.cumsum(chunks, 0) - chunks
    wi_lo = (torch.arange(n_ab, device=dev) - ab_first[wi_s]) * split
    return Tables(p.tok0, p.class_start.to(i32), p.class_row0 - p.class_start[:, :4], p.block_row0, p.block_group0,
                  p.block_width_start.to(i32), wi_s.to(i32), wi_lo.to(i32), ab_first.to(i32), chunks.to(i32), n_ab, split)


def tables(layer: TriZoneLayer, split: int) -> Tables:
    """The segment's launch tables, built once per (segment tensors, split) and dropped with the segment."""
    return layout.derived(layer, ("triton tables", split), lambda: build_tables(layer, split))


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
        n_tok = int(layout.counts(layer).sum())
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        split = min(max(-(-n_tok // max(1, 2 * sms)), 256), 8192)
    return -(-split // cfg.block_n) * cfg.block_n


def _nonempty(x: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``x``, or a one-element stand-in where there is nothing to read (a pointer the kernel never dereferences)."""
    return x if x is not None and x.numel() else torch.zeros(1, dtype=dtype, device=device)


def _stored(seg: TriZoneLayer, rows, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """The kernel's arguments for one segment's K or V rows (``rows`` is :func:`rdkv.layout.k_rows` or
    :func:`rdkv.layout.v_rows`), width by width: the codes, scales and zeros of a packed width, the 16-bit rows or
    channel means of the others."""
    dev, out = seg.device, []
    for w in widths:
        x = rows(seg, w)
        if x.scale is None:
            out.append(_nonempty(x.values, quant.META_DTYPE if w == 0 else seg.dtype16, dev))
        else:
            out += [_nonempty(x.values, torch.uint8, dev), _nonempty(x.scale, quant.META_DTYPE, dev),
                    _nonempty(x.zero, quant.META_DTYPE, dev)]
    return out


_DOT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def check(query: torch.Tensor, layer: TriZoneLayer, softcap, mask, paged: bool = False) -> None:
    """Raise :class:`RDKVError` for a call the kernel cannot serve; ``paged``: the caller is the page kernel, whose
    segments must all be in pages (the packed kernel's: none)."""
    if not isinstance(layer, TriZoneLayer):
        raise RDKVError(f"the Triton decode kernel takes a TriZoneLayer, got {type(layer).__name__}")
    layouts = [pages.paged(seg) for seg in layer.segments()]
    if any(x != paged for x in layouts):
        which = ", ".join("pages" if x else "packed" for x in layouts)
        raise RDKVError(f"the {'page' if paged else 'packed-layout'} decode kernel reads segments "
                        f"{'in pages' if paged else 'in the packed layout'} only; this layer's segments are: {which}")
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
    rope = layout.rope_table(layer)
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
    spec = layer.spec
    GL = G * L
    rows = query.reshape(S, GL, D)  # query rows of each stream, head-major (g * L + l), as the kernel numbers them
    block_m = block_m_for(GL, query.dtype)
    m_blocks = -(-GL // block_m)
    cfg = launch_config(D, block_m, query.dtype, override=launch)
    segs = layer.segments()
    tabs = [tables(seg, choose_split(seg, query, cfg)) for seg in segs]
    seq = layer.get_seq_length()
    window = sliding_window if layer.sliding_window is None else layer.sliding_window
    kc, vc = layout.zone_c(layer)
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
        rope, perm = layout.rope_table(seg), layout.k_perm(seg)
        seg_cfg = launch_config(D, block_m, query.dtype, rope is not None, launch)
        # the query rows of each stream in its packed channel order, once per step (pre-RoPE keys rotate q instead)
        qp = query if rope is not None else rows.gather(2, perm.long().unsqueeze(1).expand(S, GL, D))
        _trizone_attn[(size, m_blocks)](
            query, *query.stride(), qp, part[off:], lse[off:],
            layout.positions(seg), perm, tab.tok0, tab.vcls, tab.vbase, tab.krow, tab.kgrp, tab.kcls, tab.wi_s,
            tab.wi_lo,
            *_stored(seg, layout.k_rows, quant.WIDTHS), *_stored(seg, layout.v_rows, V_CLASSES),
            kc, *kc.stride(), vc, *vc.stride(), *mask_args, _nonempty(rope, torch.float32, dev),
            tab.n_ab, n_c if j == 0 else 0, max(1, c_chunks), layer.c_start, seq, float(scaling) * LOG2E,
            int(window) if window is not None else 0, float(softcap) if softcap is not None else 1.0,
            H, G, L, tab.split,
            K_GROUP=spec.k_group, D=D, D_PAD=_pow2(D), KB=spec.k_block, NB=D // spec.k_block,
            VG2=spec.v_group_of(2), VG4=spec.v_group_of(4), VG8=spec.v_group_of(8), BLOCK_M=block_m, BLOCK_N=cfg.block_n, DOT=_DOT[query.dtype],
            PREC="ieee" if query.dtype == torch.float32 else "tf32",
            HAS_WINDOW=window is not None, HAS_MASK=mask is not None, SOFTCAP=softcap is not None,
            ROPE=rope is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
