"""Reconstruction weights (rdkv.reconstruct): the sums of the context repeated after the prefill, checked against
a record of that repetition run as a continued prefill through transformers' own cache, and used by compress."""
import pytest
import torch

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama
from rdkv.methods import RDKV, Weights
from rdkv.reconstruct import reconstruct
from rdkv.solvers.allocate import layer_budgets

RECON = RDKV(weights=Weights(form="reconstruct"))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "attend"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_sums_are_the_repetition_queries_sums(make, fused, monkeypatch):
    """Oracle: record the context and then the same tokens again, continued through the DynamicCache with every
    query's sums streamed; minus the context's own sums, that is what the repetition paid each context key.
    Gemma 3's sliding-window layers (window 16) see only their window. Both paths: torch's fused CPU attention
    with its log-sum-exp (the default on a CPU), and rdkv.dense.attend (elsewhere)."""
    import rdkv.reconstruct as recon_module

    assert recon_module._FLASH_CPU is not None  # this torch has it: the fused case tests it
    calls = []
    if fused:
        fast = recon_module._repeat_attention
        monkeypatch.setattr(recon_module, "_repeat_attention", lambda *a, **k: calls.append(1) or fast(*a, **k))
    else:
        monkeypatch.setattr(recon_module, "_FLASH_CPU", None)
    model = make()
    ids = torch.randint(0, 96, (1, 70), generator=torch.Generator().manual_seed(1))
    rec, _ = recorded(model, ids)
    reconstruct(rec)
    first, out = recorded(model, ids, all_queries=True)
    with rdkv.record(model, all_queries=True) as both:
        out = model(ids, use_cache=True)
        model(ids, **rdkv.cache_kwargs(out.past_key_values), use_cache=True)
    T = ids.shape[1]
    for i, st in rec.layers.items():
        cut = st.start
        want_mass = both.layers[i].sums.mass[..., cut:T] - first.layers[i].sums.mass[..., cut:]
        want_mass2 = both.layers[i].sums.mass2[..., cut:T] - first.layers[i].sums.mass2[..., cut:]
        torch.testing.assert_close(st.recon.mass, want_mass, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st.recon.mass2, want_mass2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(st.recon.q2, both.layers[i].sums.q2 - first.layers[i].sums.q2, rtol=1e-4, atol=1e-3)
        assert st.recon.mass.sum() > 0
    assert len(calls) == (len(rec.layers) if fused else 0)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_fused_path_measures_what_attend_does(make, monkeypatch):
    """The largest probability per key (KVzip's score) and each key's distance to the outputs that read it
    (AttentionSums.drift) from torch's fused attention and its log-sum-exp equal rdkv.dense.attend's (which
    tests/test_dense.py checks against the softmax written out); the peak sits where it must:
    peak^2 <= mass2 <= peak * mass."""
    import rdkv.reconstruct as recon_module

    model = make()
    ids = torch.randint(0, 96, (1, 70), generator=torch.Generator().manual_seed(3))
    fused, _ = recorded(model, ids)
    reconstruct(fused)
    monkeypatch.setattr(recon_module, "_FLASH_CPU", None)
    plain, _ = recorded(model, ids)
    reconstruct(plain)
    for i, st in fused.layers.items():
        r = st.recon
        torch.testing.assert_close(r.peak, plain.layers[i].recon.peak, rtol=1e-4, atol=1e-5)
        assert 0 < r.peak.max() <= 1 + 1e-5
        assert (r.peak.square() <= r.mass2 + 1e-6).all() and (r.mass2 <= r.peak * r.mass + 1e-6).all()
        a, b = r.drift, plain.layers[i].recon.drift
        assert torch.equal(a.isnan(), b.isnan()) and not a.isnan().all()
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-3, atol=1e-5)


