"""Eviction pricing (rdkv.distortion): a dominant group of tokens, or a crowd of light ones leaning the same
way, must not look free to evict."""
import pytest
import torch

import rdkv
from conftest import SMALL, recorded, tiny_llama
from rdkv.dense import AttentionSums, allowed_keys
from rdkv.distortion import eviction_cross, layer_tables
from rdkv.solvers.allocate import _reprice, allocate
from rdkv.layout import PackSpec

SPEC = PackSpec(**SMALL)
T, D, GROUP = 64, 32, 4


def sink_head(seed: int = 0):
    """One head where 4 tokens (positions 8..11) share one value and take 90% of the window mass (14x the
    mean token weight, so they count as heavy)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, 1, T, D, generator=g)
    v[..., 8:12, :] = 0.05 * torch.randn(D, generator=g)  # the sinks' common, small value
    mass = torch.full((1, 1, T), 0.1 * 64 / (T - GROUP))
    mass[..., 8:12] = 0.9 * 64 / GROUP  # 64 window queries
    sums = AttentionSums(mass, mass.square() / 64, torch.ones(1, 1, D) * 64, torch.tensor([64.0]))
    k = torch.randn(1, 1, T, D, generator=g)
    return k, v, sums


def true_error(v, mass, evicted):
    """Output shift of the window queries' mean attention when ``evicted`` tokens are dropped."""
    p = mass[0, 0] / mass[0, 0].sum()
    out = p @ v[0, 0]
    kept = p * ~evicted
    return float((kept @ v[0, 0] / kept.sum() - out).square().sum())


@pytest.mark.parametrize("evict_to", ["output", "heavy", "mean", "max", "kept"])
def test_a_dominant_group_is_priced_by_where_its_mass_goes(evict_to):
    k, v, sums = sink_head()
    present = torch.ones(1, 1, T, dtype=torch.bool)
    t = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to=evict_to)
    group, light = t.dv[0, 0, 8:12, 0].sum(), t.dv[0, 0, 12:16, 0].sum()
    group_err = true_error(v, sums.mass, torch.arange(T).ge(8) & torch.arange(T).lt(12))
    light_err = true_error(v, sums.mass, torch.arange(T).ge(12) & torch.arange(T).lt(16))
    true_ratio = group_err / light_err
    assert true_ratio > 500  # dropping the group moves the output; 4 light tokens barely do (measured 834)
    if evict_to in ("output", "kept"):  # measured from o, which is ~ the group's own value: looks cheap
        assert group / light < 0.01 * true_ratio  # measured 2
    else:  # heavy/mean/max measure (also) from the plain mean: within 10x of the truth (measured 183..187)
        assert group / light > 0.1 * true_ratio


def test_heavy_keeps_light_tokens_priced_from_the_output():
    k, v, sums = sink_head()
    present = torch.ones(1, 1, T, dtype=torch.bool)
    heavy = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to="heavy").dv[0, 0, :, 0]
    output = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to="output").dv[0, 0, :, 0]
    light = torch.ones(T, dtype=torch.bool)
    light[8:12] = False
    assert torch.equal(heavy[light], output[light])
    assert (heavy[~light] > 50 * output[~light]).all()  # measured 88x


def test_kept_repricing_only_raises_costs_and_catches_an_evicted_group():
    """evict_to="kept": once a pass evicts the group, the next prices it from the mean of what was kept."""
    k, v, sums = sink_head()
    present = torch.ones(1, 1, T, dtype=torch.bool)
    t = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, evict_to="kept")
    before = t.dv.clone()
    widths = torch.full((1, T), 2)
    widths[:, 8:12] = 0  # a pass that evicted the group
    dv = _reprice(t, 0, t.dv[0][t.present[0]], widths)
    assert (dv >= t.dv[0, 0]).all()
    assert (dv[8:12, 0] > 50 * t.dv[0, 0, 8:12, 0]).all()  # measured ~90x
    allocate([t], [0.1 * T * 4 * D], "layer", passes=3)
    assert torch.equal(t.dv, before)  # passes re-price copies: the tables stay reusable


def test_unknown_evict_to_is_refused():
    rec, _ = recorded(tiny_llama(), torch.randint(0, 96, (1, 40)))
    with pytest.raises(rdkv.RDKVError, match="evict_to"):
        rdkv.compress(rec, 0.3, evict_to="nowhere", **SMALL)


