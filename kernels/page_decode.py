"""Fused TriZone decode attention in Triton over the page layout (:mod:`rdkv.pages`): flash-decoding split-K.

One launch of :func:`rdkv.kernels.device.page_decode._page_attn` computes partial attention for every *work item*;
one launch of :func:`rdkv.kernels.lse_merge._lse_merge` combines the partials of each stream by log-sum-exp and
writes the output.

Work items
    Zone A+B: a stream's pages (ordered by V class, then position) are cut into runs of ``split`` pages
    (:func:`choose_pages`); each run is one program. Zone C: the ``n`` fresh tokens of every stream are cut into
    chunks of as many tokens. A second grid axis tiles the query rows (``G`` grouped heads x ``L`` query
    positions, head-major) into blocks of ``BLOCK_M >= 16`` rows, so one program serves every query head that
    shares its KV head.

The launcher reads a segment through :mod:`rdkv.pages` only: its plan of offsets becomes one int32 row per stream
(:func:`stream_table`, the fields of :mod:`rdkv.kernels.device.page_decode`) and one int64 base per (stream, class),
built once per segment and kept beside it (:func:`rdkv.layout.derived`: dropped with its tensors, never in the
layer, so the layer's ``nbytes`` stays exactly what the cache holds). docs/kernels.md has the layout, the
instruction counts and the bandwidth model.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, fields

import torch
import triton.language as tl

from rdkv import layout, pages
from rdkv.errors import RDKVError
from rdkv.kernels.device import page_decode as dev
from rdkv.kernels.device.page_decode import _page_attn
from rdkv.kernels.lse_merge import LOG2E, MERGE_BLOCK_D, MERGE_WARPS, _lse_merge
from rdkv.trizone import TriZoneLayer

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of the decode kernel; a field left ``None`` takes the default of :func:`launch_config`.

    ``block_n``: tokens per tile (a power of two >= 16); ``num_warps``; ``num_stages``: software pipelining
    depth of the tile loops; ``maxnreg``: register cap per thread (lets ptxas use every register instead of
    spilling, or trades registers for programs per SM); ``split``: tokens per work item (whole pages after
    rounding up). ``scripts/bench_decode.py --sweep`` times a list of these.
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
    ``split`` stays ``None`` unless overridden (:func:`choose_pages` picks it per segment)."""
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


