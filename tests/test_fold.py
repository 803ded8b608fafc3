"""Folding zone C during long generations: bounded zone C, bytes at the policy's rate, exact bookkeeping."""
import pytest
import torch

from rdkv import layout, pages

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama
from rdkv.fold import FoldPolicy


def prefill(model, n, seed=0):
    """(record, full cache) of a prefill of ``n`` random tokens."""
    ids = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))
    rec, out = recorded(model, ids)
    return rec, out.past_key_values


def fp16_bytes(layer, tokens: int) -> int:
    return tokens * 4 * layer.heads * layer.head_dim * layer.batch


@pytest.mark.parametrize("fold", [None, 64])
def test_two_thousand_decode_steps_keep_length_positions_masks_and_memory_policy(fold):
    """At budget 1.0 every width is (nearly) lossless, so folded or not, logits track the full cache."""
    model = tiny_llama(6)
    rec, full = prefill(model, 48)  # 3 pages of 16 tokens
    cache = rdkv.compress(rec, 1.0, fold=fold, **SMALL)
    toks = torch.randint(0, 96, (1, 2000), generator=torch.Generator().manual_seed(0))
    done = 0
    for step in range(2000):
        got = model(toks[:, step : step + 1], past_key_values=cache).logits
        if step % 500 == 499:  # the full cache catches up in one teacher-forced chunk
            want = model(toks[:, done : step + 1], past_key_values=full).logits[:, -1:]
            done = step + 1
            torch.testing.assert_close(got, want, rtol=0, atol=5e-3)
    assert cache.get_seq_length() == full.get_seq_length() == 2048
    for layer in cache.layers:
        n_c = layout.zone_c(layer)[0].shape[2]
        if fold is None:
            assert n_c == 2000 and not layer.folds  # zone C holds exactly the new tokens
            continue
        assert n_c < 64 + 32 and len(layer.folds) == (2000 - 32) // 64
        spans = [(f.start, f.prefix_len) for f in layer.folds]
        assert spans == [(48 + 64 * j, 112 + 64 * j) for j in range(len(spans))]  # contiguous, in order
        assert layer.c_start == spans[-1][1] and layer.c_start + n_c == 2048
        for f in layer.folds:  # each fold holds at most the budget fraction of its tokens' fp16 bytes
            assert f.nbytes <= fp16_bytes(layer, 64)
            assert sorted(pages.positions(f).unique().tolist()) == list(range(f.start, f.prefix_len))


def test_fold_at_a_low_budget_charges_each_fold_its_fraction():
    model = tiny_llama(2)
    rec, _ = prefill(model, 200)
    budget = 0.2
    cache = rdkv.compress(rec, budget, fold=FoldPolicy(every=128, budget=budget, keep=8, window=4), **SMALL)
    prefix = cache.nbytes
    toks = torch.randint(0, 96, (1, 400), generator=torch.Generator().manual_seed(1))
    for step in range(400):
        model(toks[:, step : step + 1], past_key_values=cache)
    for layer in cache.layers:
        assert len(layer.folds) == 3 and layout.zone_c(layer)[0].shape[2] == 400 - 3 * 128 < 128 + 8
        assert layout.decode_queries(layer).shape[2] == 4
        for f in layer.folds:
            assert f.nbytes <= budget * fp16_bytes(layer, 128)
            assert (f.v_widths() < 16).float().mean() > 0.5  # at 20% most folded rows are quantized
    zone_c = sum(layout.zone_c(l)[0].nbytes + layout.zone_c(l)[1].nbytes + layout.decode_queries(l).nbytes for l in cache.layers)
    folded = sum(fp16_bytes(l, 3 * 128) for l in cache.layers)
    assert cache.nbytes <= prefix + budget * folded + zone_c
    assert sum(cache.report().components.values()) == cache.nbytes  # folds and kept queries are accounted


