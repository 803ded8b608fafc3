import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from rdkv.solvers.mckp import exact, lagrangian

BITS = np.array([0, 2, 4, 8, 16])


def realistic(rng, units, rows=128):
    """Per-group quantisation menu: bytes = bits*rows/8 + fp16 scale, distortion ~ w*sigma*4^-b."""
    R = BITS * rows / 8 + np.where(BITS > 0, 2.0, 0.0)
    R = np.broadcast_to(R, (units, len(BITS))).copy()
    w = rng.lognormal(0, 1, (units, 1))
    sigma = rng.lognormal(0, 0.5, (units, 1))
    return w * sigma * 4.0 ** -BITS, R


def fully_random(rng, units, options=5):
    return rng.random((units, options)), rng.integers(0, 100, (units, options)).astype(float)


def objective(D, R, c):
    rows = np.arange(len(c))
    return D[rows, c].sum(), R[rows, c].sum()


@pytest.mark.parametrize("make", [realistic, fully_random])
@pytest.mark.parametrize("frac", [0.05, 0.2, 0.45, 0.8])
def test_close_to_exact(make, frac):
    rng = np.random.default_rng(0)
    D, R = make(rng, 300)
    lo, hi = R.min(1).sum(), R.max(1).sum()
    budget = lo + frac * (hi - lo)
    L, cost = objective(D, R, lagrangian(D, R, budget))
    E, e_cost = objective(D, R, exact(D, R, budget))
    print(f"{make.__name__} frac={frac}: gap {(L - E) / E:.2e}")
    assert cost <= budget and e_cost <= budget
    assert L - E <= 0.01 * E + 1e-12


@st.composite
def instances(draw):
    U = draw(st.integers(1, 8))
    O = draw(st.integers(1, 4))
    cells = st.tuples(st.integers(0, 400), st.integers(0, 20), st.booleans())
    grid = draw(st.lists(st.lists(cells, min_size=O, max_size=O), min_size=U, max_size=U))
    D = np.array([[d / 4 if keep else math.inf for d, _, keep in row] for row in grid])
    R = np.array([[float(r) for _, r, _ in row] for row in grid])
    D[np.arange(U), draw(st.lists(st.integers(0, O - 1), min_size=U, max_size=U))] = 1.0  # one legal option each
    lo = np.where(np.isfinite(D), R, np.inf).min(1).sum()
    return D, R, lo + draw(st.integers(0, 40)) / 2


@settings(max_examples=150, deadline=None)
@given(instances())
def test_property(inst):
    D, R, budget = inst
    results = []
    for solve in (lagrangian, exact):
        c = solve(D, R, budget)
        assert isinstance(c, np.ndarray) and c.dtype == np.int64 and c.shape == (len(D),)
        assert ((c >= 0) & (c < D.shape[1])).all()
        obj, cost = objective(D, R, c)
        assert np.isfinite(obj) and cost <= budget
        results.append(obj)
    assert results[1] <= results[0] + 1e-9


@pytest.mark.parametrize("solve", [lagrangian, exact])
def test_errors(solve):
    D, R = np.ones((3, 2)), np.array([[1.0, 2.0]] * 3)
    D[0, 0] = math.inf  # unit 0 must pay 2: minimum cost is 4
    with pytest.raises(ValueError, match=r"minimum achievable cost is 4 .*budget is 3"):
        solve(D, R, 3)
    bad = D.copy()
    bad[1, 1] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        solve(bad, R, 10)
    with pytest.raises(ValueError, match="same shape"):
        solve(D, R[:, :1], 10)
    with pytest.raises(ValueError, match="non-negative"):
        solve(D, -R, 10)
    with pytest.raises(ValueError, match="at least one option"):
        solve(D[:, :0], R[:, :0], 10)


@pytest.mark.parametrize("solve", [lagrangian, exact])
def test_types(solve):
    D, R = realistic(np.random.default_rng(1), 20)
    budget = R[:, 2].sum()
    c = solve(torch.tensor(D, dtype=torch.float32), torch.tensor(R, dtype=torch.float16), budget)
    assert isinstance(c, torch.Tensor) and c.dtype == torch.long and c.device == torch.device("cpu")
    assert np.array_equal(c.numpy(), solve(D, R, budget))


def test_model_sized():
    U = 30 * 3 * 8192
    D, R = realistic(np.random.default_rng(2), U)
    D, R = torch.tensor(D, dtype=torch.float32), torch.tensor(R, dtype=torch.float32)
    budget = R[:, 2].double().sum().item() * 1.1
    lagrangian(D[:1000], R[:1000], budget)  # warm up
    t = time.perf_counter()
    c = lagrangian(D, R, budget)
    dt = time.perf_counter() - t
    cost = R.double()[torch.arange(U), c].sum().item()
    print(f"model-sized ({U} units): {dt:.2f} s, cost {cost:.0f} / {budget:.0f}")
    assert cost <= budget and budget - cost < R.max().item()
    assert dt < 10
