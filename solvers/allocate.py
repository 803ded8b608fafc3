"""RDKV's allocation: V token widths, then K block widths for the kept tokens, under one byte budget.

Phase 1 solves one multiple-choice knapsack over every V token and every K block of a sequence (all
layers and heads together for ``scope="global"``, which yields adaptive per-head budgets), with one
multiplier so marginal returns are equal across K and V. A K block's bytes depend on how many tokens
its stream keeps, which phase 1 is choosing: the first pass charges K as if every token were kept, and
each further pass (``passes``) re-solves with K charged for the tokens the previous pass kept, so that
K is not priced for tokens that will be evicted (with ``evict_to="kept"`` tables, each pass also re-prices
eviction from the mean value of what the previous pass kept). Phase 2 re-solves the K blocks for the tokens the last
pass kept, spending whatever is left. It always fits: width 0 (channel means) costs the same for any
number of tokens, so phase 1's V choice leaves room for it; a layer that holds its window's end
(``LayerTables.ends``) may not drop its K blocks below 2 bits (``k_least``), and each token phase 1 keeps there is
charged its K row at 2 bits, which bounds that row's cost for any number of tokens. Phase 3 spends what is still
left on V upgrades, with those K widths fixed and each newly kept token charged its K row too. Last, each stream's
V classes are made whole pages (:func:`fit_pages`), so what the solver charged is what the cache holds.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from .mckp import Infeasible, cost, fill_slack, lagrangian


def _solve_sequence(tables: list, b: int, budget: float, passes: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Widths (as option indices) for sequence ``b`` over the given layers within ``budget`` bytes, in whole pages.

    The linear solver's choice is rounded to whole pages (:func:`fit_pages`), which may leave bytes unspent or
    force tokens down a class. So the solver also runs with what rounding left unspent added (if 1% of the budget
    or more), and, where rounding evicted tokens the solver kept, with 2% and 5% less (a choice with a few more
    tokens at lower widths may round with fewer evicted); the rounded choice of least modelled distortion (V and
    K) is kept. Where every one evicts a protected token (a stream whose last page cannot be filled, with no byte
    left to leave it partly filled), the solver runs with less until one does not (bisecting down to the least it
    can allocate, up to 8 times)."""
    fixed = sum(t.fixed for t in tables)
    budget = math.floor(budget * (1 + 1e-12))  # whole bytes: budgets that differ in their last bits solve alike
    best, evicted = None, None

    def attempt(target: float) -> float | None:
        """Solve for ``target``, round, keep the better; the bytes left unspent (None: nothing fits)."""
        nonlocal best, evicted
        try:
            dv, v_opt, k_opt = _solve_linear(tables, b, target, passes)
        except Infeasible:
            if best is None and target >= budget:
                raise
            return None
        fit = fit_pages(tables, b, budget, dv, v_opt, k_opt)
        if fit is None:
            return None
        if evicted is None:
            evicted = any(bool(((a > 0) & (r == 0)).any()) for a, r in zip(v_opt, fit[0]))
        dist = fit[2] + sum(float(t.dk[b].gather(-1, k.unsqueeze(-1)).sum()) for t, k in zip(tables, k_opt))
        rank = (True, -dist) if math.isfinite(dist) else (False, fit[1])
        if best is None or rank > best[0]:
            best = (rank, fit[0], k_opt)
        return budget - fit[1]

    slack = attempt(budget)
    if slack and slack >= 0.01 * (budget - fixed):
        attempt(budget + slack)
    if evicted:  # rounding down evicted tokens the solver kept: try a little less, more of them at lower widths
        for less in (0.02, 0.05):
            attempt(budget - less * (budget - fixed))
    lo, hi = fixed, budget - 0.05 * (budget - fixed)
    for _ in range(8):
        if best[0][0]:
            break
        target = (lo + hi) / 2
        if attempt(target) is None:
            lo = target
        else:
            hi = target
    return best[1], best[2]


