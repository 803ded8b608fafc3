"""Public entry point: ``compress`` the record of a prefill (:func:`rdkv.record`) under a byte budget."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch

from . import quant
from .records import Record
from .distortion import (EVICT_TO, MODELS, Calibration, JointEviction, LayerTables, layer_distortion, layer_tables,
                         modelled_distortion)
from .methods import AUTO, BASELINE_SPECS, BASELINES, FIXED_RATE, METHODS, RDKV_VARIANTS, SNAP_WINDOW, LayerInput
from .errors import BudgetInfeasible, RDKVError
from .fold import FoldPolicy
from .rope import pair_mean, rope_table, rotate
from .trizone import PackSpec, TriZoneCache, TriZoneLayer, fixed_bytes, fp16_bytes, pack_choice
from .weights import FORMS, layer_sums, lifetime, per_visible, window_queries
from .solvers.allocate import allocate
from .solvers.mckp import Infeasible

DEFAULT_WINDOW = 64  # window queries compress weighs by default (a record keeps 256; rdkv-w256 uses them all)


@dataclass(frozen=True)
class CompressConfig:
    """How ``compress`` estimates, prices and packs. Every field can be overridden by keyword."""

    weights: str = "window"  # "window" (last W prefill queries) or "all" (every prefill query, the paper's form)
    window: int | None = None  # W: weigh by the last W prefill queries (None: 64, or all the record kept if fewer)
    window_sliding: int | None = None  # W for sliding-window layers (Gemma 3's local layers); None: ``window``
    distortion: str = "output"  # "output" (attention-output error, one unit for K and V) or "paper"
    evict_to: str = "heavy"  # what an evicted token's error is measured from (rdkv.distortion.EVICT_TO)
    evict_jointly: bool = False  # each pass adds the cross terms of evicting the previous pass's set together
    scope: str = "layer"  # "layer": a budget per layer; "global": one knapsack over all layers and heads
    passes: int = 3  # allocation passes: K is re-priced for the tokens the previous pass kept (solvers/allocate)
    floor: float = 0.0  # prior attention a future query may put on any token (see rdkv.distortion)
    surprisal: float = 0.5  # weight of a prior proportional to each token's (pooled) surprisal; 0 = off
    q_floor: float = 0.0  # fraction of each K channel's query weight replaced by the channel mean (rdkv.distortion)
    pool: int = 7  # surprisal max-pool width (odd)
    pool_weights: int = 1  # max-pool width (odd) of the attention weights; 1 = none
    evict: bool = True  # False: every token keeps at least 2 bits
    sinks: int = 4  # first tokens that may not be evicted
    recent: int = 32  # last prefill tokens that may not be evicted
    prerope: bool = False  # quantize keys before RoPE, as KVQuant does (rdkv.rope)
    visible: float = 0.0  # weigh tokens per window query that can see them: 1 fully, 0 off (rdkv.weights.per_visible)
    visible_cap: float | None = None  # largest factor ``visible`` may scale a token by (None: W, no cap)
    horizon: int | None = None  # tokens expected to be decoded: sliding layers weigh a token by how long it stays visible
    layer_gains: tuple[float, ...] | None = None  # per-layer multipliers of the modelled distortion (scope="global")
    spec: PackSpec = field(default_factory=PackSpec)

    def check(self) -> None:
        if self.weights not in FORMS:
            raise RDKVError(f"weights={self.weights!r} is not one of {FORMS}")
        if self.distortion not in MODELS:
            raise RDKVError(f"distortion={self.distortion!r} is not one of {MODELS}")
        if self.evict_to not in EVICT_TO:
            raise RDKVError(f"evict_to={self.evict_to!r} is not one of {EVICT_TO}")
        if self.evict_jointly and (self.evict_to == "kept" or self.distortion != "output"):
            raise RDKVError("evict_jointly re-prices the output distortion itself: use it with distortion='output' "
                            "and an evict_to other than 'kept'")
        if self.scope not in ("global", "layer"):
            raise RDKVError(f"scope={self.scope!r} is not 'global' or 'layer'")
        if min(self.pool, self.pool_weights) < 1 or self.pool % 2 == 0 or self.pool_weights % 2 == 0:
            raise RDKVError("pool and pool_weights must be positive odd ints")
        if self.surprisal < 0 or self.floor < 0:
            raise RDKVError("surprisal and floor must be >= 0")
        if self.visible_cap is not None and not self.visible_cap >= 1:
            raise RDKVError(f"visible_cap must be a number >= 1 (the largest visibility factor), got {self.visible_cap!r}")
        if not 0 <= self.visible <= 1:
            raise RDKVError(f"visible must be a number in [0, 1] (how far to correct for causal visibility), got {self.visible!r}")
        if not 0 <= self.q_floor <= 1:
            raise RDKVError(f"q_floor must be a fraction in [0, 1], got {self.q_floor}")
        if self.sinks < 0 or self.recent < 0:
            raise RDKVError("sinks and recent must be >= 0")
        for name in ("window", "window_sliding", "horizon"):
            w = getattr(self, name)
            if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
                raise RDKVError(f"{name} must be a positive int or None, got {w!r}")
        if self.layer_gains is not None:
            if not all(isinstance(g, (int, float)) and 0 < g < math.inf for g in self.layer_gains):
                raise RDKVError(f"layer_gains must be positive finite numbers, one per layer, got {self.layer_gains!r}")
            if self.evict_jointly or self.evict_to == "kept":
                raise RDKVError("layer_gains scales the priced tables; evict_jointly and evict_to='kept' re-price "
                                "eviction during allocation: use them without layer_gains")
        if not isinstance(self.passes, int) or self.passes < 1:
            raise RDKVError(f"passes must be a positive int, got {self.passes!r}")

    def layer_window(self, sliding: bool) -> int | None:
        """How many recorded queries weigh a layer's tokens: ``window_sliding`` on sliding-window layers
        when set, else ``window``."""
        return self.window_sliding if sliding and self.window_sliding else self.window


def _checked(rec: Record) -> Record:
    if not isinstance(rec, Record):
        raise RDKVError(f"compress takes the record of a prefill, got {type(rec).__name__}: "
                        "`with rdkv.record(model) as rec: model(ids, use_cache=True)`, then rdkv.compress(rec, budget)")
    rec.check()
    return rec


def _config(config: CompressConfig | None, overrides: dict) -> CompressConfig:
    """Apply keyword overrides; PackSpec fields (v_group, k_group, k_block) may be given directly."""
    cfg = config or CompressConfig()
    spec_keys = {f.name for f in fields(PackSpec)}
    unknown = set(overrides) - spec_keys - {f.name for f in fields(CompressConfig)}
    if unknown:
        raise RDKVError(f"unknown option(s) {sorted(unknown)}; CompressConfig fields and {sorted(spec_keys)} are accepted")
    spec = {k: overrides.pop(k) for k in spec_keys & set(overrides)}
    cfg = replace(cfg, **overrides)
    if spec:
        cfg = replace(cfg, spec=replace(cfg.spec, **spec))
    cfg.check()
    return cfg


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
    """Layer ``i``'s cached k, v (float32) and the first position a future query can still see."""
    start = st.start if st.sliding_window is None else max(st.start, st.seen - st.sliding_window + 1)
    k = st.key[..., start - st.start :, :].float()
    v = st.value[..., start - st.start :, :].float()
    if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise RDKVError(f"layer {i}: the cache holds NaN or Inf; the prefill itself is broken (check dtype/overflow)")
    if max(k.abs().max(), v.abs().max()) > quant.FP16_MAX:
        raise RDKVError(f"layer {i}: cache values exceed the fp16 range, which the packed format cannot store")
    return k, v, start


