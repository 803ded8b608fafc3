"""The explicit error budget: calibration of modelled distortion to KL, and compress(error=...)."""
import pytest
import torch

import rdkv
from conftest import SMALL, tiny_llama
from rdkv.calibrate import fit


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_llama(6)
    rdkv.attach(model)
    g = torch.Generator().manual_seed(0)
    cal_ids, ids = torch.randint(0, 96, (1, 300), generator=g), torch.randint(0, 96, (1, 200), generator=g)
    model(ids, use_cache=True)
    before = rdkv.compress(model, 0.2, **SMALL)
    cal = rdkv.calibrate(model, [cal_ids, cal_ids.flip(1)], **SMALL)
    return model, cal, before


def test_fit_recovers_a_power_law():
    cal = fit([(d, 0.3 * d**1.5) for d in (0.1, 1.0, 4.0, 20.0)])
    assert cal.a == pytest.approx(0.3) and cal.p == pytest.approx(1.5)
    noisy = fit([(1.0, 1.0), (2.0, 4.0), (4.0, 4.0), (8.0, 16.0)])  # conservative: no point above the line
    assert all(kl <= noisy.predict(d) * (1 + 1e-9) for d, kl in noisy.points)
    assert any(kl == pytest.approx(noisy.predict(d)) for d, kl in noisy.points)
    assert cal.distortion_for(cal.predict(2.0)) == pytest.approx(2.0)
    assert cal.distortion_for(cal.predict(50.0)) == 20.0  # no extrapolation past the calibrated range
    with pytest.raises(rdkv.RDKVError, match="falling"):
        fit([(1.0, 0.5), (2.0, 0.1)])
    with pytest.raises(rdkv.RDKVError, match="at least two"):
        fit([(1.0, 0.5), (1.0, 0.0)])


def test_calibration_keeps_the_users_prefill(calibrated):
    model, cal, before = calibrated
    assert cal.p > 0 and len(cal.points) >= 2
    after = rdkv.compress(model, 0.2, **SMALL)  # the prefill recorded before calibrate, not the calibration text
    assert after.nbytes == before.nbytes and after.get_seq_length() == 200
    assert all(torch.equal(a.v_widths(), b.v_widths()) for a, b in zip(after.layers, before.layers))


def test_error_budget_meets_eps_with_the_fewest_bytes(calibrated):
    model, cal, _ = calibrated
    eps = cal.predict(sorted(d for d, _ in cal.points)[len(cal.points) // 2])  # inside the fitted range
    cache = rdkv.compress(model, error=eps, **SMALL)
    assert cal.predict(cache.distortion) <= eps
    tighter = rdkv.compress(model, cache.budget * 0.95, **SMALL)  # 5% fewer bytes miss the target
    assert cal.predict(tighter.distortion) > eps
    looser = rdkv.compress(model, error=eps * 10, **SMALL)
    assert looser.nbytes < cache.nbytes


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=0.2, error=0.1), "not both"), (dict(error=0.1, method="kivi2"), "distortion model"),
    (dict(error=-1.0), "positive number"), (dict(error=0.1, method="rdkv-global"), "calibrated for method"),
])
def test_error_budget_bad_input(calibrated, kwargs, match):
    model, _, _ = calibrated
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.compress(model, **kwargs, **SMALL)


def test_error_budget_needs_a_calibration():
    model = tiny_llama(1)
    rdkv.attach(model)
    model(torch.randint(0, 96, (1, 40)), use_cache=True)
    with pytest.raises(rdkv.RDKVError, match="rdkv.calibrate"):
        rdkv.compress(model, error=0.1, **SMALL)


@pytest.mark.parametrize("texts,kwargs,match", [
    (torch.zeros(2, 40, dtype=torch.long), {}, "shape \\[1, T >= 8\\]"), ([torch.zeros(1, 4, dtype=torch.long)], {}, "T >= 8"),
    (torch.zeros(1, 40, dtype=torch.long), dict(prefix=1.0), "prefix"),
])
def test_calibrate_bad_input(calibrated, texts, kwargs, match):
    model, cal, _ = calibrated
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.calibrate(model, texts, **kwargs, **SMALL)
    assert model._rdkv_calibration is cal  # the previous calibration stays