def _solve_linear(tables: list, b: int, budget: float, passes: int) -> tuple[list, list, list]:
    """Phases 1-3 at linear prices: the final V distortion tables (flat over present tokens) and the widths."""
    fixed = sum(t.fixed for t in tables)
    budget -= fixed
    dev = tables[0].dv.device
    # a protected token may not be evicted: its eviction is priced out of reach
    dv = [t.dv[b].masked_fill(_eviction_of(t.protect[b], t.dv.shape[-1]), float("inf"))[t.present[b]] for t in tables]
    rv = [t.rv.to(dev).expand(len(d), -1) for t, d in zip(tables, dv)]
    dk = [t.dk[b].flatten(0, 1) for t in tables]
    # K blocks held at k_least or more: each kept token (and each stream once) is charged its K row at k_least
    # up front, so that phase 2 can always afford it, and K is priced for what it costs above that
    least = [_k_least_bound(t) for t in tables]
    rv_least = [r + per * (torch.arange(r.shape[1], device=dev) > 0) for r, (_, per) in zip(rv, least)]
    dk = [d.index_fill(1, torch.arange(t.k_least, device=dev), float("inf")) for t, d in zip(tables, dk)]
    budget_least = budget - sum(one * t.dk.shape[1] for t, (one, _) in zip(tables, least))

    def k_rates(t, n: torch.Tensor, bound: tuple[float, float]) -> torch.Tensor:
        r = t.rk(n)
        if t.k_least:
            r = (r - (bound[0] + n.double().unsqueeze(-1) * bound[1]) / t.dk.shape[2]).clamp_min(0)
        return r.repeat_interleave(t.dk.shape[2], 0)

    n_kept = [t.present[b].sum(-1) for t in tables]  # [H] tokens per stream; first pass: all of them
    nv = sum(len(d) for d in dv)
    for p in range(passes):
        # never below the cost of width 0 (2 bytes per channel mean) where phase 2 may fall back on it
        rk = [k_rates(t, n, q).clamp_min(0 if t.k_least else float(t.rk(torch.zeros(()))[0]))
              for t, n, q in zip(tables, n_kept, least)]
        D = torch.cat([torch.cat(dv), torch.cat(dk)]).double()
        R = torch.cat([torch.cat(rv_least), torch.cat(rk)])
        # no swap search here: on SmolLM2's 1k probe it changed the total modelled distortion by -1.7..+4.6%
        # at 21-70x the time (scripts/bench_allocation.py; 30 per-layer instances x passes x up to 96 re-solves)
        try:
            choice = lagrangian(D, R, budget_least, swap=False)
        except Infeasible as e:  # stated against the whole budget, so that a caller can scale it
            raise Infeasible(str(e), e.need + budget - budget_least + fixed, budget + fixed) from e
        v_choice = choice[:nv].split([len(d) for d in dv])
        v_widths = _widths(tables, b, v_choice)
        n_kept = [(full > 0).sum(-1) for full in v_widths]
        if p + 1 < passes:
            dv = [_reprice(t, b, d, full) for t, d, full in zip(tables, dv, v_widths)]
    spent_v = sum(float(r.gather(1, c.unsqueeze(1)).sum()) for r, c in zip(rv_least, v_choice))
    rk2 = torch.cat([k_rates(t, n, q) for t, n, q in zip(tables, n_kept, least)])
    k_choice = lagrangian(torch.cat(dk).double(), rk2, budget_least - spent_v, swap=False)
    k_widths = [c.view(t.dk.shape[1], t.dk.shape[2]) for t, c in zip(tables, k_choice.split([len(d) for d in dk]))]
    return dv, _refill_v(tables, b, budget, dv, rv, v_choice, k_widths), k_widths


ENDS_SHARE = 0.5  # the most of a sequence's budget the window ends (LayerTables.ends) may take (docs/experiments.md, 2026-12-08)


