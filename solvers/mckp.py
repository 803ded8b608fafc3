"""Multiple-choice knapsack (MCKP) solvers for per-unit option selection.

Each of U units must take exactly one of O options; option o of unit u costs R[u, o]
bytes and adds distortion D[u, o]. Minimise sum D subject to sum R <= budget.
D = +inf marks an option as disallowed.
"""

import math
from collections.abc import Callable

import numpy as np
import torch

Array = np.ndarray | torch.Tensor


def _prepare(D: Array, R: Array) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], Array]]:
    """Validate inputs; return D, R on the working device (float64, or float32 for instances large
    enough that memory matters -- sums are always taken in float64) and a converter for the result."""
    is_torch = isinstance(D, torch.Tensor) or isinstance(R, torch.Tensor)
    device = next((x.device for x in (D, R) if isinstance(x, torch.Tensor)), torch.device("cpu"))
    dtype = torch.float64 if D.shape[0] <= SWAP_UNITS else torch.float32
    D, R = (torch.as_tensor(x, dtype=dtype, device=device) for x in (D, R))
    if D.ndim != 2 or D.shape != R.shape:
        raise ValueError("D and R must be 2-D arrays of the same shape (units, options); "
                         f"got {tuple(D.shape)} and {tuple(R.shape)}")
    if D.numel() == 0:
        raise ValueError(f"need at least one unit and at least one option per unit; got shape {tuple(D.shape)}")
    if D.isnan().any() or R.isnan().any():
        raise ValueError("D and R must not contain NaN")
    if not R.isfinite().all() or (R < 0).any():
        raise ValueError("R must be finite and non-negative")
    if (D == -math.inf).any():
        raise ValueError("D must not be -inf (use +inf to disallow an option)")
    if not D.isfinite().any(1).all():
        raise ValueError("every unit needs at least one allowed option (finite D)")
    out = (lambda c: c) if is_torch else (lambda c: c.cpu().numpy().astype(np.int64))
    return D, R, out


class Infeasible(ValueError):
    """Not even the cheapest allowed option of every unit fits the budget: ``need`` bytes against ``budget``."""

    def __init__(self, message: str, need: float = math.nan, budget: float = math.nan):
        super().__init__(message)
        self.need, self.budget = need, budget


def _check_budget(D: torch.Tensor, R: torch.Tensor, budget: float) -> float:
    """Raise if not even the cheapest allowed option per unit fits the budget."""
    budget = float(budget)
    if math.isnan(budget):
        raise ValueError("budget must not be NaN")
    min_cost = torch.where(D.isfinite(), R, math.inf).amin(1).sum(dtype=torch.float64).item()
    if min_cost > budget:
        raise Infeasible(f"infeasible: the minimum achievable cost is {min_cost:.12g} bytes but the budget is "
                         f"{budget:.12g}; raise the budget to at least {min_cost:.12g}", min_cost, budget)
    return budget


SWAP_UNITS = 20_000  # instances this small also get a swap search (large ones have negligible slack)
SWAP_TRIES = 24


