"""rdkv's errors are typed: each kind of problem has its class, and rdkv itself catches by class, never by
message text, so an unrelated ValueError (a bug) is never reported as, or skipped as, a small budget."""
import re

import numpy as np
import pytest
import torch
from conftest import SMALL, recorded, tiny_llama

import rdkv


def prefilled():
    return recorded(tiny_llama(0), torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(0)))[0]


def test_a_budget_below_the_metadata_is_budget_infeasible():
    rec = prefilled()
    for method in ("rdkv", "snapkv"):
        with pytest.raises(rdkv.BudgetInfeasible, match="too small"):
            rdkv.compress(rec, 1e-4, method=method, **SMALL)
    with pytest.raises(rdkv.BudgetInfeasible, match="more than the budget"):
        rdkv.compress(rec, 0.05, method="int8", **SMALL)


def test_an_unrelated_value_error_in_allocation_is_not_called_a_small_budget(monkeypatch):
    rec = prefilled()

    def broken(*args, **kwargs):
        raise ValueError("D and R must not contain NaN")

    monkeypatch.setattr(rdkv.methods.rate_distortion, "allocate", broken)
    with pytest.raises(ValueError, match="NaN") as err:
        rdkv.compress(rec, 0.3, **SMALL)
    assert not isinstance(err.value, rdkv.RDKVError)
    with pytest.raises(ValueError, match="NaN"):  # calibration no longer drops such points as "too small"
        rdkv.calibrate(rec.model, [torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(1))], **SMALL)


def test_compress_without_a_complete_record_is_not_recorded():
    model = tiny_llama(0)
    with rdkv.record(model) as rec:
        with pytest.raises(rdkv.NotRecorded, match="still open"):
            rdkv.compress(rec, 0.3)
    with pytest.raises(rdkv.NotRecorded, match="no prefill"):
        rdkv.compress(rec, 0.3)
    with pytest.raises(rdkv.NotRecorded, match="no prefill since rdkv.install"):  # the model ran only inside the block
        rdkv.compress(model, 0.3)
    with pytest.raises(rdkv.RDKVError, match="takes a model after its prefill"):  # not a prefill at all
        rdkv.compress([rec], 0.3)
    assert all(issubclass(e, rdkv.RDKVError) for e in (rdkv.BudgetInfeasible, rdkv.NotRecorded, rdkv.CorruptFile))


def test_budget_infeasible_states_the_smallest_feasible_fraction():
    rec = prefilled()
    with pytest.raises(rdkv.BudgetInfeasible, match=r"needs at least (\S+) of the fp16 bytes") as err:
        rdkv.compress(rec, 1e-4, **SMALL)
    least = float(re.search(r"needs at least (\S+) of the fp16 bytes", str(err.value)).group(1))
    assert 1e-4 < least < 0.2
    rdkv.compress(rec, least * 1.5, **SMALL)  # the per-layer minimum is met a little above it


@pytest.mark.parametrize("budget", [np.float32(0.25), np.float64(0.25), torch.tensor(0.25), np.int64(1)])
def test_numpy_and_0d_tensor_budgets_are_numbers(budget):
    assert rdkv.compress(prefilled(), budget, **SMALL).budget == float(budget)


def test_a_model_changed_between_record_and_compress_is_refused():
    """The surprisal prior comes from the output head at the first compress: a head changed since the prefill
    (another dtype, new weights) is refused rather than priced with."""
    rec = prefilled()
    rec.model.half()
    with pytest.raises(rdkv.RDKVError, match="output head changed after the prefill"):
        rdkv.compress(rec, 0.3, **SMALL)


def test_crop_and_beam_search_are_refused_by_name():
    rec = prefilled()
    cache = rdkv.compress(rec, 0.3, **SMALL)
    with pytest.raises(rdkv.RDKVError, match="cannot be cropped"):
        cache.crop(10)
    ids = torch.randint(0, 96, (1, 85))
    with pytest.raises(rdkv.RDKVError, match="beam search"):
        rec.model.generate(ids, **rdkv.cache_kwargs(cache), num_beams=2, max_new_tokens=2, do_sample=False)
