"""The steps :func:`rdkv.compress`, :func:`rdkv.prefill` and the plots share: name the prefill, check the budget,
hold each layer as it is priced and packed, solve for an error target, pack, fold."""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from transformers.cache_utils import Cache

from . import layout, quant
from .attention import prefill_record
from .distortion import Calibration, LayerTables, modelled_distortion
from .errors import RDKVError
from .fold import FoldPolicy
from .methods import AUTO, RDKV, HeldLayer, Method, Solve, resolve
from .reconstruct import reconstruct
from .records import Record
from .rope import rope_table, rotate
from .solvers.mckp import Infeasible
from .layout import PackSpec, fp16_bytes
from .trizone import TriZoneCache, TriZoneLayer, pack_choice


# what names a prefill for compress: the model after it, the cache it filled, or an explicit record
Prefill = Record | Cache | torch.nn.Module


def checked(source: Prefill) -> Record:
    """The complete record of the prefill ``source`` names (:func:`rdkv.compress`), checked."""
    if isinstance(source, TriZoneCache):
        raise RDKVError("this cache is already compressed; compress the prefill's own cache (or its model, or its record)")
    if isinstance(source, (Cache, torch.nn.Module)):
        source = prefill_record(source)
    elif not isinstance(source, Record):
        raise RDKVError(f"compress takes a model after its prefill, that prefill's cache or an rdkv.record, got "
                        f"{type(source).__name__}: `model(ids, use_cache=True)`, then rdkv.compress(model, budget)")
    source.check()
    return source


def weigh(rec: Record, method: Method) -> None:
    """Run what ``method``'s weights need beyond the record itself: the reconstruction pass (:mod:`rdkv.reconstruct`)."""
    if isinstance(method, RDKV) and method.needs_pass:
        reconstruct(rec)


def method_for(source: Prefill, method: str | Method, options: dict) -> Method:
    """The method a compress call on ``source`` runs (:func:`rdkv.methods.resolve`), checked against its record."""
    rec = checked(source)
    return resolve(rec.model, method, options, rec.window).for_record(rec)


def check_budget(budget) -> float:
    """``budget`` (a Python, numpy or 0-d tensor real number) as a float in (0, 1], or an error that says what a
    budget is."""
    if isinstance(budget, torch.Tensor) and budget.dim() == 0 and not budget.is_complex() and budget.dtype != torch.bool:
        budget = budget.item()
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, numbers.Real):
        raise RDKVError(f"budget must be a number in (0, 1] (a fraction of the fp16 cache bytes), got {budget!r}")
    budget = float(budget)
    if math.isnan(budget) or not 0 < budget <= 1:
        raise RDKVError(f"budget must be in (0, 1] (a fraction of the fp16 cache bytes), got {budget}")
    return float(budget)


def dtype16(model: torch.nn.Module) -> torch.dtype:
    """The 16-bit dtype a cache of ``model`` keeps its 16-bit rows in: bf16 for a bf16 model, else fp16."""
    return torch.bfloat16 if next(model.parameters()).dtype == torch.bfloat16 else torch.float16


def held_cache(st, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Layer ``i``'s cached k, v (views, in the cache's dtype) and the first position a future query can still see.

    Not upcast: a 16-bit model's every layer in float32 at once would double what compress holds; pricing
    and packing upcast one layer at a time."""
    start = st.start if st.sliding_window is None else max(st.start, st.seen - st.sliding_window + 1)
    k = st.key[..., start - st.start :, :]
    v = st.value[..., start - st.start :, :]
    if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise RDKVError(f"layer {i}: the cache holds NaN or Inf; the prefill itself is broken (check dtype/overflow)")
    if max(k.abs().max(), v.abs().max()) > quant.FP16_MAX:
        raise RDKVError(f"layer {i}: cache values exceed the fp16 range, which the packed format cannot store")
    return k, v, start


def held_layer(model: torch.nn.Module, st, i: int, method: Method) -> HeldLayer:
    """Layer ``i``'s held cache as ``method`` prices and packs it (keys un-rotated when it packs pre-RoPE)."""
    method.spec.check(st.key.shape[-1])
    k, v, start = held_cache(st, i)
    rope = None
    if method.prerope:
        pos = torch.arange(start, st.seen, device=k.device)
        rope = rope_table(model, i, k.shape[-1], pos)
        k = rotate(k.float(), pos, rope, inverse=True)
    if method.spec.v_rotate:  # priced and packed in the stored basis (a copy of the layer's V)
        v = layout.rotate_v(v)
    return HeldLayer(st, k, v, start, st.valid[:, None, start:].expand(*k.shape[:3]), rope)