def _held_ends(tables: list, b: int, budget: float) -> list:
    """The tables as sequence ``b`` is solved: the layers' window ends (:attr:`rdkv.distortion.LayerTables.ends`) held
    where the least those layers pack in (:func:`_least`) is at most :data:`ENDS_SHARE` of ``budget``, else left to
    the solver like any other token, K channel means allowed: where the ends would take most of the budget, the
    layers that read the context have too little left (Gemma 3 at 4k and 2.5%: the full cache's answers all lost)."""
    held = [t for t in tables if t.ends is not None]
    if not held or sum(_least(t, b) for t in held) <= ENDS_SHARE * budget:
        return tables
    return [t if t.ends is None else replace(t, protect=t.protect & ~t.ends, ends=None) for t in tables]


def _k_least_bound(t) -> tuple[float, float]:
    """A stream's bytes for its K blocks at option ``t.k_least``, bounded as ``one + n * per_token`` for ``n`` kept
    tokens (the bound :func:`_refill_v` uses): ``(one, per_token)``; ``(0, 0)`` where channel means are allowed."""
    if not t.k_least:
        return 0.0, 0.0
    at = t.rk(torch.tensor([1.0, float(t.page), 0.0]))[:, t.k_least] * t.dk.shape[2]  # every block at 1, a page, 0 tokens
    per_token = float(at[1] - at[2]) / t.page
    return float(at[0]) - per_token, per_token


def _eviction_of(tokens: torch.Tensor, options: int) -> torch.Tensor:
    """[H, T] token mask -> [H, T, options] mask of those tokens' eviction option (option 0)."""
    return torch.nn.functional.pad(tokens.unsqueeze(-1), (0, options - 1))


def _widths(tables: list, b: int, v_choice) -> list[torch.Tensor]:
    """Per-layer option index of every V token [H, T] (0 where not present) from the flat choice."""
    out = []
    for t, c in zip(tables, v_choice):
        full = torch.zeros(t.present[b].shape, dtype=torch.long, device=c.device)
        full[t.present[b]] = c
        out.append(full)
    return out


def _refill_v(tables: list, b: int, budget: float, dv: list, rv: list, v_choice, k_widths: list) -> list[torch.Tensor]:
    """Phase 3: spend what phases 1-2 left on V upgrades, with the K widths fixed and each newly kept
    token charged its K row too.

    The passes price K for the previous pass's kept count, which can swing from pass to pass (few kept,
    so K is cheap, so many are kept, so K is dear); the last V choice can then leave bytes K cannot use
    (every block at 16 bits). A stream's K bytes are bounded as fixed + n * per_token, with
    per_token = (rk(g) - rk(0)) / g (codes plus group metadata spread over a group) and
    fixed = rk(1) - per_token, which holds for every n >= 0 since ceil(n / g) <= (n + g - 1) / g; so the
    result always fits. Only upgrades: re-solving V from scratch under these prices evicts more, which
    the model prices as cheaper than it is for questions the prefill did not ask (SmolLM2 4k agnostic
    probe at 10%: KL 0.19 -> 0.37; prose perplexity at 10%: KL 0.13 -> 0.19).
    """
    g = tables[0].spec.k_group
    fixed, rates = 0.0, []
    for t, kw, r in zip(tables, k_widths, rv):
        one, grp, zero = (t.rk(torch.full(kw.shape[:1], n, device=kw.device)).gather(1, kw) for n in (1, g, 0))
        per_token = (grp - zero) / g  # [H, nb]
        fixed += float((one - per_token).sum())
        head = torch.nonzero(t.present[b], as_tuple=True)[0]  # the stream of every present token
        kept = (torch.arange(r.shape[1], device=r.device) > 0).double()  # width 0 stores no K row
        rates.append(r + per_token.sum(1)[head].unsqueeze(1) * kept)
    D, R, choice = torch.cat(dv).double(), torch.cat(rates), torch.cat(v_choice)
    if cost(R, choice) <= budget - fixed:
        choice = fill_slack(D, R, choice, budget - fixed)
    return _widths(tables, b, choice.split([len(d) for d in dv]))