def output_error(q, k, v, q_pos, k_pos, evicted) -> float:
    """sum over queries of ||o(kept, renormalised) - o(all)||^2, from dense attention."""
    H, G = k.shape[0], q.shape[0] // k.shape[0]
    s = torch.einsum("hgqd,htd->hgqt", q.unflatten(0, (H, G)), k) * k.shape[-1] ** -0.5
    p = s.masked_fill(~allowed_keys(q_pos, k_pos, None), float("-inf")).softmax(-1)
    kept = p * ~evicted[:, None, None, :]
    return float((kept @ v[:, None] / kept.sum(-1, keepdim=True) - p @ v[:, None]).square().sum())


def test_eviction_cross_is_the_exact_marginal_error_minus_the_additive_term():
    """For every token, error(E with t) - error(E without t) = additive_t + cross_t, to float32 rounding."""
    g = torch.Generator().manual_seed(1)
    H, G, L, n, d = 2, 3, 5, 40, 8
    q, k = torch.randn(H * G, L, d, generator=g), torch.randn(H, n, d, generator=g)
    v = torch.randn(H, n, d, generator=g) + 2.0  # values share a direction: cross terms are large
    q_pos, k_pos = torch.arange(n - L, n), torch.arange(n)
    evicted = torch.rand(H, n, generator=g) < 0.3
    cross = eviction_cross(q, k, v, q_pos, k_pos, d**-0.5, None, None, torch.ones(H, n, dtype=torch.bool), evicted)
    s = torch.einsum("hgqd,htd->hgqt", q.unflatten(0, (H, G)), k) * d**-0.5
    p = s.masked_fill(~allowed_keys(q_pos, k_pos, None), float("-inf")).softmax(-1)
    additive = (p.square() * (v[:, None, None] - (p @ v[:, None])[..., None, :]).square().sum(-1)).sum((1, 2))
    big = 0
    for h in range(H):
        for t in range(n):
            with_t, without = evicted.clone(), evicted.clone()
            with_t[h, t], without[h, t] = True, False
            exact = output_error(q, k, v, q_pos, k_pos, with_t) - output_error(q, k, v, q_pos, k_pos, without)
            assert exact == pytest.approx(float(additive[h, t] + cross[h, t]), rel=1e-3, abs=1e-4)
            big += float(cross[h, t].abs()) > float(additive[h, t])
    assert big > n // 2  # the cross terms are not a small correction here (measured 59 of 80)


def crowd_head(seed: int = 0):
    """One head, 16 queries that favour 8 tokens (15% of their attention, 2.3x a uniform share); the values of
    the other 120 all sit near one point far from the favoured tokens' values (a crowd leaning one way)."""
    g = torch.Generator().manual_seed(seed)
    n, L, d = 128, 16, 32
    q = torch.randn(1, 1, L, d, generator=g)
    k = 0.3 * torch.randn(1, 1, n, d, generator=g)
    k[..., 60:68, :] += 3 * q.mean(2, keepdim=True) / q.mean(2).norm()  # the attended tokens
    v = 4.0 + 0.3 * torch.randn(1, 1, n, d, generator=g)
    v[..., 60:68, :] = torch.randn(8, d, generator=g)
    return q, k, v, torch.arange(n - L, n), torch.arange(n)


def test_joint_repricing_keeps_a_crowd_the_additive_price_evicts():
    """Evicted together, the crowd's tokens move the output many times their summed additive prices; with
    ``joint_reprice`` the allocator evicts fewer of them, and the real output error of what it evicts drops."""
    from rdkv.dense import attend
    from rdkv.distortion import JointEviction

    q, k, v, q_pos, k_pos = crowd_head()
    _, sums = attend(q, k, v, q_pos, k_pos, k.shape[-1] ** -0.5)
    present = torch.ones(1, 1, k.shape[2], dtype=torch.bool)
    budget = 0.15 * k.shape[2] * 4 * k.shape[-1]
    tables = lambda joint: layer_tables(k, v, present, sums, k.shape[-1] ** -0.5, SPEC, k.shape[2], joint=joint)  # noqa: E731
    plain = allocate([tables(None)], [budget], "layer")[0][0][0, 0]
    joint = allocate([tables(JointEviction(q, k, q_pos, k_pos))], [budget], "layer")[0][0][0, 0]
    err = lambda w: output_error(q[0], k[0], v[0], q_pos, k_pos, (w == 0)[None])  # noqa: E731
    assert int((joint == 0).sum()) < int((plain == 0).sum()) / 4  # measured 0 against 83
    assert err(joint) < 0.01 * err(plain)  # measured 2e-11 against 217


