"""Pre-RoPE keys (rdkv.rope): packed un-rotated, rotated back at decode, refused where they cannot be."""
import copy

import pytest
import torch

from rdkv import layout
from hypothesis import given, settings
from hypothesis import strategies as st

import rdkv
from conftest import SMALL, recorded, tiny_gemma3, tiny_llama
from rdkv.io import load, save
from rdkv.rope import pair_mean, rotate


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.floats(0.5, 2.0), half=st.sampled_from([2, 16, 64]))
def test_inverse_rotation_undoes_rope_with_attention_scaling(seed, scale, half):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(3, 40, 2 * half, generator=g)
    pos = torch.randint(0, 9000, (3, 40), generator=g)
    table = torch.cat([1.0 / 10000 ** (torch.arange(half) / half), torch.tensor([scale])])
    back = rotate(rotate(k, pos, table, inverse=True), pos, table)
    assert torch.allclose(back, k, atol=1e-4, rtol=1e-4)


def test_pair_mean_spreads_each_pair_evenly():
    q2 = torch.tensor([4.0, 0.0, 2.0, 6.0])  # pairs (0, 2) and (1, 3)
    assert torch.equal(pair_mean(q2), torch.tensor([3.0, 3.0, 3.0, 3.0]))


def logits_after(model, ids, budget, **kw):
    """(compressed cache, its logits over ids[:, 64:], the full cache's, the full prefill cache): 64 tokens
    compressed, 4 pages of 16."""
    rec, out = recorded(model, ids[:, :64])
    full = out.past_key_values
    cache = rdkv.compress(rec, budget, **SMALL, **kw)
    got = model(ids[:, 64:], past_key_values=cache).logits
    ref = model(ids[:, 64:], past_key_values=copy.deepcopy(full)).logits
    return cache, got, ref, full


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_prerope_at_full_budget_reproduces_the_full_cache(make):
    ids = torch.randint(0, 96, (2, 74), generator=torch.Generator().manual_seed(1))
    cache, got, ref, full = logits_after(make(), ids, 1.0, prerope=True)
    # nearly a 16-bit cache: measured 3e-4 (Llama); Gemma 3's 15-token windows fill one page of 16 with a few tokens
    # at 8 bits, 3.1e-3
    assert (got - ref).abs().max() < 5e-3
    for layer, plain in zip(cache.layers, full.layers):
        assert layout.rope_table(layer) is not None
        K, _, pos, valid = layer.dequantize()  # rotated back at the kept positions
        keys = plain.keys.flatten(0, 1)  # a sliding layer's plain cache holds only its last positions
        want = keys.gather(1, (pos - (64 - keys.shape[1]))[..., None].expand_as(K))
        assert valid.all()  # budget 1.0 keeps every position
        # budget 1.0 still pays for indices, so a few K blocks drop to 8 bits: half a step of a range < 8
        assert (K - want).abs().max() < 8 / 255 / 2
        layout.set_rope_table(layer, None)
        stored, _, _, _ = layer.dequantize()  # without the table: the keys as packed, before RoPE
        assert (stored - want)[:, 1:].abs().max() > 0.1  # position 0 has angle 0, every later one turns


def test_prerope_cache_saves_loads_and_counts_its_table(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 96, (1, 74), generator=torch.Generator().manual_seed(2))
    cache, got, _, _ = logits_after(model, ids, 0.3, prerope=True)  # compress checks the budget itself
    assert layout.rope_table(cache.layers[0]).numel() == 32 // 2 + 1  # head_dim 32: 16 frequencies and the scaling
    save(cache, tmp_path / "c.safetensors")
    back = load(tmp_path / "c.safetensors")
    nxt = torch.randint(0, 96, (1, 1))
    assert torch.equal(model(nxt, past_key_values=cache).logits, model(nxt, past_key_values=back).logits)


def test_a_model_without_rotate_half_rope_is_refused_and_nothing_changes():
    model = tiny_llama()
    rec, _ = recorded(model, torch.randint(0, 96, (1, 40)))
    model.config.model_type = "phi"
    with pytest.raises(rdkv.RDKVError, match="rotate-half"):
        rdkv.compress(rec, 0.3, prerope=True, **SMALL)
    model.config.model_type = "llama"
    assert rdkv.compress(rec, 0.3, **SMALL).nbytes > 0


def test_triton_decode_refuses_a_damaged_rope_table():
    """The kernel rotates pre-RoPE keys itself (tests/test_kernel_decode.py); a table of the wrong size or
    dtype would make it read past the frequencies, so it is refused."""
    pytest.importorskip("triton")
    from rdkv.kernels.page_decode import check

    rec, _ = recorded(tiny_llama(), torch.randint(0, 96, (1, 40)))
    layer = rdkv.compress(rec, 0.3, prerope=True, **SMALL).layers[0]
    check(torch.zeros(1, 4, 1, 32), layer, None, None)
    for bad in (layout.rope_table(layer)[:-1], layout.rope_table(layer).double()):
        layout.set_rope_table(layer, bad)
        with pytest.raises(rdkv.RDKVError, match="RoPE table"):
            check(torch.zeros(1, 4, 1, 32), layer, None, None)


def test_rope_whose_angles_are_not_position_times_frequency_is_refused():
    model = tiny_llama()
    rec, _ = recorded(model, torch.randint(0, 96, (1, 40)))
    rot = model.model.rotary_emb
    plain = rot.forward
    rot.forward = lambda x, pos: tuple(t * 1.1 for t in plain(x, pos))  # e.g. a sequence-dependent scaling
    with pytest.raises(rdkv.RDKVError, match="not position x inv_freq"):
        rdkv.compress(rec, 0.3, prerope=True, **SMALL)
