"""rdkv's errors are typed: each kind of problem has its class, and rdkv itself catches by class, never by
message text, so an unrelated ValueError (a bug) is never reported as, or skipped as, a small budget."""
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
    with pytest.raises(rdkv.RDKVError, match="rdkv.record"):  # not a record at all: a plain RDKVError
        rdkv.compress(model, 0.3)
    assert all(issubclass(e, rdkv.RDKVError) for e in (rdkv.BudgetInfeasible, rdkv.NotRecorded, rdkv.CorruptFile))