def at(X: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return X.gather(1, c[:, None])


def cost(R: torch.Tensor, c: torch.Tensor) -> float:
    return at(R, c).sum(dtype=torch.float64).item()


def moves(D: torch.Tensor, R: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distortion saved and bytes added by moving each unit from c to each option."""
    return at(D, c) - D, R - at(R, c)


def fill_slack(D: torch.Tensor, R: torch.Tensor, choice: torch.Tensor, budget: float) -> torch.Tensor:
    """Spend the slack: per unit take the upgrade (lower D, higher R, fits) with the best distortion
    saved per byte, and apply the best-ranked prefix that fits; repeat a few rounds."""
    for _ in range(8):
        left = budget - cost(R, choice)
        dD, dR = moves(D, R, choice)
        ok = (dD > 0) & (dR > 0) & (dR <= left)
        if not ok.any():
            break
        gain, best = torch.where(ok, dD / dR, -math.inf).max(1)
        units = ok.any(1).nonzero().squeeze(1)
        units = units[gain[units].argsort(descending=True)]
        step = dR[units, best[units]]
        take = units[step.cumsum(0) <= left]
        new = choice.clone()
        new[take] = best[take]
        if cost(R, new) > budget:  # float rounding of the cumsum vs. the sum; stay feasible
            break
        choice = new
    return choice


def _swap(D: torch.Tensor, R: torch.Tensor, choice: torch.Tensor, budget: float) -> torch.Tensor:
    """Local search the relaxation cannot do: pin one unit to another option, re-solve the rest, and
    keep the result if it is better. Matters when a few options are large next to the slack (a K
    block of many tokens against single V rows); candidates are the pinned moves with the best
    distortion saved per byte (upgrades) and the least lost per byte (downgrades)."""
    best_d = at(D, choice).sum().item()
    dD, dR = moves(D, R, choice)
    allowed = D.isfinite() & (dR != 0)
    up = torch.where(allowed & (dR > 0) & (dD > 0), dD / dR, -math.inf).flatten()
    down = torch.where(allowed & (dR < 0), dD / dR, math.inf).flatten()
    tries = torch.cat([up.argsort(descending=True)[:SWAP_TRIES], down.argsort()[:SWAP_TRIES]])
    step = torch.where(allowed, dR.abs(), math.inf).amin(1)  # each unit's smallest move in bytes
    for flat in tries.tolist():
        u, o = divmod(flat, D.shape[1])
        if not bool(allowed[u, o]):
            continue
        # re-solve with u pinned, once freely and once with the units as lumpy as this move frozen,
        # so many small units (not one other big one) can pay for it
        for freeze in (False, True):
            pinned = D.clone()
            lumpy = (step >= dR[u, o].abs() / 4) if freeze else torch.zeros_like(step, dtype=torch.bool)
            lumpy[u] = True
            keep = choice.clone()
            keep[u] = o
            mask = torch.zeros_like(D, dtype=torch.bool)
            mask[lumpy] = True
            mask[lumpy, keep[lumpy]] = False
            pinned[mask] = math.inf
            if torch.where(pinned.isfinite(), R, math.inf).amin(1).sum().item() > budget:
                continue
            trial = _solve(pinned, R, budget)
            d = at(D, trial).sum().item()
            if d < best_d - 1e-12 * abs(best_d):
                best_d, choice = d, trial
    return choice


def _solve(D: torch.Tensor, R: torch.Tensor, budget: float) -> torch.Tensor:
    """Bisect the multiplier for the best choice that fits, then spend the slack greedily."""
    choice = D.argmin(1)  # lam = 0
    if cost(R, choice) > budget:
        # Exact bracket: the first unit leaves lam=0's choice at lo, the last one reaches
        # its cheapest option (lowest D among the cheapest allowed) at hi.
        dD, dR = moves(D, R, choice)
        lo = torch.where(dR < 0, dD / dR, math.inf).amin().item() / 2
        cheap = torch.where(D.isfinite(), R, math.inf)
        choice = torch.where(cheap == cheap.amin(1, keepdim=True), D, math.inf).argmin(1)
        dD, dR = moves(D, R, choice)
        hi = torch.where((dD > 0) & (dR > 0), dD / dR, 0.0).amax().item() * 2
        for _ in range(60):  # bisect lam in log space; choice keeps the best that fits
            if hi <= lo * (1 + 1e-6):  # slack left by a coarser lam is what the greedy fills
                break
            mid = math.sqrt(lo * hi)
            c = torch.add(D, R, alpha=mid).argmin(1)
            if cost(R, c) <= budget:
                hi, choice = mid, c
            else:
                lo = mid

    return fill_slack(D, R, choice, budget)


def lagrangian(D: Array, R: Array, budget: float, swap: bool = True) -> Array:
    """Fast near-optimal MCKP: bisect the Lagrange multiplier, then greedily spend the slack.

    For a multiplier lam every unit independently picks argmin D + lam * R, which is optimal
    for its own cost; the smallest lam whose choice fits the budget leaves little slack, which
    upgrades ranked by distortion saved per byte then fill. Fully vectorised over units (runs on
    the tensors' device), so it scales to millions of units. Never exceeds the budget. ``swap=False``
    skips the local search small instances otherwise get (for intermediate solves).

    Returns the chosen option per unit: a torch.long tensor on the input device for torch
    input, a numpy int64 array otherwise.
    """
    D, R, out = _prepare(D, R)
    budget = _check_budget(D, R, budget)
    # Options sorted by cost, so argmin's first-index rule breaks ties toward the cheaper one.
    perm = R.argsort(dim=1, stable=True) if (R.diff(dim=1) < 0).any() else None
    if perm is not None:
        D, R = D.gather(1, perm), R.gather(1, perm)

    choice = _solve(D, R, budget)
    if swap and len(D) <= SWAP_UNITS:
        choice = _swap(D, R, choice, budget)
    return out(choice if perm is None else at(perm, choice).squeeze(1))


def exact(D: Array, R: Array, budget: float) -> Array:
    """Exact MCKP via a binary MILP (scipy/HiGHS); the reference for testing `lagrangian`.

    Variables x[u, o] in {0, 1}, one per unit, with the byte budget as a single row.
    Meant for up to a few hundred units. Same conventions and errors as `lagrangian`.
    """
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    D, R, out = _prepare(D, R)
    budget = _check_budget(D, R, budget)
    d, r = D.cpu().numpy(), R.cpu().numpy()
    U, O = d.shape
    allowed = np.isfinite(d).ravel()
    top = np.abs(d[np.isfinite(d)]).max()
    d = d * (1e6 / top) if top > 0 else d  # HiGHS tolerances are absolute: work at a sane scale
    A = sparse.vstack([sparse.kron(sparse.eye(U), np.ones((1, O))), r.reshape(1, -1)]).tocsr()
    res = milp(np.where(allowed, d.ravel(), 0.0),
               integrality=np.ones(U * O),
               bounds=Bounds(0, allowed.astype(float)),
               constraints=LinearConstraint(A, np.r_[np.ones(U), -np.inf], np.r_[np.ones(U), budget]),
               options={"mip_rel_gap": 0.0})
    if res.x is None:
        raise RuntimeError(f"MILP solver failed: {res.message}")
    return out(torch.from_numpy(res.x.reshape(U, O).argmax(1)).to(D.device))
