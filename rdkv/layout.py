"""The packed layout of a TriZone segment, and the one module that names its tensors.

A segment holds, for S = batch * kv_heads streams, each with its own allocation:

* Tokens a stream keeps, ordered by V width class (2, 4, 8, 16), then by position. The class sizes [S, 4] are
  the one table every other index derives from (:class:`Plan`).
* V rows of class w in {2, 4, 8} (zone A): packed codes [rows, D*w/8] with one fp16 scale and zero per
  ``spec.v_group_of(w)`` channels (one size, or one per width); class 16 rows (zone B) in the 16-bit dtype.
* K per channel block of ``k_block`` channels. A permutation [S, D] makes each stream's blocks contiguous and
  ordered by width; the block widths are [S, D/k_block]. The rows of all (block, stream) pairs of width w,
  block-major, are packed codes [rows, k_block*w/8] with one fp16 scale and zero per channel per ``k_group``
  consecutive tokens of a pair; width 16 keeps 16-bit rows, width 0 only the channel means.
* Optionally the layer's rotary table (keys packed before RoPE, :mod:`rdkv.rope`), rotating them back at decode.
* The absolute position of each kept token (sliding-window masks, reports).
* A layer (not a fold) also holds zone C: tokens appended after compression [B, H, n, D] in the 16-bit dtype,
  and, under a fold policy, the last decode queries the next fold weighs by.

Readers never index the tensors by name: they ask this module for them (:func:`v_rows`, :func:`k_rows`,
:func:`zone_c`, ...) and for the offsets (:func:`plan`, derived once per segment and shared by the packer, the
torch oracle, the CPU decode with its C products and the Triton launcher). The byte model here is what the packer
stores, so what the solver and the baselines are charged is what a cache holds.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from . import quant, rope
from .backend import backend, triton_kernel
from .errors import RDKVError

if TYPE_CHECKING:
    from .trizone import TriZoneLayer

T = TypeVar("T")

V_CLASSES = (2, 4, 8, 16)


@dataclass(frozen=True)
class PackSpec:
    """Group sizes of the packed format (they set the metadata bytes)."""

    # channels per V scale/zero: one size, or one per packed V width (2, 4, 8 bits). On Gemma 3 at ~40% of the
    # bytes, groups of 32 paid on the 2-bit rows only: (32, 64, 64) (docs/experiments.md)
    v_group: int | tuple[int, int, int] = 64
    k_group: int = 128  # tokens per K scale/zero per channel at most: a page (rdkv.pages.page_tokens) is one group
    k_block: int = 16  # channels per K allocation unit (a multiple of 16 keeps GPU dot shapes legal)

    def __post_init__(self) -> None:
        if isinstance(self.v_group, list):  # as JSON gives it back (rdkv.io)
            object.__setattr__(self, "v_group", tuple(self.v_group))

    def v_group_of(self, width: int) -> int:
        """V channels per scale/zero at ``width`` in quant.PACKED."""
        return self.v_group if isinstance(self.v_group, int) else self.v_group[quant.PACKED.index(width)]

    def check(self, head_dim: int) -> None:
        vg = self.v_group
        if not isinstance(vg, int) and not (isinstance(vg, tuple) and len(vg) == len(quant.PACKED)
                                            and all(isinstance(g, int) for g in vg)):
            raise RDKVError(f"v_group must be an int or one int per V width {quant.PACKED}, got {vg!r}")
        groups = [(f"v_group at {w} bits" if isinstance(vg, tuple) else "v_group", self.v_group_of(w))
                  for w in (quant.PACKED if isinstance(vg, tuple) else quant.PACKED[:1])]
        for name, g in groups + [("k_block", self.k_block)]:
            if g <= 0 or head_dim % g:
                raise RDKVError(f"{name}={g} must divide head_dim={head_dim}; pick a divisor such as {head_dim}")
        if isinstance(self.k_group, bool) or not isinstance(self.k_group, int) or self.k_group < 16:
            raise RDKVError(f"k_group must be an int of at least 16 (a page, one K scale group, holds 16 to 64 tokens), "
                            f"got {self.k_group!r}")
        if self.k_block % 4 or any(g % 4 for _, g in groups):
            raise RDKVError("v_group and k_block must be multiples of 4 (2-bit codes pack 4 per byte)")


def pos_dtype(length: int) -> torch.dtype:
    return torch.int16 if length <= torch.iinfo(torch.int16).max else torch.int32


def pos_bytes(length: int) -> int:
    """Bytes of one stored position when positions run up to ``length``."""
    return 2 if pos_dtype(length) == torch.int16 else 4


# --- the byte model: what the packer stores, which is what the solver and the baselines are charged ----

def fp16_bytes(tokens: int, head_dim: int) -> int:
    """Bytes of ``tokens`` K and V rows as a plain 16-bit cache (the budget's unit)."""
    return 4 * head_dim * tokens


def fixed_bytes(heads: int, head_dim: int, spec: PackSpec, prerope: bool = False) -> int:
    """Per-sequence bytes of one layer that do not depend on the allocation: per head the V class counts
    (4 int32), the channel permutation (uint8, int16 past 256 channels) and the block widths (uint8); with
    ``prerope`` the layer's RoPE table, charged to every sequence (conservative for batch > 1)."""
    per_head = 4 * 4 + head_dim * (1 if head_dim <= 256 else 2) + head_dim // spec.k_block
    return heads * per_head + (rope.rope_bytes(head_dim) if prerope else 0)


def v_row_bytes(spec: PackSpec, head_dim: int, length: int) -> torch.Tensor:
    """Bytes of one kept V row at each width of ``quant.WIDTHS`` [5] (float64): its codes, scales and zeros
    (or its 16-bit row) and its stored position (positions up to ``length``); 0 for an evicted token."""
    return torch.tensor([quant.row_bytes(w, head_dim, spec.v_group_of(w) if w in quant.PACKED else head_dim)
                         + (pos_bytes(length) if w else 0) for w in quant.WIDTHS], dtype=torch.float64)


def k_block_bytes(spec: PackSpec, n: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Bytes of one K channel block at each width of ``quant.WIDTHS`` when its stream keeps ``n`` tokens
    [...] -> [..., 5] (float64): at 0 bits the block's channel means, at 16 its rows, else its codes plus a
    scale and zero per channel per started group of ``group`` tokens (a page, :func:`rdkv.pages.page_tokens`;
    ``k_group`` in the packed layout)."""
    kb, g = spec.k_block, group or spec.k_group
    n = n.double().unsqueeze(-1)
    w = torch.tensor(quant.WIDTHS, dtype=torch.float64, device=n.device)
    packed = kb * w / 8 * n + kb * torch.ceil(n / g) * quant.META_BYTES
    return torch.where(w == 0, 2.0 * kb, torch.where(w == 16, 2.0 * kb * n, packed))


def fp16_token_bytes(head_dim: int, length: int) -> int:
    """Bytes of one token kept in 16 bits in every channel (an eviction baseline's unit): V row, position, K."""
    return 2 * head_dim + pos_bytes(length) + 2 * head_dim


POSITION_LIMIT = 2**31 - 1  # positions are stored as int32 at most
HEAD_DIM_LIMIT = 1024  # the widest head the packer and the decode paths are built for (k_perm is int16 past 256)


def _int(name: str, x, lo: int, hi: int = POSITION_LIMIT) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise RDKVError(f"{name} must be an int in [{lo}, {hi}], got {x!r}")
    return x


def check_scalars(*, batch: int, heads: int, head_dim: int, start: int, prefix_len: int, spec: PackSpec,
                  sliding_window: int | None, dtype16: torch.dtype) -> tuple[int, int, int]:
    """Raise :class:`RDKVError` naming the first of a segment's scalars out of range or its spec illegal for
    ``head_dim``; (batch, heads, head_dim) otherwise. Shared by :func:`check_layout` and
    :func:`rdkv.pages.check_pages`: nothing is sized by a scalar before this passes."""
    B, H = _int("batch", batch, 1, 2**16), _int("heads", heads, 1, 2**16)
    D = _int("head_dim", head_dim, 4, HEAD_DIM_LIMIT)
    start, prefix_len = _int("start", start, 0), _int("prefix_len", prefix_len, 0)
    if start > prefix_len:
        raise RDKVError(f"start {start} is past prefix_len {prefix_len}")
    if sliding_window is not None:
        _int("sliding_window", sliding_window, 1)
    if dtype16 not in (torch.float16, torch.bfloat16):
        raise RDKVError(f"the 16-bit dtype must be float16 or bfloat16, got {dtype16}")
    if not isinstance(spec, PackSpec):
        raise RDKVError(f"spec must be a PackSpec, got {type(spec).__name__}")
    spec.check(D)
    _int("k_group", spec.k_group, 1, POSITION_LIMIT)
    return B, H, D


def tensor_checker(t: dict[str, torch.Tensor]) -> Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor]:
    """A function returning ``t[name]`` once it is a tensor of exactly ``dtype`` and ``shape`` (and, if floating,
    finite), raising :class:`RDKVError` naming it otherwise. The shape is compared, never allocated."""

    def tensor(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        x = t.get(name)
        if not isinstance(x, torch.Tensor) or x.dtype != dtype or tuple(x.shape) != shape:
            got = "missing" if x is None else f"{tuple(x.shape)} {getattr(x, 'dtype', type(x).__name__)}"
            raise RDKVError(f"tensor {name!r}: expected {shape} {dtype}, got {got}")
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise RDKVError(f"tensor {name!r} holds NaN or Inf")
        return x

    return tensor


def check_extras(t: dict[str, torch.Tensor], names: set[str], *, batch: int, heads: int, head_dim: int,
                 dtype16: torch.dtype, zone_c: bool) -> None:
    """The tensors every segment layout shares, after its own ``names``: the optional RoPE table, zone C and the
    fold queries (``zone_c``: a layer, not a fold), then no tensor beyond these."""
    B, H, D = batch, heads, head_dim
    tensor = tensor_checker(t)
    names = set(names)
    if "rope" in t:
        tensor("rope", torch.float32, (rope.rope_bytes(D) // 4,))
        names.add("rope")
    if zone_c:
        nc = t["kc"].shape[2] if isinstance(t.get("kc"), torch.Tensor) and t["kc"].dim() == 4 else 0
        tensor("kc", dtype16, (B, H, nc, D))
        tensor("vc", dtype16, (B, H, nc, D))
        names |= {"kc", "vc"}
        if "qwin" in t:
            q = t["qwin"]
            if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] % H:
                raise RDKVError("tensor 'qwin': expected [batch, query heads, window, head_dim]")
            tensor("qwin", dtype16, (B, q.shape[1], q.shape[2], D))
            names.add("qwin")
    extra = sorted(set(t) - names)
    if extra:
        raise RDKVError(f"unexpected tensors {extra}")


def check_layout(t: dict[str, torch.Tensor], *, batch: int, heads: int, head_dim: int, start: int, prefix_len: int,
                 spec: PackSpec, sliding_window: int | None, dtype16: torch.dtype, zone_c: bool = True) -> None:
    """Raise :class:`RDKVError` naming the first field of a packed segment that is not what :func:`pack_layer` makes:
    scalars in range, the spec legal for ``head_dim``, exactly the tensors the counts imply with their dtypes and
    shapes, counts non-negative and within the positions held, positions in range and distinct per stream and in
    the packer's order, each permutation a permutation, widths legal and sorted, and finite 16-bit values, scales
    and zeros. Every size is checked against a tensor before anything is sized by it, so a segment from an
    untrusted file can make no decode path read out of bounds or allocate beyond its tensors."""
    B, H, D = check_scalars(batch=batch, heads=heads, head_dim=head_dim, start=start, prefix_len=prefix_len, spec=spec,
                            sliding_window=sliding_window, dtype16=dtype16)
    S, kb, L = B * H, spec.k_block, prefix_len - start
    tensor = tensor_checker(t)
    counts = tensor("v_counts", torch.int32, (S, len(V_CLASSES))).long()
    if (counts < 0).any():
        raise RDKVError("v_counts holds a negative count")
    n = counts.sum(1)
    if (n > L).any():
        raise RDKVError(f"v_counts keeps more tokens in a stream than the {L} positions it held")
    N = int(n.sum())
    pos = tensor("pos", pos_dtype(prefix_len), (N,)).long()
    s, i = _segments(n)
    if N and ((pos < start).any() or (pos >= prefix_len).any()):
        raise RDKVError(f"pos holds a position outside [{start}, {prefix_len})")
    cls = (i.unsqueeze(1) >= torch.cumsum(counts, 1)[s]).sum(1)
    same_run = (s[1:] == s[:-1]) & (cls[1:] == cls[:-1])
    if (same_run & (pos[1:] <= pos[:-1])).any():
        raise RDKVError("pos is not increasing within a stream's width class (the packer's order)")
    if torch.unique(s * (L + 1) + pos - start).numel() != N:
        raise RDKVError("pos holds a position twice in one stream")
    perm = tensor("k_perm", torch.uint8 if D <= 256 else torch.int16, (S, D)).long()
    if not torch.equal(perm.sort(1).values, torch.arange(D, device=perm.device).expand(S, D)):
        raise RDKVError("k_perm is not a permutation of the channels in every stream")
    bits = tensor("k_bits", torch.uint8, (S, D // kb)).long()
    if not torch.isin(bits, torch.tensor(quant.WIDTHS, device=bits.device)).all() or (bits[:, 1:] < bits[:, :-1]).any():
        raise RDKVError(f"k_bits must hold widths in {quant.WIDTHS}, sorted along each stream")
    names = {"v_counts", "pos", "k_perm", "k_bits"}
    for c, w in enumerate(V_CLASSES):
        rows = int(counts[:, c].sum())
        if w == 16:
            tensor("v16", dtype16, (rows, D))
            names.add("v16")
            continue
        g = spec.v_group_of(w)
        tensor(f"v{w}.codes", torch.uint8, (rows, D * w // 8))
        tensor(f"v{w}.scale", quant.META_DTYPE, (rows, D // g))
        tensor(f"v{w}.zero", quant.META_DTYPE, (rows, D // g))
        names |= {f"v{w}.codes", f"v{w}.scale", f"v{w}.zero"}
    for w in quant.WIDTHS:
        pair_n = n[torch.nonzero(bits.T == w, as_tuple=True)[1]]
        if w == 0:
            tensor("k0.mean", quant.META_DTYPE, (len(pair_n), kb))
            names.add("k0.mean")
        elif w == 16:
            tensor("k16", dtype16, (int(pair_n.sum()), kb))
            names.add("k16")
        else:
            groups = int(((pair_n + spec.k_group - 1) // spec.k_group).sum())
            tensor(f"k{w}.codes", torch.uint8, (int(pair_n.sum()), kb * w // 8))
            tensor(f"k{w}.scale", quant.META_DTYPE, (groups, kb))
            tensor(f"k{w}.zero", quant.META_DTYPE, (groups, kb))
            names |= {f"k{w}.codes", f"k{w}.scale", f"k{w}.zero"}
    check_extras(t, names, batch=B, heads=H, head_dim=D, dtype16=dtype16, zone_c=zone_c)


# --- offsets: derived once per segment -------------------------------------------------------------------

def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segment sizes ``counts`` [P]: (segment id, index inside the segment) of every element."""
    seg = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    return seg, torch.arange(len(seg), device=counts.device) - starts[seg]


def _excl(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


class KTokens(NamedTuple):
    """The kept tokens of every K pair of one width, in storage order (a pair's tokens in its stream's order)."""

    stream: torch.Tensor  # [R] stream of the pair
    block: torch.Tensor  # [R] the pair's channel block (in the stream's permuted order)
    pair: torch.Tensor  # [R] the pair's index among the pairs of this width (its row at width 0)
    token: torch.Tensor  # [R] the token's index inside its stream (its stored row at widths 2-16 is the entry's index)
    group: torch.Tensor  # [R] the token's scale/zero group among this width's groups


@dataclass(eq=False)
class Plan:
    """Every offset of one packed segment, derived from its class sizes, block widths and ``k_group``.

    Tokens: stream s's kept tokens follow every earlier stream's in the positions, ordered by V class. V rows of
    class c are stream-major. K pairs, one per (stream, channel block), in storage order: by width, then
    block-major (block, stream); a pair holds n[s] rows (one channel-mean row at width 0) and
    ceil(n[s] / k_group) scale groups, counted from the first pair of its width. Tensors are on the segment's
    device; :attr:`host` mirrors them in numpy for the CPU decode's bookkeeping.
    """

    counts: torch.Tensor  # [S, 4] int64 tokens per stream and V class
    n: torch.Tensor  # [S] tokens per stream
    tok0: torch.Tensor  # [S] index of the stream's first token among all kept tokens
    class_start: torch.Tensor  # [S, 5] class boundaries inside the stream: 0, c2, c2 + c4, ..., n
    class_row0: torch.Tensor  # [S, 4] row of the stream's first class-c token among class c's rows
    pair_width: torch.Tensor  # [P] K width of each pair, storage order
    pair_stream: torch.Tensor  # [P]
    pair_block: torch.Tensor  # [P] channel block in the stream's permuted order
    pair_row0: torch.Tensor  # [P] first stored row among its width's rows
    pair_group0: torch.Tensor  # [P] first scale/zero group among its width's groups
    width_pairs: torch.Tensor  # [6] pairs of width WIDTHS[i] are [width_pairs[i], width_pairs[i + 1]) (CPU)
    block_row0: torch.Tensor  # [S, NB] pair_row0 of each stream's blocks
    block_group0: torch.Tensor  # [S, NB] pair_group0 likewise
    block_width_start: torch.Tensor  # [S, 6] boundaries of each width along a stream's blocks (sorted by width)
    k_group: int

    @classmethod
    def build(cls, counts: torch.Tensor, k_bits: torch.Tensor, k_group: int) -> Plan:
        counts, k_bits = counts.long(), k_bits.long()
        (S, NB), dev = k_bits.shape, k_bits.device
        n = counts.sum(1)
        widx = quant.option_of(k_bits)
        if (widx < 0).any() or (widx[:, 1:] < widx[:, :-1]).any():
            raise RDKVError(f"k_bits must hold widths in {quant.WIDTHS}, sorted along each stream: the layer is corrupt")
        blocks = torch.arange(NB, device=dev)
        order = ((widx * NB + blocks) * S + torch.arange(S, device=dev).unsqueeze(1)).flatten().argsort()
        pair_stream, pair_block = order // NB, order % NB
        pwidx = widx.flatten()[order]
        width_pairs = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(pwidx.cpu(), minlength=5).cumsum(0)])
        first = width_pairs[:-1].to(dev)[pwidx]  # the first pair of each pair's width
        rows = torch.where(pwidx == 0, 1, n[pair_stream])
        groups = -(-n[pair_stream] // k_group)
        row0, group0 = _excl(rows), _excl(groups)
        row0, group0 = row0 - row0[first], group0 - group0[first]
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order), device=dev)  # (stream * NB + block) -> storage index
        at = where.view(S, NB)
        width_start = torch.cat([torch.zeros(S, 1, dtype=torch.long, device=dev),
                                 torch.nn.functional.one_hot(widx, 5).sum(1).cumsum(1)], 1)
        cstart = _excl(counts, 1)
        return cls(counts, n, _excl(n), torch.cat([cstart, n.unsqueeze(1)], 1), _excl(counts, 0),
                   torch.tensor(quant.WIDTHS, device=dev)[pwidx], pair_stream, pair_block, row0, group0, width_pairs,
                   row0[at], group0[at], width_start, k_group)

    @cached_property
    def host(self) -> Plan:
        """The same plan with numpy arrays (the CPU decode's bookkeeping runs in numpy)."""
        return Plan(**{f: (getattr(self, f).cpu().numpy() if isinstance(getattr(self, f), torch.Tensor)
                           else getattr(self, f)) for f in self.__dataclass_fields__})

    def k_tokens(self, width: int) -> KTokens:
        """Every kept token of the pairs of K width ``width``."""
        wi = quant.OPTION[width]
        a, b = int(self.width_pairs[wi]), int(self.width_pairs[wi + 1])
        s = self.pair_stream[a:b]
        pair, i = _segments(self.n[s])
        return KTokens(s[pair], self.pair_block[a:b][pair], pair, i,
                       self.pair_group0[a:b][pair] + torch.div(i, self.k_group, rounding_mode="floor"))

    @cached_property
    def tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stream, index in stream, V class 0..3) of every kept token, in position-table order."""
        s, i = _segments(self.n)
        return s, i, (i.unsqueeze(1) >= self.class_start[s, 1:]).sum(1)


_DERIVED: dict[tuple, tuple[weakref.ref, object]] = {}


def derived(seg: TriZoneLayer, key: Hashable, build: Callable[[], T]) -> T:
    """``build()``, computed once per segment tensors and ``key`` and dropped when the segment's tensors die: what a
    reader derives from a segment (its :class:`Plan`, a launcher's tables) is kept beside it, never in it, so
    ``nbytes`` stays exactly the stored tensors."""
    counts = seg.t[_COUNTS]
    full = (id(counts), key)
    hit = _DERIVED.get(full)
    if hit is not None and hit[0]() is counts:
        return hit[1]
    value = build()
    _DERIVED[full] = (weakref.ref(counts), value)
    weakref.finalize(counts, _DERIVED.pop, full, None)
    return value


def plan(seg: TriZoneLayer) -> Plan:
    """The segment's :class:`Plan`, built once per segment tensors (:func:`derived`)."""
    return derived(seg, "plan", lambda: Plan.build(seg.t[_COUNTS], seg.t[_K_BITS], seg.spec.k_group))


# --- the stored tensors, by role -----------------------------------------------------------------------------

_COUNTS, _POS, _K_PERM, _K_BITS, _ROPE = "v_counts", "pos", "k_perm", "k_bits", "rope"
_KC, _VC, _QWIN = "kc", "vc", "qwin"
INDEX_TENSORS = (_COUNTS, _K_BITS, _K_PERM, _POS)  # the integer tables every offset derives from (a file fuzzer's targets)


class Stored(NamedTuple):
    """Rows at one width: packed codes with their fp16 scales and zeros, or 16-bit rows (``scale``/``zero``
    None), or at K width 0 the channel means of every pair (``values``; ``scale``/``zero`` None)."""

    values: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None


def v_rows(seg: TriZoneLayer, width: int) -> Stored:
    """The V rows of class ``width`` in (2, 4, 8, 16), stream-major."""
    t = seg.t
    return Stored(t["v16"], None, None) if width == 16 else Stored(t[f"v{width}.codes"], t[f"v{width}.scale"],
                                                                   t[f"v{width}.zero"])


def k_rows(seg: TriZoneLayer, width: int) -> Stored:
    """The K rows of the pairs of ``width`` in quant.WIDTHS, in storage order."""
    t = seg.t
    if width in (0, 16):
        return Stored(t["k0.mean" if width == 0 else "k16"], None, None)
    return Stored(t[f"k{width}.codes"], t[f"k{width}.scale"], t[f"k{width}.zero"])


def counts(seg: TriZoneLayer) -> torch.Tensor:
    """Kept tokens per stream and V class [S, 4] (int32)."""
    return seg.t[_COUNTS]


def positions(seg: TriZoneLayer) -> torch.Tensor:
    """Absolute position of every kept token [N] (int16 or int32), stream-major, each stream by V class."""
    return seg.t[_POS]


def k_perm(seg: TriZoneLayer) -> torch.Tensor:
    """Each stream's channel order [S, D]: its K blocks are consecutive runs of it (uint8, int16 past 256)."""
    return seg.t[_K_PERM]


def k_bits(seg: TriZoneLayer) -> torch.Tensor:
    """Width of each stream's K blocks in permuted order [S, D / k_block] (uint8)."""
    return seg.t[_K_BITS]


def rope_table(seg: TriZoneLayer) -> torch.Tensor | None:
    """The rotary table keys were packed before (float32 [D/2 + 1]), or None: keys are stored rotated."""
    return seg.t.get(_ROPE)


def _put(seg: TriZoneLayer, name: str, x: torch.Tensor | None) -> None:
    """Store ``x`` under ``name``, or drop it for None."""
    if x is None:
        seg.t.pop(name, None)
    else:
        seg.t[name] = x


def set_rope_table(seg: TriZoneLayer, table: torch.Tensor | None) -> None:
    _put(seg, _ROPE, table)


def zone_c(layer: TriZoneLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """Zone C's keys and values [B, H, n, D] (16-bit)."""
    return layer.t[_KC], layer.t[_VC]


def set_zone_c(layer: TriZoneLayer, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
    """Replace zone C (None drops it: a fold segment has none)."""
    if k is None:
        del layer.t[_KC], layer.t[_VC]
    else:
        layer.t[_KC], layer.t[_VC] = k, v


def decode_queries(layer: TriZoneLayer) -> torch.Tensor | None:
    """The last decode queries a fold policy keeps [B, Hq, window, D], or None."""
    return layer.t.get(_QWIN)


def set_decode_queries(layer: TriZoneLayer, q: torch.Tensor | None) -> None:
    _put(layer, _QWIN, q)


def component(name: str) -> str:
    """The accounting bucket of a stored tensor (:data:`COMPONENTS`)."""
    if name in (_KC, _VC, _QWIN):
        return "zone C"
    if name.endswith(".codes"):
        return "codes"
    if name.endswith(".scale"):
        return "scales"
    if name.endswith(".zero") or name == "k0.mean":
        return "zeros"
    if name in ("v16", "k16"):
        return "fp16 rows"
    return "indices"  # positions, counts, permutation, block widths, RoPE table


COMPONENTS = ("codes", "scales", "zeros", "fp16 rows", "indices", "zone C")


def component_bytes(seg: TriZoneLayer) -> dict[str, int]:
    """Bytes one segment holds per accounting bucket (:data:`COMPONENTS`)."""
    out = dict.fromkeys(COMPONENTS, 0)
    for name, x in seg.t.items():
        out[component(name)] += x.numel() * x.element_size()
    return out


def zone_bytes(layer: TriZoneLayer) -> tuple[int, int, int]:
    """Bytes of one layer's zone A (packed V rows, all K, indices), zone B (16-bit V rows) and zone C."""
    b = {name: x.numel() * x.element_size() for name, x in layer.t.items()}
    zb, zc = b["v16"], b[_KC] + b[_VC] + b.get(_QWIN, 0)
    return sum(b.values()) - zb - zc, zb, zc


# --- packing and the torch oracle's view ---------------------------------------------------------------------

def quantize_pack(x: torch.Tensor, bits: int, group: int, axis: int = -1,
                  segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups of ``x`` to ``bits`` in {2, 4, 8} and pack the codes: (packed uint8, scale fp16,
    zero fp16), bit-identical on every backend.

    ``axis=-1`` (V rows): x [..., n * group] -> packed [..., n * group * bits / 8], scale/zero [..., n]; the
    same as :func:`rdkv.quant.quantize` on ``x.unflatten(-1, (-1, group))`` then :func:`rdkv.quant.pack`. ``axis=0`` (K): x [R, C],
    groups of ``group`` rows per channel, restarting at every segment of ``segments`` (row counts summing to
    R; default one) -> packed [R, C * bits / 8] (codes packed along C), scale/zero [groups, C].

    Runs the Triton kernel (``rdkv.kernels.quantize_pack``) when ``rdkv.backend.backend(x.device)`` is
    ``"triton"`` (CUDA tensors, or ``RDKV_BACKEND=triton``), the torch ops otherwise.
    """
    if backend(x.device) != "triton":
        return quant.quantize_pack_torch(x, bits, group, axis, segments)
    return triton_kernel("quantize_pack")(x, bits, group, axis, segments)


def storage_order(v_width: torch.Tensor, bits: torch.Tensor, perm: torch.Tensor, k_block: int):
    """The order a segment stores its units in, for V widths per token [S, T], K widths per block [S, D/k_block] and
    the channel order [S, D]: (channel order with the blocks sorted by width (stable), the sorted widths, tokens per
    stream and V class [S, 4], the kept tokens' indices stream-major, each stream by class then position [N], and
    their class 0..3 [N])."""
    T = v_width.shape[1]
    order = bits.argsort(dim=-1, stable=True)
    perm = perm.unflatten(-1, (-1, k_block)).gather(1, order.unsqueeze(-1).expand(-1, -1, k_block)).flatten(-2)
    bits = bits.gather(-1, order)
    rank = torch.full_like(v_width, len(V_CLASSES))
    for c, w in enumerate(V_CLASSES):
        rank[v_width == w] = c
    order = (rank * T + torch.arange(T, device=v_width.device)).argsort(1)
    counts = torch.stack([(v_width == w).sum(1) for w in V_CLASSES], 1)
    keep = torch.arange(T, device=v_width.device) < counts.sum(1, keepdim=True)
    return perm, bits, counts, order[keep], rank.gather(1, order)[keep]


def pack(k: torch.Tensor, v: torch.Tensor, start: int, v_width: torch.Tensor, bits: torch.Tensor, perm: torch.Tensor,
         spec: PackSpec, dtype16: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one packed segment (no zone C) for k, v [S, T, D] float32 at absolute positions
    start..start+T-1, V widths per token [S, T] in {0, 2, 4, 8, 16}, K widths per block [S, D/k_block] of the
    channel order [S, D]. The blocks are stored sorted by width (stable), so each stream's blocks of one width are
    consecutive and a decode visits them in storage order."""
    S, T, D = k.shape
    dev, kb = k.device, spec.k_block
    perm, bits, class_counts, t_flat, cls = storage_order(v_width, bits, perm, kb)
    n = class_counts.sum(1)
    s_flat = torch.repeat_interleave(torch.arange(S, device=dev), n)
    t: dict[str, torch.Tensor] = {
        _COUNTS: class_counts.to(torch.int32),
        _POS: (t_flat + start).to(pos_dtype(start + T)),
        _K_PERM: perm.to(torch.uint8 if D <= 256 else torch.int16),
        _K_BITS: bits.to(torch.uint8),
    }
    vf = v[s_flat, t_flat]
    for c, w in enumerate(V_CLASSES):
        rows = vf[cls == c]
        if w == 16:
            t["v16"] = rows.to(dtype16)
            continue
        t[f"v{w}.codes"], t[f"v{w}.scale"], t[f"v{w}.zero"] = quantize_pack(rows, w, spec.v_group_of(w))
    p = Plan.build(class_counts, bits, spec.k_group)
    kp = k[s_flat, t_flat].gather(1, perm.long()[s_flat]).unflatten(1, (-1, kb))  # [N, D/kb, kb] channels permuted
    for w in quant.WIDTHS:
        r = p.k_tokens(w)
        rows = kp[p.tok0[r.stream] + r.token, r.block]  # [R, kb]
        if w == 0:
            npairs = int(p.width_pairs[1])
            mean = rows.new_zeros(npairs, kb).index_add_(0, r.pair, rows)
            cnt = rows.new_zeros(npairs).index_add_(0, r.pair, rows.new_ones(len(rows)))
            t["k0.mean"] = (mean / cnt.clamp_min(1).unsqueeze(1)).to(quant.META_DTYPE)
        elif w == 16:
            t["k16"] = rows.to(dtype16)
        else:  # groups of k_group tokens per channel, restarting at each pair
            wi = quant.OPTION[w]
            pair_stream = p.pair_stream[int(p.width_pairs[wi]):int(p.width_pairs[wi + 1])]
            t[f"k{w}.codes"], t[f"k{w}.scale"], t[f"k{w}.zero"] = quantize_pack(
                rows, w, spec.k_group, axis=0, segments=n[pair_stream])
    return t


def v_widths(seg: TriZoneLayer) -> torch.Tensor:
    """V width of every held position [B, H, prefix_len - start] (0 = evicted)."""
    s, _, cls = plan(seg).tokens
    out = torch.zeros(seg.batch * seg.heads, seg.prefix_len - seg.start, dtype=torch.long, device=s.device)
    out[s, positions(seg).long() - seg.start] = torch.tensor(V_CLASSES, device=s.device)[cls]
    return out.view(seg.batch, seg.heads, -1)


def k_widths(seg: TriZoneLayer) -> torch.Tensor:
    """K width of every channel, in the model's channel order [B, H, D]."""
    S, D = seg.batch * seg.heads, seg.head_dim
    bits = k_bits(seg)
    per_perm = bits.long().repeat_interleave(seg.spec.k_block, 1)
    out = torch.empty(S, D, dtype=torch.long, device=bits.device)
    out.scatter_(1, k_perm(seg).long(), per_perm)
    return out.view(seg.batch, seg.heads, D)


def dequantize(seg: TriZoneLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zones A+B as dense float32 K, V [S, Nmax, D], positions [S, Nmax] and validity [S, Nmax].

    This is the torch reference: it unpacks the whole segment. The decode paths never do.
    """
    D, spec, p = seg.head_dim, seg.spec, plan(seg)
    S, dev = len(p.n), p.n.device
    nmax = int(p.n.max()) if S else 0
    K = torch.zeros(S, nmax, D, device=dev)
    V = torch.zeros(S, nmax, D, device=dev)
    pos = torch.zeros(S, nmax, dtype=torch.long, device=dev)
    s, i, cls = p.tokens
    pos[s, i] = positions(seg).long()
    for c, w in enumerate(V_CLASSES):
        sel = cls == c
        x = v_rows(seg, w)
        if w == 16:
            rows = x.values.float()
        else:
            codes = quant.unpack(x.values, w).unflatten(-1, (-1, spec.v_group_of(w)))
            rows = quant.dequantize(codes, x.scale, x.zero).flatten(-2)
        V[s[sel], i[sel]] = rows
    kb = spec.k_block
    Kp = torch.zeros(S, nmax, D, device=dev)  # channels in permuted order
    lane = torch.arange(kb, device=dev)
    for w in quant.WIDTHS:
        r, x = p.k_tokens(w), k_rows(seg, w)
        if w == 0:
            rows = x.values.float()[r.pair]
        elif w == 16:
            rows = x.values.float()
        else:
            rows = quant.unpack(x.values, w).float() * x.scale.float()[r.group] + x.zero.float()[r.group]
        Kp[r.stream.unsqueeze(1), r.token.unsqueeze(1), r.block.unsqueeze(1) * kb + lane] = rows
    K.scatter_(2, k_perm(seg).long().unsqueeze(1).expand(S, nmax, D), Kp)
    table = rope_table(seg)
    if table is not None:  # keys were packed before RoPE (rdkv.rope): rotate them to their positions
        K = rope.rotate(K, pos, table)
    valid = torch.arange(nmax, device=dev) < p.n.unsqueeze(1)
    return K, V, pos, valid