def test_max_score_and_readers_price_read_the_pass():
    """score="max" replaces each token's squared-attention sum by its squared peak, scaled to the layer's same
    total; k_price="readers" hands the distortion model the keys' distances to their readers' outputs
    (tests/test_distortion.py prices them); both need the reconstruction pass; compress takes them by name."""
    model = tiny_llama(2)
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(4))
    rec, _ = recorded(model, ids)
    reconstruct(rec)
    st = rec.layers[0]
    top = Weights(form="reconstruct", score="max").sums(st, st.start, False).mass2
    total = Weights(form="reconstruct").sums(st, st.start, False).mass2.sum()
    torch.testing.assert_close(top.sum(), total)
    torch.testing.assert_close(top / top.amax(), st.recon.peak.square() / st.recon.peak.square().amax())
    assert Weights(form="reconstruct").sums(st, st.start, False).drift is None  # priced from the mean output
    assert not Weights(form="reconstruct", k_price="readers").sums(st, st.start, False).drift.isnan().all()
    for bad in ({"score": "max"}, {"k_price": "readers"}):
        with pytest.raises(rdkv.RDKVError, match="weights='reconstruct'"):
            Weights(**bad)
    with pytest.raises(rdkv.RDKVError, match="score='top'"):
        Weights(form="reconstruct", score="top")
    cache = rdkv.compress(rec, 0.2, weights="reconstruct", score="max", **SMALL)
    assert 0 < cache.nbytes <= 0.2 * cache.fp16_bytes


def test_compress_runs_the_pass_once_and_weighs_by_it():
    """The first compress with reconstruction weights runs the pass; later ones reuse it; the widths follow the
    sums (they differ from the window's); the cache is within budget and decodes."""
    model = tiny_llama(2)
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(2))
    rec, _ = recorded(model, ids)
    a = rdkv.compress(rec, 0.25, method=RECON, **SMALL)
    sums = rec.layers[0].recon
    b = rdkv.compress(rec, 0.25, method=RECON, **SMALL)
    assert rec.layers[0].recon is sums
    assert torch.equal(a.layers[0].v_widths(), b.layers[0].v_widths())
    window = rdkv.compress(rec, 0.25, method="rdkv", **SMALL)
    assert not all(torch.equal(x.v_widths(), y.v_widths()) for x, y in zip(a.layers, window.layers))
    assert a.nbytes <= 0.25 * a.fp16_bytes
    assert torch.isfinite(model(torch.tensor([[3]]), **rdkv.cache_kwargs(a)).logits).all()


def test_the_card_call_takes_reconstruction_weights_and_padding_is_refused():
    model = rdkv.install(tiny_llama(2))
    ids = torch.randint(0, 96, (1, 90))
    out = model(ids, use_cache=True)
    assert rdkv.compress(model, 0.3, weights="reconstruct", **SMALL).nbytes > 0
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[1, :5] = 0
    out = model(torch.randint(0, 96, (2, 90)), attention_mask=mask, use_cache=True)
    with pytest.raises(rdkv.RDKVError, match="unpadded batch"):
        rdkv.compress(model, 0.3, weights="reconstruct", **SMALL)
    del out


