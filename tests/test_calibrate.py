"""The explicit error budget: calibration of modelled distortion to KL, and compress(error=...)."""
import pytest
import torch

import rdkv
from conftest import SMALL, recorded, tiny_llama
from rdkv.calibrate import fit


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_llama(6)
    g = torch.Generator().manual_seed(0)
    cal_ids, ids = torch.randint(0, 96, (1, 300), generator=g), torch.randint(0, 96, (1, 200), generator=g)
    rec, _ = recorded(model, ids)
    before = rdkv.compress(rec, 0.2, **SMALL)
    cal = rdkv.calibrate(model, [cal_ids, cal_ids.flip(1)], **SMALL)
    return rec, cal, before


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
    rec, cal, before = calibrated
    assert cal.p > 0 and len(cal.points) >= 2
    after = rdkv.compress(rec, 0.2, **SMALL)  # the prefill recorded before calibrate, not the calibration text
    assert after.nbytes == before.nbytes and after.get_seq_length() == 200
    assert all(torch.equal(a.v_widths(), b.v_widths()) for a, b in zip(after.layers, before.layers))


def test_error_budget_meets_eps_with_the_fewest_bytes(calibrated):
    rec, cal, _ = calibrated
    eps = cal.predict(sorted(d for d, _ in cal.points)[len(cal.points) // 2])  # inside the fitted range
    cache = rdkv.compress(rec, error=eps, calibration=cal, **SMALL)
    assert cal.predict(cache.distortion) <= eps
    tighter = rdkv.compress(rec, cache.budget * 0.95, **SMALL)  # 5% fewer bytes miss the target
    assert cal.predict(tighter.distortion) > eps
    looser = rdkv.compress(rec, error=eps * 10, calibration=cal, **SMALL)
    assert looser.nbytes < cache.nbytes


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=0.2, error=0.1), "not both"), (dict(error=0.1, method="kivi2"), "distortion model"),
    (dict(error=-1.0), "positive number"), (dict(error=0.1, scope="global"), "fitted for method"),
    (dict(budget=0.2), "calibration= is for error="),
])
def test_error_budget_bad_input(calibrated, kwargs, match):
    rec, cal, _ = calibrated
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.compress(rec, **kwargs, calibration=cal, **SMALL)


