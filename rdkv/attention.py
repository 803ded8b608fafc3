"""rdkv's transformers adapter: the attention function it registers, and the prefill record.

The ``"rdkv"`` attention implementation is torch SDPA (transformers' own) on ordinary caches. Inside
``with record(model) as rec:`` it attends exactly and streams into ``rec`` what the weight estimator
needs: the last queries, and with ``all_queries`` attention mass per key, its square and squared query
norms per channel, computed in query chunks (memory O(T * chunk), never T x T). On a compressed cache
(``cache.update`` returns the :class:`~rdkv.trizone.TriZoneLayer` itself) it runs the TriZone decode.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import contention
from .backend import backend
from .compat import CACHE_KWARG
from .decode import trizone_decode
from .dense import AttentionSums, allowed_keys, attend
from .errors import NotRecorded, RDKVError
from .records import LayerStats, Record
from .trizone import TriZoneCache, TriZoneLayer

NAME = "rdkv"
RECORD_WINDOW = 256  # the queries a record keeps per layer (observation-window weights use the last 64 by default)


def rdkv_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, except for a sliding-window layer's prefill from an empty cache without
    padding: there no mask at all (None), and :func:`rdkv_attention` applies the window itself in query
    chunks (:func:`_windowed`), instead of SDPA reading a [T, T] mask (1 GiB at 32k tokens)."""
    q_length = kwargs.get("q_length") or len(kwargs.get("cache_position", ()))
    pad = kwargs.get("attention_mask")
    if (not args and kwargs.get("local_size") is not None and kwargs.get("allow_is_causal_skip", True)
            and kwargs.get("kv_offset", 0) == 0 and kwargs.get("kv_length") == q_length > 1
            and (pad is None or bool(pad.all()))):
        return None
    return sdpa_mask(*args, **kwargs)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int) -> torch.Tensor:
    """Causal sliding-window attention of q [B, Hq, T, D] over k, v [B, H, T, D] (the same T positions) in
    chunks of ``window`` queries, each over the at most 2 x window keys it can see: exact, O(T x window)."""
    T, out = q.shape[2], torch.empty_like(q)
    for a in range(0, T, window):
        b, lo = min(a + window, T), max(0, a - window + 1)
        pos = torch.arange(lo, b, device=q.device)
        ok = allowed_keys(pos[a - lo :], pos, window)
        out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], attn_mask=ok, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out


