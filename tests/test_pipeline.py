"""record a prefill -> compress -> decode on tiny random-weight models (fast, exact checks)."""
import pytest
import torch

from rdkv import layout
from transformers import DynamicCache

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama


@pytest.mark.parametrize("all_queries", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_through_rdkv_equals_sdpa(arch, all_queries):
    """A recorded prefill computes attention through transformers' own SDPA call: the same logits bit for bit
    (so it allocates what a plain prefill does); with every query's sums, exact chunked attention."""
    model = tiny_gemma3() if arch == "gemma3" else tiny_llama()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 96, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    want = model(ids, attention_mask=mask).logits
    with rdkv.record(model, all_queries=all_queries):
        got = model(ids, attention_mask=mask, use_cache=True).logits
    if all_queries:
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-5)
    else:  # padded, so the same mask and SDPA call as a plain prefill (test_reliability: the unpadded case)
        assert torch.equal(got, want)


@pytest.mark.parametrize("weights", ["window", "all"])
def test_all_query_and_window_weights_both_compress(llama, weights):
    ids, nxt = torch.randint(0, 96, (1, 100)), torch.randint(0, 96, (1, 2))
    rec, _ = recorded(llama, ids, all_queries=weights == "all")
    cache = rdkv.compress(rec, 0.3, weights=weights, **SMALL)
    assert cache.nbytes <= 0.3 * cache.fp16_bytes
    assert torch.isfinite(llama(nxt, past_key_values=cache).logits).all()
    if weights == "window":
        with pytest.raises(rdkv.RDKVError, match="all_queries=True"):
            rdkv.compress(rec, 0.3, weights="all", **SMALL)


def test_chunked_prefill_gives_the_same_statistics(llama):
    ids = torch.randint(0, 96, (1, 90))
    rec, _ = recorded(llama, ids, all_queries=True)
    one = {i: s.sums.mass.clone() for i, s in rec.layers.items()}
    cache = DynamicCache(config=llama.config)
    with rdkv.record(llama, all_queries=True) as chunked:  # forwards inside one block extend its record
        llama(ids[:, :50], past_key_values=cache)
        llama(ids[:, 50:], past_key_values=cache)
    assert sorted(chunked.layers) == sorted(one) and chunked.ids.shape[1] == 90
    for i, s in chunked.layers.items():
        torch.testing.assert_close(s.sums.mass, one[i], rtol=1e-4, atol=1e-5)


def continuation(model, cache, nxt):
    return model(nxt, past_key_values=cache).logits


def test_budget_one_matches_the_full_cache(llama):
    # whole pages of 16 tokens: at budget 1.0 the few tokens the positions and indices push below 16 bits are
    # one page at 8 bits (past a whole page, the rest of a class drops a class, down to eviction)
    ids, nxt = torch.randint(0, 96, (1, 96)), torch.randint(0, 96, (1, 4))
    rec, out = recorded(llama, ids)
    full = out.past_key_values
    cache = rdkv.compress(rec, 1.0, **SMALL)
    assert cache.get_seq_length() == 96
    got, want = continuation(llama, cache, nxt), continuation(llama, full, nxt)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-3)  # only fp16 rounding of K and V remains
    assert cache.get_seq_length() == 100


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.12])
def test_bytes_stay_within_budget_and_quality_degrades_gracefully(llama, budget):
    ids, nxt = torch.randint(0, 96, (1, 120)), torch.randint(0, 96, (1, 4))
    rec, out = recorded(llama, ids)
    full = out.past_key_values
    cache = rdkv.compress(rec, budget, spec=rdkv.PackSpec(**SMALL))
    assert cache.nbytes <= budget * cache.fp16_bytes
    # the solver spends what it is given, to within whole pages (16 tokens here, 13% of a 120-token stream)
    assert cache.nbytes >= 0.9 * budget * cache.fp16_bytes
    want = continuation(llama, full, nxt).log_softmax(-1)
    got = continuation(llama, cache, nxt).log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1).mean()
    assert kl < 0.05 * (1 / budget)


