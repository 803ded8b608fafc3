"""Bad input gets a clear error and changes nothing; numerical edge cases stay exact where they can."""
import gc
import math
import weakref

import pytest
import torch
from transformers import StaticCache

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama


@pytest.fixture
def prefilled():
    model = tiny_llama(3)
    ids = torch.randint(0, 96, (1, 80))
    rec, out = recorded(model, ids)
    return rec, ids, out.past_key_values


@pytest.mark.parametrize("budget,match", [
    (0, "in \\(0, 1\\]"), (-0.1, "in \\(0, 1\\]"), (1.5, "in \\(0, 1\\]"), (math.nan, "in \\(0, 1\\]"),
    ("0.1", "must be a number"), (True, "must be a number"), (None, "must be a number"), (1e-4, "too small"),
])
def test_bad_budgets_raise_and_change_nothing(prefilled, budget, match):
    rec, ids, full = prefilled
    keys = [l.keys.clone() for l in full.layers]
    stats = {i: s.key for i, s in rec.layers.items()}
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.compress(rec, budget, **SMALL)
    assert all(torch.equal(a, l.keys) for a, l in zip(keys, full.layers))
    assert all(rec.layers[i].key is k for i, k in stats.items())
    # generation after the failed call is what it would have been without it
    nxt = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(0))
    cache = rdkv.compress(rec, 0.5, **SMALL)
    rec2, _ = recorded(tiny_llama(3), ids)
    torch.testing.assert_close(rec.model(nxt, past_key_values=cache).logits,
                               rec2.model(nxt, past_key_values=rdkv.compress(rec2, 0.5, **SMALL)).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="h2o"), "unknown method"), (dict(v_group=24), "v_group=24 must divide"),
    (dict(k_block=7), "k_block=7 must divide"), (dict(k_group=0), "k_group must be an int of at least 16"),
    (dict(weights="sometimes"), "weights="), (dict(scope="head"), "scope="), (dict(colour="red"), "unknown option"),
    (dict(floor=-1.0), "must be >= 0"), (dict(pool_weights=4), "positive odd"), (dict(passes=0), "passes must be"),
    (dict(pool_forward=-2), "pool_forward must be"),
    (dict(pool_back=1.5), "pool_back must be"), (dict(window_end=-1), "window_end must be"),
    (dict(window_end=True), "window_end must be"),
])
def test_bad_options_raise(prefilled, kwargs, match):
    rec, _, _ = prefilled
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.compress(rec, 0.3, **{**SMALL, **kwargs})


