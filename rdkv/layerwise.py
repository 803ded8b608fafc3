"""Compress while prefilling, so the full uncompressed cache never exists.

During a prefill, layer i's attention needs only layer i's keys and values, and once it has attended over
the whole prompt they are never read again by the prefill. :func:`prefill` runs one ordinary forward through
a cache that stores nothing, inside :func:`rdkv.record`; as each layer's attention finishes, its uncompressed
keys and values are replaced, before layer i + 1 runs, by

* ``mode="staged"`` (the default): an 8-bit copy (K per channel over groups of tokens, V per token over
  groups of channels, the packer's own directions). After the forward, the surprisal prior is known (the
  output head over the recorded final hidden states), and each layer in turn is restored from its copy,
  weighed, allocated and packed exactly as :func:`rdkv.compress` does it, and its copy freed. Everything
  compress prices is available; the tables see keys and values within half an 8-bit step of the originals.
* ``mode="layer"``: the packed layer itself. Nothing of the layer outlives its attention, but nothing after
  the last layer is available either: the surprisal prior is off. The cache is, byte for byte, what
  ``rdkv.compress(rec, budget, surprisal=0)`` gives on a record of the same prefill.

Each decoder layer's MLP runs over ``mlp_chunk`` tokens at a time: it acts on every token alone, and its
[T, intermediate] temporaries are, once the cache is gone, the largest tensors a long prefill holds. A
chunked matmul may round differently from a whole one (on some CPUs it does), so past ``mlp_chunk`` tokens
"byte for byte" holds up to that rounding.

Either way the prefill's outputs are those of an uncompressed prefill, and budgets are per layer
(``scope="layer"``, RDKV's default): one knapsack over all layers would need every layer at once. Memory,
time and quality of both modes against record + compress: docs/benchmarks.md and docs/experiments.md.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from transformers import DynamicCache

from . import quant
from .fold import FoldPolicy
from .pipeline import check_budget, dtype16, held_cache, held_layer, pack_held, set_fold
from .attention import attention_modules, record
from .compat import cache_kwargs
from .errors import BudgetInfeasible, RDKVError
from .methods import AUTO, RDKV, Method, resolve
from .records import LayerStats, Record
from .solvers.mckp import Infeasible
from .layout import fp16_bytes
from .trizone import TriZoneCache, TriZoneLayer, model_signature

MODES = ("staged", "layer")
MLP_CHUNK = 2048  # tokens per MLP call during a prefill
STAGE_GROUP = 64  # values per 8-bit scale/zero of a staged copy: tokens of a K channel, channels of a V row


try:  # glibc: hands freed heap pages back to the OS
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _malloc_trim = None


def _trim(device: torch.device) -> None:
    """Return freed host memory to the OS after a layer is staged or packed. Each layer leaves a few small
    long-lived tensors among its large freed temporaries, which glibc otherwise keeps mapped: the staged
    prefill's resident set then grows by more than its copies, layer after layer (docs/benchmarks.md, 16-bit
    models)."""
    if _malloc_trim is not None and device.type == "cpu":
        _malloc_trim(0)


class _Unstored(DynamicCache):
    """A cache that hands each layer's new keys and values to attention and keeps none of them."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states


def _stage(x: torch.Tensor, along_tokens: bool) -> tuple:
    """x [B, H, T, D] at 8 bits in groups of ``STAGE_GROUP`` along tokens (per channel) or along channels."""
    x = x.transpose(-1, -2) if along_tokens else x
    n = x.shape[-1]
    g = STAGE_GROUP if n % STAGE_GROUP == 0 or along_tokens else n
    pad = (-n) % g
    if pad:  # repeat the last value: padding must not widen a group's range
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1)
    return (*quant.quantize(x.unflatten(-1, (-1, g)), 8), n, along_tokens)


def _unstage(staged: tuple, dtype: torch.dtype) -> torch.Tensor:
    codes, scale, zero, n, along_tokens = staged
    x = quant.dequantize(codes, scale, zero).flatten(-2)[..., :n].to(dtype)
    return x.transpose(-1, -2) if along_tokens else x