def test_left_padded_batch_equals_each_sequence_alone():
    model = tiny_llama(1)
    a, b = torch.randint(0, 96, (1, 60)), torch.randint(0, 96, (1, 45))
    nxt = torch.randint(0, 96, (2, 3))
    pad = torch.cat([torch.zeros(1, 15, dtype=torch.long), b], 1)
    ids = torch.cat([a, pad])
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :15] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with rdkv.record(model) as rec:
        model(ids, attention_mask=mask, position_ids=pos, use_cache=True)
    batch = rdkv.compress(rec, 0.3, **SMALL)
    mask2 = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    got = model(nxt, past_key_values=batch, attention_mask=mask2, position_ids=pos[:, -1:] + 1 + torch.arange(3)).logits
    for i, seq in enumerate((a, b)):
        alone = rdkv.compress(recorded(model, seq)[0], 0.3, **SMALL)
        want = model(nxt[i : i + 1], past_key_values=alone).logits
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-4, atol=1e-4)


def test_generate_resumes_from_a_compressed_cache(llama):
    ids, q = torch.randint(0, 96, (1, 80)), torch.randint(0, 96, (1, 5))
    rec, out = recorded(llama, ids)
    want = llama.generate(torch.cat([ids, q], 1), past_key_values=out.past_key_values, max_new_tokens=8, do_sample=False)
    cache = rdkv.compress(rec, 1.0, **SMALL)  # generating from the full cache left the record as it was
    got = llama.generate(torch.cat([ids, q], 1), past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 80 + 5 + 7


def test_readme_calls_warn_of_nothing(llama, caplog):
    """README's calls, on any supported transformers: no FutureWarning (generate's renamed cache keyword) and no
    deprecation logged by transformers (reading a renamed output field)."""
    import logging
    import warnings

    logging.Logger.warning_once.cache_clear()  # transformers logs each deprecation once per process
    ids, q = torch.randint(0, 96, (1, 80)), torch.randint(0, 96, (1, 5))
    rdkv.install(llama)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")
        prefill = llama(ids, use_cache=True, logits_to_keep=1)  # noqa: F841 (compress(model) needs it alive)
        cache = rdkv.compress(llama, 0.3, **SMALL)
        out = llama.generate(torch.cat([ids, q], 1), **rdkv.cache_kwargs(cache), max_new_tokens=3, do_sample=False)
        cache.report()
        rec, _ = recorded(llama, ids)
        rdkv.compress(rec, 0.3, **SMALL)
    assert out.shape == (1, 88)
    assert not [r.getMessage() for r in caplog.records if "deprecat" in r.getMessage()]


def test_gemma3_sliding_window_layers_decode_like_the_full_cache():
    model = tiny_gemma3()
    ids = torch.randint(0, 96, (1, 40))  # longer than the 16-token window
    rec, out = recorded(model, ids)
    full = out.past_key_values
    cache = rdkv.compress(rec, 1.0, spec=rdkv.PackSpec(**SMALL))
    assert cache.layers[0].start == 40 - 15 and cache.layers[2].start == 0
    for step in range(20):  # decode past another window length, one token at a time
        tok = torch.randint(0, 96, (1, 1))
        torch.testing.assert_close(model(tok, past_key_values=cache).logits, model(tok, past_key_values=full).logits, rtol=0, atol=5e-3)
    cache = rdkv.compress(rec, 0.3, spec=rdkv.PackSpec(**SMALL))
    assert cache.nbytes <= 0.3 * cache.fp16_bytes


def test_window_end_holds_each_sliding_windows_end_with_real_keys():
    """window_end=32 on a Gemma 3 whose sliding-window layers hold 63 tokens: with the question in the prompt at 10%
    (bytes split) and asked later (peak split), each sliding-window layer keeps its last 32 tokens and every K block
    at 2 bits or more, where without it its K blocks are left as channel means; the global layer's keys are
    allocated as before (channel means are allowed there), and the budget holds. At 5% the sliding-window layers'
    ends with 2-bit keys would take most of the budget: they give way, and the cache is the one without them."""
    model = tiny_gemma3(window=64)
    rec, _ = recorded(model, torch.randint(0, 96, (1, 400), generator=torch.Generator().manual_seed(0)))
    for method in ("rdkv-aware", "rdkv-reconstruct"):
        plain = rdkv.compress(rec, 0.1, method=method, window_end=0, **SMALL)
        ended = rdkv.compress(rec, 0.1, method=method, window_end=32, **SMALL)
        assert ended.nbytes <= 0.1 * ended.fp16_bytes
        for a, b in zip(plain.layers[:2], ended.layers[:2]):
            assert (a.k_widths() == 0).any() and (b.k_widths() >= 2).all()
            assert (b.v_widths()[..., -32:] > 0).all()
        assert (ended.layers[2].k_widths() == 0).any()
    # at 5% the ends would take more than half the budget (ENDS_SHARE): they give way, the allocation is as without
    plain, ended = (rdkv.compress(rec, 0.05, method="rdkv-aware", **SMALL, **kw) for kw in ({"window_end": 0}, {"window_end": 48}))
    assert ended.nbytes == plain.nbytes and all(torch.equal(a.v_widths(), b.v_widths()) and
                                                torch.equal(a.k_widths(), b.k_widths()) for a, b in zip(plain.layers, ended.layers))


def test_two_compressions_of_one_prefill_are_independent(llama):
    ids, nxt = torch.randint(0, 96, (1, 90)), torch.randint(0, 96, (1, 3))
    rec, _ = recorded(llama, ids)
    c1 = rdkv.compress(rec, 0.3, **SMALL)
    c2 = rdkv.compress(rec, 0.3, **SMALL)
    assert c1.nbytes == c2.nbytes
    a = continuation(llama, c1, nxt)
    continuation(llama, c1, nxt)  # c1 grows, c2 must not
    assert torch.equal(a, continuation(llama, c2, nxt))


@pytest.mark.parametrize("method", rdkv.methods.NAMES)
def test_every_method_packs_within_its_bytes_and_decodes(method):
    model = tiny_llama(2)
    ids, nxt = torch.randint(0, 96, (2, 150)), torch.randint(0, 96, (2, 3))
    rec, _ = recorded(model, ids, all_queries=True)
    fixed = method != "auto" and rdkv.methods.METHODS[method].fixed_rate
    cache = rdkv.compress(rec, None if fixed else 0.2, method=method, v_group=32, k_block=16)
    ratio = cache.nbytes / cache.fp16_bytes
    widths = cache.layers[0].v_widths()
    if fixed:
        want = {"int8": 8, "int4": 4, "kivi4": 4, "kivi2": 2}[method]
        assert (widths[..., :-128] == want).all() and set(cache.layers[0].k_widths().unique().tolist()) == {want}
    else:
        assert 0.15 < ratio <= 0.2
    if method in ("streaming", "snapkv", "adakv", "knorm"):
        assert set(widths.unique().tolist()) <= {0, 16}
    if method == "adakv":  # head-adaptive: kept counts may differ per head
        kept = (widths > 0).sum(-1)
        assert kept.sum() > 0
    assert torch.isfinite(model(nxt, past_key_values=cache).logits).all()


@pytest.mark.parametrize("method", ["snapkv", "adakv", "streaming", "knorm"])
def test_eviction_keeps_one_share_of_every_layer(method):
    """On a hybrid model every layer keeps the same share of the tokens it holds (kvpress's per-layer
    compression ratio), not one count per head: a sliding-window layer holds 15 tokens, the full layer 150,
    and one count for all would leave the full layer a tenth of the share the window layers get."""
    ids = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(0))
    rec, _ = recorded(tiny_gemma3(1), ids)
    cache = rdkv.compress(rec, 0.3, method=method, **SMALL)
    kept = [(layer.v_widths() > 0).sum().item() for layer in cache.layers]
    held = [layer.v_widths().shape[-1] for layer in cache.layers]
    assert held == [15, 15, 150]
    share = (0.3 * cache.fp16_bytes - 3 * (16 + 32 + 2)) / (sum(held) * (4 * 32 + 1))  # fixed bytes, 1-byte positions
    # in whole pages of 16 tokens, each layer within a page of its share (the 15-token windows: none or one)
    assert all(k % 16 == 0 and abs(k - share * n) < 16 for k, n in zip(kept, held)) and kept[2] > 2 * kept[0]
    assert 0.27 < cache.nbytes / cache.fp16_bytes <= 0.3