def _reprice(t, b: int, dv: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """With tables that re-price eviction from what a pass kept (``t.reprice``), raise each token's
    eviction cost to that; costs only rise, so passes cannot oscillate."""
    if t.reprice is None:
        return dv
    dv = dv.clone()
    dv[:, 0] = torch.maximum(dv[:, 0], t.reprice(b, widths > 0)[t.present[b]].to(dv.dtype))
    return dv


def allocate(tables: list, budgets: list[float], scope: str = "global", passes: int = 3,
             split: str = "bytes", floor: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Option indices per V token [B, H, T] and per K block [B, H, nb], one entry per layer.

    ``budgets[b]`` is sequence b's byte budget; ``scope="layer"`` splits it across layers
    (:func:`layer_budgets`, by ``split`` and ``floor``) instead of solving all layers together.
    """
    if scope not in ("global", "layer"):
        raise ValueError(f"unknown allocation scope {scope!r}; use 'global' or 'layer'")
    per_seq = []
    for b, budget in enumerate(budgets):
        tables_b = _held_ends(tables, b, budget)
        if scope == "global":
            per_seq.append(_solve_sequence(tables_b, b, budget, passes))
            continue
        parts = [_solve_sequence([t], b, part, passes)
                 for t, part in zip(tables_b, layer_budgets(tables_b, b, budget, split, floor))]
        per_seq.append(([p[0][0] for p in parts], [p[1][0] for p in parts]))
    v = [torch.stack([s[0][i] for s in per_seq]) for i in range(len(tables))]
    k = [torch.stack([s[1][i] for s in per_seq]) for i in range(len(tables))]
    return v, k


SPLITS = ("bytes", "peak")
PEAK_WIDTH = 2  # split="peak" ranks as many tokens as the budget buys at this option (4 bits)


def layer_budgets(tables: list, b: int, budget: float, split: str = "bytes", floor: float = 0.0) -> list[float]:
    """Sequence ``b``'s ``budget`` split across layers. Each layer gets at least the least it can be packed in
    (:func:`_least`) where the budget holds every layer's. ``"bytes"``: in proportion to each layer's fp16 bytes,
    the layers whose part would fall below their least raised to it and the others' parts lowered in proportion
    (it binds where a layer protects many tokens for its bytes: ``window_end`` on a sliding-window layer).
    ``"peak"``: each layer gets its least plus, of the rest, its share of one top-k over the evictable
    tokens of every layer and head ranked by :attr:`rdkv.distortion.LayerTables.peak` (the largest attention a
    reconstruction query paid each), k being the tokens the rest buys at 4 bits (a V row and as much K each).
    That is KVzip's ranking (Kim et al. 2025: one top-k over all layers and heads): the layers that copy from the
    context get the bytes, where an even split gives each layer as much (docs/experiments.md, 2026-12-07,
    "split='peak'"). ``floor`` (with ``"peak"``) hands that share of the rest out by fp16 bytes instead, so no
    layer gets less than ``floor`` x its part of it under ``"bytes"``: a layer the pass's queries barely read
    may be the one a later question reads (docs/experiments.md, 2026-12-07, "Gemma 3 at 16k, and a floor under
    the peak split": measured, it loses at 10%)."""
    if split not in SPLITS:
        raise ValueError(f"unknown layer split {split!r}; use one of {SPLITS}")
    fp16 = torch.tensor([float(t.present[b].sum()) * float(t.rv[-1]) for t in tables], dtype=torch.float64)
    least = torch.tensor([_least(t, b) for t in tables], dtype=torch.float64)
    if split == "bytes":
        parts, low = budget * fp16 / fp16.sum(), torch.zeros(len(tables), dtype=torch.bool)
        if float(least.sum()) > budget:  # no split holds every layer's least: the solver says so
            return parts.tolist()
        while (raise_ := (parts < least) & ~low).any():  # each round fixes at least one more layer at its least
            low |= raise_
            parts = torch.where(low, least, (budget - least[low].sum()) * fp16 / fp16[~low].sum())
        return parts.tolist()
    if any(t.peak is None for t in tables):
        raise ValueError('split="peak" ranks tokens by the reconstruction pass\'s peaks: use weights="reconstruct"')
    free = [t.present[b] & ~t.protect[b] for t in tables]
    scores = torch.cat([t.peak[b][f] for t, f in zip(tables, free)])
    layer = torch.cat([torch.full((int(f.sum()),), i) for i, f in enumerate(free)])
    per_token = 2 * max(float(t.rv[PEAK_WIDTH]) for t in tables)
    k = min(len(scores), int(max(0.0, budget - float(least.sum())) / per_token))
    top = torch.bincount(layer[scores.topk(k).indices], minlength=len(tables)).double()
    share = (1 - floor) * top / top.sum() + floor * fp16 / fp16.sum() if k else fp16 / fp16.sum()
    return (least + (budget - least.sum()) * share).tolist()


def _least(t, b: int) -> float:
    """The bytes a layer of sequence ``b`` is packed in at the least: its protected tokens and a page more per
    stream at 2 bits, their K rows at ``t.k_least`` (:func:`_k_least_bound`; at channel means, none), and its
    ``fixed`` bytes."""
    n = t.protect[b].sum(-1).double() + t.page  # [H]
    one, per_token = _k_least_bound(t)
    k = one + n * per_token if t.k_least else t.rk(n)[:, 0] * t.dk.shape[2]
    return t.fixed + float((n * t.rv[1] + k).sum())


def _top(score: torch.Tensor, need: torch.Tensor, most: int) -> torch.Tensor:
    """[H, T] mask of the ``need[h]`` (< ``most``) highest finite scores of each row (fewer where fewer are finite)."""
    val, idx = score.topk(min(most, score.shape[-1]), -1)
    pick = (torch.arange(val.shape[-1], device=score.device) < need.unsqueeze(-1)) & (val > -math.inf)
    return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, pick)


def _round_class(opt: torch.Tensor, dv: torch.Tensor, present: torch.Tensor, page: int, c: int,
                 up: torch.Tensor) -> torch.Tensor:
    """Option indices [H, T] with V option ``c`` a whole number of pages: in the streams ``up`` [H], its last page
    filled with the tokens below it that gain the most (evicted ones included; too few leave it partly filled),
    in the others the last page's tokens that lose the least dropped one option (from 2 bits: evicted; protected
    tokens last, at an infinite distortion)."""
    r = (opt == c).sum(-1) % page
    gain = dv.gather(-1, opt.unsqueeze(-1)).squeeze(-1) - dv[..., c]  # distortion saved by moving up to c
    gain = gain.masked_fill(~present | (opt >= c) | gain.isnan(), -math.inf)
    lose = dv[..., c] - dv[..., c - 1]  # minus the distortion added by dropping from c
    lose = lose.nan_to_num(-math.inf, neginf=-torch.finfo(lose.dtype).max).masked_fill(opt != c, -math.inf)
    pick = _top(torch.where(up.unsqueeze(-1), gain, lose), torch.where(up, (page - r) % page, r), page)
    return torch.where(pick, torch.where(up, c, c - 1).unsqueeze(-1), opt)


def _round_pages(opt: torch.Tensor, dv: torch.Tensor, present: torch.Tensor, page: int,
                 ways: torch.Tensor) -> torch.Tensor:
    """:func:`_round_class` for every V class, 16 bits first; bit ``c - 1`` of ``ways`` [H] sends option c up."""
    for c in range(dv.shape[-1] - 1, 0, -1):
        opt = _round_class(opt, dv, present, page, c, (ways >> (c - 1)) & 1 == 1)
    return opt


def page_bytes(t, opt: torch.Tensor, k_opt: torch.Tensor) -> torch.Tensor:
    """Bytes each stream of one sequence's layer holds [H] (float64) for V options [H, T] and K options [H, nb]:
    every started page of each V class at its full size (its slots' V rows and positions, its K codes, one K scale
    and zero per packed channel), plus the width-0 channel means; the layer's ``fixed`` bytes not included."""
    n = torch.stack([(opt == c).sum(-1) for c in range(1, len(t.rv))], -1)  # [H, 4]
    P = t.page
    at = t.rk(torch.tensor([0.0, float(P)], device=k_opt.device))  # [2, 5]: a block's bytes at 0 and P tokens
    k_fixed = at[0][k_opt].sum(-1)
    k_page = (at[1] - at[0])[k_opt].sum(-1)
    return k_fixed + (torch.ceil(n / P) * (P * t.rv[1:].to(k_opt.device) + k_page.unsqueeze(-1))).sum(-1)


PROTECTED = 1e30  # the distortion of a rounding that evicts a protected token, in the knapsack over roundings


def fit_pages(tables: list, b: int, budget: float, dv: list, v_opt: list,
              k_opt: list) -> tuple[list[torch.Tensor], float, float] | None:
    """Round sequence ``b``'s V choice to whole pages within ``budget`` bytes (all of them, fixed included): the
    options per layer, the bytes they take and their V distortion (infinite where a protected token is evicted),
    or None where no rounding fits (a choice made for a larger budget).

    The solver prices a token's slot and a page's K scales linearly (:meth:`LayerTables.rk` at one group per page),
    which a stored page matches only when it is full. Each stream rounds each of its four V classes up (filling
    the page the solver started from below) or down (its last page's tokens drop a class): of the 16 ways, a
    multiple-choice knapsack over every stream picks one per stream for the least distortion that fits. Rounding
    every class down only lowers widths, so the solver's own choice always has a way that fits."""
    rows, units = [], []  # per layer: distortion and bytes of each way [H, 16]
    for t, d, opt, kw in zip(tables, dv, v_opt, k_opt):
        present = t.present[b]
        full = torch.full((*present.shape, d.shape[-1]), math.inf, dtype=d.dtype, device=d.device)
        full[present] = d
        ways = {0: opt}  # the ways' common prefixes share their roundings: 30 class steps for 16 ways
        for c in range(d.shape[-1] - 1, 0, -1):
            ways = {w | up << (c - 1): _round_class(o, full, present, t.page, c, torch.full(opt.shape[:1], bool(up),
                                                                                               device=opt.device))
                    for w, o in ways.items() for up in (0, 1)}
        dist, cost = [], []
        for w in range(len(ways)):
            o = ways[w]
            dist.append(full.gather(-1, o.unsqueeze(-1)).squeeze(-1).masked_fill(~present, 0).sum(-1))
            cost.append(page_bytes(t, o, kw))
        dist = torch.stack(dist, 1).double()
        rows.append((dist.masked_fill(dist.isnan(), math.inf), torch.stack(cost, 1)))
        units.append((opt, full, present, t.page))
    fixed = sum(t.fixed for t in tables)
    try:
        dist = torch.cat([r[0] for r in rows]).cpu()
        # evicting a protected token is allowed here, at a price above any other way's
        choice = lagrangian(dist.clamp(max=PROTECTED), torch.cat([r[1] for r in rows]).cpu(), budget - fixed, swap=False)
    except Infeasible:
        return None
    out, spent, dist, i = [], fixed, 0.0, 0
    for (opt, full, present, page), (d, cost) in zip(units, rows):
        H = opt.shape[0]
        w = choice[i:i + H]
        spent += float(cost.cpu().gather(1, w.unsqueeze(1)).sum())
        dist += float(d.cpu().gather(1, w.unsqueeze(1)).sum())
        out.append(_round_pages(opt, full, present, page, w.to(opt.device)))
        i += H
    return out, spent, dist
