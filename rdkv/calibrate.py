"""An explicit error budget: ``compress(rec, error=eps, calibration=cal)`` asks for the fewest bytes whose predicted
KL divergence from the full cache's next-token distribution is at most ``eps``.

The solver's objective is a modelled distortion: the expected squared attention-output error summed
over layers, per weight query (:func:`rdkv.distortion.modelled_distortion`). It is not a KL. :func:`calibrate` maps
one to the other on the model itself: it prefills each calibration text, compresses it at several
budgets, teacher-forces the text's continuation through each cache, and fits ``log KL = log a + p log D``:
the slope p by least squares over all points, the intercept conservatively, so that no calibration point
lies above the line (an error *budget* should hold, not hold on average). The fit is returned, and
``compress(error=..., calibration=...)`` bisects the byte budget until the predicted KL of the
allocation meets ``eps``. How well the map transfers to other texts and lengths is measured, not assumed:
``scripts/eval_error_budget.py`` reports the rank correlation of D with measured KL and predicted vs
measured KL at several ``eps``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from .api import compress
from .attention import attention_modules, record
from .compat import cache_kwargs, output_cache
from .distortion import Calibration
from .errors import BudgetInfeasible, RDKVError
from .methods import AUTO, METHODS, Method, resolve
from .records import Record
from .trizone import TriZoneCache


def fit(points: list[tuple[float, float]], method: Method | None = None) -> Calibration:
    """Line through (log D, log KL): least-squares slope, intercept raised until every point is on or below
    it. Needs two points with distinct D and KL > 0. ``method``: the method, options applied, the points
    came from (default: ``rdkv``)."""
    pts = [(d, k) for d, k in points if d > 0 and k > 0]
    if len({d for d, _ in pts}) < 2:
        raise RDKVError("calibration needs at least two budgets with different, non-zero distortion and KL; "
                        "use a longer calibration text or smaller budgets")
    x = torch.tensor([math.log(d) for d, _ in pts], dtype=torch.float64)
    y = torch.tensor([math.log(k) for _, k in pts], dtype=torch.float64)
    p = float(((x - x.mean()) * (y - y.mean())).sum() / (x - x.mean()).square().sum())
    if not p > 0:
        raise RDKVError(f"calibration found KL falling as modelled distortion grows (slope {p:.3g}): the "
                        "distortion model does not track this model's output; use budget= instead of error=")
    method = method if method is not None else METHODS["rdkv"]
    return Calibration(math.exp(float((y - p * x).max())), p, tuple(pts), method.name, method)


def _check_texts(model: torch.nn.Module, texts, prefix: float) -> list[torch.Tensor]:
    attention_modules(model)
    texts = [texts] if isinstance(texts, torch.Tensor) else list(texts)
    for ids in texts:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 8:
            raise RDKVError(f"calibration texts must be token ids of shape [1, T >= 8], got "
                            f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if not 0 < prefix < 1:
        raise RDKVError(f"prefix must be a fraction in (0, 1), got {prefix}")
    return texts


def plain_prefill(model: torch.nn.Module, ids: torch.Tensor):
    """Prefill ``ids`` into plain layers everywhere (no sliding-window layers that drop old keys), so that a
    compressed layer, which masks over absolute positions, can stand in for any of them (:func:`swap_in`)."""
    from transformers import DynamicCache

    return output_cache(model(ids, **cache_kwargs(DynamicCache()), use_cache=True, logits_to_keep=1))


def swap_in(full, compressed: TriZoneCache, layers):
    """A copy of the plain cache ``full`` with ``layers`` replaced by copies of the compressed cache's."""
    hybrid = copy.deepcopy(full)
    for i in layers:
        hybrid.layers[i] = copy.deepcopy(compressed.layers[i])
    return hybrid


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean KL(ref || got) of next-token distributions over positions, from logits or log-probabilities
    [..., V] (normalised here, which leaves log-probabilities as they are)."""
    p, q = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _recorded(model: torch.nn.Module, ids: torch.Tensor, all_queries: bool = False,
              plain: bool = False) -> tuple[Record, object]:
    """A record of prefilling ``ids`` and that prefill's cache (:func:`plain_prefill`'s with ``plain``)."""
    with record(model, all_queries=all_queries) as rec:
        full = plain_prefill(model, ids) if plain else output_cache(model(ids, use_cache=True, logits_to_keep=1))
    return rec, full


def _measure(model: torch.nn.Module, texts: list[torch.Tensor], prefix: float,
             calls: list[tuple[object, float, Method]]) -> list[tuple[object, float, float]]:
    """For each text: record a prefill of its first ``prefix`` fraction, then for each (key, budget, method)
    compress and teacher-force the rest; returns (key, modelled distortion, KL from the full cache).
    Budgets too small for a text are skipped."""
    out = []
    every = any(m.all_queries for _, _, m in calls)
    for ids in texts:
        n = int(ids.shape[1] * prefix)
        rec, full = _recorded(model, ids[:, :n], every)
        got = []
        for key, b, m in calls:
            try:
                cache = compress(rec, b, method=m)
            except BudgetInfeasible:
                continue
            got.append((key, cache.distortion, model(ids[:, n:], **cache_kwargs(cache)).logits[0].float().log_softmax(-1)))
        ref = model(ids[:, n:], **cache_kwargs(full)).logits[0].float().log_softmax(-1)
        out += [(key, d, kl(ref, lp)) for key, d, lp in got]
    return out


@torch.no_grad()
def calibrate(model: torch.nn.Module, texts: torch.Tensor | list[torch.Tensor], prefix: float = 0.75,
              budgets: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5), method: str | Method = AUTO, **options) -> Calibration:
    """Fit the distortion-to-KL map on calibration token ids (one [1, T] tensor or a list of them; the first
    ``prefix`` fraction of each is compressed, the rest teacher-forced), for
    ``compress(rec, error=eps, calibration=...)`` with the same ``method`` and options. Texts unlike the ones
    you will compress make the bound more robust.
    """
    texts = _check_texts(model, texts, prefix)
    m = resolve(model, method, options)  # as compress resolves it on a record of the default window
    pairs = _measure(model, texts, prefix, [(None, b, m) for b in budgets])
    return fit([(d, kl) for _, d, kl in pairs], m)


# (floor, surprisal) candidates for tune_prior: today's default, two stronger reserves, and the one
# Gemma 3 prose preferred in docs/results/perplexity_gemma3-270m_prose-3win-variants2.md
PRIORS: tuple[tuple[float, float], ...] = ((0.0, 0.5), (0.0, 1.5), (1.0, 3.0), (3.0, 3.0))


@dataclass(frozen=True)
class PriorFit:
    """The reserve for unseen questions ``tune_prior`` picked, and every candidate's score."""

    floor: float
    surprisal: float
    scores: tuple[tuple[float, float, float], ...]  # (floor, surprisal, mean log KL over texts and budgets)

    @property
    def options(self) -> dict[str, float]:
        """The compress options it chose: ``rdkv.compress(rec, budget, **fit.options)``."""
        return {"floor": self.floor, "surprisal": self.surprisal}