def held_layers(rec: Record, method: Method) -> tuple[list[HeldLayer], list[int]]:
    """Every held layer of the record and each sequence's fp16 bytes of what they hold."""
    held = [held_layer(rec.model, rec.layers[i], i, method) for i in range(len(rec.layers))]
    fp16 = [sum(fp16_bytes(int(h.present[b].sum()), h.k.shape[-1]) for h in held) for b in range(held[0].k.shape[0])]
    return held, fp16


def rdkv_method(method: Method, what: str) -> RDKV:
    if not isinstance(method, RDKV):
        raise RDKVError(f"{what} needs a distortion model; method {method.name or type(method).__name__!r} has none: "
                        "use an RDKV method (rdkv, rdkv-aware, rdkv-hybrid, rdkv-paper or rdkv.methods.RDKV(...))")
    return method


@torch.no_grad()
def allocation_tables(source: Prefill, method: str | Method = AUTO,
                      **options) -> tuple[RDKV, list[LayerTables], list[int]]:
    """What the solver sees for a prefill (``source`` as :func:`compress` takes it): (the method as it runs,
    per-layer tables, fp16 bytes per sequence). The budget of sequence b is budget x fp16[b]; see
    :func:`rdkv.solvers.allocate`."""
    rec = checked(source)
    m = rdkv_method(method_for(rec, method, options), "allocation_tables")
    weigh(rec, m)
    held, fp16 = held_layers(rec, m)
    return m, m.all_tables(rec, held), fp16


def budget_for_error(tables: list[LayerTables], fp16: list[int], solve: Solve, cal: Calibration, error: float,
                      steps: int = 14) -> float:
    """The smallest budget fraction (to 1/2^steps of the bracket) whose allocation's predicted KL <= error."""
    target = cal.distortion_for(error)

    def ok(b: float) -> bool:
        try:
            return modelled_distortion(tables, *solve(tables, [b * f for f in fp16])) <= target
        except Infeasible:  # below the smallest feasible budget
            return False

    lo, hi = 0.0, 1.0
    if not ok(hi):
        raise RDKVError(f"error={error} is below what the format reaches even at budget 1.0 (predicted KL "
                        f"{cal.predict(modelled_distortion(tables, *solve(tables, fp16))):.3g}); raise error")
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def pack_held(h: HeldLayer, v_opt: torch.Tensor, k_opt: torch.Tensor, perm: torch.Tensor, spec: PackSpec,
              dtype16: torch.dtype) -> TriZoneLayer:
    """Pack one held layer (:func:`held_layer`) at the chosen options, with its RoPE table if pre-RoPE."""
    layer = pack_choice(h.k, h.v, h.start, v_opt, k_opt, perm, spec, dtype16, h.stats.sliding_window, h.stats.seen)
    layout.set_rope_table(layer, h.rope)
    return layer


def set_fold(cache: TriZoneCache, fold: int | FoldPolicy | None, method: Method) -> None:
    """``fold=R``: fold every R generated tokens at the cache's own fraction of the fp16 bytes, priced with
    ``method`` when it is an RDKV method (the default ``rdkv`` otherwise)."""
    if fold is not None:
        if not isinstance(fold, FoldPolicy):
            budget = cache.budget if cache.budget is not None else cache.nbytes / cache.fp16_bytes
            fold = FoldPolicy(every=fold, budget=budget, **({"method": method} if isinstance(method, RDKV) else {}))
        cache.set_fold(fold)