def rdkv_tables(st, k, v, start, present, cfg: CompressConfig, surprise: torch.Tensor | None,
                 gain: float = 1.0) -> LayerTables:
    """The solver tables of one layer's held cache (:func:`held_layer`) under ``cfg``: weights from the
    record's statistics, the prior (``surprise``: :func:`pooled_surprisal`), protected sinks and recent
    tokens, and joint eviction pricing when asked; ``gain`` scales the layer in a global knapsack."""
    window = cfg.layer_window(st.sliding_window is not None)
    sums = layer_sums(st, cfg.weights, start, window)
    if cfg.visible and cfg.weights == "window":
        sums = per_visible(sums, st, start, window, cfg.visible, cfg.visible_cap)
    if cfg.prerope:
        sums.q2 = pair_mean(sums.q2)
    if cfg.pool_weights > 1:  # SnapKV-style: a token next to an attended one counts as attended
        mp = lambda x: torch.nn.functional.max_pool1d(x, cfg.pool_weights, 1, cfg.pool_weights // 2)  # noqa: E731
        sums.mass, sums.mass2 = mp(sums.mass), mp(sums.mass2)
    n = present.sum(-1, keepdim=True).clamp_min(1)
    prior = cfg.floor / n
    if surprise is not None:
        s = surprise[:, None, start:] * present
        prior = prior + cfg.surprisal * s / s.sum(-1, keepdim=True).clamp_min(1e-9)
    if cfg.horizon and st.sliding_window is not None:
        life = lifetime(torch.arange(start, st.seen, device=k.device), st.seen, st.sliding_window, cfg.horizon)
        sums.mass2, prior = sums.mass2 * life, prior * life
    pos = torch.arange(start, st.seen, device=k.device)
    # sinks are the sequence's first real (unpadded) tokens: a sliding-window layer that no longer holds them
    # protects none, not the oldest tokens it holds, which are about to leave its window
    first = (st.valid.cumsum(-1)[:, None, start:] <= cfg.sinks).expand_as(present)
    protect = first | (pos >= st.seen - cfg.recent) | (not cfg.evict)
    joint = None
    if cfg.evict_jointly:
        q, q_pos = window_queries(st, window)
        # the keys as the queries saw them (rotated, even with prerope)
        joint = JointEviction(q, st.key[..., start - st.start :, :], q_pos, pos, st.sliding_window, st.softcap)
    return layer_tables(k, v, present, sums, st.scaling, cfg.spec, st.seen, cfg.distortion, prior, cfg.evict_to,
                        cfg.q_floor, protect=protect, fixed=fixed_bytes(k.shape[1], k.shape[-1], cfg.spec, cfg.prerope),
                        gain=gain, joint=joint)


def resolve_method(rec: Record, method: str, overrides: dict) -> tuple[str, dict]:
    """``"auto"`` -> (the RDKV preset for the recorded model's attention layout, its options merged under ``overrides``);
    any other name is returned as given.

    Models that mix sliding-window and global layers (``layer_types`` in the config, as Gemma 3 has) get
    ``rdkv-hybrid``: on Gemma 3 270M it is the one preset that met both goals of docs/experiments.md, where
    plain ``rdkv`` raised prose perplexity 5.7% at 25%. Every other model gets ``rdkv``. The preset's query
    windows are capped at what the record kept, so ``auto`` works with any record window.
    """
    if method != AUTO:
        return method, overrides
    kinds = set(getattr(rec.model.config.get_text_config(), "layer_types", None) or ())
    name = "rdkv-hybrid" if {"sliding_attention", "full_attention"} <= kinds else "rdkv"
    preset = {k: min(v, rec.window) if k in ("window", "window_sliding") else v for k, v in RDKV_VARIANTS[name].items()}
    return name, {**preset, **overrides}


def priced_options(method: str, overrides: dict) -> dict:
    """The options a compress call with these arguments is priced with: the method's preset (or a baseline's
    group sizes), then the call's own options."""
    return {**(RDKV_VARIANTS.get(method) or BASELINE_SPECS.get(method, {})), **overrides}


def options_key(method: str, config: CompressConfig | None, overrides: dict) -> tuple[str, CompressConfig]:
    """What makes two compress calls price alike (a calibration is valid for one key only): the method and the
    config it resolves to, with the method's preset merged in, so ``auto`` and the preset it names agree and
    options compare by value (``floor=1`` is ``floor=1.0``, a default given explicitly is the default)."""
    return (method, _config(config, priced_options(method, overrides)))


@torch.no_grad()
def allocation_tables(rec: Record, method: str = AUTO, config: CompressConfig | None = None,
                      **overrides) -> tuple[CompressConfig, list[LayerTables], list[int]]:
    """What the solver sees for a recorded prefill: (config, per-layer tables, fp16 bytes per
    sequence). The budget of sequence b is budget x fp16[b]; see :func:`rdkv.solvers.allocate`."""
    method, overrides = resolve_method(_checked(rec), method, overrides)
    if method not in RDKV_VARIANTS:
        raise RDKVError(f"method {method!r} has no distortion model; use one of {', '.join(RDKV_VARIANTS)}")
    cfg, _, fp16, tables, _ = _prepare(rec, method, config, overrides)
    return cfg, tables, fp16


def method_config(method: str, config: CompressConfig | None, overrides: dict, recorded_window: int) -> CompressConfig:
    """The validated config a compress call prices with, for a record that kept ``recorded_window`` queries."""
    if method not in METHODS:
        raise RDKVError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    cfg = _config(config, priced_options(method, overrides))
    for name in ("window", "window_sliding"):
        w = getattr(cfg, name)
        if w is not None and w > recorded_window:
            raise RDKVError(f"{name}={w} but the record kept only the last {recorded_window} prefill queries: "
                            f"record with rdkv.record(model, window={w}) and prefill again")
    return replace(cfg, window=cfg.window or min(DEFAULT_WINDOW, recorded_window))


def held_layer(model: torch.nn.Module, st, i: int, cfg: CompressConfig):
    """Layer ``i``'s held cache as compress packs it: ((stats, k, v, start, present), RoPE table or None),
    keys un-rotated with ``prerope``."""
    cfg.spec.check(st.key.shape[-1])
    k, v, start = held_cache(st, i)
    rope = None
    if cfg.prerope:
        pos = torch.arange(start, st.seen, device=k.device)
        rope = rope_table(model, i, k.shape[-1], pos)
        k = rotate(k, pos, rope, inverse=True)
    return (st, k, v, start, st.valid[:, None, start:].expand(*k.shape[:3])), rope


def pooled_surprisal(rec: Record, cfg: CompressConfig) -> torch.Tensor | None:
    """Each prefill token's surprisal [B, T], max-pooled over ``cfg.pool`` neighbours so a whole improbable span
    counts, not one word; None when the prior does not use it."""
    if cfg.surprisal <= 0:
        return None
    return torch.nn.functional.max_pool1d(rec.surprisal().unsqueeze(1), cfg.pool, 1, cfg.pool // 2).squeeze(1)


def _prepare(rec: Record, method: str, config: CompressConfig | None, overrides: dict):
    """Validate, gather each layer's held cache, and build the solver tables (RDKV variants only).
    Returns (config, held, fp16 bytes, tables, RoPE tables or Nones)."""
    cfg = method_config(method, config, overrides, rec.window)
    held, ropes = zip(*(held_layer(rec.model, rec.layers[i], i, cfg) for i in range(len(rec.layers))))
    # fp16 bytes of what the cache holds, per sequence
    fp16 = [sum(fp16_bytes(int(p[b].sum()), k.shape[-1]) for _, k, _, _, p in held) for b in range(held[0][1].shape[0])]
    tables = None
    if method in RDKV_VARIANTS:
        surprise = pooled_surprisal(rec, cfg)
        gains = cfg.layer_gains or (1.0,) * len(held)
        if len(gains) != len(held):
            raise RDKVError(f"layer_gains has {len(gains)} entries for a model of {len(held)} layers")
        tables = [rdkv_tables(st, k, v, start, p, cfg, surprise, g) for (st, k, v, start, p), g in zip(held, gains)]
    return cfg, held, fp16, tables, ropes


def _budget_for_error(tables: list[LayerTables], fp16: list[int], scope: str, passes: int, cal, error: float,
                      steps: int = 14) -> float:
    """The smallest budget fraction (to 1/2^steps of the bracket) whose allocation's predicted KL <= error."""
    target = cal.distortion_for(error)

    def ok(b: float) -> bool:
        try:
            return modelled_distortion(tables, *allocate(tables, [b * f for f in fp16], scope, passes)) <= target
        except Infeasible:  # below the smallest feasible budget
            return False

    lo, hi = 0.0, 1.0
    if not ok(hi):
        raise RDKVError(f"error={error} is below what the format reaches even at budget 1.0 (predicted KL "
                        f"{cal.predict(modelled_distortion(tables, *allocate(tables, fp16, scope, passes))):.3g}); raise error")
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def pack_held(held: tuple, v_opt: torch.Tensor, k_opt: torch.Tensor, perm: torch.Tensor, spec: PackSpec,
              dtype16: torch.dtype, rope: torch.Tensor | None) -> TriZoneLayer:
    """Pack one layer's held cache (:func:`held_layer`) at the chosen options, with its RoPE table if pre-RoPE."""
    st, k, v, start, _ = held
    layer = pack_choice(k, v, start, v_opt, k_opt, perm, spec, dtype16, st.sliding_window, st.seen)
    if rope is not None:
        layer.t["rope"] = rope
    return layer


def set_fold(cache: TriZoneCache, fold: int | FoldPolicy | None) -> None:
    """``fold=R``: fold every R generated tokens at the cache's own fraction of the fp16 bytes."""
    if fold is not None:
        if not isinstance(fold, FoldPolicy):
            budget = cache.budget if cache.budget is not None else cache.nbytes / cache.fp16_bytes
            fold = FoldPolicy(every=fold, budget=budget)
        cache.set_fold(fold)


@torch.no_grad()
def compress(rec: Record, budget: float | None = None, *, method: str = AUTO,
             config: CompressConfig | None = None, fold: int | FoldPolicy | None = None,
             error: float | None = None, calibration: Calibration | None = None, **overrides) -> TriZoneCache:
    """Compress the cache of a recorded prefill (:func:`rdkv.record`) into a :class:`TriZoneCache` of at
    most ``budget`` x its fp16 bytes (every byte counted: codes, scales, zeros, indices).

    ``method`` is ``"rdkv"``, one of its variants or a baseline (:data:`rdkv.methods.METHODS`); all go
    through the same packer. The default ``"auto"`` picks the RDKV preset for the model's layout
    (:func:`resolve_method`: ``rdkv-hybrid`` when sliding-window and global layers mix, else ``rdkv``);
    ``cache.method`` names what ran. Fixed-rate baselines (int8, kivi2, ...) need no budget; given one, they
    raise if they do not fit. The record, its uncompressed cache and the model are left untouched, so one
    prefill can be compressed many times; on any error nothing changes.

    ``fold=R`` (or a :class:`rdkv.fold.FoldPolicy`) packs every R tokens generated after compression
    into the compressed zones at the same fraction of their fp16 bytes, so memory stays bounded over
    long generations; by default generated tokens stay in 16 bits (zone C).

    ``error=eps`` instead of a budget: the fewest bytes whose KL divergence from the full cache's
    next-token distribution is predicted to be at most ``eps`` by ``calibration``, the map
    :func:`rdkv.calibrate` fitted on this model for the same method and options (RDKV methods only).
    """
    method, overrides = resolve_method(_checked(rec), method, overrides)
    if error is not None:
        if budget is not None:
            raise RDKVError("give either budget= (bytes) or error= (predicted KL), not both")
        if method not in RDKV_VARIANTS:
            raise RDKVError(f"error= needs a distortion model; method {method!r} has none: use budget=")
        if isinstance(error, bool) or not isinstance(error, (int, float)) or not error > 0 or math.isinf(error):
            raise RDKVError(f"error must be a positive number (a KL in nats), got {error!r}")
        if not isinstance(calibration, Calibration):
            raise RDKVError("error= needs calibration=rdkv.calibrate(model, ids, ...) fitted on this model, got "
                            f"{type(calibration).__name__}")
        if calibration.key != options_key(method, config, overrides):
            raise RDKVError(f"the calibration was fitted for method {calibration.method!r} with other options than this "
                            f"call's ({method!r}, {overrides or 'no options'}): calibrate with rdkv.calibrate(model, ids, "
                            f"method={method!r}, ...) and the same options")
    elif calibration is not None:
        raise RDKVError("calibration= is for error=; with a byte budget it has nothing to do")
    elif budget is not None or method not in FIXED_RATE:
        budget = check_budget(budget)
    cfg, held, fp16, tables, ropes = _prepare(rec, method, config, overrides)
    spec = cfg.spec
    per_layer = None
    try:
        if tables is not None:
            if error is not None:
                budget = _budget_for_error(tables, fp16, cfg.scope, cfg.passes, calibration, error)
            v_opt, k_opt = allocate(tables, [budget * f for f in fp16], cfg.scope, cfg.passes)
            per_layer = tuple(layer_distortion(tables, v_opt, k_opt))
            perms = [t.perm for t in tables]
        else:
            fixed = [sum(fixed_bytes(k.shape[1], k.shape[-1], spec, cfg.prerope) for _, k, _, _, _ in held)] * len(fp16)
            inputs = [LayerInput(k, p, layer_sums(st, "window", start, SNAP_WINDOW).mass, start, st.seen)
                      for st, k, v, start, p in held]
            budgets = [budget * f if budget is not None else float("inf") for f in fp16]
            v_opt, k_opt = BASELINES[method](inputs, budgets, fixed, spec.k_block)
            perms = [torch.arange(k.shape[-1], device=k.device).expand(*k.shape[:2], -1) for _, k, _, _, _ in held]
    except Infeasible as e:
        raise BudgetInfeasible(f"budget {budget} is too small for this cache ({e}); raise the budget") from e
    layers = [pack_held(h, vo, ko, perm, spec, dtype16(rec.model), rope)
              for h, vo, ko, perm, rope in zip(held, v_opt, k_opt, perms, ropes)]
    cache = TriZoneCache(layers, fp16_bytes=int(sum(fp16)), budget=budget, method=method, layer_distortion=per_layer)
    set_fold(cache, fold)
    if budget is not None and cache.nbytes > budget * cache.fp16_bytes:
        if method in FIXED_RATE:
            raise BudgetInfeasible(f"{method} needs {cache.nbytes / cache.fp16_bytes:.4f} of the fp16 bytes, more than the "
                            f"budget {budget}; raise the budget or pass budget=None")
        raise AssertionError(f"rdkv bug: packed {cache.nbytes} B exceeds budget {budget * cache.fp16_bytes:.0f} B")
    return cache