def _nonempty(x: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``x``, or a one-element stand-in where there is nothing to read (a pointer the kernel never dereferences)."""
    return x if x is not None and x.numel() else torch.zeros(1, dtype=dtype, device=device)


_DOT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

def check(query: torch.Tensor, layer: TriZoneLayer, softcap, mask) -> None:
    """Raise :class:`RDKVError` for a call the kernel cannot serve."""
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





@dataclass
class PageTables:
    """What a launch over one paged segment reads besides the pages: the stream table, the class bases, the
    work items of one ``split`` (in pages) and the compile-time channel bounds."""

    plan: pages.PagePlan
    st: torch.Tensor  # [S, FIELDS] int32
    cbase: torch.Tensor  # [S, 4] int64 byte offset of each class's first page
    wi_s: torch.Tensor  # [n_ab] int32 stream of each work item
    wi_lo: torch.Tensor  # [n_ab] int32 first page of each work item
    ab_first: torch.Tensor  # [S] int32
    ab_cnt: torch.Tensor  # [S] int32
    n_ab: int
    split: int  # pages per work item
    bounds: dict  # KQ (a packed K channel present), K16 (a 16-bit one)


def stream_table(p: pages.PagePlan) -> torch.Tensor:
    S = len(p.counts)
    st = torch.zeros(S, dev.FIELDS.value, dtype=torch.long, device=p.counts.device)
    st[:, dev.F_CHANS.value:dev.F_CHANS.value + 4] = p.chans[:, 1:]
    st[:, dev.F_CH0.value:dev.F_CH0.value + 4] = p.ch0[:, 1:]
    st[:, dev.F_KOFF.value:dev.F_KOFF.value + 4] = p.k_off
    st[:, dev.F_KMETA.value], st[:, dev.F_VOFF.value], st[:, dev.F_MEAN0.value] = p.k_meta, p.v_off, p.mean0
    st[:, dev.F_PAGE0.value:dev.F_PAGE0.value + 5] = p.page0
    st[:, dev.F_COUNT.value:dev.F_COUNT.value + 4] = p.counts
    st[:, dev.F_PSIZE.value:dev.F_PSIZE.value + 4] = p.page_size
    if st.numel() and int(st.max()) >= 2**31:
        raise RDKVError("a page or segment offset exceeds int32: split the batch")
    return st.to(torch.int32)


def build_tables(layer: TriZoneLayer, split: int) -> PageTables:
    p = pages.segment_plan(layer)
    S, d = len(p.counts), p.counts.device
    npg = p.page0[:, 4]
    chunks = -(-npg // split)
    n_ab = int(chunks.sum())
    wi_s = torch.repeat_interleave(torch.arange(S, device=d), chunks)
    ab_first = torch.cumsum(chunks, 0) - chunks
    wi_lo = (torch.arange(n_ab, device=d) - ab_first[wi_s]) * split
    top = p.chans.amax(0).tolist() if S else [0] * 5
    bounds = dict(KQ=any(top[1:4]), K16=bool(top[4]))
    i32 = torch.int32
    return PageTables(p, stream_table(p), p.class_base, wi_s.to(i32), wi_lo.to(i32), ab_first.to(i32),
                      chunks.to(i32), n_ab, split, bounds)


PROGRAM_PAGES = 1.0  # a program's fixed work (q columns, table loads, its partial's store and merge) in pages


def makespan(npg: list[int], split: int, slots: int) -> float:
    """Time, in pages, of work items of ``split`` pages cut from streams of ``npg`` pages, dispatched in launch
    order to the first of ``slots`` free program slots (as the GPU's block scheduler does)."""
    free = [0.0] * slots
    for n in npg:
        for lo in range(0, n, split):
            heapq.heapreplace(free, free[0] + min(split, n - lo) + PROGRAM_PAGES)
    return max(free)


def choose_pages(npg: list[int], slots: int) -> int:
    """Pages per zone A+B work item over streams of ``npg`` pages: of the splits that make about 1..8 waves of
    ``slots`` programs (and up to 25% longer, for the items cut short at the end of each stream), the one with the
    shortest :func:`makespan` (ties to fewer, longer items: fewer partials to merge)."""
    total = sum(npg)
    cands = sorted({max(1, math.ceil(total / (k * slots) * (1 + j / 16))) for k in range(1, 9) for j in range(5)},
                   reverse=True)
    return min(cands, key=lambda s: makespan(npg, s, slots))


def k_chunk(head_dim: int, dtype: torch.dtype, rope: bool) -> int:
    """K channels per dot: the whole head where its tile and q stay in registers, else chunks whose tables and q
    columns are read again each step (scripts/compile_check.py holds every variant to no spills)."""
    if rope:  # rotated in fp32
        return 16
    if dtype == torch.float32 and head_dim > 128:  # an fp32 dot holds a row of each operand per thread
        return 16
    return min(head_dim, 128)


def page_launch_config(head_dim: int, block_m: int, dtype: torch.dtype, launch: LaunchConfig | None,
                       rope: bool = False, masked: bool = False) -> LaunchConfig:
    """:func:`launch_config`, with 4 warps at head_dim 128 for 16 fp16/bf16 query rows
    without window, mask or softcap (``masked``): a program then fits in 255 registers without spills, so two
    share an SM and keep two pages in flight (docs/kernels.md, "The page kernel, one K tile"). The other variants
    spill at 4 warps and keep 8."""
    o = launch or LaunchConfig()
    if o.num_warps is None and head_dim <= 128 and block_m == 16 and dtype != torch.float32 and not masked:
        o = dataclasses.replace(o, num_warps=4)
    return launch_config(head_dim, block_m, dtype, rope, o)


def programs_per_sm(cfg: LaunchConfig) -> int:
    """Register-bound: the kernel takes ~240 of the 255 registers a thread may have, so 65536 / (256 x 32 x warps),
    at least 1."""
    return max(1, 65536 // (256 * 32 * cfg.num_warps))


def program_slots(query: torch.Tensor, cfg: LaunchConfig) -> int:
    """Programs the device runs at once: SMs x :func:`programs_per_sm`. Off the GPU: 4."""
    if not query.is_cuda:
        return 4
    return torch.cuda.get_device_properties(query.device).multi_processor_count * programs_per_sm(cfg)


def tables(layer: TriZoneLayer, split: int) -> PageTables:
    return layout.derived(layer, ("page tables", split), lambda: build_tables(layer, split))


def page_decode(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                softcap: float | None = None, mask: torch.Tensor | None = None,
                launch: LaunchConfig | None = None) -> torch.Tensor:
    """query [B, Hq, L, D] (the L newest tokens, already appended to zone C) -> out [B, Hq, L, D].

    Same contract as :func:`rdkv.reference.trizone_attention`, computed by the fused kernel over the layer and its
    folds; ``launch`` overrides the default launch settings (:class:`LaunchConfig`).
    """
    check(query, layer, softcap, mask)
    B, Hq, L, D = query.shape
    H = layer.heads
    G, S = Hq // H, B * H
    GL = G * L
    block_m = 16 if D > 128 else block_m_for(GL, query.dtype)  # 32 rows of head_dim 256 spill
    m_blocks = -(-GL // block_m)
    window = sliding_window if layer.sliding_window is None else layer.sliding_window
    masked = window is not None or mask is not None or softcap is not None
    cfg = page_launch_config(D, block_m, query.dtype, launch, masked=masked)
    segs = layer.segments()
    page = [pages.segment_page(seg) for seg in segs]
    if cfg.split:
        splits = [-(-cfg.split // P) for P in page]
    else:
        slots = program_slots(query, cfg)
        splits = [layout.derived(seg, ("page split", slots),
                                 lambda seg=seg: choose_pages(pages.segment_plan(seg).page0[:, 4].tolist(), slots))
                  for seg in segs]
    tabs = [tables(seg, split) for seg, split in zip(segs, splits)]
    seq = layer.get_seq_length()
    kc, vc = layout.zone_c(layer)
    n_c = kc.shape[2]
    split_c = tabs[0].split * page[0]
    c_chunks = -(-n_c // split_c)
    # partial results: segment 0's work items, zone C's, then each fold's
    sizes = [tabs[0].n_ab + S * c_chunks] + [tab.n_ab for tab in tabs[1:]]
    offs = [0] + list(itertools.accumulate(sizes))[:-1]
    n_prog = sum(sizes)
    out = torch.empty(B, Hq, L, D, dtype=query.dtype, device=query.device)
    part = torch.empty(max(1, n_prog), GL, D, dtype=torch.float32, device=query.device)
    lse = torch.empty(max(1, n_prog), GL, dtype=torch.float32, device=query.device)
    if mask is not None:
        m8 = mask.view(torch.uint8)
        mask_args = (m8, m8.stride(0) if mask.shape[0] > 1 else 0, m8.stride(2), m8.stride(3))
    else:
        mask_args = (out, 0, 0, 0)
    rows = query.reshape(S, GL, D)
    for j, (seg, tab, off, size, P) in enumerate(zip(segs, tabs, offs, sizes, page)):
        if not size:
            continue
        rope, perm = layout.rope_table(seg), layout.k_perm(seg)
        seg_cfg = page_launch_config(D, block_m, query.dtype, launch, rope is not None, masked)
        buf = pages.buffer(seg)
        buf = buf if buf.numel() else torch.zeros(16, dtype=torch.uint8, device=query.device)
        pos_bytes = layout.pos_bytes(seg.prefix_len)
        qp = rows.gather(2, perm.long().unsqueeze(1).expand(S, GL, D))  # each stream's packed channel order
        _page_attn[(size, m_blocks)](
            query, *query.stride(), qp, part[off:], lse[off:],
            buf, buf.view(torch.int32), buf.view(torch.float16), buf.view(seg.dtype16),
            buf.view(torch.int16 if pos_bytes == 2 else torch.int32),
            _nonempty(pages.k_means(seg), torch.float16, query.device), tab.st, tab.cbase, tab.wi_s, tab.wi_lo,
            kc, *kc.stride(), vc, *vc.stride(), *mask_args, perm, _nonempty(rope, torch.float32, query.device),
            tab.n_ab, n_c if j == 0 else 0, max(1, c_chunks), layer.c_start, seq, float(scaling) * LOG2E,
            int(window) if window is not None else 0, float(softcap) if softcap is not None else 1.0,
            H, G, L, tab.split, split_c,
            D=D, P=P, PT=min(P, cfg.block_n), KC=k_chunk(D, query.dtype, rope is not None), **tab.bounds,
            VG2=seg.spec.v_group_of(2), VG4=seg.spec.v_group_of(4), VG8=seg.spec.v_group_of(8),
            POS_BYTES=pos_bytes, BLOCK_M=block_m, DOT=_DOT[query.dtype],
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
    _lse_merge[(S, m_blocks * (D // block_d))](part, lse, seg_first, seg_cnt, len(tabs), out, tabs[0].n_ab, c_chunks,
                                                H, G, L, D=D, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=MERGE_WARPS)
    return out
