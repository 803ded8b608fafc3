"""rdkv.dense.attend against the softmax written out in full, on the shapes its callers give it."""
import pytest
import torch

from rdkv.dense import attend


def full(q, k, v, q_pos, k_pos, scaling, window, softcap, mask):
    """Every score, every key: the definition attend must reproduce."""
    B, Hq, L, D = q.shape
    H = k.shape[1]
    kk, vv = k.repeat_interleave(Hq // H, 1), v.repeat_interleave(Hq // H, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, kk) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok = ok & (q_pos[:, None] - k_pos[None, :] < window)
    ok = ok.expand(B, 1, L, -1) if mask is None else ok & mask
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    grouped = p.unflatten(1, (H, -1))
    nq = ok.any(-1).sum((1, 2)) * (Hq // H)  # (query, grouped head) pairs of one KV head that see a key
    o = torch.einsum("bhqk,bhkd->bhqd", p, vv)
    dist = (o[:, :, :, None] - vv[:, :, None]).square().sum(-1).unflatten(1, (H, -1))  # ||o_q - v_t||^2
    mass2 = (grouped**2).sum((2, 3))
    return o, grouped.sum((2, 3)), mass2, nq, grouped.amax((2, 3)), (grouped**2 * dist).sum((2, 3)) / mass2


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("order", ["ascending", "shuffled"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_attend_reads_only_visible_keys_and_matches_the_full_softmax(window, order, softcap):
    """A continued pass (queries after a prefix, as reconstruction and folds run it), chunks of a few queries (so
    chunks see different key ranges, and the first sees none), a bool mask; shuffled key positions take the path
    that reads every key."""
    g = torch.Generator().manual_seed(0)
    B, H, G, T, L, D = 2, 2, 3, 60, 24, 16
    k_pos = torch.arange(10, 10 + T)
    q_pos = torch.arange(T - L + 4, T + 4)  # the first queries precede some keys; position 5 sees none
    q_pos[0] = 5
    if order == "shuffled":
        k_pos = k_pos[torch.randperm(T, generator=g)]
    q = torch.randn(B, H * G, L, D, generator=g)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    mask = torch.rand(B, 1, L, T, generator=g) > 0.2
    out, sums = attend(q, k, v, q_pos, k_pos, 0.3, window, softcap, mask, elements=B * H * G * T * 4,  # 4 queries a chunk
                       drift=True)
    want, mass, mass2, nq, peak, drift = full(q, k, v, q_pos, k_pos, 0.3, window, softcap, mask)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums.mass, mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums.mass2, mass2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums.peak, peak, rtol=1e-5, atol=1e-6)
    read = mass2 > 0  # keys no query sees have no distance: NaN in both
    assert torch.equal(sums.drift.isnan(), ~read) and (~read).any() and read.any()
    torch.testing.assert_close(sums.drift[read], drift[read], rtol=1e-4, atol=1e-5)
    assert torch.equal(sums.nq, nq.float()) and out[:, :, 0].abs().max() == 0  # position 5 precedes every key
