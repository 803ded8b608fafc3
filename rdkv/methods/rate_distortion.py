"""RDKV: every V token row and K channel block priced at every width, one knapsack per byte budget.

The method is four parts, each a frozen dataclass, so a variant is a different part rather than a flag:

* :class:`Weights`: which recorded queries weigh each unit, and how (:mod:`rdkv.weights`);
* :class:`Prior`: the attention reserved for questions the prefill did not ask;
* :class:`Eviction`: which tokens may be evicted and what evicting one is priced at;
* :class:`Solve`: the knapsack's scope and passes (:mod:`rdkv.solvers.allocate`).

The tables a layer's parts produce are built once (:func:`rdkv.distortion.layer_tables`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from ..dense import AttentionSums
from ..distortion import EVICT_TO, MODELS, JointEviction, LayerTables, layer_distortion, layer_tables
from ..errors import RDKVError
from ..records import LayerStats, Record
from ..rope import pair_mean
from ..solvers.allocate import SPLITS, allocate
from ..weights import FORMS, layer_sums, lifetime, per_visible, window_queries
from .base import Allocation, HeldLayer, Method

DEFAULT_WINDOW = 64  # window queries weigh tokens by default (a record keeps 256)
SCORES = ("sum", "max")  # Weights.score: a token's squared attention summed over the queries, or its largest
K_PRICES = ("mean", "readers")  # Weights.k_price: a key error priced from the queries' mean output, or their own


def _positive_int(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise RDKVError(f"{name} must be a positive int or None, got {value!r}")


def _odd(name: str, value) -> None:
    if not isinstance(value, int) or value < 1 or value % 2 == 0:
        raise RDKVError(f"{name} must be a positive odd int, got {value!r}")


def _scaled_to(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, T] scaled to the total of ``like`` over each sequence's heads and tokens."""
    return x * (like.sum((1, 2), keepdim=True) / x.sum((1, 2), keepdim=True).clamp_min(1e-30))


