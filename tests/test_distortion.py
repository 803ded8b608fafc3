"""Eviction pricing (rdkv.distortion evict_to): a dominant group of tokens must not look free to evict."""
import pytest
import torch

import rdkv
from conftest import SMALL, tiny_llama
from rdkv.attention import AttentionSums
from rdkv.distortion import layer_tables
from rdkv.solvers.allocate import _reprice, allocate
from rdkv.trizone import PackSpec

SPEC = PackSpec(**SMALL)
T, D, GROUP = 64, 32, 4


def sink_head(seed: int = 0):
    """One head where 4 tokens (positions 8..11) share one value and take 90% of the window mass (14x the
    mean token weight, so they count as heavy)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, 1, T, D, generator=g)
    v[..., 8:12, :] = 0.05 * torch.randn(D, generator=g)  # the sinks' common, small value
    mass = torch.full((1, 1, T), 0.1 * 64 / (T - GROUP))
    mass[..., 8:12] = 0.9 * 64 / GROUP  # 64 window queries
    sums = AttentionSums(mass, mass.square() / 64, torch.ones(1, 1, D) * 64, torch.tensor([64.0]))
    k = torch.randn(1, 1, T, D, generator=g)
    return k, v, sums


def true_error(v, mass, evicted):
    """Output shift of the window queries' mean attention when ``evicted`` tokens are dropped."""
    p = mass[0, 0] / mass[0, 0].sum()
    out = p @ v[0, 0]
    kept = p * ~evicted
    return float((kept @ v[0, 0] / kept.sum() - out).square().sum())


@pytest.mark.parametrize("evict_to", ["output", "heavy", "mean", "max", "kept"])
def test_a_dominant_group_is_priced_by_where_its_mass_goes(evict_to):
    k, v, sums = sink_head()
    present = torch.ones(1, 1, T, dtype=torch.bool)
    t = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to=evict_to)
    group, light = t.dv[0, 0, 8:12, 0].sum(), t.dv[0, 0, 12:16, 0].sum()
    group_err = true_error(v, sums.mass, torch.arange(T).ge(8) & torch.arange(T).lt(12))
    light_err = true_error(v, sums.mass, torch.arange(T).ge(12) & torch.arange(T).lt(16))
    true_ratio = group_err / light_err
    assert true_ratio > 500  # dropping the group moves the output; 4 light tokens barely do (measured 834)
    if evict_to in ("output", "kept"):  # measured from o, which is ~ the group's own value: looks cheap
        assert group / light < 0.01 * true_ratio  # measured 2
    else:  # heavy/mean/max measure (also) from the plain mean: within 10x of the truth (measured 183..187)
        assert group / light > 0.1 * true_ratio


def test_heavy_keeps_light_tokens_priced_from_the_output():
    k, v, sums = sink_head()
    present = torch.ones(1, 1, T, dtype=torch.bool)
    heavy = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to="heavy").dv[0, 0, :, 0]
    output = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to="output").dv[0, 0, :, 0]
    light = torch.ones(T, dtype=torch.bool)
    light[8:12] = False
    assert torch.equal(heavy[light], output[light])
    assert (heavy[~light] > 50 * output[~light]).all()  # measured 88x


def test_kept_repricing_only_raises_costs_and_catches_an_evicted_group():
    """evict_to="kept": once a pass evicts the group, the next prices it from the mean of what was kept."""
    k, v, sums = sink_head()
    present = torch.ones(1, 1, T, dtype=torch.bool)
    t = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to="kept")
    before = t.dv.clone()
    widths = torch.full((1, T), 2)
    widths[:, 8:12] = 0  # a pass that evicted the group
    dv = _reprice(t, 0, t.dv[0][t.present[0]], widths)
    assert (dv >= t.dv[0, 0]).all()
    assert (dv[8:12, 0] > 50 * t.dv[0, 0, 8:12, 0]).all()  # measured ~90x
    allocate([t], [0.1 * T * 4 * D], "layer", passes=3)
    assert torch.equal(t.dv, before)  # passes re-price copies: the tables stay reusable


def test_unknown_evict_to_is_refused():
    model = tiny_llama()
    rdkv.attach(model)
    model(torch.randint(0, 96, (1, 40)), use_cache=True)
    with pytest.raises(rdkv.RDKVError, match="evict_to"):
        rdkv.compress(model, 0.3, evict_to="nowhere", **SMALL)
