"""The page layout (rdkv.pages) and its Triton decode kernel (rdkv.kernels.page_decode), under TRITON_INTERPRET=1.

The oracle reads the pages back in torch (``pages.dequantize``); the kernel must match attention over it within
the fp16 tolerances of tests/test_kernel_decode.py (same rounding steps: q * scale instead of the dequantized K,
each rounded once to fp16). RDKV_TEST_DEVICE=cuda runs them compiled on a GPU (scripts/gpu_check.sh)."""
import importlib
import os
import sys

import pytest
import torch

DEVICE = os.environ.get("RDKV_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
elif not torch.cuda.is_available():
    pytest.skip(f"RDKV_TEST_DEVICE={DEVICE} but no GPU is visible", allow_module_level=True)

from rdkv import layout, pages
from rdkv.dense import allowed_keys
from rdkv.layout import PackSpec
from rdkv.reference import merge, partial_attention, queries
from rdkv.trizone import TriZoneLayer

for _name in ("rdkv.kernels.lse_merge", "rdkv.kernels.device.trizone_decode", "rdkv.kernels.trizone_decode",
              "rdkv.kernels.device.page_decode", "rdkv.kernels.page_decode"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
from rdkv.kernels.page_decode import page_decode  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
if DEVICE != "cpu":  # fp32 dots use "ieee" on GPU too, but accumulation order differs more across warps
    TOL[torch.float32] = dict(atol=1e-4, rtol=1e-4)


def build(seed, B, H, T, D, vmix=(0, 2, 4, 8, 16), kmix=(0, 2, 4, 8, 16), n_c=5, start=7):
    spec = PackSpec(v_group=32, k_group=64, k_block=16)
    g = torch.Generator().manual_seed(seed)
    S = B * H
    k = torch.randn(S, T, D, generator=g) * 1.5
    k[..., 5] += 12.0
    v = torch.randn(S, T, D, generator=g)
    vw = torch.tensor(vmix)[torch.randint(0, len(vmix), (S, T), generator=g)]
    kb = torch.tensor(kmix)[torch.randint(0, len(kmix), (S, D // 16), generator=g)]
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(S)])
    t = pages.pack(k, v, start, vw, kb, perm, spec, torch.float16)
    t["kc"] = torch.randn(B, H, n_c, D, generator=g).half()
    t["vc"] = torch.randn(B, H, n_c, D, generator=g).half()
    t = {name: x.to(DEVICE) for name, x in t.items()}
    layer = TriZoneLayer(t, batch=B, heads=H, head_dim=D, start=start, prefix_len=start + T, spec=spec,
                         sliding_window=None, dtype16=torch.float16)
    return layer, k, v, vw, kb, perm


def reference(q, layer, scaling, window=None):
    """Attention over every segment's dequantized pages and zone C."""
    qq, q_pos, window, _ = queries(q, layer, window, None)
    S, _, D = qq.shape
    parts = []
    for seg in layer.segments():
        K, V, pos, valid = pages.dequantize_segment(seg)  # pre-RoPE keys rotated to their positions
        parts.append(partial_attention(qq, K, V, allowed_keys(q_pos, pos, window) & valid.unsqueeze(1), scaling, None))
    kc, vc = (x.float().reshape(S, -1, D) for x in layout.zone_c(layer))
    c_pos = torch.arange(layer.c_start, layer.get_seq_length(), device=qq.device)
    parts.append(partial_attention(qq, kc, vc, allowed_keys(q_pos, c_pos, window).expand(S, -1, -1), scaling, None))
    return merge(parts).reshape(q.shape).to(q.dtype)


def test_pages_round_trip():
    """Every kept token comes back at its position, V/K within half a quantization step of their width."""
    layer, k, v, vw, kb, perm = build(0, 1, 3, 300, 64)
    P = pages.segment_page(layer)
    K, V, pos, valid = (x.cpu() for x in pages.dequantize(layer.t, layer.spec, 64, layer.prefix_len, P, torch.float16))
    s, i = valid.nonzero(as_tuple=True)
    p = pos[s, i] - layer.start
    assert int(valid.sum()) == int((vw > 0).sum()) and bool((vw[s, p] > 0).all())
    err = (V[s, i] - v[s, p]).abs()
    for w, bound in ((16, 2e-3), (8, 0.02)):  # 8 bits over a ~7-wide group: step 0.03
        assert float(err[vw[s, p] == w].max()) < bound
    assert pages.PagePlan.build(layout.counts(layer), layout.k_bits(layer), layer.spec, 64, layer.prefix_len, P).total \
        == pages.buffer(layer).numel()


@pytest.mark.parametrize("B,H,T,D,G,L,dtype,vmix,kmix", [
    (2, 2, 300, 64, 4, 1, torch.float16, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),
    (1, 2, 500, 128, 8, 1, torch.float32, (0, 2, 4, 8, 16), (2, 4, 8, 16)),
    (1, 1, 200, 256, 2, 3, torch.float16, (0, 2, 8), (0, 4, 16)),
    (1, 2, 150, 256, 3, 1, torch.float32, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),  # K in chunks of 16 channels
    (2, 1, 300, 32, 4, 1, torch.float16, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),
    (2, 1, 120, 64, 3, 1, torch.float16, (0,), (0, 2, 4, 8, 16)),  # everything evicted: zone C only
])
def test_page_kernel_matches_oracle(B, H, T, D, G, L, dtype, vmix, kmix):
    layer = build(T + D, B, H, T, D, vmix, kmix)[0]
    q = torch.randn(B, H * G, L, D, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    got = page_decode(q, layer, D ** -0.5)
    torch.testing.assert_close(got.float(), reference(q, layer, D ** -0.5).float(), **TOL[dtype])


def test_masks_and_softcap():
    """A bool mask (left padding, a query row that sees nothing) and a softcap, against the torch decode path."""
    from rdkv.reference import trizone_attention

    layer = build(21, 2, 2, 250, 64, n_c=6)[0]
    L, seq = 3, layer.get_seq_length()
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 1, L, seq, generator=g) > 0.3
    mask[1, :, :, :40] = False
    mask[0, :, 1, :] = False
    mask = mask.to(DEVICE)
    q = (torch.randn(2, 8, L, 64, generator=g) * 4).to(DEVICE)
    for softcap in (None, 5.0):
        got = page_decode(q, layer, 0.125, None, softcap, mask)
        torch.testing.assert_close(got, trizone_attention(q, layer, 0.125, None, softcap, mask), **TOL[torch.float32])
        assert got[0, :, 1].abs().max() == 0


@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter computes bf16 wrongly")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_bf16_queries_on_gpu(D):
    layer = build(30 + D, 2, 2, 600, D)[0]
    q = torch.randn(2, 8, 1, D, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    torch.testing.assert_close(page_decode(q, layer, D ** -0.5).float(), reference(q, layer, D ** -0.5).float(),
                               **TOL[torch.bfloat16])


def rope_table(D: int) -> torch.Tensor:
    """D/2 inverse frequencies, then an attention scaling that is not 1 (rdkv.rope's table)."""
    return torch.cat([10000.0 ** -(torch.arange(0, D, 2, dtype=torch.float32) / D), torch.tensor([1.25])]).to(DEVICE)


@pytest.mark.parametrize("D,start,dtype,kmix", [(64, 0, torch.float32, (0, 2, 4, 8, 16)),
                                                (128, 8000, torch.float16, (0, 2, 4, 8, 16)),
                                                (64, 40, torch.float16, (0,))])  # every K channel a mean
def test_pre_rope_keys_are_rotated_to_each_page(D, start, dtype, kmix):
    """Keys packed before RoPE: the kernel rotates every width's channels (means included) to each page's
    positions; without the table the output differs, so the rotation is what the oracle checks."""
    layer = build(D, 2, 2, 300, D, kmix=kmix, start=start)[0]
    q = torch.randn(2, 6, 2, D, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    plain = page_decode(q, layer, D ** -0.5)
    layout.set_rope_table(layer, rope_table(D))
    got = page_decode(q, layer, D ** -0.5)
    torch.testing.assert_close(got.float(), reference(q, layer, D ** -0.5).float(), **TOL[dtype])
    assert (got.float() - plain.float()).abs().max() > 0.05


@pytest.mark.parametrize("split", [None, 64])
def test_folds_merge_with_the_prefix_and_zone_c(split):
    """A pre-RoPE prefix, two post-RoPE folds (one fully evicted) and zone C in one call, with and without a window
    that hides the prefix; ``split`` in tokens: one page per work item."""
    from rdkv.kernels.trizone_decode import LaunchConfig

    layer = build(13, 2, 2, 300, 64, n_c=0, start=0)[0]
    layout.set_rope_table(layer, rope_table(64))
    layer.folds = [build(14, 2, 2, 150, 64, n_c=0, start=300)[0], build(15, 2, 2, 90, 64, vmix=(0,), n_c=0, start=450)[0]]
    layer.c_start = 540
    g = torch.Generator().manual_seed(2)
    layer.update(*(torch.randn(2, 2, 7, 64, generator=g).to(DEVICE) for _ in range(2)))
    for dtype, window in ((torch.float16, None), (torch.float32, 200)):
        q = torch.randn(2, 6, 2, 64, generator=g).to(DEVICE, dtype)
        got = page_decode(q, layer, 0.125, sliding_window=window, launch=LaunchConfig(split=split))
        torch.testing.assert_close(got.float(), reference(q, layer, 0.125, window).float(), **TOL[dtype])


def test_the_triton_backend_sends_a_cache_in_pages_to_the_page_kernel(monkeypatch):
    """rdkv.decode picks the kernel by the layer's layout; a layer mixing layouts is refused by both kernels."""
    from rdkv import decode
    from rdkv.errors import RDKVError
    from rdkv.kernels.trizone_decode import trizone_decode
    from rdkv.trizone import pack_layer

    monkeypatch.setenv("RDKV_BACKEND", "triton")
    layer = build(40, 1, 2, 200, 64)[0]
    q = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    torch.testing.assert_close(decode.trizone_decode(q, layer, 0.125), reference(q, layer, 0.125), **TOL[q.dtype])
    with pytest.raises(RDKVError, match="in the packed layout only; this layer's segments are: pages"):
        trizone_decode(q, layer, 0.125)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 1, 2, 50, 64, generator=g).to(DEVICE)
    layer.folds = [pack_layer(k, v, 207, torch.full((1, 2, 50), 4, device=DEVICE),
                              torch.full((1, 2, 4), 8, device=DEVICE), torch.arange(64, device=DEVICE).expand(1, 2, 64),
                              layer.spec, torch.float16, None, 257)]
    with pytest.raises(RDKVError, match="in pages only; this layer's segments are: pages, packed"):
        decode.trizone_decode(q, layer, 0.125)


def test_repack_keeps_the_allocation_and_the_values():
    """A packed layer in pages and back: the same widths, positions and V; K requantized per scale group, so 16-bit
    channels are exact and 8-bit ones within one 8-bit step of a group's ~5-wide range (0.02) each way."""
    from rdkv.errors import RDKVError
    from rdkv.trizone import pack_layer, repack

    g = torch.Generator().manual_seed(5)
    B, H, T, D = 1, 2, 300, 64
    widths = torch.tensor([0, 2, 4, 8, 16])
    k, v = torch.randn(2, B, H, T, D, generator=g)
    vw = widths[torch.randint(0, 5, (B, H, T), generator=g)]
    kb = torch.tensor([[0, 2, 8, 16], [16, 8, 4, 2]]).view(B, H, D // 16)
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(B * H)]).view(B, H, D)
    seg = pack_layer(k, v, 5, vw, kb, perm, PackSpec(v_group=32, k_group=128, k_block=16), torch.float16, None, 305)
    out = repack(seg, paged=True)
    back = repack(out, paged=False)
    assert pages.paged(out) and not pages.paged(back)
    for a, b in ((seg, out), (out, back)):
        assert torch.equal(a.v_widths(), b.v_widths()) and torch.equal(a.k_widths(), b.k_widths())
        (K0, V0, p0, ok0), (K1, V1, p1, ok1) = a.dequantize(), b.dequantize()
        assert torch.equal(ok0, ok1) and torch.equal(p0[ok0], p1[ok1]) and torch.equal(V0[ok0], V1[ok1])
        err = (K0[ok0] - K1[ok1]).abs()  # [kept, D], model channel order
        kw = a.k_widths().reshape(B * H, 1, D).expand(-1, ok0.shape[1], -1)[ok0]
        assert float(err[kw == 16].max()) == 0 and float(err[kw == 8].max()) < 0.02
    with pytest.raises(RDKVError, match="already in pages"):
        repack(out, paged=True)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU paths are compared too")
def test_real_model_generates_the_same_tokens_from_pages(monkeypatch):
    """SmolLM2 compressed at 10% of a 400-token prefill (in pages): the page kernel (Triton backend) and the C page
    path (torch backend) generate the oracle's tokens, logits within 2e-2 (as
    tests/test_cpu_decode.py::test_real_models_generate_the_same_tokens; measured 1.0e-3 and 1.3e-3 at 1k tokens)."""
    import copy

    import rdkv
    from conftest import load_real

    model, tok = load_real("smollm2-135m")
    ids = tok(rdkv.models.retrieval_prompt(400, 0.5, tok)["context"], return_tensors="pt").input_ids
    with rdkv.record(model) as rec:
        model(ids[:, :-1], use_cache=True, logits_to_keep=1)
    cache = rdkv.compress(rec, 0.1)
    del rec
    assert all(pages.paged(seg) for seg in cache.layers)
    runs = {}
    for backend in ("reference", "torch", "triton"):
        monkeypatch.setenv("RDKV_BACKEND", backend)
        runs[backend] = model.generate(ids, past_key_values=copy.deepcopy(cache), max_new_tokens=2, min_new_tokens=2,
                                       do_sample=False, output_logits=True, return_dict_in_generate=True)
    for backend in ("torch", "triton"):
        assert torch.equal(runs[backend].sequences, runs["reference"].sequences)
        worst = max(float((a - b).abs().max()) for a, b in zip(runs[backend].logits, runs["reference"].logits))
        assert worst < 2e-2


def test_work_items_keep_every_program_slot_busy():
    """The launcher's split: items of ``split`` pages, dispatched in order to the first free of ``slots`` program
    slots, each costing one page more than its pages (kernels/page_decode.PROGRAM_PAGES)."""
    from rdkv.kernels.page_decode import PROGRAM_PAGES, choose_pages, makespan

    assert PROGRAM_PAGES == 1.0
    assert makespan([4, 4], 2, 2) == 6.0  # four items of 2 (+1) pages on two slots: two each
    assert makespan([5], 2, 4) == 3.0  # items of 2, 2, 1 pages side by side: the longest decides
    # a ragged batch of 8 streams on 132 slots: the pick is within 5% of the best split there is
    g = torch.Generator().manual_seed(0)
    npg = (150 + 100 * torch.rand(8, generator=g)).long()
    split = choose_pages(npg.tolist(), 132)
    best = min(makespan(npg.tolist(), s, 132) for s in range(1, 251))
    assert makespan(npg.tolist(), split, 132) <= 1.05 * best
    assert makespan(npg.tolist(), split, 132) < 0.5 * makespan(npg.tolist(), 250, 132)  # one item per stream