@dataclass(frozen=True)
class Weights:
    """How much each unit matters: attention sums over the recorded queries.

    ``form="window"`` re-attends the last ``window`` prefill queries (``window_sliding`` of them on
    sliding-window layers, when set); ``"all"`` uses every prefill query (the paper's form; record with
    ``all_queries=True``). ``visible`` corrects the window's last tokens for the queries that cannot see
    them (:func:`rdkv.weights.per_visible`, capped at ``visible_cap``). ``pool`` max-pools the token weights
    (SnapKV-style, odd; 1 = none); ``pool_forward`` lets a token's weight also reach the ``pool_forward``
    tokens after it, one-sided: a question attends to a needle's start, and what follows is read while
    the answer is written; ``pool_back`` lets it reach the ``pool_back`` tokens before it: the repetition reads
    the first token of a copied span (a number's first digit) less than the span's rest, and a later question
    needs it as much. ``q_floor`` replaces that fraction of each K channel's query weight by
    the channel mean. ``horizon``: on sliding-window layers, a token is weighed by the share of the next
    ``horizon`` decode queries that can still see it (:func:`rdkv.weights.lifetime`). ``score="max"`` (with
    ``form="reconstruct"``) weighs each token by the largest attention any one repetition query paid it, squared,
    as KVzip scores its pairs, in place of the sum over queries: a token one query copies counts as much as one
    many queries read a little (scaled per layer to the same total, so the prior keeps its share).
    ``k_price="readers"`` (with ``form="reconstruct"``) prices a key error by the token's distance to the outputs
    of the queries that read it (:attr:`rdkv.dense.AttentionSums.drift`) rather than to their mean output: a query
    that copies a token already outputs its value, so the token's key error barely moves it
    (:mod:`rdkv.distortion`). Eviction keeps its price. ``blend`` (with ``form="reconstruct"``) takes that share
    of each layer's token weights from the prefill's last ``window`` queries instead (each source scaled to the
    layer's total): the repetition finds what a later question may copy, the prompt's end what it reads anyway.
    """

    form: str = "window"
    window: int | None = None  # None: 64, or every query the record kept if fewer
    window_sliding: int | None = None
    visible: float = 0.0
    visible_cap: float | None = None
    pool: int = 1
    pool_forward: int = 0
    pool_back: int = 0
    q_floor: float = 0.0
    horizon: int | None = None
    score: str = "sum"
    k_price: str = "mean"
    blend: float = 0.0

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise RDKVError(f"weights={self.form!r} is not one of {FORMS}")
        if self.score not in SCORES:
            raise RDKVError(f"score={self.score!r} is not one of {SCORES}")
        if self.k_price not in K_PRICES:
            raise RDKVError(f"k_price={self.k_price!r} is not one of {K_PRICES}")
        for name, value in (("score", "max"), ("k_price", "readers")):
            if getattr(self, name) == value and self.form != "reconstruct":
                raise RDKVError(f"{name}={value!r} reads what the reconstruction pass measures: use it with "
                                "weights='reconstruct'")
        if not 0 <= self.blend <= 1:
            raise RDKVError(f"blend must be a fraction in [0, 1] (the window's share of the weights), got {self.blend!r}")
        if self.blend and self.form != "reconstruct":
            raise RDKVError(f"blend={self.blend!r} mixes the window's weights into the reconstruction pass's: use it "
                            "with weights='reconstruct'")
        for name in ("window", "window_sliding", "horizon"):
            _positive_int(name, getattr(self, name))
        _odd("pool_weights", self.pool)
        for name, where in (("pool_forward", "after"), ("pool_back", "before")):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise RDKVError(f"{name} must be an int >= 0 (tokens a weight reaches {where} its own), got {n!r}")
        if not 0 <= self.visible <= 1:
            raise RDKVError(f"visible must be a number in [0, 1] (how far to correct for causal visibility), "
                            f"got {self.visible!r}")
        if self.visible_cap is not None and not self.visible_cap >= 1:
            raise RDKVError(f"visible_cap must be a number >= 1 (the largest visibility factor), got {self.visible_cap!r}")
        if not 0 <= self.q_floor <= 1:
            raise RDKVError(f"q_floor must be a fraction in [0, 1], got {self.q_floor}")

    def of_layer(self, sliding: bool) -> int | None:
        """How many recorded queries weigh a layer: ``window_sliding`` on sliding-window layers when set."""
        return self.window_sliding if sliding and self.window_sliding else self.window

    def sums(self, st: LayerStats, start: int, prerope: bool) -> AttentionSums:
        window = self.of_layer(st.sliding_window is not None)
        sums = layer_sums(st, self.form, start, window)
        if self.visible and self.form == "window":
            sums = per_visible(sums, st, start, window, self.visible, self.visible_cap)
        if prerope:  # a pre-RoPE channel pair shares one rotation: weigh it by the pair's mean
            sums.q2 = pair_mean(sums.q2)
        if self.k_price == "mean":
            sums.drift = None
        if self.score == "max":
            sums.mass2 = _scaled_to(sums.peak.square(), sums.mass2)
        if self.blend:
            end = layer_sums(st, "window", start, window)
            sums.mass, sums.mass2 = ((1 - self.blend) * x + self.blend * _scaled_to(y, x)
                                     for x, y in ((sums.mass, end.mass), (sums.mass2, end.mass2)))
        return self.pooled(sums)

    def pooled(self, sums: AttentionSums) -> AttentionSums:
        """``sums`` with token weights max-pooled over ``pool`` neighbours, then over the ``pool_forward``
        tokens before each and the ``pool_back`` tokens after each (weights are >= 0, so zero padding is exact): a
        token next to, after or before an attended one counts as attended."""
        if self.pool > 1:
            mp = lambda x: F.max_pool1d(x, self.pool, 1, self.pool // 2)  # noqa: E731
            sums.mass, sums.mass2 = mp(sums.mass), mp(sums.mass2)
        if self.pool_forward or self.pool_back:  # one window from pool_forward tokens before to pool_back after
            f, b = self.pool_forward, self.pool_back
            reach = lambda x: F.max_pool1d(F.pad(x, (f, b)), f + b + 1, 1)  # noqa: E731
            sums.mass, sums.mass2 = reach(sums.mass), reach(sums.mass2)
        return sums


@dataclass(frozen=True)
class Prior:
    """The squared attention a future query is expected to put on each token beyond what the prefill's did:
    ``surprisal`` x each token's surprisal (max-pooled over ``pool`` neighbours, so a whole improbable span
    counts), normalised per head, plus a uniform ``floor / T`` (:mod:`rdkv.distortion`), plus ``carry`` x the
    share of the weight the earlier global layers gave each token (:meth:`carried`), normalised per head: a layer
    whose own queries look elsewhere still keeps what the layers before it found (the last global layer of a
    model that reads a question's needle in its middle layers)."""

    floor: float = 0.0
    surprisal: float = 0.5
    pool: int = 7
    carry: float = 0.0

    def __post_init__(self) -> None:
        if not (self.floor >= 0 and self.surprisal >= 0 and self.carry >= 0):
            raise RDKVError("surprisal, floor and carry must be >= 0")
        _odd("pool", self.pool)

    @staticmethod
    def carried(previous: torch.Tensor | None, mass2: torch.Tensor, keep: torch.Tensor, start: int) -> torch.Tensor:
        """The running profile [B, seen] after a global layer whose token weights are ``mass2`` [B, H, T] (positions
        ``start`` to seen - 1; ``keep`` [B, H, T] marks those the layer may evict): each token's share of its head's
        evictable weight, the largest over heads and over this and the earlier global layers. Protected tokens
        (sinks, the recent window) are left out: they are kept anyway, and a sink's share would swamp the rest."""
        m = mass2 * keep
        share = (m / m.sum(-1, keepdim=True).clamp_min(1e-30)).amax(1)
        now = share.new_zeros(share.shape[0], start + share.shape[-1])
        now[:, start:] = share
        return now if previous is None else torch.maximum(previous, now)

    def surprise(self, rec: Record) -> torch.Tensor | None:
        """Pooled surprisal of every prefill token [B, T], or None when the prior does not use it."""
        if self.surprisal <= 0:
            return None
        return F.max_pool1d(rec.surprisal().unsqueeze(1), self.pool, 1, self.pool // 2).squeeze(1)

    def of_layer(self, present: torch.Tensor, surprise: torch.Tensor | None, start: int,
                 carried: torch.Tensor | None = None) -> torch.Tensor:
        prior = self.floor / present.sum(-1, keepdim=True).clamp_min(1)
        for strength, x in ((self.surprisal, surprise), (self.carry, carried)):
            if strength and x is not None:
                s = x[:, None, start:] * present
                prior = prior + strength * s / s.sum(-1, keepdim=True).clamp_min(1e-9)
        return prior


@dataclass(frozen=True)
class Eviction:
    """Whether tokens may be evicted (``allowed``), which may not (the sequence's first ``sinks`` real tokens
    and the prefill's last ``recent``), and the value an evicted token's error is measured from (``to``:
    :data:`rdkv.distortion.EVICT_TO`). ``jointly`` re-prices each pass's eviction from the set the previous
    pass evicted (:func:`rdkv.distortion.joint_reprice`). ``window_end``: on sliding-window layers the prefill's
    last ``window_end`` tokens are protected as well and no K block is left as its channel means (every block keeps
    2 bits or more, charged to the tokens kept), the layer's budget raised to hold them
    (:func:`rdkv.solvers.allocate.layer_budgets`), where the ends take at most half the budget
    (:data:`rdkv.solvers.allocate.ENDS_SHARE`; past that they give way). The question's tokens at the window's end
    are read with their keys, and keys that are only channel means cannot tell them apart (docs/experiments.md,
    2026-12-08)."""

    allowed: bool = True
    sinks: int = 4
    recent: int = 32
    to: str = "heavy"
    jointly: bool = False
    window_end: int = 0

    def __post_init__(self) -> None:
        if self.to not in EVICT_TO:
            raise RDKVError(f"evict_to={self.to!r} is not one of {EVICT_TO}")
        if self.sinks < 0 or self.recent < 0:
            raise RDKVError("sinks and recent must be >= 0")
        if isinstance(self.window_end, bool) or not isinstance(self.window_end, int) or self.window_end < 0:
            raise RDKVError(f"window_end must be an int >= 0 (tokens at each sliding window's end), got {self.window_end!r}")
        if self.jointly and self.to == "kept":
            raise RDKVError("evict_jointly re-prices eviction itself: use it with an evict_to other than 'kept'")

    def protect(self, st: LayerStats, start: int, present: torch.Tensor, ends: bool) -> torch.Tensor:
        pos = torch.arange(start, st.seen, device=present.device)
        # sinks are the sequence's first real (unpadded) tokens: a sliding-window layer that no longer holds them
        # protects none, not the oldest tokens it holds, which are about to leave its window
        first = (st.valid.cumsum(-1)[:, None, start:] <= self.sinks).expand_as(present)
        recent = max(self.recent, self.window_end) if ends else self.recent
        return first | (pos >= st.seen - recent) | (not self.allowed)

    def ends(self, st: LayerStats) -> bool:
        """Whether a layer holds its window's end (``window_end``)."""
        return bool(self.window_end) and st.sliding_window is not None

    def joint(self, st: LayerStats, start: int, window: int | None) -> JointEviction | None:
        if not self.jointly:
            return None
        q, q_pos = window_queries(st, window)
        pos = torch.arange(start, st.seen, device=q.device)
        # the keys as the queries saw them (rotated, even with prerope)
        return JointEviction(q, st.key[..., start - st.start :, :], q_pos, pos, st.sliding_window, st.softcap)


@dataclass(frozen=True)
class Solve:
    """``scope="layer"``: a budget per layer, split as ``split`` says (:func:`rdkv.solvers.allocate.layer_budgets`:
    ``"bytes"``, each layer's share of the fp16 bytes; ``"peak"``, KVzip's one ranking of every layer's tokens by
    the reconstruction pass's peaks, which it runs whatever the weights, with ``split_floor`` of it handed out by
    bytes instead: a floor for the layers the pass reads little); ``"global"``: one knapsack over every layer and
    head, with ``layer_gains`` (one positive multiplier per layer, :func:`rdkv.fit_layer_gains`) weighing each layer's
    distortion. ``passes``: how often K is re-priced for the tokens the previous pass kept."""

    scope: str = "layer"
    passes: int = 3
    layer_gains: tuple[float, ...] | None = None
    split: str = "bytes"
    split_floor: float = 0.0

    def __post_init__(self) -> None:
        if self.scope not in ("global", "layer"):
            raise RDKVError(f"scope={self.scope!r} is not 'global' or 'layer'")
        if self.split not in SPLITS:
            raise RDKVError(f"split={self.split!r} is not one of {SPLITS}")
        if self.split != "bytes" and self.scope != "layer":
            raise RDKVError(f"split={self.split!r} divides the budget between layers: use it with scope='layer'")
        f = self.split_floor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise RDKVError(f"split_floor must be a fraction in [0, 1] (the share of the budget split by bytes), got {f!r}")
        if f and self.split != "peak":
            raise RDKVError(f"split_floor={f!r} puts a floor under split='peak''s layer parts: use it with split='peak'")
        if not isinstance(self.passes, int) or isinstance(self.passes, bool) or self.passes < 1:
            raise RDKVError(f"passes must be a positive int, got {self.passes!r}")
        if self.layer_gains is not None:
            if isinstance(self.layer_gains, list):
                object.__setattr__(self, "layer_gains", tuple(self.layer_gains))
            if not all(isinstance(g, (int, float)) and 0 < g < math.inf for g in self.layer_gains):
                raise RDKVError(f"layer_gains must be positive finite numbers, one per layer, got {self.layer_gains!r}")

    def __call__(self, tables: list[LayerTables], budgets: list[float]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return allocate(tables, budgets, self.scope, self.passes, self.split, self.split_floor)


# compress(**options) keyword -> (part, field): the names the results and scripts use
OPTIONS: dict[str, tuple[str | None, str]] = {
    "weights": ("weights", "form"), "window": ("weights", "window"), "window_sliding": ("weights", "window_sliding"),
    "visible": ("weights", "visible"), "visible_cap": ("weights", "visible_cap"), "pool_weights": ("weights", "pool"),
    "pool_forward": ("weights", "pool_forward"), "pool_back": ("weights", "pool_back"),
    "q_floor": ("weights", "q_floor"), "horizon": ("weights", "horizon"),
    "score": ("weights", "score"), "k_price": ("weights", "k_price"), "blend": ("weights", "blend"),
    "floor": ("prior", "floor"), "surprisal": ("prior", "surprisal"), "pool": ("prior", "pool"),
    "carry": ("prior", "carry"),
    "evict": ("eviction", "allowed"), "sinks": ("eviction", "sinks"), "recent": ("eviction", "recent"),
    "evict_to": ("eviction", "to"), "evict_jointly": ("eviction", "jointly"),
    "window_end": ("eviction", "window_end"),
    "scope": ("solve", "scope"), "passes": ("solve", "passes"), "layer_gains": ("solve", "layer_gains"),
    "split": ("solve", "split"), "split_floor": ("solve", "split_floor"),
    "distortion": (None, "distortion"), "prerope": (None, "prerope"),
}


@dataclass(frozen=True)
class RDKV(Method):
    """Rate-distortion allocation: weights -> prior -> per-layer tables -> knapsack (:mod:`rdkv.distortion`).

    ``distortion`` is ``"output"`` (attention-output error, one unit for K and V) or ``"paper"`` (the RDKV
    paper's w * sigma * 2^-b); ``prerope`` quantizes keys before RoPE, as KVQuant does (:mod:`rdkv.rope`).
    """

    name: str = field(default="rdkv", compare=False)
    weights: Weights = field(default_factory=Weights)
    prior: Prior = field(default_factory=Prior)
    eviction: Eviction = field(default_factory=Eviction)
    solve: Solve = field(default_factory=Solve)
    distortion: str = "output"
    prerope: bool = False

    def __post_init__(self) -> None:
        if self.distortion not in MODELS:
            raise RDKVError(f"distortion={self.distortion!r} is not one of {MODELS}")
        if self.eviction.jointly and self.distortion != "output":
            raise RDKVError("evict_jointly re-prices the output distortion itself: use it with distortion='output'")
        if self.solve.layer_gains is not None and (self.eviction.jointly or self.eviction.to == "kept"):
            raise RDKVError("layer_gains scales the priced tables; evict_jointly and evict_to='kept' re-price "
                            "eviction during allocation: use them without layer_gains")

    @property
    def all_queries(self) -> bool:
        return self.weights.form == "all"

    @property
    def needs_pass(self) -> bool:
        """Whether compressing runs the reconstruction pass (:mod:`rdkv.reconstruct`): for its token weights, or
        for the peaks ``split="peak"`` divides the budget by."""
        return self.weights.form == "reconstruct" or self.solve.split == "peak"

    def options(self) -> dict[str, tuple[str | None, str]]:
        parts = {p: (None, p) for p in ("spec", "weights", "prior", "eviction", "solve")} | {"weights": OPTIONS["weights"]}
        return {**OPTIONS, **parts, **{f.name: ("spec", f.name) for f in fields(self.spec)}}

    def for_record(self, rec: Record) -> RDKV:
        for name in ("window", "window_sliding"):
            w = getattr(self.weights, name)
            if w is not None and w > rec.window:
                raise RDKVError(f"{name}={w} but the record kept only the last {rec.window} prefill queries: "
                                f"record with rdkv.record(model, window={w}) and prefill again")
        if self.all_queries and not rec.all_queries:
            raise RDKVError("weights='all' needs every prefill query: record with rdkv.record(model, all_queries=True)")
        return replace(self, weights=replace(self.weights, window=self.weights.window or min(DEFAULT_WINDOW, rec.window)))

    def tables(self, layer: HeldLayer, surprise: torch.Tensor | None, gain: float = 1.0,
               carried: torch.Tensor | None = None) -> tuple[LayerTables, torch.Tensor | None]:
        """The solver tables of one held layer, and the profile it carries to the next (:meth:`Prior.carried`;
        None while ``carry`` is 0). Layers go in order, each given the previous one's profile as ``carried``;
        ``surprise`` is :meth:`Prior.surprise` of the record."""
        st, k, v, start, present, _ = layer
        w, ev = self.weights, self.eviction
        sums = w.sums(st, start, self.prerope)
        if self.solve.split == "peak":  # the layers' shares come from the reconstruction pass, whatever the weights
            sums.peak = layer_sums(st, "reconstruct", start).peak
        prior = self.prior.of_layer(present, surprise, start, carried)
        ends = ev.ends(st)
        protect = ev.protect(st, start, present, ends)
        plain = ev.protect(st, start, present, False) if ends else protect
        if self.prior.carry and st.sliding_window is None:
            carried = self.prior.carried(carried, sums.mass2, present & ~protect, start)
        if w.horizon and st.sliding_window is not None:
            life = lifetime(torch.arange(start, st.seen, device=k.device), st.seen, st.sliding_window, w.horizon)
            sums.mass2, prior = sums.mass2 * life, prior * life
        tables = layer_tables(k, v, present, sums, st.scaling, self.spec, st.seen, self.distortion, prior, ev.to,
                              w.q_floor, protect=protect, prerope=self.prerope, gain=gain,
                              joint=ev.joint(st, start, w.of_layer(st.sliding_window is not None)))
        return replace(tables, ends=protect & ~plain & present if ends else None), carried

    def all_tables(self, rec: Record, layers: list[HeldLayer]) -> list[LayerTables]:
        gains = self.solve.layer_gains or (1.0,) * len(layers)
        if len(gains) != len(layers):
            raise RDKVError(f"layer_gains has {len(gains)} entries for a model of {len(layers)} layers")
        surprise, carried, out = self.prior.surprise(rec), None, []
        for h, g in zip(layers, gains):
            tables, carried = self.tables(h, surprise, g, carried)
            out.append(tables)
        return out

    def solved(self, tables: list[LayerTables], fp16: list[int], budget: float) -> Allocation:
        v, k = self.solve(tables, [budget * f for f in fp16])
        return Allocation(v, k, [t.perm for t in tables], tuple(layer_distortion(tables, v, k)))

    def allocate(self, rec: Record, layers: list[HeldLayer], fp16: list[int], budget: float | None) -> Allocation:
        return self.solved(self.all_tables(rec, layers), fp16, budget)

    def fold(self, k: torch.Tensor, v: torch.Tensor, sums: AttentionSums, scaling: float, seen: int, floor: float,
             budgets: list[float]) -> Allocation:
        """Widths for a fold (:mod:`rdkv.fold`): tokens generated after compression, ``k``, ``v`` [B, H, R, D] ending
        at position ``seen - 1``, weighed by the decode queries' attention ``sums`` over zone C (cut to the folded
        tokens after pooling) and the uniform prior ``floor`` alone (generated tokens have no recorded surprisal);
        no sinks, recent tokens or joint eviction (they need the prefill); one knapsack per sequence of ``budgets``
        bytes."""
        R = k.shape[2]
        sums = self.weights.pooled(sums)
        sums.mass, sums.mass2 = sums.mass[..., :R], sums.mass2[..., :R]
        present = torch.ones(k.shape[:3], dtype=torch.bool, device=k.device)
        tables = layer_tables(k, v, present, sums, scaling, self.spec, seen, self.distortion, floor / R, self.eviction.to,
                              self.weights.q_floor, protect=present & (not self.eviction.allowed))
        v_opt, k_opt = allocate([tables], budgets, "layer", self.solve.passes)
        return Allocation(v_opt, k_opt, [tables.perm])
