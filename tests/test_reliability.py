"""Bad input gets a clear error and changes nothing; numerical edge cases stay exact where they can."""
import math

import pytest
import torch

import rdkv
from conftest import SMALL, tiny_llama


@pytest.fixture
def prefilled():
    model = tiny_llama(3)
    rdkv.attach(model)
    ids = torch.randint(0, 96, (1, 80))
    full = model(ids, use_cache=True).past_key_values
    return model, ids, full


@pytest.mark.parametrize("budget,match", [
    (0, "in \\(0, 1\\]"), (-0.1, "in \\(0, 1\\]"), (1.5, "in \\(0, 1\\]"), (math.nan, "in \\(0, 1\\]"),
    ("0.1", "must be a number"), (True, "must be a number"), (None, "must be a number"), (1e-4, "too small"),
])
def test_bad_budgets_raise_and_change_nothing(prefilled, budget, match):
    model, ids, full = prefilled
    keys = [l.keys.clone() for l in full.layers]
    stats = {i: s.key for i, s in model._rdkv_state.layers.items()}
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.compress(model, budget, **SMALL)
    assert all(torch.equal(a, l.keys) for a, l in zip(keys, full.layers))
    assert all(model._rdkv_state.layers[i].key is k for i, k in stats.items())
    # generation after the failed call is what it would have been without it
    nxt = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(0))
    cache = rdkv.compress(model, 0.5, **SMALL)
    model2 = tiny_llama(3)
    rdkv.attach(model2)
    model2(ids, use_cache=True)
    torch.testing.assert_close(model(nxt, past_key_values=cache).logits,
                               model2(nxt, past_key_values=rdkv.compress(model2, 0.5, **SMALL)).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="h2o"), "unknown method"), (dict(v_group=24), "v_group=24 must divide"),
    (dict(k_block=7), "k_block=7 must divide"), (dict(k_group=0), "k_group must be positive"),
    (dict(weights="sometimes"), "weights="), (dict(scope="head"), "scope="), (dict(colour="red"), "unknown option"),
    (dict(floor=-1.0), "must be >= 0"), (dict(pool_weights=4), "positive odd"), (dict(passes=0), "passes must be"),
])
def test_bad_options_raise(prefilled, kwargs, match):
    model, _, _ = prefilled
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.compress(model, 0.3, **{**SMALL, **kwargs})


def test_compress_needs_attach_and_a_prefill():
    model = tiny_llama()
    with pytest.raises(rdkv.RDKVError, match="not attached"):
        rdkv.compress(model, 0.3)
    rdkv.attach(model)
    with pytest.raises(rdkv.RDKVError, match="no prefill"):
        rdkv.compress(model, 0.3)
    with pytest.raises(rdkv.RDKVError, match="no transformers attention"):
        rdkv.attach(torch.nn.Linear(2, 2))


def test_nan_in_the_cache_is_refused(prefilled):
    model, _, _ = prefilled
    st = model._rdkv_state.layers[1]
    saved = st.value
    st.value = saved.clone()
    st.value[0, 0, 5, 3] = float("nan")
    with pytest.raises(rdkv.RDKVError, match="NaN or Inf"):
        rdkv.compress(model, 0.3, **SMALL)
    st.value = saved


def test_single_token_and_shorter_than_a_group():
    model = tiny_llama(4)
    rdkv.attach(model)
    for n in (1, 5):  # k_group = 32 > n
        model(torch.randint(0, 96, (1, n)), use_cache=True)
        cache = rdkv.compress(model, 1.0, **SMALL)
        # ~50 B of per-head metadata (counts, channel order) does not fit next to 5 tokens at 16 bits,
        # so widths drop, but nothing is evicted, the budget holds and decoding works
        assert cache.nbytes <= cache.fp16_bytes and cache.report().totals()["v0"] == 0
        assert torch.isfinite(model(torch.randint(0, 96, (1, 2)), past_key_values=cache).logits).all()


def test_outlier_channels_and_constant_rows_pack_without_loss_of_range():
    from rdkv.trizone import PackSpec, pack_layer

    k = torch.randn(1, 1, 64, 32) * 0.3
    k[..., 5] = 1e4  # a constant huge channel: exact at any width
    k[..., 9] += torch.linspace(-7000, 7000, 64)  # a huge varying channel
    v = torch.full((1, 1, 64, 32), 0.25)  # constant rows
    widths = torch.full((1, 1, 64), 2)
    layer = pack_layer(k, v, 0, widths, torch.full((1, 1, 2), 2), torch.arange(32).view(1, 1, 32), PackSpec(32, 32, 16),
                       torch.float16, None, 64)
    K, V, _, _ = layer.dequantize()
    assert torch.equal(V[0], v[0, 0])
    assert torch.equal(K[0, :, 5], k[0, 0, :, 5])
    assert (K[0, :, 9] - k[0, 0, :, 9]).abs().max() <= 14000 / 64 * 32 / 3 / 2 * 1.01  # half a 2-bit step per group


def test_attaching_twice_keeps_one_set_of_hooks_and_release_forgets_everything():
    model = tiny_llama(8)
    rdkv.attach(model)
    rdkv.attach(model)
    assert len(model._rdkv_hooks) == 2 and len(model._forward_pre_hooks) == 1
    model(torch.randint(0, 96, (1, 40)), use_cache=True)
    state = model._rdkv_state
    assert state.hidden.shape[1] == 40 and state.ids.shape[1] == 40
    rdkv.release(model)
    assert state.hidden is None and state.ids is None and not state.layers
    with pytest.raises(rdkv.RDKVError, match="no prefill"):
        rdkv.compress(model, 0.3, **SMALL)


def test_continuing_a_cache_filled_before_attach_is_refused_clearly():
    """Re-attaching drops the statistics; a cache filled before that cannot be weighed, so say so."""
    model = tiny_llama()
    rdkv.attach(model)
    cache = model(torch.randint(0, 96, (1, 20)), use_cache=True).past_key_values
    rdkv.attach(model)
    with pytest.raises(rdkv.RDKVError, match="already held 20 tokens that rdkv did not see"):
        model(torch.randint(0, 96, (1, 4)), past_key_values=cache, use_cache=True)