def test_peak_split_moves_bytes_between_layers_within_the_budget():
    """split="peak" hands each layer the bytes of its share of one ranking of every layer's tokens by the pass's
    peaks (rdkv.solvers.allocate.layer_budgets, tested there): each layer of the cache fits its part, which is
    not the default's equal part. With the window's weights the split runs the pass for its peaks alone: the
    layers get the same parts, and the widths inside them follow the window. It needs one budget per layer."""
    model = tiny_llama(2)
    ids = torch.randint(0, 96, (1, 400), generator=torch.Generator().manual_seed(5))
    rec, _ = recorded(model, ids)
    even = rdkv.compress(rec, 0.1, weights="reconstruct", score="max", **SMALL)
    peak = rdkv.compress(rec, 0.1, weights="reconstruct", score="max", split="peak", **SMALL)
    assert peak.nbytes <= 0.1 * peak.fp16_bytes
    _, tables, fp16 = rdkv.pipeline.allocation_tables(rec, weights="reconstruct", score="max", split="peak", **SMALL)
    parts = layer_budgets(tables, 0, 0.1 * fp16[0], "peak")
    assert abs(parts[0] - parts[1]) > 0.02 * sum(parts)
    for layer, part in zip(peak.layers, parts):
        assert layer.nbytes <= part
    assert not all(torch.equal(x.v_widths(), y.v_widths()) for x, y in zip(even.layers, peak.layers))
    fresh, _ = recorded(model, ids)
    window = rdkv.compress(fresh, 0.1, split="peak", **SMALL)
    assert fresh.layers[0].recon is not None
    _, window_tables, _ = rdkv.pipeline.allocation_tables(fresh, split="peak", **SMALL)
    assert layer_budgets(window_tables, 0, 0.1 * fp16[0], "peak") == parts
    for layer, part in zip(window.layers, parts):
        assert layer.nbytes <= part
    assert not all(torch.equal(x.v_widths(), y.v_widths()) for x, y in zip(window.layers, peak.layers))
    with pytest.raises(rdkv.RDKVError, match="scope='layer'"):
        rdkv.compress(rec, 0.1, weights="reconstruct", split="peak", scope="global", **SMALL)
    floored = rdkv.compress(rec, 0.1, weights="reconstruct", score="max", split="peak", split_floor=0.5, **SMALL)
    least = min(parts)  # the layer the peaks pass over: a floor of half its bytes share of the rest lifts it
    floor_parts = layer_budgets(tables, 0, 0.1 * fp16[0], "peak", 0.5)
    assert min(floor_parts) > least
    for layer, part in zip(floored.layers, floor_parts):
        assert layer.nbytes <= part
    for bad, match in ((1.5, "fraction in"), (True, "fraction in"), (0.5, "use it with split='peak'")):
        with pytest.raises(rdkv.RDKVError, match=match):
            rdkv.compress(rec, 0.1, weights="reconstruct", split_floor=bad, **({} if bad == 0.5 else {"split": "peak"}), **SMALL)
    with pytest.raises(rdkv.RDKVError, match="split='even'"):
        rdkv.compress(rec, 0.1, weights="reconstruct", split="even", **SMALL)
    for options in ({"weights": "reconstruct"}, {"split": "peak"}, {"method": "rdkv-reconstruct"}):
        with pytest.raises(rdkv.RDKVError, match="rdkv.prefill has no reconstruction pass"):
            rdkv.prefill(model, ids, 0.1, **options, **SMALL)


def test_blend_mixes_the_windows_token_weights_into_the_passes():
    """blend=a: each layer's token weights are (1 - a) x the pass's plus a x the window's scaled to the pass's total,
    so 0 is the pass's and 1 the window's up to one factor per layer; it needs the pass."""
    model = tiny_llama(2)
    ids = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(3))
    rec, _ = recorded(model, ids)
    reconstruct(rec)
    st, start = rec.layers[1], rec.layers[1].start
    recon = Weights(form="reconstruct", score="max").sums(st, start, False).mass2
    window = Weights(window=64).sums(st, start, False).mass2
    ratio = Weights(form="reconstruct", score="max", window=64, blend=1.0).sums(st, start, False).mass2 / window
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(recon.sum() / window.sum())))
    half = Weights(form="reconstruct", score="max", window=64, blend=0.5).sums(st, start, False).mass2
    torch.testing.assert_close(half, 0.5 * recon + 0.5 * window * recon.sum() / window.sum())
    assert not torch.allclose(half / half.sum(), recon / recon.sum(), rtol=0.05)  # the window moves the weights
    with pytest.raises(rdkv.RDKVError, match="use it with weights='reconstruct'"):
        Weights(blend=0.5)
    with pytest.raises(rdkv.RDKVError, match=r"fraction in \[0, 1\]"):
        Weights(form="reconstruct", blend=1.5)
