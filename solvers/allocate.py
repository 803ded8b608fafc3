"""RDKV's allocation: V token widths, then K block widths for the kept tokens, under one byte budget.

Phase 1 solves one multiple-choice knapsack over every V token and every K block of a sequence (all
layers and heads together for ``scope="global"``, which yields adaptive per-head budgets), with one
multiplier so marginal returns are equal across K and V. A K block's bytes depend on how many tokens
its stream keeps, which phase 1 is choosing: the first pass charges K as if every token were kept, and
each further pass (``passes``) re-solves with K charged for the tokens the previous pass kept, so that
K is not priced for tokens that will be evicted (with ``evict_to="kept"`` tables, each pass also re-prices
eviction from the mean value of what the previous pass kept). Phase 2 re-solves the K blocks for the tokens the last
pass kept, spending whatever is left. It always fits: width 0 (channel means) costs the same for any
number of tokens, so phase 1's V choice leaves room for it. Phase 3 spends what is still left on V
upgrades, with those K widths fixed and each newly kept token charged its K row too.
"""
from __future__ import annotations

import torch

from .mckp import Infeasible, cost, fill_slack, lagrangian


def _solve_sequence(tables: list, b: int, budget: float, passes: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Widths (as option indices) for sequence ``b`` over the given layers within ``budget`` bytes."""
    fixed = sum(t.fixed for t in tables)
    budget -= fixed
    dev = tables[0].dv.device
    # a protected token may not be evicted: its eviction is priced out of reach
    dv = [t.dv[b].masked_fill(_eviction_of(t.protect[b], t.dv.shape[-1]), float("inf"))[t.present[b]] for t in tables]
    rv = [t.rv.to(dev).expand(len(d), -1) for t, d in zip(tables, dv)]
    dk = [t.dk[b].flatten(0, 1) for t in tables]
    n_kept = [t.present[b].sum(-1) for t in tables]  # [H] tokens per stream; first pass: all of them
    nv = sum(len(d) for d in dv)
    for p in range(passes):
        # never below the cost of width 0 (2 bytes per channel mean): phase 2 must always afford it
        rk = [t.rk(n).clamp_min(float(t.rk(torch.zeros(()))[0])).repeat_interleave(t.dk.shape[2], 0) for t, n in zip(tables, n_kept)]
        D = torch.cat([torch.cat(dv), torch.cat(dk)]).double()
        R = torch.cat([torch.cat(rv), torch.cat(rk)])
        # no swap search here: on SmolLM2's 1k probe it changed the total modelled distortion by -1.7..+4.6%
        # at 21-70x the time (scripts/bench_allocation.py; 30 per-layer instances x passes x up to 96 re-solves)
        try:
            choice = lagrangian(D, R, budget, swap=False)
        except Infeasible as e:  # stated against the whole budget, so that a caller can scale it
            raise Infeasible(str(e), e.need + fixed, e.budget + fixed) from e
        v_choice = choice[:nv].split([len(d) for d in dv])
        v_widths = _widths(tables, b, v_choice)
        n_kept = [(full > 0).sum(-1) for full in v_widths]
        if p + 1 < passes:
            dv = [_reprice(t, b, d, full) for t, d, full in zip(tables, dv, v_widths)]
    spent_v = sum(float(r.gather(1, c.unsqueeze(1)).sum()) for r, c in zip(rv, v_choice))
    rk2 = torch.cat([t.rk(n).repeat_interleave(t.dk.shape[2], 0) for t, n in zip(tables, n_kept)])
    k_choice = lagrangian(torch.cat(dk).double(), rk2, budget - spent_v, swap=False)
    k_widths = [c.view(t.dk.shape[1], t.dk.shape[2]) for t, c in zip(tables, k_choice.split([len(d) for d in dk]))]
    return _refill_v(tables, b, budget, dv, rv, v_choice, k_widths), k_widths


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


def allocate(tables: list, budgets: list[float], scope: str = "global",
             passes: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Option indices per V token [B, H, T] and per K block [B, H, nb], one entry per layer.

    ``budgets[b]`` is sequence b's byte budget; ``scope="layer"`` splits it across layers in proportion
    to each layer's fp16 bytes instead of solving all layers together.
    """
    if scope not in ("global", "layer"):
        raise ValueError(f"unknown allocation scope {scope!r}; use 'global' or 'layer'")
    per_seq = []
    for b, budget in enumerate(budgets):
        if scope == "global":
            per_seq.append(_solve_sequence(tables, b, budget, passes))
            continue
        fp16 = torch.tensor([float(t.present[b].sum()) * t.rv[-1].item() for t in tables])
        share = fp16 / fp16.sum()
        parts = [_solve_sequence([t], b, budget * float(f), passes) for t, f in zip(tables, share)]
        per_seq.append(([p[0][0] for p in parts], [p[1][0] for p in parts]))
    v = [torch.stack([s[0][i] for s in per_seq]) for i in range(len(tables))]
    k = [torch.stack([s[1][i] for s in per_seq]) for i in range(len(tables))]
    return v, k
