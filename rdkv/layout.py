"""What a TriZone segment stores, named in one place, and the byte model the solver and the baselines are charged by.

A segment holds, for S = batch * kv_heads streams, each with its own allocation:

* the tokens each stream keeps per V width class (2, 4, 8, 16) [S, 4] (``v_counts``), the one table every offset
  derives from;
* each stream's channel order [S, D] (``k_perm``), in which its K channel blocks of ``k_block`` channels are
  consecutive runs sorted by width, and the block widths [S, D/k_block] (``k_bits``);
* the kept tokens themselves in pages (:mod:`rdkv.pages`: K codes, scales and zeros per page, V rows, positions)
  and the width-0 channel means;
* optionally the layer's rotary table (keys packed before RoPE, :mod:`rdkv.rope`), rotating them back at decode;
* a layer (not a fold) also holds zone C: tokens appended after compression [B, H, n, D] in the 16-bit dtype,
  and, under a fold policy, the last decode queries the next fold weighs by.

Readers never index the tensors by name: they ask this module (:func:`counts`, :func:`zone_c`, ...) and
:mod:`rdkv.pages` (the pages and their plan of offsets, derived once per segment and shared by the torch oracle,
the CPU decode's C products, the Triton launcher, the report and the plots).
"""
from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, TypeVar

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
    # every V row (zone C's too) stored times an orthonormal Hadamard matrix (:func:`rotate_v`), decode's output
    # rotated back: outlier channels spread over the row, which lowers quantization error (docs/experiments.md)
    v_rotate: bool = False

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
        if not isinstance(self.v_rotate, bool):
            raise RDKVError(f"v_rotate must be True or False, got {self.v_rotate!r}")
        if self.v_rotate and head_dim & (head_dim - 1):
            raise RDKVError(f"v_rotate needs a power-of-two head_dim (a Hadamard matrix of that size), this model's is "
                            f"{head_dim}: compress with v_rotate=False")


@functools.cache
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / math.sqrt(n)).to(torch.float32).to(device)


def rotate_v(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D] times the orthonormal Sylvester-Hadamard matrix of size D, in float32 then back to x's dtype.

    The matrix is symmetric and its own inverse, so the same call rotates V rows into the stored basis and an
    attention output back out of it (the output is linear in V)."""
    return (x.float() @ _hadamard(x.shape[-1], x.device)).to(x.dtype)


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


def k_block_bytes(spec: PackSpec, n: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes of one K channel block at each width of ``quant.WIDTHS`` when its stream keeps ``n`` tokens
    [...] -> [..., 5] (float64): at 0 bits the block's channel means, at 16 its rows, else its codes plus a
    scale and zero per channel per started group of ``group`` tokens (a page, :func:`rdkv.pages.page_tokens`)."""
    kb, g = spec.k_block, group
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
    ``head_dim``; (batch, heads, head_dim) otherwise (:func:`rdkv.pages.check_pages`: nothing is sized by a scalar
    before this passes)."""
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


# --- offsets: derived once per segment -------------------------------------------------------------------

_DERIVED: dict[tuple, tuple[weakref.ref, object]] = {}


def derived(seg: TriZoneLayer, key: Hashable, build: Callable[[], T]) -> T:
    """``build()``, computed once per segment tensors and ``key`` and dropped when the segment's tensors die: what a
    reader derives from a segment (its page plan, a launcher's tables) is kept beside it, never in it, so
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


# --- the stored tensors, by role -----------------------------------------------------------------------------

_COUNTS, _K_PERM, _K_BITS, _ROPE = "v_counts", "k_perm", "k_bits", "rope"
_KC, _VC, _QWIN = "kc", "vc", "qwin"


def counts(seg: TriZoneLayer) -> torch.Tensor:
    """Kept tokens per stream and V class [S, 4] (int32)."""
    return seg.t[_COUNTS]


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
    """The accounting bucket (:data:`COMPONENTS`) of a stored tensor other than the pages and the channel means
    (:func:`rdkv.pages.component_bytes` splits those)."""
    return "zone C" if name in (_KC, _VC, _QWIN) else "indices"  # counts, permutation, block widths, RoPE table


COMPONENTS = ("codes", "scales", "zeros", "fp16 rows", "indices", "zone C")


# --- packing ------------------------------------------------------------------------------------------------

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


def k_widths(seg: TriZoneLayer) -> torch.Tensor:
    """K width of every channel, in the model's channel order [B, H, D]."""
    S, D = seg.batch * seg.heads, seg.head_dim
    bits = k_bits(seg)
    per_perm = bits.long().repeat_interleave(seg.spec.k_block, 1)
    out = torch.empty(S, D, dtype=torch.long, device=bits.device)
    out.scatter_(1, k_perm(seg).long(), per_perm)
    return out.view(seg.batch, seg.heads, D)
