"""The page layout (rdkv.pages): what the pages hold, how the kernel's launcher cuts them into work items, and a
real model decoding from them on every path (the kernel under TRITON_INTERPRET=1; its grid against the oracle is
tests/test_kernel_decode.py). RDKV_TEST_DEVICE=cuda runs them compiled on a GPU (scripts/gpu_check.sh)."""
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
from rdkv.layout import PackSpec
from rdkv.trizone import TriZoneLayer

for _name in ("rdkv.kernels.lse_merge", "rdkv.kernels.device.page_decode", "rdkv.kernels.page_decode"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])


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
