"""Packing, byte accounting and the reference decode on synthetic tensors."""
import pytest
import torch

from rdkv import quant
from rdkv.distortion import LayerTables, fixed_bytes, layer_tables
from rdkv.errors import RDKVError
from rdkv.dense import AttentionSums
from rdkv.reference import trizone_attention
from rdkv.trizone import PackSpec, pack_layer

SPEC = PackSpec(v_group=16, k_group=8, k_block=16)
PER_WIDTH = PackSpec(v_group=(32, 16, 8), k_group=8, k_block=16)  # a V group size per width (2, 4, 8 bits)


def packed(seed=0, B=2, H=2, T=37, D=32, start=0, spec=SPEC):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g) * 2
    k[..., 3] += 20  # an outlier channel, as real keys have
    v = torch.randn(B, H, T, D, generator=g)
    widths = torch.tensor(quant.WIDTHS)
    vw = widths[torch.randint(0, 5, (B, H, T), generator=g)]
    kb = widths[torch.randint(0, 5, (B, H, D // spec.k_block), generator=g)].sort(-1).values
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(B * H)]).view(B, H, D)
    layer = pack_layer(k, v, start, vw, kb, perm, spec, torch.float16, None, start + T)
    return layer, k, v, vw, kb, perm


@pytest.mark.parametrize("spec", [SPEC, PER_WIDTH], ids=["one-v-group", "v-group-per-width"])
def test_dequantize_matches_each_width(spec):
    layer, k, v, vw, kb, perm = packed(spec=spec)
    K, V, pos, valid = layer.dequantize()
    B, H, T, D = k.shape
    kw = layer.k_widths()
    assert torch.equal(layer.v_widths(), vw)
    for s in range(B * H):
        b, h = divmod(s, H)
        n = int(valid[s].sum())
        assert n == int((vw[b, h] > 0).sum())
        p = pos[s, :n]
        assert torch.equal(p.sort().values, torch.nonzero(vw[b, h] > 0).squeeze(1))
        for w in quant.WIDTHS[1:]:
            sel = vw[b, h, p] == w
            if w == 16:
                want = v[b, h, p[sel]].half().float()
            else:
                g = spec.v_group_of(w)
                want = quant.fake_quantize(v[b, h, p[sel]].view(-1, D // g, g), w).flatten(-2)
            torch.testing.assert_close(V[s, :n][sel], want, rtol=0, atol=1e-6)
        kk = k[b, h, p]  # [n, D] true keys of the kept tokens
        for c in range(D):
            w, got = int(kw[b, h, c]), K[s, :n, c]
            if w == 0:
                torch.testing.assert_close(got, kk[:, c].mean().half().float().expand(n), rtol=0, atol=1e-6)
            elif w == 16:
                assert torch.equal(got, kk[:, c].half().float())
            else:  # per-channel groups of k_group tokens: error within half a step of the group's range
                rng = kk[:, c].max() - kk[:, c].min()
                assert (got - kk[:, c]).abs().max() <= rng / ((1 << w) - 1) / 2 * 1.01 + 2e-2


@pytest.mark.parametrize("spec", [SPEC, PER_WIDTH], ids=["one-v-group", "v-group-per-width"])
def test_nbytes_is_what_the_allocator_charges(spec):
    layer, k, v, vw, kb, perm = packed(seed=3, start=40000, spec=spec)
    B, H, T, D = k.shape
    present = torch.ones(B, H, T, dtype=torch.bool)
    pos_bytes = 4  # positions past 32767 need int32
    rv = torch.tensor([quant.row_bytes(w, D, spec.v_group_of(w) if w in quant.PACKED else D) + (pos_bytes if w else 0)
                       for w in quant.WIDTHS], dtype=torch.float64)
    sums = AttentionSums(torch.ones(B, H, T), torch.ones(B, H, T), torch.ones(B, H, D), torch.ones(B))
    assert torch.equal(layer_tables(k, v, present, sums, D**-0.5, spec, 40000 + T).rv, rv)  # what the solver charges
    tables = LayerTables(None, rv, present, None, None, spec, fixed_bytes(H, D, spec), torch.ones(B))
    idx = {w: i for i, w in enumerate(quant.WIDTHS)}
    v_cost = rv[vw.flatten().apply_(idx.get)].sum()
    n = (vw > 0).sum(-1)  # [B, H]
    rk = tables.rk(n)  # [B, H, 5]
    k_cost = sum(float(rk[b, h, idx[int(w)]]) for b in range(B) for h in range(H) for w in kb[b, h])
    assert layer.nbytes == B * tables.fixed + v_cost + k_cost


def test_pack_spec_checks_every_v_group():
    PER_WIDTH.check(32)
    for bad, match in (((32, 16), "one int per V width"), ((32, 12, 8), "v_group at 4 bits=12 must divide"),
                       ((32, 16, 2), "multiples of 4"), ("64", "one int per V width")):
        with pytest.raises(RDKVError, match=match):
            PackSpec(v_group=bad).check(32)
    assert PackSpec(v_group=[32, 16, 8]).v_group == (32, 16, 8)  # as rdkv.io reads it back from JSON


def dense_attention(q, K, V, allowed, scaling):
    s = torch.einsum("md,nd->mn", q, K) * scaling
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0) @ V


@pytest.mark.parametrize("L", [1, 3])
def test_decode_equals_dense_attention_over_the_dequantized_cache(L):
    layer, k, v, vw, kb, perm = packed(seed=5)
    B, H, T, D = k.shape
    G = 3
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # two continuation chunks: zone C grows
        layer.update(torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g))
    q = torch.randn(B, H * G, L, D, generator=g)
    out = trizone_attention(q, layer, 0.2)
    K, V, pos, valid = layer.dequantize()
    seq = layer.get_seq_length()
    for b in range(B):
        for h in range(H):
            s = b * H + h
            Kall = torch.cat([K[s][valid[s]], layer.t["kc"][b, h].float()])
            Vall = torch.cat([V[s][valid[s]], layer.t["vc"][b, h].float()])
            kpos = torch.cat([pos[s][valid[s]], torch.arange(T, seq)])
            for gi in range(G):
                qq = q[b, h * G + gi].float()
                qpos = torch.arange(seq - L, seq)
                want = dense_attention(qq, Kall, Vall, kpos[None] <= qpos[:, None], 0.2)
                torch.testing.assert_close(out[b, h * G + gi], want, rtol=1e-5, atol=1e-5)