def test_auto_picks_the_preset_for_the_attention_layout():
    """``auto`` (compress's default) is rdkv on an all-global model and rdkv-hybrid where sliding-window and
    global layers mix, with the preset's query windows capped at what the record kept."""
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    rec, _ = recorded(tiny_llama(3), ids)
    auto, plain = rdkv.compress(rec, 0.2, **SMALL), rdkv.compress(rec, 0.2, method="rdkv", **SMALL)
    assert auto.method == "rdkv" and _same_widths(auto, plain)
    rec, _ = recorded(tiny_gemma3(3), ids, window=32)
    auto = rdkv.compress(rec, 0.2, **SMALL)
    hybrid = rdkv.compress(rec, 0.2, method="rdkv-hybrid", window=32, window_sliding=32, **SMALL)
    assert auto.method == "rdkv-hybrid" and "(rdkv-hybrid)" in str(auto.report()) and _same_widths(auto, hybrid)
    # the presets price differently (on 15-token windows in pages of 16 the widths may still coincide)
    assert auto.layer_distortion != rdkv.compress(rec, 0.2, method="rdkv", **SMALL).layer_distortion
    with pytest.raises(rdkv.RDKVError, match="the record kept only the last 32"):  # the named preset is not capped
        rdkv.compress(rec, 0.2, method="rdkv-hybrid", **SMALL)