def _sdpa(module: torch.nn.Module, query, key, value, mask, scaling: float, window: int | None, **kwargs) -> torch.Tensor:
    """Attention output [B, Hq, L, D] as transformers' SDPA computes it (or :func:`_windowed` for the
    unmasked sliding-window prefill that :func:`rdkv_mask` leaves to it)."""
    if mask is None and window is not None and query.shape[2] == key.shape[2] > window:
        return _windowed(query, key, value, scaling, window)
    out = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, sliding_window=window, **kwargs)[0]
    # a row that may attend to nothing (left padding) comes out NaN on some SDPA backends; its keys and values
    # are never attended, but the record checks every held value is finite
    return (out if mask is None else out.nan_to_num(0.0)).transpose(1, 2)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformers attention modules, or a clear error for a model rdkv cannot serve."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    if not mods or not hasattr(model, "set_attn_implementation"):
        raise RDKVError(
            f"{type(model).__name__} has no transformers attention modules (layer_idx, num_key_value_groups): "
            "rdkv serves transformers decoders such as Llama, Qwen, Mistral and Gemma 3"
        )
    return mods


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Select the ``"rdkv"`` attention implementation on ``model`` (in place) and return it: SDPA on ordinary
    caches, the TriZone decode on compressed ones, and a pass through a compressed cache on the CPU path on the
    cores other work leaves free (:mod:`rdkv.contention`, forward hooks on ``model``). From then on every prefill
    into an empty cache is recorded, and its record kept for as long as the cache it returns lives, so that
    ``rdkv.compress(model, budget)`` (or ``compress(cache, budget)``) compresses it; a later forward through that
    cache drops the record. :func:`rdkv.models.load` and :func:`record` call it; call it yourself on a model you
    loaded, or to decode a cache from :func:`rdkv.load`.

    Args:
        model: a transformers decoder (Llama, Qwen, Mistral, Gemma 3, ...).
    """
    attention_modules(model)
    AttentionInterface.register(NAME, rdkv_attention)
    AttentionMaskInterface.register(NAME, rdkv_mask)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
    if not getattr(model, "_rdkv_pass_hooks", None):
        model._rdkv_pass_hooks = (model.register_forward_pre_hook(_begin_pass, with_kwargs=True),
                                  model.register_forward_hook(_end_pass, with_kwargs=True, always_call=True))
    return model


# The record of each installed model's most recent prefill into a cache, for as long as that cache lives (keyed
# by the cache, not held by it: a copy of the cache copies no record and no model). None once the cache has grown.
_PREFILLS: weakref.WeakKeyDictionary[Cache, Record | None] = weakref.WeakKeyDictionary()


def _begin_pass(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Before each forward of an installed model: a pass through a compressed cache on the CPU path runs on the
    cores other work leaves free (:mod:`rdkv.contention`); a prefill into an empty cache is recorded for
    ``rdkv.compress(model)``; a later pass through a recorded cache drops that record (it would keep the
    prefill's tensors alive beside the grown cache's)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, TriZoneCache):
        cache.check_model(module)
        if cache.layers and backend(cache.layers[0].device) == "torch":
            contention.begin_pass()
        return
    if cache is not None and cache.get_seq_length() > 0:
        if _PREFILLS.get(cache) is not None:
            _PREFILLS[cache] = None
        return
    use_cache = kwargs.get("use_cache")
    if not (module.config.use_cache if use_cache is None else use_cache):
        return
    mods = attention_modules(module)
    if any(getattr(m, "_rdkv_record", None) is not None for m in mods):  # inside rdkv.record or rdkv.prefill
        return
    rec = Record(module, RECORD_WINDOW, shares_cache=True)
    for m in mods:
        m._rdkv_record = rec
    module._rdkv_prefill = (rec, mods, _hidden_hook(module, rec, [_keep_ids(rec, args, kwargs)]))


def _end_pass(module: torch.nn.Module, args: tuple, kwargs: dict, out) -> None:
    """After each forward, or its failure: the prefill :func:`_begin_pass` began recording is kept with the cache
    the forward returned (``_PREFILLS``), and the model keeps a weak reference to that cache."""
    contention.end_pass()
    pending = module.__dict__.pop("_rdkv_prefill", None)
    if pending is None:
        return
    rec, mods, hooks = pending
    for m in mods:
        del m._rdkv_record
    for h in hooks:
        h.remove()
    rec.close()
    cache = getattr(out, CACHE_KWARG, None)
    if isinstance(cache, Cache) and rec.layers:
        _PREFILLS[cache] = rec
        module._rdkv_last_prefill = weakref.ref(cache)


def prefill_record(source: torch.nn.Module | Cache) -> Record:
    """The record of the prefill that filled ``source`` (a cache), or of ``source``'s most recent prefill (an
    installed model); a :class:`~rdkv.errors.NotRecorded` that says why there is none and what to call."""
    if isinstance(source, Cache):
        if source not in _PREFILLS:
            raise NotRecorded("this cache's prefill was not recorded: the model did not run rdkv's attention then. Call "
                              "rdkv.install(model) (rdkv.models.load does) and prefill again, or prefill inside "
                              "`with rdkv.record(model) as rec:` and compress rec")
        rec = _PREFILLS[source]
        if rec is None:
            raise NotRecorded("this cache has grown since its prefill (a decode step or another prompt ran through it), "
                              "and rdkv dropped the prefill's record rather than keep a second copy of the cache alive: "
                              "compress right after the prefill, or prefill the whole text again")
        return rec
    if not getattr(source, "_rdkv_pass_hooks", None):
        raise NotRecorded(f"{type(source).__name__} records no prefill: call rdkv.install(model) before the prefill "
                          "(rdkv.models.load does), or prefill inside `with rdkv.record(model) as rec:` and compress rec")
    last = getattr(source, "_rdkv_last_prefill", None)
    if last is None:
        raise NotRecorded(f"{type(source).__name__} has run no prefill since rdkv.install: run "
                          "model(input_ids, use_cache=True), then compress")
    cache = last()
    if cache is None:
        raise NotRecorded("the model's most recent prefill is gone: its output and cache were dropped. Keep the output "
                          "of model(input_ids, use_cache=True) until compress, or compress its cache")
    return prefill_record(cache)


@contextmanager
def record(model: torch.nn.Module, window: int = RECORD_WINDOW, all_queries: bool = False,
           tokens: bool = True) -> Iterator[Record]:
    """``with rdkv.record(model) as rec: model(ids, use_cache=True)`` records that prefill for
    :func:`rdkv.compress`, which may then compress ``rec`` any number of times.

    The record keeps each layer's last ``window`` queries (observation-window weights; compress weighs by
    the last 64 unless told otherwise) and, with ``all_queries=True``, attention sums over every prefill
    query (the paper's weights; prefill then runs its attention in chunks instead of through SDPA), and with
    ``tokens`` the token ids and final hidden states the surprisal prior is computed from. It holds
    references to the prefill's cache tensors, not copies: drop the record to free them. Forwards after the
    block change nothing in it; the model keeps the ``"rdkv"`` attention implementation (:func:`install`).
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise RDKVError(f"window must be a positive int, got {window!r}")
    mods = attention_modules(model)
    if any(getattr(m, "_rdkv_record", None) is not None for m in mods):
        raise RDKVError("a record of this model is already open: end its `with` block first")
    install(model)
    rec = Record(model, window, all_queries)
    hooks = _record_tokens(model, rec) if tokens else []
    for m in mods:
        m._rdkv_record = rec
    try:
        yield rec
    finally:
        for m in mods:
            del m._rdkv_record
        for h in hooks:
            h.remove()
        rec.close()


def _record_tokens(model: torch.nn.Module, rec: Record) -> list:
    """Hooks that keep each recorded prefill's token ids and final hidden states (:func:`_keep_ids`,
    :func:`_hidden_hook`) for as long as the ``with rdkv.record`` block lasts."""
    recording = [False]
    hooks = _hidden_hook(model, rec, recording)
    if not hooks:
        return []

    def before(module, args, kwargs):
        recording[0] = _keep_ids(rec, args, kwargs)

    return [model.register_forward_pre_hook(before, with_kwargs=True), *hooks]


def _keep_ids(rec: Record, args: tuple, kwargs: dict) -> bool:
    """Keep a forward's token ids in ``rec`` (appended to a continued prefill's); whether it is recorded."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(cache, TriZoneCache) or ids is None:
        return False
    fresh = cache is None or cache.get_seq_length() == 0
    rec.ids = ids.detach() if fresh or rec.ids is None else torch.cat([rec.ids, ids.detach()], 1)
    if fresh:
        rec.hidden = None
    return True


def _hidden_hook(model: torch.nn.Module, rec: Record, recording: list[bool]) -> list:
    """A hook on the final norm that keeps the hidden states of a recorded forward in ``rec``, from which compress
    computes each token's surprisal (-log p under the model) without anyone keeping all logits; none for a
    model without a final norm and an output head."""
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None or model.get_output_embeddings() is None:
        return []

    def after(module, args, out):
        if recording[0]:
            h = out.detach()
            rec.hidden = h if rec.hidden is None else torch.cat([rec.hidden, h], 1)

    return [norm.register_forward_hook(after)]


def _record(rec: Record, module: torch.nn.Module, query, key, value, mask, scaling, window, softcap):
    """Prefill/continuation on an ordinary cache: attend, and stream what the estimator needs into
    ``rec`` (all-query sums only when recorded with ``all_queries=True``)."""
    layer = module.layer_idx
    L, Tk = query.shape[2], key.shape[2]
    prev = rec.layers.get(layer)
    if prev is None and Tk != L:
        raise RDKVError(f"layer {layer}: the cache already held {Tk - L} tokens that the record did not see (it was "
                        "filled outside the `with rdkv.record(model)` block, or is a static cache longer than the prefill): "
                        "prefill again from an empty DynamicCache")
    fresh = prev is None or Tk == L  # the cache held nothing before this call: a new prefill
    seen = L if fresh else prev.seen + L
    dev = query.device
    q_pos = torch.arange(seen - L, seen, device=dev)
    k_pos = torch.arange(seen - Tk, seen, device=dev)
    if mask is not None and mask.dtype != torch.bool:
        raise RDKVError(f"rdkv attention expects a boolean mask, got {mask.dtype}; select it with rdkv.install(model)")
    key, value, query = key.detach(), value.detach(), query.detach()
    B, H = key.shape[0], key.shape[1]
    if rec.all_queries or softcap is not None:
        out, sums = attend(query, key, value, q_pos, k_pos, scaling, window, softcap, mask)
    else:
        out, sums = _sdpa(module, query, key, value, mask, scaling, window), None
    total = None
    if rec.all_queries:
        sums = AttentionSums(*(x.detach() for x in (sums.mass, sums.mass2, sums.q2, sums.nq)))
        if fresh:
            z = sums.mass.new_zeros(B, H, seen)
            total = AttentionSums(z, z.clone(), sums.q2, sums.nq)
        else:
            old, z = prev.sums, sums.mass.new_zeros(B, H, L)
            total = AttentionSums(torch.cat([old.mass, z], -1), torch.cat([old.mass2, z], -1), old.q2 + sums.q2, old.nq + sums.nq)
        total.mass[..., seen - Tk :] += sums.mass
        total.mass2[..., seen - Tk :] += sums.mass2
    attended = mask[:, 0].any(1) if mask is not None else torch.ones(B, Tk, dtype=torch.bool, device=dev)
    keep = None if window is None else window + rec.window - 1
    if keep is not None and Tk > keep:
        # a sliding-window layer's prefill hands attention every key, but its cache keeps the last window: the record
        # keeps that and what the last queries see. transformers' sliding cache layer is itself a view of every key
        # until its next update, so a record that lives only as long as the cache takes a view too; one that may
        # outlive the cache copies (a view would keep every key of the prefill alive)
        key, value = key[..., -keep:, :], value[..., -keep:, :]
        if not rec.shares_cache:
            key, value = key.clone(), value.clone()
    if fresh:
        valid = torch.zeros(B, seen, dtype=torch.bool, device=dev)
        window_q = query[:, :, -rec.window :].clone()  # a view would keep every query of the prefill alive
    else:
        valid = torch.cat([prev.valid, prev.valid.new_zeros(B, L)], -1)
        window_q = torch.cat([prev.window_q, query], 2)[:, :, -rec.window :]
    valid[:, seen - Tk :] |= attended
    rec.layers[layer] = LayerStats(key, value, seen, total, valid, window_q, scaling, window, softcap)
    if rec.on_layer is not None:
        rec.on_layer(layer)
    return out.to(query.dtype)


def rdkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (out [B, q, Hq, D], None)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    repeat = getattr(module, "_rdkv_reconstruct", None)  # the context repeated after a recorded prefill
    if repeat is not None:
        return repeat(module, query, key, value, scaling, sliding_window, softcap).transpose(1, 2), None
    if isinstance(key, TriZoneLayer):
        out = trizone_decode(query, key, scaling, sliding_window, softcap, attention_mask)
        return out.transpose(1, 2), None
    rec = getattr(module, "_rdkv_record", None)
    if rec is None and softcap is None:
        return _sdpa(module, query, key, value, attention_mask, scaling, sliding_window, dropout=dropout,
                     **kwargs).transpose(1, 2), None
    if dropout and module.training:
        raise RDKVError("rdkv attention is for inference: call model.eval() (dropout is not supported)")
    if rec is None:  # SDPA cannot cap logits: exact chunked attention, positions relative to the cache
        L, Tk = query.shape[2], key.shape[2]
        pos = torch.arange(Tk, device=query.device)
        out = attend(query, key, value, pos[Tk - L :], pos, scaling, sliding_window, softcap, attention_mask)[0]
        return out.to(query.dtype).transpose(1, 2), None
    out = _record(rec, module, query, key, value, attention_mask, scaling, sliding_window, softcap)
    return out.transpose(1, 2), None
