"""The CPU decode path (rdkv.cpu_decode: the C products over the pages, or the page oracle's values where no
compiler is) against the torch oracle (rdkv.reference).

Both read the same stored codes, scales and 16-bit rows and compute in float32; only the order of
summation differs (the fast path dots dequantized keys in the packed channel order with a permuted
query, and runs one softmax over every segment instead of merging partial ones). Tolerances:
* fp32 queries: ~1e-6 relative observed; atol 2e-5 / rtol 1e-4, as for the Triton kernel.
* fp16 / bf16 queries: both outputs are rounded to the query dtype, so they differ by at most one ulp
  of the output where the float32 results straddle a rounding boundary: 2^-10 (fp16) and 2^-7 (bf16)
  relative, for |out| up to ~4. atol/rtol 2e-3 (fp16) and 1.6e-2 (bf16) allow that one ulp and no more.
A layout bug moves outputs by O(1).
"""
import copy

import pytest
import torch
from conftest import load_real
from test_kernel_decode import GRID, ROPE_GRID, _decode_logits, build, query, rope_table, width_mixes

import rdkv
from rdkv import cpu_decode, layout, reference
from rdkv.kernels import cpu_dequant
from rdkv.layout import PackSpec

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.fixture(params=["C", "torch"])
def dequant(request, monkeypatch):
    """Each test with this fixture runs twice: dequantizing with the C functions (kernels/cpu_dequant.c) and with
    the page oracle in torch (where no compiler builds them)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_dequant, "library", lambda: None)
    elif cpu_dequant.library() is None:
        pytest.skip("no C compiler builds kernels/cpu_dequant.c here")
    return request.param


def check(layer, q, window=None, softcap=None, mask=None):
    scaling = layer.head_dim ** -0.5
    want = reference.trizone_attention(q, layer, scaling, window, softcap, mask)
    got = cpu_decode.trizone_attention(q, layer, scaling, window, softcap, mask)
    assert got.shape == q.shape and got.dtype == q.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[q.dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(GRID)))
def test_matches_the_oracle_over_the_grid(case, dtype, dequant):
    """Every row of the kernel's grid (head_dims 64-256, GQA groups 1-8, L = 1 and 3, zone A empty to 1024
    tokens, zone C empty to 130, batches of per-stream allocations) in all three query dtypes."""
    B, H, T, D, n_c, G, L, _, vmix, kmix = GRID[case]
    layer = build(seed=T + D + n_c, B=B, H=H, T=T, D=D, n_c=n_c, vmix=vmix, kmix=kmix)
    check(layer, query(layer, G, L, dtype))


@pytest.mark.parametrize("seed,T,D,start,G,L,dtype,vmix,kmix", ROPE_GRID, ids=[f"D{c[2]}-start{c[3]}" for c in ROPE_GRID])
def test_pre_rope_keys(seed, T, D, start, G, L, dtype, vmix, kmix, dequant):
    layer = build(seed=seed, B=2, H=2, T=T, D=D, n_c=3, start=start, vmix=vmix, kmix=kmix)
    q = query(layer, G, L, dtype)
    plain = cpu_decode.trizone_attention(q, layer, D ** -0.5)
    layout.set_rope_table(layer, rope_table(D))
    got = check(layer, q)
    assert (got.float() - plain.float()).abs().max() > 0.05  # the rotation happened


def test_every_mix_of_width_classes_and_unsorted_k_blocks(dequant):
    for layer, q in width_mixes(H=2):
        check(layer, q)


def test_ragged_and_empty_streams(dequant):
    layer = build(seed=7, B=3, H=2, T=600, D=64, n_c=70, empty_streams=2)
    check(layer, query(layer, 4, 3, torch.float16))
    layer = build(seed=8, B=2, H=1, T=50, D=64, n_c=0, vmix=(0,))  # nothing kept, no zone C: zero output
    assert check(layer, query(layer, 2, 1, torch.float32)).abs().max() == 0


def test_sliding_windows_masks_and_softcap(dequant):
    layer = build(seed=3, B=2, H=1, T=400, D=64, n_c=20, start=1000, window=150)
    check(layer, query(layer, 3, 3, torch.float32))
    layer = build(seed=4, B=1, H=2, T=300, D=128, n_c=8)
    check(layer, query(layer, 2, 3, torch.float32), window=100)
    layer = build(seed=5, B=2, H=2, T=250, D=64, n_c=6)
    seq = layer.get_seq_length()
    mask = torch.rand(2, 1, 3, seq + 7, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[1, :, :, :40] = False  # left padding
    mask[0, :, 1, :] = False  # a query row that sees nothing: zero output
    assert check(layer, query(layer, 4, 3, torch.float32), mask=mask)[0, :, 1].abs().max() == 0
    check(layer, query(layer, 2, 1, torch.float32) * 4, softcap=5.0)


def test_folds_and_other_pack_specs(dequant):
    layer = build(seed=13, B=2, H=2, T=300, D=64, n_c=0)
    layout.set_rope_table(layer, rope_table(64))  # a pre-RoPE prefix beside post-RoPE folds
    layer.folds = [build(seed=14, B=2, H=2, T=150, D=64, n_c=0, start=300),
                   build(seed=15, B=2, H=2, T=90, D=64, n_c=0, start=450, empty_streams=1)]
    layer.c_start = 540
    layer.update(*(torch.randn(2, 2, 7, 64, generator=torch.Generator().manual_seed(2)) for _ in range(2)))
    check(layer, query(layer, 3, 2, torch.float16))
    check(layer, query(layer, 3, 2, torch.float32), window=200)
    layer = build(seed=8, B=2, H=1, T=300, D=128, n_c=3, dtype16=torch.bfloat16)
    check(layer, query(layer, 4, 1, torch.float32))
    for spec in (PackSpec(v_group=128, k_group=16, k_block=32), PackSpec(v_group=(64, 32, 16), k_group=64, k_block=16),
                 PackSpec(v_group=16, k_group=300, k_block=8)):
        layer = build(seed=9, B=1, H=2, T=300, D=128, n_c=3, spec=spec)
        check(layer, query(layer, 2, 3, torch.float16))


def test_nothing_is_kept_between_steps():
    layer = build(seed=11, B=2, H=2, T=100, D=64, n_c=2)
    before = layer.nbytes, set(layer.t), layer.__dict__.keys() - {"t"}
    check(layer, query(layer, 2, 1, torch.float32))
    assert (layer.nbytes, set(layer.t), layer.__dict__.keys() - {"t"}) == before


def test_cpu_tensors_take_the_fast_path_and_reference_selects_the_oracle(monkeypatch):
    from rdkv.decode import backend

    monkeypatch.delenv("RDKV_BACKEND", raising=False)
    assert backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("RDKV_BACKEND", "reference")
    assert backend(torch.device("cpu")) == "reference"


# --- end to end: the same compressed cache decoded through both paths ------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_end_to_end_tiny_models(monkeypatch, arch):
    """Tiny Llama with a left-padded batch; tiny Gemma 3 (sliding and global layers, q/k norms, two RoPE
    bases) with pre-RoPE keys: three query positions at once, then one, through each path."""
    from conftest import tiny_gemma3

    g = torch.Generator().manual_seed(1)
    ids, nxt = torch.randint(0, 96, (2, 150), generator=g), torch.randint(0, 96, (2, 3), generator=g)
    mask = torch.ones(2, 150, dtype=torch.long)
    mask[1, :25] = 0
    kw = dict(batch_mask=mask) if arch == "llama" else dict(make=tiny_gemma3, prerope=True)
    want = _decode_logits("reference", monkeypatch, ids, nxt, **kw)
    got = _decode_logits("torch", monkeypatch, ids, nxt, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_models_generate_the_same_tokens(monkeypatch, name):
    """A 1k-token prefill of each real model compressed at 10%, then 8 greedy tokens through each path: the
    same tokens, and logits within 2e-2. Measured: 1.8e-3 (SmolLM2) and 6.8e-3 (Gemma 3), float32 summation
    order differences grown through 30 and 18 layers, on logits of size ~10-30; a layout bug moves them by O(1)."""
    model, tok = load_real(name)
    ids = tok(rdkv.models.retrieval_prompt(1000, 0.5, tok)["context"], return_tensors="pt").input_ids
    with rdkv.record(model) as rec:
        model(ids[:, :-1], use_cache=True, logits_to_keep=1)
    cache = rdkv.compress(rec, 0.1)
    del rec  # the record holds the uncompressed cache
    runs = {}
    for backend in ("torch", "reference"):
        monkeypatch.setenv("RDKV_BACKEND", backend)
        runs[backend] = model.generate(ids, past_key_values=copy.deepcopy(cache), max_new_tokens=8,
                                       min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(runs["torch"].sequences, runs["reference"].sequences)
    worst = max(float((a - b).abs().max()) for a, b in zip(runs["torch"].logits, runs["reference"].logits))
    assert worst < 2e-2


def test_decode_runs_in_inference_mode_only_when_no_gradient_is_wanted():
    """Without gradients the torch paths run in inference mode and hand back an ordinary tensor, which the model
    may change in place; with them, the output stays on the autograd graph."""
    from rdkv.decode import trizone_decode

    layer = build(seed=12, B=1, H=2, T=80, D=64, n_c=2)
    q = query(layer, 2, 1, torch.float32)
    out = trizone_decode(q, layer, 0.125)  # the suite runs without gradients (conftest)
    assert not out.is_inference()
    out.add_(1.0)
    with torch.enable_grad():
        assert trizone_decode(q.requires_grad_(True), layer, 0.125).requires_grad