def _same_widths(a, b) -> bool:
    return all(torch.equal(x.v_widths(), y.v_widths()) and torch.equal(x.k_widths(), y.k_widths())
               for x, y in zip(a.layers, b.layers))


def test_fixed_rate_method_over_budget_raises(llama):
    rec, _ = recorded(llama, torch.randint(0, 96, (1, 60)))
    with pytest.raises(rdkv.RDKVError, match="int8 needs"):
        rdkv.compress(rec, 0.3, method="int8", **SMALL)
    with pytest.raises(rdkv.RDKVError, match="unknown method"):
        rdkv.compress(rec, 0.3, method="h2o")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_models_keep_their_dtype_and_match_at_full_budget(dtype):
    model = tiny_llama(5, dtype)
    ids, nxt = torch.randint(0, 96, (1, 112)), torch.randint(0, 96, (1, 3))  # 7 pages of 16 tokens
    rec, out = recorded(model, ids)
    full = out.past_key_values
    held, _ = rdkv.pipeline.held_layers(rec, rdkv.methods.resolve(model, "rdkv", SMALL))
    for h, st in zip(held, [rec.layers[i] for i in range(len(held))]):  # no float32 copy of every layer while compress runs
        assert h.k.dtype == h.v.dtype == dtype and h.v.untyped_storage().data_ptr() == st.value.untyped_storage().data_ptr()
    cache = rdkv.compress(rec, 1.0, **SMALL)
    assert layout.zone_c(cache.layers[0])[1].dtype == dtype
    held = cache.report().totals()
    assert held["v16"] == sum(held[f"v{w}"] for w in (0, 2, 4, 8, 16))  # a 16-bit cache stays 16-bit...
    got, want = model(nxt, past_key_values=cache).logits.float(), model(nxt, past_key_values=full).logits.float()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # ...up to K blocks and 16-bit rounding


def test_pooled_weights_raise_every_token_to_its_neighbourhood_max(llama):
    """pool_weights=7 max-pools the attention sums: no token's price can fall, some must rise."""
    rec, _ = recorded(llama, torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(1)))
    _, plain, _ = rdkv.pipeline.allocation_tables(rec, **SMALL)
    _, pooled, _ = rdkv.pipeline.allocation_tables(rec, pool_weights=7, **SMALL)
    for a, b in zip(plain, pooled):  # quantized widths (1..4): only the token's weight changes, not its error
        assert (b.dv[..., 1:] >= a.dv[..., 1:] * (1 - 1e-6)).all()
        assert (b.dv[..., 1:] > a.dv[..., 1:] * 1.01).any()