def test_window_option_takes_the_last_recorded_queries_and_refuses_more():
    rec, _ = recorded(tiny_llama(), torch.randint(0, 96, (1, 64)), window=16)
    st = rec.layers[0]
    from rdkv.weights import layer_sums
    assert torch.allclose(layer_sums(st, "window", window=16).mass, layer_sums(st, "window").mass)
    assert float(layer_sums(st, "window", window=4).nq[0]) == 4 * st.window_q.shape[1] // st.key.shape[1]
    assert not torch.allclose(layer_sums(st, "window", window=4).mass, layer_sums(st, "window").mass)
    with pytest.raises(rdkv.RDKVError, match="window=32 but the record kept only the last 16"):
        rdkv.compress(rec, 0.3, window=32, **SMALL)
    with pytest.raises(rdkv.RDKVError, match="window must be a positive int"):
        rdkv.compress(rec, 0.3, window=0, **SMALL)


def test_window_sliding_weighs_only_the_sliding_layers_by_its_own_window():
    """window_sliding changes the weights (so the tables) of Gemma 3's sliding layers and leaves the full
    layer exactly as it was; asking for more than the record kept is refused."""
    from conftest import tiny_gemma3

    from rdkv.pipeline import allocation_tables

    model = tiny_gemma3()
    rec, _ = recorded(model, torch.randint(0, 96, (1, 60)), window=16)
    _, base, _ = allocation_tables(rec, "rdkv", window=4, **SMALL)
    _, mixed, _ = allocation_tables(rec, "rdkv", window=4, window_sliding=16, **SMALL)
    kinds = model.config.layer_types
    for kind, a, b in zip(kinds, base, mixed):
        if kind == "full_attention":
            assert torch.equal(a.dv, b.dv) and torch.equal(a.dk, b.dk)
        else:
            assert not torch.allclose(a.dv[..., 1:], b.dv[..., 1:])
    assert float(mixed[0].nq[0]) == 16 * 2 and float(mixed[2].nq[0]) == 4 * 2  # queries x query heads
    with pytest.raises(rdkv.RDKVError, match="window_sliding=32 but the record kept only the last 16"):
        rdkv.compress(rec, 0.3, window_sliding=32, **SMALL)
    with pytest.raises(rdkv.RDKVError, match="window_sliding must be a positive int"):
        rdkv.compress(rec, 0.3, window_sliding=True, **SMALL)


def test_q_floor_mixes_the_channel_mean_into_k_weights():
    """q_floor=f prices K as if each channel's squared query weight were (1-f) q2 + f mean(q2): checked
    against tables built from sums whose q2 was mixed by hand. A channel the window never queried still
    costs something at f > 0, and V prices do not move."""
    import dataclasses

    k, v, sums = sink_head(1)
    q2 = torch.zeros(1, 1, D)
    q2[..., :8] = 64.0 * 4  # the window used 8 of 32 channels only
    sums = dataclasses.replace(sums, q2=q2)
    present = torch.ones(1, 1, T, dtype=torch.bool)
    plain = layer_tables(k, v, present, sums, D**-0.5, SPEC, T)
    for f in (0.25, 1.0):
        floored = layer_tables(k, v, present, sums, D**-0.5, SPEC, T, q_floor=f)
        mixed = dataclasses.replace(sums, q2=(1 - f) * q2 + f * q2.mean(-1, keepdim=True))
        want = layer_tables(k, v, present, mixed, D**-0.5, SPEC, T)
        assert torch.allclose(floored.dk, want.dk) and torch.equal(floored.perm, want.perm)
        assert torch.equal(floored.dv, plain.dv)
    assert (plain.dk[0, 0, :, 1] == 0).sum() >= 1 and (floored.dk[0, 0, :, 1] > 0).all()  # unqueried blocks now cost
    with pytest.raises(rdkv.RDKVError, match="q_floor must be a fraction"):
        rdkv.methods.Weights(q_floor=1.5)


