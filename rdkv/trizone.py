"""The TriZone cache: packed old zone (A), 16-bit V rows (B), fresh tokens (C), as transformers cache layers.

A layer holds one packed segment (:mod:`rdkv.layout`, :mod:`rdkv.pages`: the tokens each stream kept, in pages of
V rows packed by width class or in 16 bits and K per channel block at its width) and zone C, the tokens appended after compression in the 16-bit
dtype, whose first sits at absolute position ``c_start``. With a fold policy (:mod:`rdkv.fold`), older zone C
tokens are packed into further segments (``folds``, each a :class:`TriZoneLayer` without a zone C) covering
positions ``[fold.start, fold.prefix_len)``.

``nbytes`` is the sum of every tensor the layer and its folds hold; no other state is kept.
"""
from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import layout, pages, quant
from .errors import RDKVError
from .layout import PackSpec


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
        kc, vc = layout.zone_c(self)
        if self.spec.v_rotate:
            value_states = layout.rotate_v(value_states)
        layout.set_zone_c(self, torch.cat([kc, key_states.to(self.dtype16)], 2),
                          torch.cat([vc, value_states.to(self.dtype16)], 2))
        return self, self

    def get_seq_length(self) -> int:
        return self.c_start + layout.zone_c(self)[0].shape[2]

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
        return layout.counts(self).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.t.values()) + sum(f.nbytes for f in self.folds)

    def segments(self) -> list[TriZoneLayer]:
        """The segments decode reads: the compressed prefix, then every fold."""
        return [self, *self.folds]

    @property
    def kept(self) -> torch.Tensor:
        """Tokens kept per stream [S]."""
        return layout.counts(self).sum(1)

    def v_widths(self) -> torch.Tensor:
        """V width of every held prefix position [B, H, prefix_len - start] (0 = evicted)."""
        return pages.v_widths(self)

    def k_widths(self) -> torch.Tensor:
        """K width of every channel, in the model's channel order [B, H, D]."""
        return layout.k_widths(self)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zones A+B as dense float32 K, V [S, Nmax, D] (V rotated back to the model's basis under ``v_rotate``),
        positions [S, Nmax] and validity [S, Nmax]; the decode paths never unpack a whole segment."""
        K, V, pos, valid = pages.dequantize_segment(self)
        return K, layout.rotate_v(V) if self.spec.v_rotate else V, pos, valid


def pack_layer(k: torch.Tensor, v: torch.Tensor, start: int, v_width: torch.Tensor, k_bits: torch.Tensor,
               k_perm: torch.Tensor, spec: PackSpec, dtype16: torch.dtype, sliding_window: int | None,
               prefix_len: int) -> TriZoneLayer:
    """Pack k, v [B, H, T, D] (absolute positions start..start+T-1) in pages (:func:`rdkv.pages.pack`) given widths
    per V token [B, H, T] in {0,2,4,8,16}, per K block [B, H, D/k_block] and the channel order [B, H, D] (the blocks
    are stored sorted by width)."""
    B, H, T, D = k.shape
    S = B * H
    t = pages.pack(k.reshape(S, T, D).float(), v.reshape(S, T, D).float(), start, v_width.reshape(S, T),
                   k_bits.reshape(S, D // spec.k_block), k_perm.reshape(S, D), spec, dtype16)
    layer = TriZoneLayer(t, batch=B, heads=H, head_dim=D, start=start, prefix_len=prefix_len, spec=spec,
                         sliding_window=sliding_window, dtype16=dtype16)
    layout.set_zone_c(layer, k.new_zeros(B, H, 0, D, dtype=dtype16), k.new_zeros(B, H, 0, D, dtype=dtype16))
    return layer


def pack_choice(k: torch.Tensor, v: torch.Tensor, start: int, v_opt: torch.Tensor, k_opt: torch.Tensor,
                perm: torch.Tensor, spec: PackSpec, dtype16: torch.dtype, sliding_window: int | None,
                prefix_len: int) -> TriZoneLayer:
    """Pack an allocation given as option indices into ``quant.WIDTHS`` (V per token [B, H, T], K per
    block [B, H, nb] in the channel order ``perm`` [B, H, D]) in pages."""
    widths = torch.tensor(quant.WIDTHS, device=k.device)
    return pack_layer(k, v, start, widths[v_opt], widths[k_opt], perm, spec, dtype16, sliding_window, prefix_len)


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
                layout.set_decode_queries(layer, None)

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: codes, scales, zeros, indices, counts, zone C and folds."""
        return sum(layer.nbytes for layer in self.layers)

    def report(self):
        from .report import Report

        return Report.of(self)