def test_compress_needs_a_record_with_a_prefill():
    model = tiny_llama()
    with pytest.raises(rdkv.RDKVError, match="rdkv.record"):
        rdkv.compress(model, 0.3)
    with rdkv.record(model) as rec:
        pass
    with pytest.raises(rdkv.NotRecorded, match="no prefill"):
        rdkv.compress(rec, 0.3)
    with pytest.raises(rdkv.RDKVError, match="no transformers attention"):
        with rdkv.record(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(rdkv.RDKVError, match="no transformers attention"):
        rdkv.install(torch.nn.Linear(2, 2))


def test_nan_in_the_cache_is_refused():
    model = tiny_llama(3)
    model.model.layers[1].self_attn.v_proj.weight[5, 3] = float("nan")  # a broken prefill: NaN in layer 1's values
    rec, _ = recorded(model, torch.randint(0, 96, (1, 80)))
    assert torch.isfinite(rec.layers[0].value).all() and not torch.isfinite(rec.layers[1].value).all()
    with pytest.raises(rdkv.RDKVError, match="NaN or Inf"):
        rdkv.compress(rec, 0.3, **SMALL)


def test_single_token_and_shorter_than_a_group():
    model = tiny_llama(4)
    for n in (1, 5, 20):  # k_group = 32 > n
        rec, _ = recorded(model, torch.randint(0, 96, (1, n)))
        cache = rdkv.compress(rec, 1.0, **SMALL)
        # ~50 B of per-head metadata (counts, channel order) does not fit next to 5 tokens at 16 bits, so widths
        # drop; a page holds 16 tokens, which 1 or 5 tokens' fp16 bytes cannot pay for, so those are evicted;
        # 20 tokens fill two pages at low widths and are all kept. The budget holds and decoding works.
        assert cache.nbytes <= cache.fp16_bytes and (n < 16 or cache.report().totals()["v0"] == 0)
        assert torch.isfinite(model(torch.randint(0, 96, (1, 2)), past_key_values=cache).logits).all()


def test_outlier_channels_and_constant_rows_pack_without_loss_of_range():
    from rdkv.layout import PackSpec
    from rdkv.trizone import pack_layer

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


def test_forwards_after_the_block_leave_the_record_as_it_was():
    """Outside its block nothing changes a record: not a new prefill, not a continuation of the recorded cache;
    it compresses to the same cache as before them. The block leaves no hooks of its own behind (only the pass
    hooks of ``rdkv.install``), and the model keeps no reference to the record, so dropping it frees what it holds."""
    from rdkv.attention import _begin_pass, _end_pass

    model = tiny_llama(8)
    rec, out = recorded(model, torch.randint(0, 96, (1, 40)))
    assert rec.closed and rec.hidden.shape[1] == 40 and rec.ids.shape[1] == 40
    assert list(model._forward_pre_hooks.values()) == [_begin_pass] and not model.model.norm._forward_hooks
    assert list(model._forward_hooks.values()) == [_end_pass]
    ids, hidden, layers = rec.ids.clone(), rec.hidden.clone(), dict(rec.layers)
    versions = {i: (s.key._version, s.value._version) for i, s in layers.items()}
    before = rdkv.compress(rec, 0.3, **SMALL)
    model(torch.randint(0, 96, (1, 60)), use_cache=True)  # another prefill
    model(torch.randint(0, 96, (1, 4)), past_key_values=out.past_key_values, use_cache=True)  # a continuation
    assert torch.equal(rec.ids, ids) and torch.equal(rec.hidden, hidden) and rec.layers == layers
    assert all(s.seen == 40 and s.key.shape[-2] == 40 for s in rec.layers.values())
    assert {i: (s.key._version, s.value._version) for i, s in rec.layers.items()} == versions
    after = rdkv.compress(rec, 0.3, **SMALL)
    assert after.get_seq_length() == 40 and after.nbytes == before.nbytes
    assert all(torch.equal(a.v_widths(), b.v_widths()) and torch.equal(a.k_widths(), b.k_widths())
               for a, b in zip(after.layers, before.layers))
    gone = weakref.ref(rec)
    del rec
    gc.collect()
    assert gone() is None


def test_compress_on_an_open_record_is_not_recorded():
    model = tiny_llama(8)
    with rdkv.record(model) as rec:
        model(torch.randint(0, 96, (1, 40)), use_cache=True)
        with pytest.raises(rdkv.NotRecorded, match="still open"):
            rdkv.compress(rec, 0.3, **SMALL)
    assert rdkv.compress(rec, 0.3, **SMALL).get_seq_length() == 40


def test_a_second_open_record_of_one_model_is_refused():
    """One record at a time: a second ``with`` inside the first raises and leaves the first recording."""
    model = tiny_llama(8)
    with rdkv.record(model) as rec:
        with pytest.raises(rdkv.RDKVError, match="already open"):
            with rdkv.record(model):
                pass
        model(torch.randint(0, 96, (1, 40)), use_cache=True)
    assert rec.ids.shape[1] == 40 and rdkv.compress(rec, 0.3, **SMALL).get_seq_length() == 40
    other, _ = recorded(model, torch.randint(0, 96, (1, 20)))  # once the block has ended, a new record opens
    assert other.ids.shape[1] == 20 and rec.ids.shape[1] == 40


def test_an_in_place_change_of_the_recorded_cache_is_refused_at_compress():
    """The record refers to the cache's own tensors: a change made to them after the block (by hand, or by
    reusing a static cache's buffers for another prefill) is caught at compress, not compressed silently."""
    model = tiny_llama(8)
    rec, _ = recorded(model, torch.randint(0, 96, (1, 40)))
    rec.layers[0].key.add_(0)
    with pytest.raises(rdkv.RDKVError, match="changed in place"):
        rdkv.compress(rec, 0.3, **SMALL)
    static = StaticCache(config=model.config, max_cache_len=40)
    with rdkv.record(model) as rec:
        model(torch.randint(0, 96, (1, 40)), past_key_values=static, use_cache=True)
    assert rdkv.compress(rec, 0.3, **SMALL).get_seq_length() == 40
    static.reset()
    model(torch.randint(0, 96, (1, 40)), past_key_values=static, use_cache=True)  # the buffers hold another text
    with pytest.raises(rdkv.RDKVError, match="changed in place"):
        rdkv.compress(rec, 0.3, **SMALL)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_after_the_block_the_model_runs_as_sdpa(make):
    """The model keeps the "rdkv" attention implementation; on ordinary caches it is transformers' SDPA:
    a prefill, and a decode step on its cache, against the same weights with "sdpa". Bit for bit, except
    a sliding-window layer's unpadded prefill, which rdkv attends in window-sized query chunks instead of
    through a [T, T] mask: there the fp32 sums run in another order (error ~1e-7 on logits of ~1)."""
    model, sdpa = make(8), make(8)
    sdpa.set_attn_implementation("sdpa")
    ids, nxt = torch.randint(0, 96, (2, 50)), torch.randint(0, 96, (2, 1))
    recorded(model, ids[:, :30])
    assert model.config._attn_implementation == "rdkv"
    got, want = model(ids, use_cache=True), sdpa(ids, use_cache=True)
    step, want_step = model(nxt, past_key_values=got.past_key_values).logits, sdpa(nxt, past_key_values=want.past_key_values).logits
    if make is tiny_llama:
        assert torch.equal(got.logits, want.logits) and torch.equal(step, want_step)
    else:
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=2e-6)
        torch.testing.assert_close(step, want_step, rtol=0, atol=2e-6)
        padded = torch.ones_like(ids)
        padded[0, :3] = 0  # with padding, transformers' own mask and SDPA call: bit for bit again
        keep = padded.bool()
        assert torch.equal(model(ids, attention_mask=padded).logits[keep], sdpa(ids, attention_mask=padded).logits[keep])


def test_windowed_attention_is_sliding_window_attention():
    """The chunked sliding-window prefill equals dense masked attention, GQA included, at window sizes that do
    and do not divide the length."""
    from rdkv.attention import _windowed
    from rdkv.dense import allowed_keys

    g = torch.Generator().manual_seed(0)
    for T, W in ((50, 16), (64, 16), (33, 40), (7, 3)):
        q, k, v = (torch.randn(2, h, T, 8, generator=g) for h in (4, 2, 2))
        pos = torch.arange(T)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.3
        want = s.masked_fill(~allowed_keys(pos, pos, W), float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
        torch.testing.assert_close(_windowed(q, k, v, 0.3, W), want, rtol=1e-5, atol=1e-6)


def test_continuing_a_cache_filled_outside_the_record_is_refused_clearly():
    """A cache filled before the block cannot be weighed, so say so."""
    model = tiny_llama()
    cache = model(torch.randint(0, 96, (1, 20)), use_cache=True).past_key_values
    with pytest.raises(rdkv.RDKVError, match="already held 20 tokens that the record did not see"):
        with rdkv.record(model):
            model(torch.randint(0, 96, (1, 4)), past_key_values=cache, use_cache=True)