def test_per_visible_weighs_each_token_by_the_window_queries_that_can_see_it():
    """Against dense attention: squared mass per window query that can see the token, times W. Tokens older
    than the window are unchanged; the last token, seen only by the last query, is scaled by W."""
    from rdkv.weights import layer_sums, per_visible

    rec, _ = recorded(tiny_llama(5), torch.randint(0, 96, (1, 64)), window=16)
    st = rec.layers[0]
    plain = layer_sums(st, "window", window=16)
    got = per_visible(plain, st, st.start, 16)
    q, k = st.window_q[0].float(), st.key[0].float()  # [Hq, 16, D], [H, 64, D]
    q_pos, k_pos = torch.arange(48, 64), torch.arange(64)
    ok = allowed_keys(q_pos, k_pos, None)
    p = (torch.einsum("hqd,htd->hqt", q, k.repeat_interleave(2, 0)) * st.scaling).masked_fill(~ok, float("-inf")).softmax(-1)
    want = p.square().sum(1).unflatten(0, (2, 2)).sum(1) * 16 / ok.sum(0)  # grouped heads summed, per visible query
    assert torch.allclose(got.mass2[0], want, rtol=1e-4, atol=1e-7)
    assert torch.equal(got.mass2[..., :48], plain.mass2[..., :48])
    assert torch.allclose(got.mass2[..., 63], 16 * plain.mass2[..., 63])
    assert torch.equal(got.q2, plain.q2) and torch.equal(got.nq, plain.nq)
    half = per_visible(plain, st, st.start, 16, power=0.5)  # part of the way: (W / seen) ** 0.5
    assert torch.allclose(half.mass2[..., 63], 4 * plain.mass2[..., 63])
    capped = per_visible(plain, st, st.start, 16, cap=4.0)  # factors above 4 (tokens seen by < 4 queries) clipped
    assert torch.allclose(capped.mass2[..., 63], 4 * plain.mass2[..., 63])
    assert torch.equal(capped.mass2[..., :61], got.mass2[..., :61])
    with pytest.raises(rdkv.RDKVError, match="visible_cap must be a number >= 1"):
        rdkv.compress(rec, 0.3, visible=1, visible_cap=0.5, **SMALL)
    with pytest.raises(rdkv.RDKVError, match="visible must be a number in"):
        rdkv.compress(rec, 0.3, visible=2, **SMALL)


def test_lifetime_is_the_share_of_the_next_decode_queries_that_see_each_token():
    """Against the sliding-window mask itself: for each held token, the fraction of the next ``horizon``
    decode positions whose window still contains it. The newest token stays visible throughout (for a
    horizon shorter than the window), the oldest for one step."""
    from rdkv.weights import lifetime

    seen, window = 40, 16
    pos = torch.arange(seen - window + 1, seen)
    for horizon in (1, 8, 16, 50):
        future = torch.arange(seen, seen + horizon)
        want = allowed_keys(future, pos, window).float().mean(0)
        assert torch.equal(lifetime(pos, seen, window, horizon), want)
    assert float(lifetime(pos, seen, window, 8)[-1]) == 1.0 and float(lifetime(pos, seen, window, 8)[0]) == 1 / 8


def test_horizon_moves_bits_to_the_tokens_a_sliding_layer_keeps_longest():
    """``horizon`` prices a sliding-window layer's tokens by how long they stay visible: in the same bytes,
    the newer half of each sliding layer's tokens gets more V bits and the older half fewer; the full-attention
    layer (every token stays visible) is allocated exactly as without it. A bad value is refused."""
    from conftest import tiny_gemma3

    model = tiny_gemma3(2, window=128)  # sliding layers of 8 pages of 16 tokens
    rec, _ = recorded(model, torch.randint(0, 96, (1, 300)), window=16)
    plain = rdkv.compress(rec, 0.4, method="rdkv", **SMALL)  # (auto would pick rdkv-hybrid, horizon 512)
    long = rdkv.compress(rec, 0.4, method="rdkv", horizon=128, **SMALL)
    assert long.nbytes <= 0.4 * long.fp16_bytes
    for kind, a, b in zip(model.config.layer_types, plain.layers, long.layers):
        va, vb = a.v_widths().float(), b.v_widths().float()
        if kind == "full_attention":
            assert torch.equal(va, vb)
        else:
            half = va.shape[-1] // 2
            assert vb[..., half:].mean() > va[..., half:].mean() and vb[..., :half].mean() < va[..., :half].mean()
    with pytest.raises(rdkv.RDKVError, match="horizon must be a positive int"):
        rdkv.compress(rec, 0.3, horizon=0, **SMALL)