def test_one_sided_pooling_spreads_a_weight_onto_the_tokens_on_its_side_only():
    """pool_forward=3: a weight at token 5 reaches tokens 6-8 and nothing before it; with pool=3 as well, the
    centred pool runs first (4-6), then the forward one (4-9). pool_back=2: it reaches tokens 3-4 and nothing
    after it; with pool_forward=1 too, 3-6."""
    from rdkv.dense import AttentionSums
    from rdkv.methods import Weights

    def pooled(**kw):
        mass = torch.zeros(1, 2, 12)
        mass[0, 0, 5], mass[0, 1, 0] = 2.0, 1.0
        sums = AttentionSums(mass=mass, mass2=mass.square(), q2=torch.ones(1, 2, 4), nq=torch.ones(1))
        return Weights(**kw).pooled(sums)

    got = pooled(pool_forward=3)
    assert got.mass[0, 0].tolist() == [0] * 5 + [2.0] * 4 + [0] * 3
    assert got.mass[0, 1].tolist() == [1.0] * 4 + [0] * 8
    assert torch.equal(got.mass2, got.mass.square())
    assert pooled(pool=3, pool_forward=3).mass[0, 0].tolist() == [0] * 4 + [2.0] * 6 + [0] * 2
    back = pooled(pool_back=2)
    assert back.mass[0, 0].tolist() == [0] * 3 + [2.0] * 3 + [0] * 6
    assert back.mass[0, 1].tolist() == [1.0] + [0] * 11  # nothing before the first token to reach
    assert torch.equal(back.mass2, back.mass.square())
    assert pooled(pool_back=2, pool_forward=1).mass[0, 0].tolist() == [0] * 3 + [2.0] * 4 + [0] * 5


def test_report_names_the_layers_that_hold_the_modelled_distortion(llama):
    """The report's distortion line sums the cache's per-layer parts and ranks them; baselines have none."""
    rec, _ = recorded(llama, torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(2)))
    cache = rdkv.compress(rec, 0.2, **SMALL)
    d = cache.layer_distortion
    assert len(d) == 2 and min(d) > 0 and sum(d) == pytest.approx(cache.distortion, rel=1e-12)
    top = max(range(2), key=lambda i: d[i])
    line = next(x for x in str(cache.report()).splitlines() if x.startswith("modelled distortion"))
    assert f"{cache.distortion:.4g}" in line and f"layers {top} ({d[top] / sum(d):.0%})" in line
    assert "modelled distortion" not in str(rdkv.compress(rec, method="int4", **SMALL).report())


def test_carried_profile_is_each_token_s_largest_share_of_an_earlier_layer_s_evictable_weight():
    """Prior.carried: per head, each evictable token's share of the head's weight (protected tokens out), the
    largest over heads, then over layers; positions a layer does not hold (before ``start``) carry nothing."""
    from rdkv.methods import Prior

    mass2 = torch.tensor([[[4.0, 1.0, 1.0, 2.0], [0.0, 3.0, 1.0, 0.0]]])  # [B=1, H=2, T=4] at positions 1..4
    keep = torch.tensor([True, True, True, False]).expand(1, 2, 4)  # position 4 is protected
    first = Prior.carried(None, mass2, keep, start=1)
    assert first.shape == (1, 5)
    torch.testing.assert_close(first, torch.tensor([[0.0, 4 / 6, 3 / 4, 1 / 4, 0.0]]))
    later = Prior.carried(first, torch.tensor([[[0.0, 0.0, 0.0, 1.0, 9.0]]]), torch.ones(1, 1, 5, dtype=torch.bool), 0)
    torch.testing.assert_close(later, torch.tensor([[0.0, 4 / 6, 3 / 4, 1 / 4, 0.9]]))  # max(1/4, 1/10)


def test_carry_prices_a_layer_by_what_the_layers_before_it_weighed(llama):
    """carry=1: the first layer is priced as before; the next one's quantized prices rise on exactly the tokens
    the first layer weighed (never on its protected sinks and recent window, which carry nothing)."""
    rec, _ = recorded(llama, torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(3)))
    _, plain, _ = rdkv.pipeline.allocation_tables(rec, **SMALL)
    m, carried, _ = rdkv.pipeline.allocation_tables(rec, carry=1.0, **SMALL)
    assert m.prior.carry == 1.0
    torch.testing.assert_close(carried[0].dv, plain[0].dv, rtol=0, atol=0)
    rise = carried[1].dv[..., 1:] / plain[1].dv[..., 1:]  # [B, H, T, widths]: the token's weight, for every width
    assert (rise >= 1 - 1e-6).all()
    protected = torch.zeros(120, dtype=torch.bool)
    protected[:4], protected[-32:] = True, True  # Eviction's defaults: 4 sinks, 32 recent tokens
    torch.testing.assert_close(rise[:, :, protected], torch.ones_like(rise[:, :, protected]))
    assert (rise[:, :, ~protected] > 1 + 1e-3).float().mean() > 0.5
