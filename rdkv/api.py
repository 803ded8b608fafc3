"""Public entry point: ``compress`` a prefill (its model, its cache or its record) under a byte budget."""
from __future__ import annotations

import math

import torch

from .distortion import Calibration
from .errors import BudgetInfeasible, RDKVError
from .fold import FoldPolicy
from .methods import AUTO, Allocation, Method, resolve
from .pipeline import (Prefill, budget_for_error, check_budget, checked, dtype16, held_layers, pack_held, rdkv_method,
                       set_fold, weigh)
from .solvers.mckp import Infeasible
from .trizone import TriZoneCache, model_signature


@torch.no_grad()
def compress(source: Prefill, budget: float | None = None, *, method: str | Method = AUTO,
             fold: int | FoldPolicy | None = None, error: float | None = None, calibration: Calibration | None = None,
             **options) -> TriZoneCache:
    """Compress a prefill's cache into a :class:`TriZoneCache` of at most ``budget`` x its fp16 bytes (every
    byte counted: codes, scales, zeros, indices).

    ``rdkv.compress(model, budget)`` right after ``model(ids, use_cache=True)`` (or ``model.generate``) compresses
    that prefill: once :func:`rdkv.install` has run (:func:`rdkv.models.load` runs it), every prefill into an
    empty cache leaves its record with the cache it returns, for as long as that cache lives. The most recent
    prefill is the last forward that started from an empty cache; a later forward through its cache (a decode
    step, another prompt appended) drops the record, and compress then refuses with
    :class:`~rdkv.errors.NotRecorded` instead of compressing something else. The record, its uncompressed cache
    and the model are left untouched, so one prefill can be compressed many times; on any error nothing changes.

    Args:
        source: the model after its prefill; that prefill's cache (``out.past_key_values``, ``out.cache`` on
            transformers 5.25+); or a record from ``with rdkv.record(model) as rec:`` (which also keeps every
            query's attention sums with ``all_queries=True``, and prefills continued in several forwards).
            All three give the same cache for the same prefill.
        budget: the fraction of the fp16 cache bytes to keep, in (0, 1]. Fixed-rate baselines (int8, kivi2,
            ...) need none; given one, they raise if they do not fit.
        method: a name in :data:`rdkv.methods.METHODS` or a method object (``rdkv.methods.RDKV(...)``,
            ``rdkv.methods.SnapKV(window=32)``, ...); all go through the same packer. The default ``"auto"``
            picks the RDKV configuration for the model's layout (:func:`rdkv.methods.resolve`: ``rdkv-hybrid``
            when sliding-window and global layers mix, else ``rdkv``); ``cache.method`` names what ran.
        fold: ``R`` (or a :class:`rdkv.fold.FoldPolicy`) packs every R tokens generated after compression into
            the compressed zones at the same fraction of their fp16 bytes, so memory stays bounded over long
            generations; by default generated tokens stay in 16 bits (zone C).
        error: instead of a budget, the fewest bytes whose KL divergence from the full cache's next-token
            distribution is predicted to be at most ``error`` by ``calibration`` (RDKV methods only).
        calibration: for ``error=``, the map :func:`rdkv.calibrate` fitted on this model for the same method
            and options.
        options: applied to the method (``window=256``, ``v_group=32``: :meth:`rdkv.methods.Method.with_options`).
    """
    rec = checked(source)
    key = resolve(rec.model, method, options, rec.window)
    m = key.for_record(rec)
    if error is not None:
        if budget is not None:
            raise RDKVError("give either budget= (bytes) or error= (predicted KL), not both")
        rdkv_method(m, "error=")
        if isinstance(error, bool) or not isinstance(error, (int, float)) or not error > 0 or math.isinf(error):
            raise RDKVError(f"error must be a positive number (a KL in nats), got {error!r}")
        if not isinstance(calibration, Calibration):
            raise RDKVError("error= needs calibration=rdkv.calibrate(model, ids, ...) fitted on this model, got "
                            f"{type(calibration).__name__}")
        if calibration.key != key:
            raise RDKVError(f"the calibration was fitted for method {calibration.method!r} with other options than this "
                            f"call's ({key.name!r}, {options or 'no options'}): calibrate with rdkv.calibrate(model, ids, "
                            f"method={key.name!r}, ...) and the same options")
    elif calibration is not None:
        raise RDKVError("calibration= is for error=; with a byte budget it has nothing to do")
    elif budget is not None or not m.fixed_rate:
        budget = check_budget(budget)
    weigh(rec, m)
    held, fp16 = held_layers(rec, m)
    try:
        if error is not None:
            tables = m.all_tables(rec, held)
            budget = budget_for_error(tables, fp16, m.solve, calibration, error)
            alloc: Allocation = m.solved(tables, fp16, budget)
        else:
            alloc = m.allocate(rec, held, fp16, budget)
    except Infeasible as e:
        least = f"at least {budget * e.need / e.budget:.4g}" if e.budget > 0 else "a larger one"
        raise BudgetInfeasible(f"budget {budget} is too small for this cache: the cheapest allocation needs {least} "
                               f"of the fp16 bytes ({e.need:.0f} B where the budget gives {e.budget:.0f} B); raise "
                               "the budget") from e
    layers = [pack_held(h, v, k, perm, m.spec, dtype16(rec.model)) for h, v, k, perm in zip(held, alloc.v, alloc.k, alloc.perm)]
    cache = TriZoneCache(layers, fp16_bytes=int(sum(fp16)), budget=budget, method=m.name or type(m).__name__,
                         layer_distortion=alloc.layer_distortion, model=model_signature(rec.model))
    set_fold(cache, fold, m)
    if budget is not None and cache.nbytes > budget * cache.fp16_bytes:
        if m.fixed_rate:
            raise BudgetInfeasible(f"{cache.method} needs {cache.nbytes / cache.fp16_bytes:.4f} of the fp16 bytes, more "
                                   f"than the budget {budget}; raise the budget or pass budget=None")
        raise AssertionError(f"rdkv bug: packed {cache.nbytes} B exceeds budget {budget * cache.fp16_bytes:.0f} B")
    return cache