@torch.no_grad()
def tune_prior(model: torch.nn.Module, texts: torch.Tensor | list[torch.Tensor], prefix: float = 0.75,
               budgets: tuple[float, ...] = (0.1, 0.25), candidates: tuple[tuple[float, float], ...] = PRIORS,
               **options) -> PriorFit:
    """Pick the prior (``floor``, ``surprisal``: how much attention compress reserves for questions the
    prefill did not ask) with the lowest mean log KL over calibration texts and budgets, for
    ``compress(rec, budget, **fit.options)`` with the default method (``auto``). Gemma 3's prose windows
    wanted a stronger reserve than the default; on held-out calibration text both Gemma 3 and SmolLM2
    chose the default (docs/experiments.md, "Prior per model").

    Mean log KL, not mean KL: every budget and text counts, not only the coarsest.
    """
    texts = _check_texts(model, texts, prefix)
    if not candidates or any(len(c) != 2 or min(c) < 0 for c in candidates):
        raise RDKVError(f"candidates must be (floor, surprisal) pairs of non-negative numbers, got {candidates!r}")
    if {"floor", "surprisal", "method"} & set(options):
        raise RDKVError("tune_prior chooses floor and surprisal for the default method; pass other options only")
    calls = [(c, b, resolve(model, AUTO, dict(floor=c[0], surprisal=c[1], **options))) for c in candidates for b in budgets]
    logs: dict = {c: [] for c in candidates}
    for c, _, kl in _measure(model, texts, prefix, calls):
        logs[c].append(math.log(max(kl, 1e-12)))
    if {len(v) for v in logs.values()} != {len(texts) * len(budgets)}:
        raise RDKVError("some budgets did not fit every calibration text: use longer texts or larger budgets")
    scores = tuple((c[0], c[1], sum(v) / len(v)) for c, v in logs.items())
    best = min(scores, key=lambda x: x[2])
    return PriorFit(best[0], best[1], scores)