def test_layer_gains_move_bytes_toward_the_layer_weighed_more():
    """One knapsack over both layers with each layer's distortion scaled: weighing layer 0 a thousand times
    more than layer 1 gives it more of the bytes than the reverse does, in the same total; gains of 1
    change nothing. Wrong length, non-positive gains and joint eviction pricing are refused."""
    rec, _ = recorded(tiny_llama(4), torch.randint(0, 96, (1, 100)))
    kw = dict(scope="global", **SMALL)
    plain = rdkv.compress(rec, 0.25, **kw)
    ones = rdkv.compress(rec, 0.25, layer_gains=(1.0, 1.0), **kw)
    assert [layer.nbytes for layer in ones.layers] == [layer.nbytes for layer in plain.layers]
    first = rdkv.compress(rec, 0.25, layer_gains=(1e3, 1e-3), **kw)
    second = rdkv.compress(rec, 0.25, layer_gains=(1e-3, 1e3), **kw)
    assert max(first.nbytes, second.nbytes) <= 0.25 * first.fp16_bytes
    assert first.layers[0].nbytes > second.layers[0].nbytes and first.layers[1].nbytes < second.layers[1].nbytes
    for bad, match in (((1.0,), "layer_gains has 1 entries"), ((1.0, 0.0), "positive finite"),
                       ((1.0, float("nan")), "positive finite")):
        with pytest.raises(rdkv.RDKVError, match=match):
            rdkv.compress(rec, 0.25, layer_gains=bad, **kw)
    with pytest.raises(rdkv.RDKVError, match="evict_jointly"):
        rdkv.compress(rec, 0.25, layer_gains=(1.0, 1.0), evict_jointly=True, **kw)


def test_sinks_are_the_sequence_s_first_tokens_not_a_sliding_window_s_oldest():
    """Eviction protection (``sinks``) covers the first real tokens of the sequence. A sliding-window layer that
    no longer holds them protects none of its tokens: its oldest are about to leave the window."""
    from conftest import tiny_gemma3

    model = tiny_gemma3(0)
    rec, _ = recorded(model, torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(0)))
    _, tables, _ = rdkv.pipeline.allocation_tables(rec, "rdkv", sinks=4, recent=0, **SMALL)
    kinds = model.config.layer_types
    for t, kind in zip(tables, kinds):
        pinned = t.protect[0]  # [H, held]: tokens the allocator may not evict
        if kind == "full_attention":
            assert pinned[:, :4].all() and not pinned[:, 4:].any()
        else:
            assert t.dv.shape[2] == 15 and not pinned.any()  # the window: 15 held tokens and the next query


@pytest.mark.parametrize("seed", range(4))
def test_copying_queries_price_key_errors_by_their_own_outputs(seed):
    """Queries that each copy one token (92-97% of their attention on it, as the reconstruction pass's do) barely
    move when K is quantized: the copied token's value is already their output. Priced from each key's distance to
    the outputs that read it (AttentionSums.drift) the K tables are within 4x of the output error K quantization
    really causes at 4 and 8 bits (measured 0.68-3.8x over seeds 0-3); priced from one mean output they are 150x
    or more too high (measured 155-1150x), which made K look dearer than tokens. Evicting a copied token still
    costs what it did: its readers lose the value they copy, not a key error's nudge."""
    import dataclasses

    from rdkv import quant
    from rdkv.dense import attend

    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, 1, T, D, generator=g), torch.randn(1, 1, T, D, generator=g)
    pos, q_pos = torch.arange(T), torch.full((T,), T)
    out, sums = attend(2.0 * k, k, v, q_pos, pos, D**-0.5, drift=True)  # query i copies token i
    present = torch.ones(1, 1, T, dtype=torch.bool)
    measured = layer_tables(k, v, present, sums, D**-0.5, SPEC, T)
    mean_output = layer_tables(k, v, present, dataclasses.replace(sums, drift=None), D**-0.5, SPEC, T)
    assert torch.equal(measured.dv, mean_output.dv)
    page = 32  # rdkv.pages.page_tokens(32, SPEC, 64): one K scale group
    for bits, width in ((4, 2), (8, 3)):
        kq = quant.fake_quantize(k.transpose(-1, -2).unflatten(-1, (-1, page)), bits).flatten(-2).transpose(-1, -2)
        actual = float((attend(2.0 * k, kq, v, q_pos, pos, D**-0.5)[0] - out).square().sum())
        assert 0.25 < float(measured.dk.sum((0, 1, 2))[width]) / actual < 4
        assert float(mean_output.dk.sum((0, 1, 2))[width]) / actual > 50