def _check_ids(model: torch.nn.Module, input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0 \
            or input_ids.dtype not in (torch.int32, torch.int64):
        raise RDKVError("input_ids must be token ids of shape [batch, tokens >= 1], got "
                        f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        raise RDKVError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] > limit:
        raise RDKVError(f"the prompt has {input_ids.shape[1]} tokens, more than the model's context of {limit}: "
                        "shorten it")


@contextmanager
def _chunked_mlps(model: torch.nn.Module, chunk: int) -> Iterator[None]:
    """Run every decoder layer's ``mlp`` over at most ``chunk`` tokens at a time, then restore it."""
    mlps = [m.mlp for m in model.modules() if hasattr(m, "self_attn") and isinstance(getattr(m, "mlp", None), torch.nn.Module)]
    for mlp in mlps:
        def forward(x: torch.Tensor, run=mlp.forward) -> torch.Tensor:
            return run(x) if x.shape[-2] <= chunk else torch.cat([run(part) for part in x.split(chunk, -2)], -2)
        mlp.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for mlp in mlps:
            del mlp.forward


def _method(model: torch.nn.Module, method: str | Method, mode: str, window: int, options: dict) -> RDKV:
    if mode not in MODES:
        raise RDKVError(f"mode={mode!r} is not one of {MODES}")
    m = resolve(model, method, options, window)
    if not isinstance(m, RDKV):
        raise RDKVError(f"rdkv.prefill packs with RDKV methods (rdkv, rdkv-aware, rdkv-hybrid, ...); for {m.name!r}, "
                        "record the prefill with rdkv.record and call rdkv.compress")
    if mode == "layer":
        if options.get("surprisal", 0) > 0:
            raise RDKVError("mode='layer' packs each layer before the output head has run, so it has no surprisal "
                            "prior: pass surprisal=0, or use mode='staged'")
        m = m.with_options(surprisal=0.0)
    if m.needs_pass:
        raise RDKVError("rdkv.prefill has no reconstruction pass (weights='reconstruct', split='peak', "
                        "method='rdkv-reconstruct' run one over the whole prompt): record the prefill with "
                        "rdkv.record and call rdkv.compress")
    if m.solve.scope != "layer" or m.solve.layer_gains is not None or m.solve.split != "bytes":
        raise RDKVError("rdkv.prefill solves each layer on its own: use scope='layer' (the default) without "
                        "layer_gains or split, or record the prefill with rdkv.record and call rdkv.compress")
    return m.for_record(Record(model, window, m.all_queries))


@torch.no_grad()
def prefill(model: torch.nn.Module, input_ids: torch.Tensor, budget: float = 0.1, *,
            attention_mask: torch.Tensor | None = None, mode: str = "staged", method: str | Method = AUTO,
            fold: int | FoldPolicy | None = None, window: int = 256, mlp_chunk: int = MLP_CHUNK,
            **options) -> TriZoneCache:
    """Prefill ``input_ids`` [B, T] and return its cache compressed to at most ``budget`` x its fp16 bytes,
    without the uncompressed cache ever being held. A model as :func:`rdkv.models.load` returns it needs no
    other call first; the cache works with ``model.generate`` afterwards.

    ``mode`` is ``"staged"`` (8-bit copies of each layer until the surprisal prior is known) or ``"layer"``
    (each layer packed at its attention, no surprisal prior): see the module docstring. ``method`` and
    ``options`` are :func:`rdkv.compress`'s, for RDKV methods with per-layer budgets; ``window`` recorded
    queries per layer weigh its tokens, as in :func:`rdkv.record`; ``mlp_chunk`` tokens at a time go through each
    MLP. On any error the model is left as it was.
    """
    _check_ids(model, input_ids, attention_mask)
    budget = check_budget(budget)
    if isinstance(mlp_chunk, bool) or not isinstance(mlp_chunk, int) or mlp_chunk < 1:
        raise RDKVError(f"mlp_chunk must be a positive int (tokens per MLP call), got {mlp_chunk!r}")
    attention_modules(model)
    m = _method(model, method, mode, window, options)
    layers: dict[int, TriZoneLayer] = {}
    fp16: dict[int, list[int]] = {}
    distortion: dict[int, float] = {}
    staged: dict[int, tuple[LayerStats, tuple, tuple]] = {}
    carried: torch.Tensor | None = None  # the prior's profile from the layers packed so far (in order)

    def pack(i: int, st: LayerStats, surprise: torch.Tensor | None) -> None:
        nonlocal carried
        held = held_layer(model, st, i, m)
        fp16[i] = [fp16_bytes(int(n), held.k.shape[-1]) for n in held.present.sum((1, 2))]
        tables, carried = m.tables(held, surprise, carried=carried)
        try:
            alloc = m.solved([tables], fp16[i], budget)
        except Infeasible as e:
            raise BudgetInfeasible(f"budget {budget} is too small for layer {i} ({e}); raise the budget") from e
        distortion[i] = alloc.layer_distortion[0]
        layers[i] = pack_held(held, alloc.v[0], alloc.k[0], alloc.perm[0], m.spec, dtype16(model))

    def stage(i: int) -> None:
        st = rec.layers.pop(i)
        k, v, start = held_cache(st, i)  # the part a later query can see, checked finite and within fp16
        empty = st.key.new_empty(*st.key.shape[:-2], 0, st.key.shape[-1])  # a view would keep the layer alive
        staged[i] = (replace(st, key=empty, value=empty), _stage(k, along_tokens=True), _stage(v, along_tokens=False))
        _trim(input_ids.device)  # the layer itself is freed once its attention returns, trimmed after the next one

    def pack_now(i: int) -> None:
        pack(i, rec.layers.pop(i), None)
        _trim(input_ids.device)

    previous = getattr(model.config, "_attn_implementation", None)
    try:
        with record(model, window, m.all_queries, tokens=mode == "staged") as rec, _chunked_mlps(model, mlp_chunk):
            rec.on_layer = pack_now if mode == "layer" else stage
            model(input_ids, attention_mask=attention_mask, **cache_kwargs(_Unstored(config=model.config)),
                  use_cache=True, logits_to_keep=1)
        if mode == "staged":
            surprise = m.prior.surprise(rec)
            dtype = next(model.parameters()).dtype
            for i in sorted(staged):
                st, k, v = staged.pop(i)
                pack(i, replace(st, key=_unstage(k, dtype), value=_unstage(v, dtype)), surprise)
                del st, k, v  # this layer's copy, then its freed temporaries, go back to the OS
                _trim(input_ids.device)
        order = range(len(layers))
        cache = TriZoneCache([layers[i] for i in order], fp16_bytes=sum(sum(fp16[i]) for i in order), budget=budget,
                             method=m.name, layer_distortion=tuple(distortion[i] for i in order),
                             model=model_signature(model))
        set_fold(cache, fold, m)
    except BaseException:
        if previous is not None and previous != model.config._attn_implementation:
            model.set_attn_implementation(previous)
        raise
    return cache