def test_error_budget_needs_the_calibrated_options(calibrated):
    """The fixture calibrated ``auto`` (rdkv on Llama) with SMALL's groups: naming rdkv is the same pricing;
    other groups are not, and are refused rather than held to a map fitted for different bytes."""
    rec, cal, _ = calibrated
    assert cal.method == "rdkv"
    eps = cal.predict(sorted(d for d, _ in cal.points)[len(cal.points) // 2])
    a = rdkv.compress(rec, error=eps, calibration=cal, **SMALL)
    b = rdkv.compress(rec, error=eps, calibration=cal, method="rdkv", **SMALL)
    assert a.method == b.method == "rdkv" and a.nbytes == b.nbytes
    with pytest.raises(rdkv.RDKVError, match="other options"):
        rdkv.compress(rec, error=eps, calibration=cal, **{**SMALL, "k_group": 64})
    # a prior is part of the pricing: a map fitted with floor=1 holds for calls with floor=1 only, either way
    floored = rdkv.calibrate(rec.model, torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(2)),
                             floor=1.0, **SMALL)
    eps1 = floored.predict(sorted(d for d, _ in floored.points)[len(floored.points) // 2])
    with pytest.raises(rdkv.RDKVError, match="other options"):
        rdkv.compress(rec, error=eps1, calibration=floored, **SMALL)
    with pytest.raises(rdkv.RDKVError, match="other options"):
        rdkv.compress(rec, error=eps, calibration=cal, floor=1.0, **SMALL)
    cache = rdkv.compress(rec, error=eps1, calibration=floored, floor=1.0, **SMALL)
    assert floored.predict(cache.distortion) <= eps1
    # options compare by value: an int for a float, or a default spelled out, is the same pricing
    same = rdkv.compress(rec, error=eps1, calibration=floored, floor=1, surprisal=0.5, **SMALL)
    assert same.nbytes == cache.nbytes
    method = rdkv.RDKV(spec=rdkv.PackSpec(**SMALL))  # the same pricing as an object, under another name
    assert rdkv.compress(rec, error=eps, calibration=cal, method=method).nbytes == a.nbytes


def test_error_budget_needs_a_calibration():
    rec, _ = recorded(tiny_llama(1), torch.randint(0, 96, (1, 40)))
    with pytest.raises(rdkv.RDKVError, match="rdkv.calibrate"):
        rdkv.compress(rec, error=0.1, **SMALL)


@pytest.mark.parametrize("texts,kwargs,match", [
    (torch.zeros(2, 40, dtype=torch.long), {}, "shape \\[1, T >= 8\\]"), ([torch.zeros(1, 4, dtype=torch.long)], {}, "T >= 8"),
    (torch.zeros(1, 40, dtype=torch.long), dict(prefix=1.0), "prefix"),
])
def test_calibrate_bad_input(calibrated, texts, kwargs, match):
    rec, _, before = calibrated
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.calibrate(rec.model, texts, **kwargs, **SMALL)
    after = rdkv.compress(rec, 0.2, **SMALL)  # the refused call changed nothing: the user's record is as it was
    assert all(torch.equal(a.v_widths(), b.v_widths()) for a, b in zip(after.layers, before.layers))


def test_tune_prior_picks_the_lowest_mean_log_kl_and_compress_uses_it():
    """tune_prior scores every candidate on the same texts and budgets, keeps the one with the lowest mean
    log KL (checked against the KLs measured here directly), leaves the user's record as it was, and
    returns the choice as options for compress, which prices with it only when they are passed."""
    import math

    from rdkv.calibrate import _measure

    model = tiny_llama(7)
    g = torch.Generator().manual_seed(1)
    cal_ids, ids = torch.randint(0, 96, (1, 240), generator=g), torch.randint(0, 96, (1, 150), generator=g)
    rec, _ = recorded(model, ids)
    before = rdkv.compress(rec, 0.2, **SMALL)
    cands = ((0.0, 0.0), (0.0, 0.5), (5.0, 5.0))
    fit_ = rdkv.tune_prior(model, cal_ids, budgets=(0.15, 0.3), candidates=cands, **SMALL)
    direct = _measure(model, [cal_ids], 0.75,
                      [(c, b, rdkv.methods.resolve(model, "auto", dict(floor=c[0], surprisal=c[1], **SMALL)))
                       for c in cands for b in (0.15, 0.3)])
    want = {c: sum(math.log(kl) for k, _, kl in direct if k == c) / 2 for c in cands}
    assert [s[2] for s in fit_.scores] == pytest.approx([want[c] for c in cands], rel=1e-6)
    assert (fit_.floor, fit_.surprisal) == min(want, key=want.get)
    assert len({round(v, 6) for v in want.values()}) == 3  # the candidates really allocate differently
    # compress: the user's record is as it was, and the tuned prior is what the fit's options ask for
    assert fit_.options == {"floor": fit_.floor, "surprisal": fit_.surprisal}
    tuned = rdkv.compress(rec, 0.2, **fit_.options, **SMALL)
    explicit = rdkv.compress(rec, 0.2, floor=fit_.floor, surprisal=fit_.surprisal, **SMALL)
    assert tuned.get_seq_length() == 150 and tuned.nbytes == explicit.nbytes
    assert tuned.distortion == pytest.approx(explicit.distortion)
    default = rdkv.compress(rec, 0.2, floor=0.0, surprisal=0.5, **SMALL)  # no implicit prior: the defaults
    assert default.distortion == pytest.approx(before.distortion)
    assert rdkv.compress(rec, 0.2, **SMALL).distortion == pytest.approx(before.distortion)
    with pytest.raises(rdkv.RDKVError, match="chooses floor and surprisal"):
        rdkv.tune_prior(model, cal_ids, floor=1.0)
    with pytest.raises(rdkv.RDKVError, match="candidates"):
        rdkv.tune_prior(model, cal_ids, candidates=((1.0,),))


def test_layer_gains_are_each_layer_s_kl_per_unit_of_modelled_distortion():
    """fit_layer_gains on a tiny Gemma 3 (sliding and global layers) against the same ratio computed by hand
    with the swaps test_harness checks: layer i's KL with only it compressed over its modelled distortion, normalised to
    geometric mean 1; power 1/2 is the square root of power 1. The user's record is kept; bad input refused."""
    import copy

    from conftest import tiny_gemma3

    from rdkv.calibrate import kl
    from rdkv.calibrate import plain_prefill, swap_in
    from rdkv.distortion import cache_options, modelled_distortion

    model = tiny_gemma3(3)
    ids = torch.randint(0, 96, (1, 96), generator=torch.Generator().manual_seed(1))
    rec, _ = recorded(model, ids[:, :50])
    before = rdkv.compress(rec, 0.2, **SMALL)
    g1 = rdkv.fit_layer_gains(model, ids, budget=0.2, power=1.0, **SMALL)
    half = rdkv.fit_layer_gains(model, ids, budget=0.2, **SMALL)
    after = rdkv.compress(rec, 0.2, **SMALL)
    assert all(torch.equal(a.v_widths(), b.v_widths()) for a, b in zip(after.layers, before.layers))

    with rdkv.record(model) as rec:
        full = plain_prefill(model, ids[:, :72])  # prefix 0.75 of 96 tokens
    c = rdkv.compress(rec, 0.2, **SMALL)
    _, tables, _ = rdkv.pipeline.allocation_tables(rec, **SMALL)
    d = [modelled_distortion([t], [v], [k]) for t, v, k in zip(tables, *cache_options(c, tables))]
    assert c.layer_distortion == pytest.approx(d, rel=1e-9) and c.distortion == pytest.approx(sum(d), rel=1e-9)

    def through(cache) -> torch.Tensor:  # teacher-force the rest of the text, as fit_layer_gains does
        return model(ids[:, 72:], past_key_values=cache).logits[0].float().log_softmax(-1)

    ref = through(copy.deepcopy(full))
    want = torch.tensor([kl(ref, through(swap_in(full, c, [i]))) / d[i] for i in range(3)])
    want = want / want.log().mean().exp()
    assert torch.allclose(torch.tensor(g1), want.float(), rtol=1e-3)
    assert max(g1) / min(g1) > 1.01  # the layers differ, so the comparison above can fail
    assert torch.allclose(torch.tensor(half), torch.tensor(g1).sqrt(), rtol=1e-6)
    with pytest.raises(rdkv.RDKVError, match="do not pass scope"):
        rdkv.fit_layer_gains(model, ids, scope="global", **SMALL)
    with pytest.raises(rdkv.RDKVError, match="power must be > 0"):
        rdkv.fit_layer_gains(model, ids, power=0, **SMALL)
