"""The TriZone cache: packed old zone (A), 16-bit V rows (B), fresh tokens (C).

Layout of one layer, for S = batch * kv_heads streams, each with its own allocation:

* Tokens a stream keeps are ordered by V width class (2, 4, 8, 16), then by position. ``v_counts``
  [S, 4] holds the class sizes; every other index is derived from it.
* V rows of class w in {2, 4, 8} (zone A) are packed codes ``v{w}.codes`` [rows, D*w/8] with one fp16
  scale and zero per ``spec.v_group_of(w)`` channels (one size, or one per width); class 16 rows are
  ``v16`` (zone B), in the 16-bit dtype.
* K is stored per channel block of ``k_block`` channels. ``k_perm`` [S, D] permutes the channels so
  blocks are contiguous and ordered by width; ``k_bits`` [S, D/k_block] gives each block's width.
  The rows of all (block, stream) pairs of width w, block-major, are ``k{w}.codes`` [rows, k_block*w/8],
  with one fp16 scale and zero per channel per ``k_group`` consecutive tokens of a pair. Width 16 is
  ``k16``; width 0 stores only the channel means ``k0.mean``.
* ``rope`` (only when compressed with ``prerope``): the keys were packed before RoPE; the layer's
  rotary frequencies and scaling [D/2 + 1] rotate them back at decode (:mod:`rdkv.rope`).
* ``pos`` [N] is the absolute position of each kept token (needed by sliding-window masks and reports).
* Zone C, ``kc``/``vc`` [B, H, n, D], holds tokens appended after compression, in the 16-bit dtype; its
  first token sits at absolute position ``c_start``.
* ``folds``: with a fold policy (:mod:`rdkv.fold`), older zone C tokens are packed into further
  segments of the same layout (each a :class:`TriZoneLayer` without a zone C) covering positions
  ``[fold.start, fold.prefix_len)``; ``qwin`` then holds the last decode queries the next fold weighs by.

``nbytes`` is the sum of every tensor the layer and its folds hold; no other state is kept.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import quant, rope
from .backend import backend, triton_kernel
from .errors import RDKVError

V_CLASSES = (2, 4, 8, 16)


@dataclass(frozen=True)
class PackSpec:
    """Group sizes of the packed format (they set the metadata bytes)."""

    # channels per V scale/zero: one size, or one per packed V width (2, 4, 8 bits). On Gemma 3 at ~40% of the
    # bytes, groups of 32 paid on the 2-bit rows only: (32, 64, 64) (docs/experiments.md)
    v_group: int | tuple[int, int, int] = 64
    k_group: int = 128  # tokens per K scale/zero, per channel
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
        if self.k_group <= 0 or self.k_block % 4 or any(g % 4 for _, g in groups):
            raise RDKVError("k_group must be positive and v_group/k_block multiples of 4 (2-bit codes pack 4 per byte)")


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


def k_block_bytes(spec: PackSpec, n: torch.Tensor) -> torch.Tensor:
    """Bytes of one K channel block at each width of ``quant.WIDTHS`` when its stream keeps ``n`` tokens
    [...] -> [..., 5] (float64): at 0 bits the block's channel means, at 16 its rows, else its codes plus a
    scale and zero per channel per started group of ``k_group`` tokens."""
    kb, g = spec.k_block, spec.k_group
    n = n.double().unsqueeze(-1)
    w = torch.tensor(quant.WIDTHS, dtype=torch.float64, device=n.device)
    packed = kb * w / 8 * n + kb * torch.ceil(n / g) * quant.META_BYTES
    return torch.where(w == 0, 2.0 * kb, torch.where(w == 16, 2.0 * kb * n, packed))


def fp16_token_bytes(head_dim: int, length: int) -> int:
    """Bytes of one token kept in 16 bits in every channel (an eviction baseline's unit): V row, position, K."""
    return 2 * head_dim + pos_bytes(length) + 2 * head_dim


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segment sizes ``counts`` [P]: (segment id, index inside the segment) of every element."""
    seg = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    return seg, torch.arange(len(seg), device=counts.device) - starts[seg]


def _k_pairs(k_bits: torch.Tensor, n: torch.Tensor, width: int, k_group: int):
    """Rows of the (block, stream) pairs with K width ``width``, block-major.

    Returns (stream, block, pair, token index, group id) per row, the number of pairs and of groups.
    """
    blk, s = torch.nonzero(k_bits.T == width, as_tuple=True)
    pair, i = _segments(n[s])
    groups = torch.div(n[s] + k_group - 1, k_group, rounding_mode="floor")
    gid = (torch.cumsum(groups, 0) - groups)[pair] + torch.div(i, k_group, rounding_mode="floor")
    return s[pair], blk[pair], pair, i, gid, len(s), int(groups.sum())


POSITION_LIMIT = 2**31 - 1  # positions are stored as int32 at most
HEAD_DIM_LIMIT = 1024  # the widest head the packer and the decode paths are built for (k_perm is int16 past 256)


def _int(name: str, x, lo: int, hi: int = POSITION_LIMIT) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise RDKVError(f"{name} must be an int in [{lo}, {hi}], got {x!r}")
    return x


def check_layout(t: dict[str, torch.Tensor], *, batch: int, heads: int, head_dim: int, start: int, prefix_len: int,
                 spec: PackSpec, sliding_window: int | None, dtype16: torch.dtype, zone_c: bool = True) -> None:
    """Raise :class:`RDKVError` naming the first field of a packed segment that is not what :func:`pack_layer` makes:
    scalars in range, the spec legal for ``head_dim``, exactly the tensors the counts imply with their dtypes and
    shapes, counts non-negative and within the positions held, positions in range and distinct per stream and in
    the packer's order, each permutation a permutation, widths legal and sorted, and finite 16-bit values, scales
    and zeros. Every size is checked against a tensor before anything is sized by it, so a segment from an
    untrusted file (:func:`rdkv.load`) can make no decode path read out of bounds or allocate beyond its tensors."""
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
    S, kb, L = B * H, spec.k_block, prefix_len - start

    def tensor(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        x = t.get(name)
        if not isinstance(x, torch.Tensor) or x.dtype != dtype or tuple(x.shape) != shape:
            got = "missing" if x is None else f"{tuple(x.shape)} {getattr(x, 'dtype', type(x).__name__)}"
            raise RDKVError(f"tensor {name!r}: expected {shape} {dtype}, got {got}")
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise RDKVError(f"tensor {name!r} holds NaN or Inf")
        return x

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


class TriZoneLayer(CacheLayerMixin):
    """One layer of a compressed cache. ``update`` appends to zone C and returns the layer itself,
    which the rdkv attention function recognises and decodes."""

    is_compileable = False
    is_croppable = False

    def __init__(self, tensors: dict[str, torch.Tensor], *, batch: int, heads: int, head_dim: int,
                 start: int, prefix_len: int, spec: PackSpec, sliding_window: int | None, dtype16: torch.dtype):
        super().__init__()
        self.t = tensors
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.start = start  # first position this layer held at compress time (sliding layers hold a window)
        self.prefix_len, self.spec, self.sliding_window, self.dtype16 = prefix_len, spec, sliding_window, dtype16
        self.is_sliding = sliding_window is not None
        self.is_initialized = True
        self.c_start = prefix_len  # absolute position of zone C's first token
        self.folds: list[TriZoneLayer] = []
        self.fold = None  # a rdkv.fold.FoldPolicy, or None: zone C grows without bound

    # --- transformers cache-layer API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != self.batch and key_states.shape[0] % self.batch == 0:
            raise RDKVError(f"the batch grew from {self.batch} to {key_states.shape[0]} sequences, as beam search and "
                            "num_return_sequences > 1 expand it: a compressed cache decodes the batch it was compressed "
                            "from; use greedy decoding or sampling with one sequence per prompt")
        if key_states.shape[0] != self.batch or key_states.shape[1] != self.heads:
            raise RDKVError(
                f"new keys have batch/heads {tuple(key_states.shape[:2])}, the compressed cache holds "
                f"{(self.batch, self.heads)}: continue with the same batch the cache was compressed from"
            )
        self.t["kc"] = torch.cat([self.t["kc"], key_states.to(self.dtype16)], 2)
        self.t["vc"] = torch.cat([self.t["vc"], value_states.to(self.dtype16)], 2)
        return self, self

    def get_seq_length(self) -> int:
        return self.c_start + self.t["kc"].shape[2]

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # masks are built over absolute positions; decode gathers the columns of the tokens it kept
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the same question under its transformers 5.2 name

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RDKVError("beam search is not supported on a compressed cache; use greedy or sampling")

    def reset(self) -> None:
        raise RDKVError("a compressed cache cannot be reset; prefill again and call rdkv.compress")

    def crop(self, max_length: int) -> None:
        raise RDKVError("a compressed cache cannot be cropped (evicted tokens cannot come back); prefill the text to "
                        "keep again and call rdkv.compress")

    # --- accounting ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.t["pos"].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.t.values()) + sum(f.nbytes for f in self.folds)

    def segments(self) -> list[TriZoneLayer]:
        """The packed segments decode reads: the compressed prefix, then every fold."""
        return [self, *self.folds]

    @property
    def kept(self) -> torch.Tensor:
        """Tokens kept per stream [S]."""
        return self.t["v_counts"].sum(1).long()

    # --- reference decode support ---------------------------------------------------------------
    def token_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stream, index in stream, V class 0..3) of every kept token, in ``pos`` order."""
        counts = self.t["v_counts"].long()
        s, i = _segments(counts.sum(1))
        bounds = torch.cumsum(counts, 1)[s]  # [N, 4]
        cls = (i.unsqueeze(1) >= bounds).sum(1)
        return s, i, cls

    def v_widths(self) -> torch.Tensor:
        """V width of every held prefix position [B, H, prefix_len - start] (0 = evicted)."""
        s, _, cls = self.token_index()
        out = torch.zeros(self.batch * self.heads, self.prefix_len - self.start, dtype=torch.long, device=self.device)
        out[s, self.t["pos"].long() - self.start] = torch.tensor(V_CLASSES, device=self.device)[cls]
        return out.view(self.batch, self.heads, -1)

    def k_widths(self) -> torch.Tensor:
        """K width of every channel, in the model's channel order [B, H, D]."""
        S, D = self.batch * self.heads, self.head_dim
        per_perm = self.t["k_bits"].long().repeat_interleave(self.spec.k_block, 1)
        out = torch.empty(S, D, dtype=torch.long, device=self.device)
        out.scatter_(1, self.t["k_perm"].long(), per_perm)
        return out.view(self.batch, self.heads, D)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zones A+B as dense float32 K, V [S, Nmax, D], positions [S, Nmax] and validity [S, Nmax].

        This is the torch reference: it unpacks the whole layer. The fused kernel never does.
        """
        t, D, spec = self.t, self.head_dim, self.spec
        S = self.batch * self.heads
        n = self.kept
        nmax = int(n.max()) if S else 0
        dev = self.device
        K = torch.zeros(S, nmax, D, device=dev)
        V = torch.zeros(S, nmax, D, device=dev)
        pos = torch.zeros(S, nmax, dtype=torch.long, device=dev)
        s, i, cls = self.token_index()
        pos[s, i] = t["pos"].long()
        for c, w in enumerate(V_CLASSES):
            sel = cls == c
            if w == 16:
                rows = t["v16"].float()
            else:
                codes = quant.unpack(t[f"v{w}.codes"], w).unflatten(-1, (-1, spec.v_group_of(w)))
                rows = quant.dequantize(codes, t[f"v{w}.scale"], t[f"v{w}.zero"]).flatten(-2)
            V[s[sel], i[sel]] = rows
        kb = spec.k_block
        Kp = torch.zeros(S, nmax, D, device=dev)  # channels in permuted order
        lane = torch.arange(kb, device=dev)
        for w in quant.WIDTHS:
            ps, pb, pair, pi, gid, _, _ = _k_pairs(t["k_bits"], n, w, spec.k_group)
            if w == 0:
                rows = t["k0.mean"].float()[pair]
            elif w == 16:
                rows = t["k16"].float()
            else:
                codes = quant.unpack(t[f"k{w}.codes"], w).float()
                rows = codes * t[f"k{w}.scale"].float()[gid] + t[f"k{w}.zero"].float()[gid]
            Kp[ps.unsqueeze(1), pi.unsqueeze(1), pb.unsqueeze(1) * kb + lane] = rows
        K.scatter_(2, t["k_perm"].long().unsqueeze(1).expand(S, nmax, D), Kp)
        if "rope" in t:  # keys were packed before RoPE (rdkv.rope): rotate them to their positions
            K = rope.rotate(K, pos, t["rope"])
        valid = torch.arange(nmax, device=dev) < n.unsqueeze(1)
        return K, V, pos, valid


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


def pack_layer(k: torch.Tensor, v: torch.Tensor, start: int, v_width: torch.Tensor, k_bits: torch.Tensor,
               k_perm: torch.Tensor, spec: PackSpec, dtype16: torch.dtype, sliding_window: int | None,
               prefix_len: int) -> TriZoneLayer:
    """Pack k, v [B, H, T, D] (absolute positions start..start+T-1) given widths per V token
    [B, H, T] in {0,2,4,8,16}, per K block [B, H, D/k_block] and the channel order [B, H, D]."""
    B, H, T, D = k.shape
    S, dev, kb = B * H, k.device, spec.k_block
    k, v = k.reshape(S, T, D).float(), v.reshape(S, T, D).float()
    v_width, k_bits, k_perm = v_width.reshape(S, T), k_bits.reshape(S, D // kb), k_perm.reshape(S, D)
    rank = torch.full_like(v_width, len(V_CLASSES))
    for c, w in enumerate(V_CLASSES):
        rank[v_width == w] = c
    order = (rank * T + torch.arange(T, device=dev)).argsort(1)
    counts = torch.stack([(v_width == w).sum(1) for w in V_CLASSES], 1)
    n = counts.sum(1)
    keep = torch.arange(T, device=dev) < n.unsqueeze(1)
    s_flat = torch.arange(S, device=dev).unsqueeze(1).expand(S, T)[keep]
    t_flat = order[keep]
    cls = rank.gather(1, order)[keep]
    t: dict[str, torch.Tensor] = {
        "v_counts": counts.to(torch.int32),
        "pos": (t_flat + start).to(pos_dtype(start + T)),
        "k_perm": k_perm.to(torch.uint8 if D <= 256 else torch.int16),
        "k_bits": k_bits.to(torch.uint8),
    }
    vf = v[s_flat, t_flat]
    for c, w in enumerate(V_CLASSES):
        rows = vf[cls == c]
        if w == 16:
            t["v16"] = rows.to(dtype16)
            continue
        t[f"v{w}.codes"], t[f"v{w}.scale"], t[f"v{w}.zero"] = quantize_pack(rows, w, spec.v_group_of(w))
    kp = k[s_flat, t_flat].gather(1, k_perm.long()[s_flat])  # [N, D] channels permuted
    for w in quant.WIDTHS:
        ps, pb, pair, pi, _, npairs, _ = _k_pairs(k_bits, n, w, spec.k_group)
        rows = kp.unflatten(1, (-1, kb))[(torch.cumsum(n, 0) - n)[ps] + pi, pb]  # [R, kb]
        if w == 0:
            mean = rows.new_zeros(npairs, kb).index_add_(0, pair, rows)
            cnt = rows.new_zeros(npairs).index_add_(0, pair, rows.new_ones(len(rows)))
            t["k0.mean"] = (mean / cnt.clamp_min(1).unsqueeze(1)).to(quant.META_DTYPE)
        elif w == 16:
            t["k16"] = rows.to(dtype16)
        else:
            # groups of k_group tokens per channel, restarting at each (block, stream) pair
            pair_stream = torch.nonzero(k_bits.T == w, as_tuple=True)[1]  # _k_pairs' pair order
            t[f"k{w}.codes"], t[f"k{w}.scale"], t[f"k{w}.zero"] = quantize_pack(
                rows, w, spec.k_group, axis=0, segments=n[pair_stream])
    t["kc"] = k.new_zeros(B, H, 0, D, dtype=dtype16)
    t["vc"] = k.new_zeros(B, H, 0, D, dtype=dtype16)
    return TriZoneLayer(t, batch=B, heads=H, head_dim=D, start=start, prefix_len=prefix_len, spec=spec,
                        sliding_window=sliding_window, dtype16=dtype16)


def pack_choice(k: torch.Tensor, v: torch.Tensor, start: int, v_opt: torch.Tensor, k_opt: torch.Tensor,
                perm: torch.Tensor, spec: PackSpec, dtype16: torch.dtype, sliding_window: int | None,
                prefix_len: int) -> TriZoneLayer:
    """Pack an allocation given as option indices into ``quant.WIDTHS`` (V per token [B, H, T], K per
    block [B, H, nb] in the channel order ``perm`` [B, H, D]); K blocks are reordered so each width
    class is contiguous."""
    widths = torch.tensor(quant.WIDTHS, device=k.device)
    kbits = widths[k_opt]
    order = kbits.argsort(dim=-1, stable=True)
    perm = perm.unflatten(-1, (-1, spec.k_block)).gather(2, order.unsqueeze(-1).expand(-1, -1, -1, spec.k_block))
    return pack_layer(k, v, start, widths[v_opt], kbits.gather(-1, order), perm.flatten(-2), spec, dtype16,
                      sliding_window, prefix_len)


SIGNATURE = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
             "vocab_size", "sliding_window", "layer_types")


def model_signature(model: torch.nn.Module) -> dict:
    """The fields of ``model``'s text config a compressed cache depends on (:data:`SIGNATURE`), JSON-ready: a cache
    decodes only with a model whose signature is its own."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    sig = {name: getattr(c, name, None) for name in SIGNATURE} | {"head_dim": head_dim}
    sig["layer_types"] = None if sig["layer_types"] is None else list(sig["layer_types"])
    return sig


class TriZoneCache(Cache):
    """A transformers ``Cache`` whose layers are :class:`TriZoneLayer`."""

    def __init__(self, layers: list[TriZoneLayer], fp16_bytes: int, budget: float | None = None,
                 method: str | None = None, layer_distortion: tuple[float, ...] | None = None,
                 model: dict | None = None):
        super().__init__(layers=layers)
        self.fp16_bytes = fp16_bytes  # what the compressed prefix takes as a plain fp16 cache
        self.budget = budget
        self.method = method  # the method compress ran ("auto" resolved)
        # the solver's modelled distortion per layer (rdkv.calibrate), None for baselines
        self.layer_distortion = layer_distortion
        self.model = model  # model_signature() of the model it was compressed for (None: unchecked)
        self._checked_with: weakref.ref | None = None  # the model check_model last passed

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise :class:`RDKVError` unless ``model`` is one this cache decodes with: the signature it was compressed
        for (when known), and in any case one layer per model layer with the model's KV heads, head size and
        sliding windows, and one batch size. Checked once per model: every forward through the cache asks."""
        if self._checked_with is not None and self._checked_with() is model:
            return
        sig = model_signature(model)
        if self.model is not None and self.model != sig:
            diff = ", ".join(f"{k}: cache {self.model.get(k)!r}, model {sig.get(k)!r}"
                             for k in sorted(set(sig) | set(self.model)) if self.model.get(k) != sig.get(k))
            raise RDKVError(f"this cache was compressed for another model ({diff}): decode it with the model it was "
                            "compressed for")
        kinds = sig["layer_types"]
        if len(self.layers) != sig["num_hidden_layers"]:
            raise RDKVError(f"the cache has {len(self.layers)} layers, the model {sig['num_hidden_layers']}: decode it "
                            "with the model it was compressed for")
        for i, layer in enumerate(self.layers):
            window = None if kinds is None else sig["sliding_window"] if kinds[i] == "sliding_attention" else None
            if ((layer.heads, layer.head_dim) != (sig["num_key_value_heads"], sig["head_dim"]) or layer.batch !=
                    self.layers[0].batch or (kinds is not None and layer.sliding_window != window)):
                raise RDKVError(f"layer {i} of the cache (batch {layer.batch}, {layer.heads} KV heads of {layer.head_dim}, "
                                f"window {layer.sliding_window}) does not fit the model ({sig['num_key_value_heads']} of "
                                f"{sig['head_dim']}, window {window}) or the cache's batch {self.layers[0].batch}")
        self._checked_with = weakref.ref(model)

    @property
    def distortion(self) -> float | None:
        """The solver's modelled distortion (:func:`rdkv.distortion.modelled_distortion`), None for baselines."""
        return None if self.layer_distortion is None else sum(self.layer_distortion)

    def set_fold(self, policy) -> None:
        """Fold zone C under ``policy`` (a :class:`rdkv.fold.FoldPolicy`) from the next decode step on;
        ``None`` turns folding off. Validates against every layer before changing any."""
        if policy is not None:
            for layer in self.layers:
                policy.check(layer)
        for layer in self.layers:
            layer.fold = policy
            if policy is None:
                layer.t.pop("qwin", None)

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: codes, scales, zeros, indices, counts, zone C and folds."""
        return sum(layer.nbytes for layer in self.layers)

    def report(self):
        from .report import Report

        return Report.of(self)