def test_sliding_layers_drop_folds_no_query_can_see():
    model = tiny_gemma3(3)
    rec, full = prefill(model, 40)
    cache = rdkv.compress(rec, 0.5, fold=16, **SMALL)
    toks = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(2))
    for step in range(300):
        got = model(toks[:, step : step + 1], past_key_values=cache).logits
    want = model(toks, past_key_values=full).logits[:, -1:]
    assert got.argmax(-1).item() == want.argmax(-1).item()
    sliding, full_layer = cache.layers[0], cache.layers[2]
    assert sliding.sliding_window == 16 and full_layer.sliding_window is None
    assert len(sliding.folds) <= 2 and len(full_layer.folds) == (300 - 32) // 16
    seq = cache.get_seq_length()
    assert all(f.prefix_len - 1 > seq - 16 - 16 for f in sliding.folds)


def test_folded_cache_saves_loads_and_continues_identically(tmp_path):
    model = tiny_llama(4)
    rec, _ = prefill(model, 60)
    cache = rdkv.compress(rec, 0.3, fold=40, **SMALL)
    toks = torch.randint(0, 96, (1, 160), generator=torch.Generator().manual_seed(3))
    for step in range(100):
        model(toks[:, step : step + 1], past_key_values=cache)
    rdkv.save(cache, tmp_path / "c.safetensors")
    back = rdkv.load(tmp_path / "c.safetensors")
    assert back.nbytes == cache.nbytes and len(back.layers[0].folds) == len(cache.layers[0].folds) == 1
    assert back.layers[0].fold == cache.layers[0].fold
    for step in range(100, 160):  # both fold again at the same step
        a = model(toks[:, step : step + 1], past_key_values=cache).logits
        b = model(toks[:, step : step + 1], past_key_values=back).logits
        assert torch.equal(a, b)
    assert len(back.layers[0].folds) == 3 and back.nbytes == cache.nbytes


def test_folds_price_with_the_method_the_cache_was_compressed_with():
    """On one compressed prefix, a fold under the cache's own method (the paper's distortion model here)
    allocates as an explicit policy with that method does, and unlike one with the default method."""
    model = tiny_llama(4)
    rec, _ = prefill(model, 60)
    toks = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(3))

    def folded(fold) -> list[torch.Tensor]:
        cache = rdkv.compress(rec, 0.2, fold=fold, distortion="paper", **SMALL)
        for step in range(80):
            model(toks[:, step : step + 1], past_key_values=cache)
        return cache.layers[0].fold.method, [f.v_widths() for layer in cache.layers for f in layer.folds]

    method, own = folded(40)
    assert method == rdkv.RDKV(distortion="paper", spec=rdkv.PackSpec(**SMALL), weights=rdkv.methods.Weights(window=64))
    _, explicit = folded(FoldPolicy(every=40, budget=0.2, method=method))
    _, default = folded(FoldPolicy(every=40, budget=0.2, method=rdkv.RDKV(spec=rdkv.PackSpec(**SMALL))))
    assert len(own) == 2 and all(torch.equal(a, b) for a, b in zip(own, explicit))
    assert not all(torch.equal(a, b) for a, b in zip(own, default))


@pytest.mark.parametrize("fold,match", [(0, "positive int"), (True, "positive int"), (2.5, "positive int"),
                                        (1, "fold at least")])
def test_bad_fold_policies_raise_before_anything_changes(fold, match):
    model = tiny_llama(5)
    rec, _ = prefill(model, 30)
    with pytest.raises(rdkv.RDKVError, match=match):
        rdkv.compress(rec, 0.5, fold=fold, **SMALL)
    layer = rdkv.compress(rec, 0.5, **SMALL).layers[0]
    with pytest.raises(rdkv.RDKVError, match="budget"):
        FoldPolicy(every=64, budget=1.5).check(layer)
    with pytest.raises(rdkv.RDKVError, match="prices with an RDKV method"):
        FoldPolicy(every=64, budget=0.5, method=rdkv.methods.SnapKV()).check(layer)
