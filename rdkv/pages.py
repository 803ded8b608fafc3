"""The page layout of a segment: each stream's kept tokens in pages of ``P`` tokens, one contiguous span each.

A stream's kept tokens, ordered by V class (2, 4, 8, 16) then position (:func:`rdkv.layout.storage_order`), are cut
per class into pages of ``P`` tokens (the last page of a class may be partly filled; its empty slots are zero bytes). A page
of stream ``s`` and class ``c`` holds, in this order, every section a multiple of 16 bytes:

* K codes of the stream's channels of width 2, then 4, then 8 (channels in the stream's permuted order, which
  :func:`rdkv.layout.storage_order` sorts by width): byte row ``r`` of width ``w`` holds channels ``r * 8/w + k`` (bits
  ``k * w``) of the page's ``P`` tokens, so a row is ``P`` consecutive bytes, one per token;
* K rows of the 16-bit channels, channel-major (``P`` consecutive 16-bit values per channel);
* one fp16 scale per packed K channel, then one fp16 zero (K is quantized per channel per page: a page is one
  scale group);
* V codes [P, D*w/8], then V scales and zeros [P, D/v_group] each (class 16: V rows [P, D] in 16 bits);
* the positions [P] (int16, int32 past 32767).

A page's size depends only on (the stream's K widths, the class), so one base per (stream, class) and a page index
give every address of a tile: the decode kernel (:mod:`rdkv.kernels.page_decode`) issues a page's loads together.
Width-0 channels keep their means outside the pages (``k_mean``: one fp16 per channel, stream-major).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant, rope
from .errors import RDKVError
from .layout import (COMPONENTS, _COUNTS, _K_BITS, _K_PERM, V_CLASSES, PackSpec, check_extras,
                     check_scalars, component, derived, pos_bytes, pos_dtype, quantize_pack, rope_table, storage_order,
                     tensor_checker)

K_WIDTHS = (2, 4, 8, 16)  # the K sections of a page, in order


def page_tokens(head_dim: int, spec: PackSpec, held: int) -> int:
    """Tokens per page, a power of two from 16 to 64: one decode tile (64 up to head_dim 128, 32 past it), at most
    ``spec.k_group`` (a page is one K scale group) and at most a 16th of the ``held`` positions, so that short
    segments (short prompts, sliding windows, folds) round few tokens to whole pages. Smaller pages pay more K
    scales: on SmolLM2 at 1k, pages of 64 gave lower KL than pages of 16 (docs/kernels.md, "Pages as the stored
    format")."""
    cap = min(64 if head_dim <= 128 else 32, spec.k_group, max(16, held // 16))
    return 1 << (cap.bit_length() - 1)


def segment_page(seg) -> int:
    """:func:`page_tokens` of a segment (a :class:`rdkv.trizone.TriZoneLayer`)."""
    return page_tokens(seg.head_dim, seg.spec, seg.prefix_len - seg.start)


def v_bytes(width: int, head_dim: int, spec: PackSpec, page: int) -> tuple[int, int]:
    """(V code or row bytes, V scale bytes) of a page of class ``width``; the zeros take as many as the scales."""
    if width == 16:
        return 2 * page * head_dim, 0
    return page * head_dim * width // 8, 2 * page * (head_dim // spec.v_group_of(width))


@dataclass(eq=False)
class PagePlan:
    """Every offset of a segment, from its class sizes and K block widths (tensors on the segment's device)."""

    page: int  # tokens per page
    counts: torch.Tensor  # [S, 4] tokens per stream and V class
    chans: torch.Tensor  # [S, 5] channels per K width 0, 2, 4, 8, 16
    ch0: torch.Tensor  # [S, 5] first permuted channel of each K width
    k_off: torch.Tensor  # [S, 4] byte offset inside a page of the K sections of widths 2, 4, 8, 16
    k_meta: torch.Tensor  # [S] offset of the K scales; the zeros follow 2 bytes per packed channel later
    v_off: torch.Tensor  # [S] offset of the V section (the K sections' bytes)
    page_size: torch.Tensor  # [S, 4] bytes of one page of each class
    pages: torch.Tensor  # [S, 4] pages of each class
    page0: torch.Tensor  # [S, 5] class boundaries along the stream's pages
    class_base: torch.Tensor  # [S, 4] byte offset of each class's first page
    mean0: torch.Tensor  # [S] index of the stream's first channel mean in ``k_mean``
    total: int  # bytes of all pages

    @classmethod
    def build(cls, counts: torch.Tensor, k_bits: torch.Tensor, spec: PackSpec, head_dim: int, pos_len: int,
              page: int) -> PagePlan:
        counts = counts.long()
        dev, D = counts.device, head_dim
        chans = torch.stack([(k_bits.long() == w).sum(1) for w in quant.WIDTHS], 1) * spec.k_block
        ch0 = _excl(chans, 1)
        sec = torch.stack([chans[:, 1 + i] * page * w // 8 for i, w in enumerate(K_WIDTHS)], 1)
        k_off = _excl(sec, 1)
        k_meta = sec.sum(1)
        v_off = k_meta + 4 * (chans[:, 1] + chans[:, 2] + chans[:, 3])
        v_sec = torch.tensor([v_section(w, D, spec, page) + page * pos_bytes(pos_len) for w in V_CLASSES], device=dev)
        page_size = v_off.unsqueeze(1) + v_sec
        pages = -(-counts // page)
        span = (pages * page_size).flatten()
        class_base = _excl(span).view_as(pages)
        return cls(page, counts, chans, ch0, k_off, k_meta, v_off, page_size, pages,
                   torch.cat([torch.zeros_like(pages[:, :1]), pages.cumsum(1)], 1), class_base, _excl(chans[:, 0]),
                   int(span.sum()))


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segment sizes ``counts`` [P]: (segment id, index inside the segment) of every element."""
    seg = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    return seg, torch.arange(len(seg), device=counts.device) - starts[seg]


def _excl(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


class _Slots:
    """Where each kept token lives: its stream, class, page base (bytes) and slot inside the page."""

    def __init__(self, p: PagePlan):
        s, i = _segments(p.counts.sum(1))
        cstart = _excl(p.counts, 1)
        cls = (i.unsqueeze(1) >= (cstart + p.counts)[s]).sum(1)
        j = i - cstart[s, cls]
        self.s, self.cls, self.index = s, cls, i  # index: the token's place among its stream's kept tokens
        self.base = p.class_base[s, cls] + torch.div(j, p.page, rounding_mode="floor") * p.page_size[s, cls]
        self.slot = j % p.page


def _k_addresses(p: PagePlan, at: _Slots, D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per kept token and permuted channel [N, D]: width, byte address of its code (its first byte at 16 bits) and
    bit shift."""
    ch = torch.arange(D, device=p.counts.device)
    wi = (ch.unsqueeze(0) >= p.ch0[at.s, 1:].unsqueeze(2)).sum(1)  # [N, D] option index of the channel's width
    width = torch.tensor(quant.WIDTHS, device=ch.device)[wi]
    j = ch - p.ch0[at.s].gather(1, wi)  # channel index inside its width
    per = torch.where(width == 0, 1, 8 // width.clamp(1, 8))
    sec = p.k_off[at.s].gather(1, (wi - 1).clamp(0))
    base, slot = at.base.unsqueeze(1), at.slot.unsqueeze(1)
    code = base + sec + torch.where(width == 16, (j * p.page + slot) * 2, torch.div(j, per, rounding_mode="floor")
                                    * p.page + slot)
    shift = torch.where(width == 16, 0, (j % per) * width)
    return width, code, shift


def _v_addresses(p: PagePlan, at: _Slots, D: int, spec: PackSpec, w: int, sel: torch.Tensor):
    """Byte address of the first code byte (or 16-bit value) of each V row of class ``w`` and of its first scale."""
    rb, sb = v_bytes(w, D, spec, p.page)
    vbase = at.base[sel] + p.v_off[at.s[sel]]
    slot = at.slot[sel]
    return vbase + slot * (rb // p.page), vbase + rb + slot * (sb // p.page)


def v_section(width: int, head_dim: int, spec: PackSpec, page: int) -> int:
    """Bytes of a page's V section of class ``width``: codes, scales and zeros, or 16-bit rows."""
    rb, sb = v_bytes(width, head_dim, spec, page)
    return rb + 2 * sb


def _pos_addresses(p: PagePlan, at: _Slots, D: int, spec: PackSpec, pos_len: int) -> torch.Tensor:
    """Byte address of each kept token's position (after its page's V section)."""
    sec = torch.tensor([v_section(w, D, spec, p.page) for w in V_CLASSES], device=at.s.device)
    return at.base + p.v_off[at.s] + sec[at.cls] + at.slot * pos_bytes(pos_len)


def _put(buf: torch.Tensor, addr: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x`` (any dtype) little-endian at byte addresses ``addr`` (one per element)."""
    b = x.reshape(-1).contiguous().view(torch.uint8).view(*x.shape, x.element_size())
    buf[addr.unsqueeze(-1) + torch.arange(x.element_size(), device=buf.device)] = b


def _get(buf: torch.Tensor, addr: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return buf[addr.unsqueeze(-1) + torch.arange(size, device=buf.device)].view(dtype).squeeze(-1)


def pack(k: torch.Tensor, v: torch.Tensor, start: int, v_width: torch.Tensor, bits: torch.Tensor, perm: torch.Tensor,
         spec: PackSpec, dtype16: torch.dtype, page: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one segment for k, v [S, T, D] at positions start..start+T-1, V widths per token [S, T]
    and K widths per block [S, D/k_block] of the channel order [S, D]."""
    S, T, D = k.shape
    dev, kb = k.device, spec.k_block
    P = page or page_tokens(D, spec, T)
    if P % 8:
        raise RDKVError(f"a page holds a multiple of 8 tokens (16-byte sections), got {P}")
    perm, bits, counts, t_flat, _ = storage_order(v_width, bits, perm, kb)
    p = PagePlan.build(counts, bits, spec, D, start + T, P)
    at = _Slots(p)
    buf = torch.zeros(p.total, dtype=torch.uint8, device=dev)
    _put(buf, _pos_addresses(p, at, D, spec, start + T), (t_flat + start).to(pos_dtype(start + T)))
    vf = v[at.s, t_flat].float()
    for c, w in enumerate(V_CLASSES):
        sel = at.cls == c
        code_at, scale_at = _v_addresses(p, at, D, spec, w, sel)
        if w == 16:
            _put(buf, code_at.unsqueeze(1) + 2 * torch.arange(D, device=dev), vf[sel].to(dtype16))
            continue
        codes, scale, zero = quantize_pack(vf[sel], w, spec.v_group_of(w))
        buf[code_at.unsqueeze(1) + torch.arange(codes.shape[1], device=dev)] = codes
        g = torch.arange(scale.shape[1], device=dev)
        _put(buf, scale_at.unsqueeze(1) + 2 * g, scale)
        _put(buf, scale_at.unsqueeze(1) + v_bytes(w, D, spec, P)[1] + 2 * g, zero)
    kp = k[at.s, t_flat].float().gather(1, perm.long()[at.s])  # [N, D] channels in permuted order
    width, code_at, _ = _k_addresses(p, at, D)
    mean_at = p.mean0[at.s].unsqueeze(1) + torch.arange(D, device=dev)
    k_mean = torch.zeros(int(p.chans[:, 0].sum()), dtype=quant.META_DTYPE, device=dev)
    msum = kp.new_zeros(len(k_mean)).index_add_(0, mean_at[width == 0], kp[width == 0])
    mcnt = kp.new_zeros(len(k_mean)).index_add_(0, mean_at[width == 0], torch.ones_like(kp[width == 0]))
    k_mean[:] = (msum / mcnt.clamp_min(1)).to(quant.META_DTYPE)
    _put(buf, code_at[width == 16], kp[width == 16].to(dtype16))
    # packed widths: each page is one scale group per channel (groups of P tokens restarting at every (stream, class))
    page_s, _, page_base = _page_bases(p)
    npacked = p.chans[:, 1:4].sum(1)
    col = torch.arange(D, device=dev)
    for i, w in enumerate(quant.PACKED, 1):
        if not p.chans[:, i].any():
            continue
        codes, scale, zero = quantize_pack(kp, w, P, axis=0, segments=p.counts.flatten())  # every channel at w
        per = 8 // w
        lo, n = p.ch0[:, i] // per, p.chans[:, i] // per  # the stream's bytes of width w in a row of codes
        b = torch.arange(codes.shape[1], device=dev) - lo[at.s].unsqueeze(1)  # [N, D * w / 8]: its byte row
        mine = (b >= 0) & (b < n[at.s].unsqueeze(1))
        row_at = at.base.unsqueeze(1) + p.k_off[at.s, i - 1].unsqueeze(1) + b * P + at.slot.unsqueeze(1)
        buf[row_at[mine]] = codes[mine]
        c = col - p.ch0[page_s, i].unsqueeze(1)  # [pages, D]: the channel's index among the stream's width-w ones
        mine = (c >= 0) & (c < p.chans[page_s, i].unsqueeze(1))
        meta_at = (page_base + p.k_meta[page_s]).unsqueeze(1) + 2 * (col - p.ch0[page_s, 1].unsqueeze(1))
        _put(buf, meta_at[mine], scale[mine])
        _put(buf, (meta_at + 2 * npacked[page_s].unsqueeze(1))[mine], zero[mine])
    return _tensors(counts, perm, bits, k_mean, buf)


def _tensors(counts: torch.Tensor, perm: torch.Tensor, bits: torch.Tensor, k_mean: torch.Tensor,
             buf: torch.Tensor) -> dict[str, torch.Tensor]:
    return {_COUNTS: counts.to(torch.int32), _K_PERM: perm.to(torch.uint8 if perm.shape[1] <= 256 else torch.int16),
            _K_BITS: bits.to(torch.uint8), _K_MEAN: k_mean, _PAGES: buf}


def sized(v_width: torch.Tensor, bits: torch.Tensor, perm: torch.Tensor, spec: PackSpec, pos_len: int,
          page: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a segment with the allocation of :func:`pack`'s arguments and uninitialised bytes: what
    sizing a segment or compiling a launch over it needs, without packing (or holding) any K/V."""
    D = perm.shape[1]
    perm, bits, counts, _, _ = storage_order(v_width, bits, perm, spec.k_block)
    p = PagePlan.build(counts, bits, spec, D, pos_len, page or page_tokens(D, spec, v_width.shape[1]))
    k_mean = torch.empty(int(p.chans[:, 0].sum()), dtype=quant.META_DTYPE, device=perm.device)
    return _tensors(counts, perm, bits, k_mean, torch.empty(p.total, dtype=torch.uint8, device=perm.device))


def plan(t: dict[str, torch.Tensor], spec: PackSpec, head_dim: int, pos_len: int, page: int) -> PagePlan:
    return PagePlan.build(t[_COUNTS], t[_K_BITS], spec, head_dim, pos_len, page)


_PAGES, _K_MEAN = "pages", "k_mean"  # the tensors a segment adds to the index tables of rdkv.layout


def buffer(seg) -> torch.Tensor:
    """A segment's bytes: every page, uint8."""
    return seg.t[_PAGES]


def k_means(seg) -> torch.Tensor:
    """A segment's width-0 K channel means, fp16, stream-major in each stream's permuted order."""
    return seg.t[_K_MEAN]


def segment_plan(seg) -> PagePlan:
    """A segment's plan, built once and kept beside it (:func:`rdkv.layout.derived`)."""
    return derived(seg, "page plan", lambda: plan(seg.t, seg.spec, seg.head_dim, seg.prefix_len, segment_page(seg)))


def component_bytes(seg) -> dict[str, int]:
    """Bytes a segment holds per accounting bucket (:data:`rdkv.layout.COMPONENTS`), each page's sections
    charged at their full size (a partly filled page's empty slots to the section they are in): K and V codes,
    scales, zeros (and the width-0 channel means), 16-bit K and V rows, indices (class counts, permutation, block
    widths, positions, RoPE table) and zone C."""
    p = segment_plan(seg)
    out = dict.fromkeys(COMPONENTS, 0)
    for name, x in seg.t.items():
        if name != _PAGES:
            out["zeros" if name == _K_MEAN else component(name)] += x.numel() * x.element_size()
    packed = p.chans[:, 1:4].sum(1)  # per stream
    k_codes = p.k_off[:, 3]  # the sections of widths 2, 4, 8 come first
    for c, w in enumerate(V_CLASSES):
        n = p.pages[:, c]
        rb, sb = v_bytes(w, seg.head_dim, seg.spec, p.page)
        out["codes"] += int((n * (k_codes + (rb if w < 16 else 0))).sum())
        out["fp16 rows"] += int((n * ((p.k_meta - k_codes) + (rb if w == 16 else 0))).sum())
        out["scales"] += int((n * (2 * packed + sb)).sum())
        out["zeros"] += int((n * (2 * packed + sb)).sum())
        out["indices"] += int(n.sum()) * p.page * pos_bytes(seg.prefix_len)
    return out


def zone_bytes(layer) -> tuple[int, int, int]:
    """Bytes of a layer's zone A (everything but the next two), zone B (the V sections of its class-16
    pages) and zone C."""
    p = segment_plan(layer)
    zb = int(p.pages[:, 3].sum()) * v_bytes(16, layer.head_dim, layer.spec, p.page)[0]
    zc = sum(x.numel() * x.element_size() for name, x in layer.t.items() if component(name) == "zone C")
    return sum(x.numel() * x.element_size() for x in layer.t.values()) - zb - zc, zb, zc


def dequantize_segment(seg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dequantize` of a segment, keys packed before RoPE rotated to their positions: zones A+B as dense
    float32 K, V [S, Nmax, D], positions [S, Nmax] and validity [S, Nmax] (the torch reference; the decode paths
    never unpack a whole segment)."""
    K, V, pos, valid = dequantize(seg.t, seg.spec, seg.head_dim, seg.prefix_len, segment_page(seg),
                                   seg.dtype16)
    table = rope_table(seg)
    return (K if table is None else rope.rotate(K, pos, table)), V, pos, valid


def _positions(buf: torch.Tensor, p: PagePlan, at: _Slots, head_dim: int, spec: PackSpec,
               pos_len: int) -> torch.Tensor:
    return _get(buf, _pos_addresses(p, at, head_dim, spec, pos_len), pos_dtype(pos_len)).long()


def positions(seg) -> torch.Tensor:
    """The absolute position of every token a segment kept [N] (int64), stream by stream, each stream's by V
    class then position."""
    p = segment_plan(seg)
    return _positions(buffer(seg), p, _Slots(p), seg.head_dim, seg.spec, seg.prefix_len)


def v_widths(seg) -> torch.Tensor:
    """V width of every held position of a segment [B, H, prefix_len - start] (0 = evicted)."""
    at = _Slots(segment_plan(seg))
    pos = positions(seg)
    out = torch.zeros(seg.batch * seg.heads, seg.prefix_len - seg.start, dtype=torch.long, device=pos.device)
    out[at.s, pos - seg.start] = torch.tensor(V_CLASSES, device=pos.device)[at.cls]
    return out.view(seg.batch, seg.heads, -1)


def dequantize(t: dict[str, torch.Tensor], spec: PackSpec, head_dim: int, pos_len: int, page: int,
               dtype16: torch.dtype):
    """Dense float32 K, V [S, Nmax, D] (K in the model's channel order), positions [S, Nmax] and validity: the torch
    oracle of the page layout."""
    D, p = head_dim, plan(t, spec, head_dim, pos_len, page)
    buf, at = t[_PAGES], _Slots(p)
    S, dev = len(p.counts), buf.device
    nmax = int(p.counts.sum(1).max()) if S else 0
    K = torch.zeros(S, nmax, D, device=dev)
    V = torch.zeros(S, nmax, D, device=dev)
    pos = torch.zeros(S, nmax, dtype=torch.long, device=dev)
    pos[at.s, at.index] = _positions(buf, p, at, D, spec, pos_len)
    for c, w in enumerate(V_CLASSES):
        sel = at.cls == c
        code_at, scale_at = _v_addresses(p, at, D, spec, w, sel)
        if w == 16:
            rows = _get(buf, code_at.unsqueeze(1) + 2 * torch.arange(D, device=dev), dtype16).float()
        else:
            codes = buf[code_at.unsqueeze(1) + torch.arange(D * w // 8, device=dev)]
            g = torch.arange(D // spec.v_group_of(w), device=dev)
            scale = _get(buf, scale_at.unsqueeze(1) + 2 * g, quant.META_DTYPE)
            zero = _get(buf, scale_at.unsqueeze(1) + v_bytes(w, D, spec, page)[1] + 2 * g, quant.META_DTYPE)
            rows = quant.dequantize(quant.unpack(codes, w).unflatten(-1, (-1, spec.v_group_of(w))), scale,
                                    zero).flatten(-2)
        V[at.s[sel], at.index[sel]] = rows
    width, code_at, shift = _k_addresses(p, at, D)
    packed = (width > 0) & (width < 16)
    # a packed channel's scale, its zero 2 bytes x the stream's packed channels later
    meta_at = at.base.unsqueeze(1) + p.k_meta[at.s].unsqueeze(1) + 2 * (torch.arange(D, device=dev) - p.ch0[at.s, 1:2])
    code = ((buf[torch.where(packed, code_at, 0)].int() >> shift) & ((1 << width.clamp(1, 8)) - 1)).float()
    cp = p.chans[at.s, 1:4].sum(1, keepdim=True)
    safe = torch.where(packed, meta_at, 0)
    kq = code * _get(buf, safe, quant.META_DTYPE).float() + _get(buf, safe + 2 * cp, quant.META_DTYPE).float()
    k16 = _get(buf, torch.where(width == 16, code_at, 0), dtype16).float()
    mean_at = p.mean0[at.s].unsqueeze(1) + torch.arange(D, device=dev)
    means = t[_K_MEAN]
    mean = means[torch.where(width == 0, mean_at, 0).clamp(max=max(0, len(means) - 1))].float() \
        if len(means) else torch.zeros_like(kq)
    kp = torch.where(width == 0, mean, torch.where(width == 16, k16, kq))
    Kp = torch.zeros(S, nmax, D, device=dev)
    Kp[at.s, at.index] = kp
    K.scatter_(2, t[_K_PERM].long().unsqueeze(1).expand(S, nmax, D), Kp)
    valid = torch.arange(nmax, device=dev) < p.counts.sum(1).unsqueeze(1)
    return K, V, pos, valid


def _page_bases(p: PagePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every page, in storage order: its stream, its V class 0..3 and its byte offset."""
    sc, k = _segments(p.pages.flatten())  # (stream, class) of each page and its index in the class
    return torch.div(sc, 4, rounding_mode="floor"), sc % 4, p.class_base.flatten()[sc] + k * p.page_size.flatten()[sc]


def _pages16(p: PagePlan, head_dim: int, spec: PackSpec, dtype16: torch.dtype) -> dict[torch.dtype, torch.Tensor]:
    """Which of a segment's pages' 16-bit values (masks over the pages as [total / 2] 16-bit words) are of each
    dtype: K and V scales and zeros (fp16), K and V 16-bit rows (``dtype16``), the empty slots of partly filled
    pages included. Every section starts on a 16-byte boundary, so each is whole 16-bit words."""
    s, c, base = _page_bases(p)
    vb = torch.tensor([v_bytes(w, head_dim, spec, p.page) for w in V_CLASSES], device=base.device)[c]
    rows, meta = vb[:, 0], 2 * vb[:, 1]  # V codes (16-bit rows in class 16), then scales and zeros (none there)
    v0, wide = base + p.v_off[s], c == V_CLASSES.index(16)
    spans = [(quant.META_DTYPE, base + p.k_meta[s], v0),  # K scales and zeros
             (quant.META_DTYPE, v0 + rows, v0 + rows + meta),  # V scales and zeros
             (dtype16, base + p.k_off[s, K_WIDTHS.index(16)], base + p.k_meta[s]),  # K 16-bit rows
             (dtype16, v0, v0 + torch.where(wide, rows, 0))]  # V 16-bit rows
    edges: dict[torch.dtype, torch.Tensor] = {}
    for dtype, lo, hi in spans:
        e = edges.setdefault(dtype, torch.zeros(p.total // 2 + 1, dtype=torch.int32, device=base.device))
        e.index_add_(0, torch.div(lo, 2, rounding_mode="floor"), torch.ones_like(lo, dtype=torch.int32))
        e.index_add_(0, torch.div(hi, 2, rounding_mode="floor"), torch.full_like(hi, -1, dtype=torch.int32))
    return {dtype: e.cumsum(0)[:-1] > 0 for dtype, e in edges.items()}


def check_pages(t: dict[str, torch.Tensor], *, batch: int, heads: int, head_dim: int, start: int, prefix_len: int,
                spec: PackSpec, sliding_window: int | None, dtype16: torch.dtype, zone_c: bool = True) -> None:
    """Raise :class:`RDKVError` naming the first field of a segment that is not what :func:`pack` makes:
    scalars in range and the spec legal, exactly the
    tensors ``v_counts``, ``k_perm``, ``k_bits``, ``k_mean`` and ``pages`` (with the optional ``rope`` and, for a
    layer, zone C and ``qwin``) with their dtypes and shapes, counts non-negative and within the positions held,
    each permutation a permutation, K widths legal and sorted, the positions in the pages in range, increasing
    within each (stream, V class) and distinct per stream, and every 16-bit value finite: ``k_mean`` and every
    fp16/bf16 value the pages hold (K and V scales and zeros, K and V 16-bit rows), the empty slots of partly
    filled pages included (the page kernel loads them and weighs them by zero, and zero times Inf is NaN).

    Each size is checked against a tensor before anything is sized by it (counts and widths, then the plan they
    give, then ``pages`` against the plan's total and only then the per-token addresses, which lie inside it), so
    a segment from an untrusted file (:func:`rdkv.load`) can make no decode path read out of bounds or allocate
    beyond its tensors. The bytes of empty slots are otherwise unchecked: no path reads a position or code there."""
    B, H, D = check_scalars(batch=batch, heads=heads, head_dim=head_dim, start=start, prefix_len=prefix_len, spec=spec,
                            sliding_window=sliding_window, dtype16=dtype16)
    S, kb, L = B * H, spec.k_block, prefix_len - start
    tensor = tensor_checker(t)
    counts = tensor(_COUNTS, torch.int32, (S, len(V_CLASSES))).long()
    if (counts < 0).any():
        raise RDKVError(f"{_COUNTS} holds a negative count")
    if (counts.sum(1) > L).any():
        raise RDKVError(f"{_COUNTS} keeps more tokens in a stream than the {L} positions it held")
    perm = tensor(_K_PERM, torch.uint8 if D <= 256 else torch.int16, (S, D)).long()
    if not torch.equal(perm.sort(1).values, torch.arange(D, device=perm.device).expand(S, D)):
        raise RDKVError(f"{_K_PERM} is not a permutation of the channels in every stream")
    bits = tensor(_K_BITS, torch.uint8, (S, D // kb)).long()
    if not torch.isin(bits, torch.tensor(quant.WIDTHS, device=bits.device)).all() or (bits[:, 1:] < bits[:, :-1]).any():
        raise RDKVError(f"{_K_BITS} must hold widths in {quant.WIDTHS}, sorted along each stream")
    p = PagePlan.build(counts, bits, spec, D, prefix_len, page_tokens(D, spec, L))
    buf = tensor(_PAGES, torch.uint8, (p.total,))
    tensor(_K_MEAN, quant.META_DTYPE, (int(p.chans[:, 0].sum()),))
    at = _Slots(p)  # one entry per kept token: at most one per position byte of the pages just checked
    pos = _positions(buf, p, at, D, spec, prefix_len)
    if len(pos) and ((pos < start).any() or (pos >= prefix_len).any()):
        raise RDKVError(f"{_PAGES} holds a position outside [{start}, {prefix_len})")
    same_run = (at.s[1:] == at.s[:-1]) & (at.cls[1:] == at.cls[:-1])
    if (same_run & (pos[1:] <= pos[:-1])).any():
        raise RDKVError(f"the positions in {_PAGES} do not increase within a stream's V class (the packer's order)")
    if torch.unique(at.s * (L + 1) + pos - start).numel() != len(pos):
        raise RDKVError(f"{_PAGES} holds a position twice in one stream")
    if p.total:
        values = buf.view(torch.int16)
        for dtype, inside in _pages16(p, D, spec, dtype16).items():
            if not torch.isfinite(values[inside].view(dtype)).all():
                raise RDKVError(f"{_PAGES} holds a NaN or Inf {dtype} value (a K or V 16-bit row, scale or zero)")
    check_extras(t, {_COUNTS, _K_PERM, _K_BITS, _K_MEAN, _PAGES}, batch=B, heads=H, head_dim=D, dtype16=dtype16,
                 zone_c=zone_c)
