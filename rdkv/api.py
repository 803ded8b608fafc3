"""Public entry point: ``compress`` the record of a prefill (:func:`rdkv.record`) under a byte budget."""
from __future__ import annotations

import math

import torch

from . import quant
from .distortion import Calibration, LayerTables, modelled_distortion
from .errors import BudgetInfeasible, RDKVError
from .fold import FoldPolicy
from .methods import AUTO, RDKV, Allocation, HeldLayer, Method, Solve, resolve
from .records import Record
from .rope import rope_table, rotate
from .solvers.mckp import Infeasible
from .trizone import PackSpec, TriZoneCache, TriZoneLayer, fp16_bytes, pack_choice


def _checked(rec: Record) -> Record:
    if not isinstance(rec, Record):
        raise RDKVError(f"compress takes the record of a prefill, got {type(rec).__name__}: "
                        "`with rdkv.record(model) as rec: model(ids, use_cache=True)`, then rdkv.compress(rec, budget)")
    rec.check()
    return rec


def method_for(rec: Record, method: str | Method, options: dict) -> Method:
    """The method a compress call on ``rec`` runs (:func:`rdkv.methods.resolve`), checked against the record."""
    return resolve(rec.model, method, options, rec.window).for_record(rec)


def check_budget(budget) -> float:
    """``budget`` as a float in (0, 1], or an error that says what a budget is."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise RDKVError(f"budget must be a number in (0, 1] (a fraction of the fp16 cache bytes), got {budget!r}")
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
    return HeldLayer(st, k, v, start, st.valid[:, None, start:].expand(*k.shape[:3]), rope)


def _held(rec: Record, method: Method) -> tuple[list[HeldLayer], list[int]]:
    """Every held layer of the record and each sequence's fp16 bytes of what they hold."""
    held = [held_layer(rec.model, rec.layers[i], i, method) for i in range(len(rec.layers))]
    fp16 = [sum(fp16_bytes(int(h.present[b].sum()), h.k.shape[-1]) for h in held) for b in range(held[0].k.shape[0])]
    return held, fp16


def _rdkv(method: Method, what: str) -> RDKV:
    if not isinstance(method, RDKV):
        raise RDKVError(f"{what} needs a distortion model; method {method.name or type(method).__name__!r} has none: "
                        "use an RDKV method (rdkv, rdkv-aware, rdkv-hybrid, rdkv-paper or rdkv.methods.RDKV(...))")
    return method


@torch.no_grad()
def allocation_tables(rec: Record, method: str | Method = AUTO, **options) -> tuple[RDKV, list[LayerTables], list[int]]:
    """What the solver sees for a recorded prefill: (the method as it runs, per-layer tables, fp16 bytes per
    sequence). The budget of sequence b is budget x fp16[b]; see :func:`rdkv.solvers.allocate`."""
    m = _rdkv(method_for(_checked(rec), method, options), "allocation_tables")
    held, fp16 = _held(rec, m)
    return m, m.all_tables(rec, held), fp16


def _budget_for_error(tables: list[LayerTables], fp16: list[int], solve: Solve, cal: Calibration, error: float,
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
    if h.rope is not None:
        layer.t["rope"] = h.rope
    return layer


def set_fold(cache: TriZoneCache, fold: int | FoldPolicy | None, method: Method) -> None:
    """``fold=R``: fold every R generated tokens at the cache's own fraction of the fp16 bytes, priced with
    ``method`` when it is an RDKV method (the default ``rdkv`` otherwise)."""
    if fold is not None:
        if not isinstance(fold, FoldPolicy):
            budget = cache.budget if cache.budget is not None else cache.nbytes / cache.fp16_bytes
            fold = FoldPolicy(every=fold, budget=budget, **({"method": method} if isinstance(method, RDKV) else {}))
        cache.set_fold(fold)


@torch.no_grad()
def compress(rec: Record, budget: float | None = None, *, method: str | Method = AUTO,
             fold: int | FoldPolicy | None = None, error: float | None = None, calibration: Calibration | None = None,
             **options) -> TriZoneCache:
    """Compress the cache of a recorded prefill (:func:`rdkv.record`) into a :class:`TriZoneCache` of at
    most ``budget`` x its fp16 bytes (every byte counted: codes, scales, zeros, indices).

    ``method`` is a name in :data:`rdkv.methods.METHODS` or a method object (``rdkv.methods.RDKV(...)``,
    ``rdkv.methods.SnapKV(window=32)``, ...); all go through the same packer. Keyword ``options`` are applied
    to it (``window=256``, ``v_group=32``: :meth:`rdkv.methods.Method.with_options`). The default ``"auto"``
    picks the RDKV configuration for the model's layout (:func:`rdkv.methods.resolve`: ``rdkv-hybrid`` when
    sliding-window and global layers mix, else ``rdkv``); ``cache.method`` names what ran. Fixed-rate
    baselines (int8, kivi2, ...) need no budget; given one, they raise if they do not fit. The record, its
    uncompressed cache and the model are left untouched, so one prefill can be compressed many times; on any
    error nothing changes.

    ``fold=R`` (or a :class:`rdkv.fold.FoldPolicy`) packs every R tokens generated after compression
    into the compressed zones at the same fraction of their fp16 bytes, so memory stays bounded over
    long generations; by default generated tokens stay in 16 bits (zone C).

    ``error=eps`` instead of a budget: the fewest bytes whose KL divergence from the full cache's
    next-token distribution is predicted to be at most ``eps`` by ``calibration``, the map
    :func:`rdkv.calibrate` fitted on this model for the same method and options (RDKV methods only).
    """
    _checked(rec)
    key = resolve(rec.model, method, options, rec.window)
    m = key.for_record(rec)
    if error is not None:
        if budget is not None:
            raise RDKVError("give either budget= (bytes) or error= (predicted KL), not both")
        _rdkv(m, "error=")
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
    held, fp16 = _held(rec, m)
    try:
        if error is not None:
            tables = m.all_tables(rec, held)
            budget = _budget_for_error(tables, fp16, m.solve, calibration, error)
            alloc: Allocation = m.solved(tables, fp16, budget)
        else:
            alloc = m.allocate(rec, held, fp16, budget)
    except Infeasible as e:
        raise BudgetInfeasible(f"budget {budget} is too small for this cache ({e}); raise the budget") from e
    layers = [pack_held(h, v, k, perm, m.spec, dtype16(rec.model)) for h, v, k, perm in zip(held, alloc.v, alloc.k, alloc.perm)]
    cache = TriZoneCache(layers, fp16_bytes=int(sum(fp16)), budget=budget, method=m.name or type(m).__name__,
                         layer_distortion=alloc.layer_distortion)
    set_fold(cache, fold, m)
    if budget is not None and cache.nbytes > budget * cache.fp16_bytes:
        if m.fixed_rate:
            raise BudgetInfeasible(f"{cache.method} needs {cache.nbytes / cache.fp16_bytes:.4f} of the fp16 bytes, more "
                                   f"than the budget {budget}; raise the budget or pass budget=None")
        raise AssertionError(f"rdkv bug: packed {cache.nbytes} B exceeds budget {budget * cache.fp16_bytes:.0f} B")
    return cache