@torch.no_grad()
def fit_layer_gains(model: torch.nn.Module, texts: torch.Tensor | list[torch.Tensor], method: str | Method = AUTO,
                    budget: float = 0.25, prefix: float = 0.75, power: float = 0.5, **options) -> tuple[float, ...]:
    """How much of each layer's modelled distortion reaches the output, for one knapsack over all layers:
    ``compress(..., scope="global", layer_gains=fit_layer_gains(model, texts))``.

    The solver prices every layer in its own attention-output units, which say nothing of how much of the
    error survives to the logits; a global knapsack on raw units starves the layers that matter (on Gemma 3
    270M the ratio spans three orders of magnitude). For each calibration text (the first ``prefix`` fraction
    prefilled) this compresses at ``budget`` with ``method`` (per-layer budgets), then teacher-forces the rest
    through the full cache with one layer at a time replaced by its compressed layer. A layer's gain is its
    KL from the full cache over its modelled distortion, summed over texts, raised to ``power`` and normalised
    to geometric mean 1. The default 1/2 hedges a one-point estimate: on Gemma 3 it gave the lowest
    perplexity KL of any allocation in all three domains. Gains do not carry across kinds of text, though:
    fitted on prose and code, every global allocation doubled SmolLM2's KL on legal text
    (docs/experiments.md, "sliding-window lifetime").
    """
    texts = _check_texts(model, texts, prefix)
    if {"scope", "layer_gains"} & set(options):
        raise RDKVError("fit_layer_gains measures the per-layer allocation itself: do not pass scope or layer_gains")
    if not power > 0:
        raise RDKVError(f"power must be > 0, got {power!r}")
    kls = distortion = 0.0
    for ids in texts:
        n = int(ids.shape[1] * prefix)
        m = resolve(model, method, options)
        rec, full = _recorded(model, ids[:, :n], m.all_queries, plain=True)
        cache = compress(rec, budget, method=m)

        def through(c) -> torch.Tensor:
            return model(ids[:, n:], **cache_kwargs(c)).logits[0].float().log_softmax(-1)

        ref = through(copy.deepcopy(full))
        layer_kl = [kl(ref, through(swap_in(full, cache, [i]))) for i in range(len(cache.layers))]
        kls = kls + torch.tensor(layer_kl, dtype=torch.float64)
        distortion = distortion + torch.tensor(cache.layer_distortion, dtype=torch.float64)
    gains = (kls.clamp_min(0) / distortion.clamp_min(1e-30)).clamp_min(1e-12) ** power
    return tuple((gains / gains.log().mean().exp()).tolist())
