"""The fused Triton TriZone decode kernel over pages (rdkv.kernels.page_decode), run on CPU under
TRITON_INTERPRET=1, against the torch reference.

Tolerances (``tol``):
* fp32 queries: the kernel dots in fp32 ("ieee") and reads exactly the stored fp16 codes/scales/rows the
  reference reads; only summation order differs, so errors are ~1e-6 relative. atol 2e-5 / rtol 1e-4.
* fp16 queries: the kernel rounds three things to fp16 that the reference keeps in fp32 — dequantized K
  (relative 2^-11 ~ 4.9e-4 per element), the probabilities p and dequantized V fed to the second dot
  (4.9e-4 each). A score q.k * scaling with N(0, 1)-like entries sums D products of size ~1/sqrt(D) with
  independent rounding errors, so its error is ~4.9e-4 * sqrt(D) / sqrt(D) ~ 5e-4 (the worst case, all
  errors aligned, is ~4.9e-4 * 0.64 * sqrt(D) ~ 5e-3 at D = 256); exp turns that into ~0.05% relative
  error on p, and p/V rounding add ~5e-4 relative each, so the output moves by ~1e-3 * |v| ~ 2e-3 for
  |v| <= ~4. Both outputs are then rounded to fp16: one ulp at |out| in [2, 4) is 2e-3. Observed max
  error over the grid: 2e-3 (one output ulp). atol 5e-3 / rtol 5e-3 leaves ~2x margin on the typical
  case while staying 5x below the all-errors-aligned bound, which a layout bug would exceed by far.
* bf16 queries run only on CUDA (the interpreter computes bf16 wrongly; on CPU bf16-cache cases feed fp32
  queries, so the kernel's dots run in fp32 over the bf16 rows). bf16 keeps 8 mantissa bits instead of
  11, so every fp16 error term above grows 8x: atol 4e-2 / rtol 4e-2.

RDKV_TEST_DEVICE=cuda runs the same tests compiled on a GPU (scripts/gpu_check.sh); the default is the
interpreter on CPU.
"""
import importlib
import os
import sys

DEVICE = os.environ.get("RDKV_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels

import pytest
import torch

if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"RDKV_TEST_DEVICE={DEVICE} but no GPU is visible", allow_module_level=True)

import rdkv
from rdkv import RDKVError, layout, pages
from rdkv.reference import trizone_attention
from rdkv.layout import PackSpec
from rdkv.trizone import pack_layer

for _name in ("rdkv.kernels.lse_merge", "rdkv.kernels.device.page_decode", "rdkv.kernels.page_decode"):
    if _name in sys.modules:  # imported earlier without the interpreter: redecorate
        importlib.reload(sys.modules[_name])
from rdkv.kernels import page_decode as kmod  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
if DEVICE != "cpu":  # fp32 dots use "ieee" on GPU too, but accumulation order differs more across warps
    TOL[torch.float32] = dict(atol=1e-4, rtol=1e-4)


def on_device(layer):
    layer.t = {k: v.to(DEVICE) for k, v in layer.t.items()}
    return layer


def build(seed=0, B=2, H=2, T=300, D=64, n_c=5, vmix=(0, 2, 4, 8, 16), kmix=(0, 2, 4, 8, 16), spec=None,
          dtype16=torch.float16, start=0, sort_k=True, window=None, empty_streams=0):
    """A layer packed from random K/V with a different random allocation per stream.

    Each stream draws its own mixture over the allowed V widths ``vmix`` (so class sizes differ a lot
    between streams, including empty classes), its own K block widths from ``kmix``, and its own
    channel permutation. ``empty_streams`` streams evict everything.
    """
    spec = spec or PackSpec(v_group=32, k_group=64, k_block=16)
    g = torch.Generator().manual_seed(seed)
    S = B * H
    k = torch.randn(B, H, T, D, generator=g) * 1.5
    k[..., 5] += 12.0  # an outlier channel, as real keys have
    v = torch.randn(B, H, T, D, generator=g)
    allowed = torch.tensor(vmix)
    mixes = torch.rand(S, len(vmix), generator=g) ** 3  # skewed: some classes nearly empty
    mixes = mixes / mixes.sum(1, keepdim=True)
    draw = torch.multinomial(mixes, T, replacement=True, generator=g) if T else torch.zeros(S, 0, dtype=torch.long)
    vw = allowed[draw].view(B, H, T)
    if empty_streams:
        vw.view(S, T)[:empty_streams] = 0
    kall = torch.tensor(kmix)
    kb = kall[torch.randint(0, len(kmix), (B, H, D // spec.k_block), generator=g)]
    if sort_k:
        kb = kb.sort(-1).values
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(S)]).view(B, H, D)
    layer = pack_layer(k, v, start, vw, kb, perm, spec, dtype16, window, start + T)
    if n_c:
        layer.update(torch.randn(B, H, n_c, D, generator=g), torch.randn(B, H, n_c, D, generator=g))
    return on_device(layer)


def query(layer, G, L, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layer.batch, layer.heads * G, L, layer.head_dim, generator=g).to(dtype).to(DEVICE)


def check(layer, q, window=None, softcap=None, mask=None, launch=None):
    if mask is not None:
        mask = mask.to(DEVICE)
    scaling = layer.head_dim ** -0.5
    want = trizone_attention(q, layer, scaling, window, softcap, mask)
    got = kmod.page_decode(q, layer, scaling, window, softcap, mask, launch)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[q.dtype])
    return got, want


# A sampled grid (the full product would take far longer than the 3-minute budget under the interpreter):
# every head_dim meets every group size at least once, both dtypes, L = 1 and 3, zone A from 0 to
# 1024 tokens, zone C from 0 to 130, batch 1..3 with per-stream allocations.
#        B  H  T     D    n_c  G  L  dtype          vmix                 kmix
GRID = [
    (1, 1, 1024, 64, 1, 1, 1, torch.float16, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),
    (2, 2, 700, 128, 9, 4, 1, torch.float16, (0, 2, 4, 8, 16), (2, 4, 8, 16)),
    (1, 2, 400, 256, 3, 8, 1, torch.float16, (0, 2, 8), (0, 4, 16)),
    (3, 1, 500, 64, 130, 3, 3, torch.float32, (0, 4, 16), (2, 8)),
    (2, 2, 0, 64, 4, 4, 3, torch.float32, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),  # zone A empty
    (2, 1, 350, 128, 0, 1, 1, torch.float32, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),  # zone C empty
    (1, 2, 260, 256, 2, 3, 3, torch.float32, (0, 16), (0, 16)),  # zone B only, K 0/16
    (2, 2, 300, 64, 6, 8, 3, torch.float16, (0, 2), (2,)),  # everything at 2 bits
    (1, 1, 200, 128, 1, 4, 1, torch.float32, (0, 8), (4,)),
    (2, 1, 120, 64, 3, 3, 1, torch.float16, (0,), (0, 2, 4, 8, 16)),  # everything evicted: zone C only
    (1, 3, 180, 64, 1, 1, 1, torch.float32, (0, 2, 4, 8, 16), (0,)),  # K all means: constant zone-A scores
    (1, 1, 1024, 256, 17, 4, 1, torch.float16, (2, 4, 8, 16), (0, 2, 4, 8, 16)),  # nothing evicted
    (2, 1, 800, 128, 33, 8, 3, torch.float32, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),
    (1, 2, 64, 256, 130, 1, 3, torch.float16, (0, 4), (8, 16)),
    (2, 2, 1, 128, 1, 3, 1, torch.float16, (2,), (16,)),  # one kept token per stream
    (1, 2, 300, 32, 2, 4, 1, torch.float16, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),  # 2-bit V rows under a dot's width
]


@pytest.mark.parametrize("B,H,T,D,n_c,G,L,dtype,vmix,kmix", GRID,
                         ids=[f"B{c[0]}H{c[1]}T{c[2]}D{c[3]}C{c[4]}G{c[5]}L{c[6]}-{str(c[7])[6:]}-v{''.join(map(str, c[8]))}"
                              f"-k{''.join(map(str, c[9]))}" for c in GRID])
def test_kernel_matches_reference(B, H, T, D, n_c, G, L, dtype, vmix, kmix):
    layer = build(seed=T + D + n_c, B=B, H=H, T=T, D=D, n_c=n_c, vmix=vmix, kmix=kmix)
    check(layer, query(layer, G, L, dtype))


def test_launch_settings_are_an_argument_and_checked():
    """Other tile sizes, warps, pipelining depth and work-item split give the reference's result; bad
    settings raise before any launch."""
    layer = build(seed=21, B=2, H=2, T=700, D=128, n_c=3, kmix=(2, 4, 8))
    q = query(layer, 4, 1, torch.float16)
    for launch in (kmod.LaunchConfig(block_n=32, num_warps=4, num_stages=2, split=128),
                   kmod.LaunchConfig(block_n=128, maxnreg=128)):
        want = trizone_attention(q, layer, 128 ** -0.5)
        got = kmod.page_decode(q, layer, 128 ** -0.5, launch=launch)
        torch.testing.assert_close(got.float(), want.float(), **TOL[torch.float16])
    assert kmod.launch_config(128, 16, override=kmod.LaunchConfig(split=100)).split == 100
    for bad, what in ((kmod.LaunchConfig(block_n=48), "block_n"), (kmod.LaunchConfig(num_warps=3), "num_warps"),
                      (kmod.LaunchConfig(split=0), "split"), (kmod.LaunchConfig(maxnreg=300), "maxnreg")):
        with pytest.raises(RDKVError, match=what):
            kmod.page_decode(q, layer, 128 ** -0.5, launch=bad)


def rope_table(D: int, base: float = 10000.0, scaling: float = 1.25) -> torch.Tensor:
    """A layer's RoPE table as compress stores it with prerope (rdkv.rope): D/2 inverse frequencies, then
    the attention scaling (not 1, so a kernel that forgot it would fail)."""
    inv = base ** -(torch.arange(0, D, 2, dtype=torch.float32) / D)
    return torch.cat([inv, torch.tensor([scaling])]).to(DEVICE)


# pre-RoPE keys: every head_dim, both query dtypes, width-0 K blocks (rotated means), positions past 8k
#        seed T    D    start G  L  dtype          vmix              kmix
ROPE_GRID = [
    (30, 300, 64, 0, 3, 1, torch.float32, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),
    (31, 500, 128, 8000, 4, 3, torch.float16, (0, 2, 4, 8, 16), (0, 2, 4, 8, 16)),
    (32, 260, 256, 100, 2, 1, torch.float32, (0, 4, 16), (0, 16)),
    (33, 200, 64, 40, 8, 1, torch.float16, (2, 16), (0,)),  # every K channel a mean
    (34, 260, 256, 500, 4, 2, torch.float16, (0, 2, 4, 8, 16), (0, 2, 8)),  # V unpacked, not per plane
]


@pytest.mark.parametrize("seed,T,D,start,G,L,dtype,vmix,kmix", ROPE_GRID, ids=[f"D{c[2]}-start{c[3]}" for c in ROPE_GRID])
def test_pre_rope_keys_are_rotated_at_their_positions(seed, T, D, start, G, L, dtype, vmix, kmix):
    """Keys packed before RoPE (``prerope``): the kernel rotates each block at its tokens' positions, the
    reference rotates the dequantized keys; without the table the result differs, so rotation is tested."""
    layer = build(seed=seed, B=2, H=2, T=T, D=D, n_c=3, start=start, vmix=vmix, kmix=kmix)
    q = query(layer, G, L, dtype)
    plain = kmod.page_decode(q, layer, D ** -0.5)
    layout.set_rope_table(layer, rope_table(D))
    got, _ = check(layer, q)
    assert (got.float() - plain.float()).abs().max() > 0.05


def test_pre_rope_prefix_with_a_post_rope_fold():
    """A pre-RoPE prefix and a fold packed from zone C (already rotated keys, no table) in one call."""
    layer = build(seed=34, B=1, H=2, T=300, D=64, n_c=0)
    layout.set_rope_table(layer, rope_table(64))
    layer.folds = [build(seed=35, B=1, H=2, T=100, D=64, n_c=0, start=300)]
    layer.c_start = 400
    layer.update(*(torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE) for _ in range(2)))
    check(layer, query(layer, 3, 2, torch.float16))


def width_mixes(H: int = 1):
    """(layer, query) for all 15 non-empty subsets of V classes x a rotation of K mixes, sorted and unsorted
    K blocks."""
    kmixes = [(0, 2, 4, 8, 16), (2,), (16,), (0, 8), (4, 16), (2, 4, 8)]
    subsets = [tuple(w for i, w in enumerate((2, 4, 8, 16)) if m >> i & 1) for m in range(1, 16)]
    for n, sub in enumerate(subsets):
        layer = build(seed=n, B=2, H=H, T=90, D=64, n_c=2, vmix=(0,) + sub, kmix=kmixes[n % len(kmixes)],
                      sort_k=bool(n % 2))
        yield layer, query(layer, 2, 1, torch.float32, seed=n)


def test_every_mix_of_width_classes():
    for layer, q in width_mixes():
        check(layer, q)


@pytest.mark.parametrize("split", [64, 128])
def test_many_splits_and_ragged_streams(split):
    """Small splits: many work items per stream, chunks that cross class boundaries, empty streams."""
    layer = build(seed=7, B=3, H=2, T=600, D=64, n_c=70, empty_streams=2)
    check(layer, query(layer, 4, 3, torch.float16), launch=kmod.LaunchConfig(split=split))


def test_sliding_window_and_start_offset():
    layer = build(seed=3, B=2, H=1, T=400, D=64, n_c=20, start=1000, window=150)
    check(layer, query(layer, 3, 3, torch.float32))
    layer = build(seed=4, B=1, H=2, T=300, D=128, n_c=8)
    check(layer, query(layer, 2, 3, torch.float32), window=100)  # the window of the call, not of the layer


def test_bool_mask_gathered_at_kept_positions():
    layer = build(seed=5, B=2, H=2, T=250, D=64, n_c=6)
    L = 3
    seq = layer.get_seq_length()
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(layer.batch, 1, L, seq + 7, generator=g) > 0.3
    mask[1, :, :, :40] = False  # left padding of the second sequence
    mask[0, :, 1, :] = False  # a query row that sees nothing: zero output
    got, _ = check(layer, query(layer, 4, L, torch.float32), mask=mask)
    assert got[0, :, 1].abs().max() == 0
    check(layer, query(layer, 4, L, torch.float32), mask=mask[:1].expand(2, -1, -1, -1))  # broadcast strides


def test_softcap():
    layer = build(seed=6, B=1, H=2, T=200, D=64, n_c=4)
    check(layer, query(layer, 2, 1, torch.float32) * 4, softcap=5.0)


def test_bf16_cache_with_fp32_queries_and_other_pack_specs():
    layer = build(seed=8, B=2, H=1, T=300, D=128, n_c=3, dtype16=torch.bfloat16)
    check(layer, query(layer, 4, 1, torch.float32))
    layer = build(seed=9, B=1, H=2, T=300, D=128, n_c=3, spec=PackSpec(v_group=128, k_group=16, k_block=32))
    check(layer, query(layer, 2, 3, torch.float16))
    for groups in ((64, 32, 16), (16, 32, 128)):  # a V group size per width class, each path its own
        layer = build(seed=10, B=2, H=1, T=300, D=128, n_c=2, spec=PackSpec(v_group=groups, k_group=64, k_block=16))
        P = pages.segment_page(layer)
        assert [pages.v_bytes(w, 128, layer.spec, P)[1] for w in (2, 4, 8)] == [2 * P * 128 // g for g in groups]
        check(layer, query(layer, 2, 1, torch.float16))


@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter computes bf16 wrongly")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_bf16_queries_on_gpu(D):
    layer = build(seed=12 + D, B=2, H=2, T=900, D=D, n_c=5, dtype16=torch.bfloat16)
    check(layer, query(layer, 4, 1, torch.bfloat16))
    check(layer, query(layer, 3, 3, torch.bfloat16))


@pytest.mark.parametrize("split", [None, 64])
def test_folded_segments_merge_with_the_prefix_and_zone_c(split):
    """A layer with two folds (one fully evicted in some streams) and a window that hides the first."""
    launch = kmod.LaunchConfig(split=split)
    layer = build(seed=13, B=2, H=2, T=300, D=64, n_c=0)
    layer.folds = [build(seed=14, B=2, H=2, T=150, D=64, n_c=0, start=300),
                   build(seed=15, B=2, H=2, T=90, D=64, n_c=0, start=450, empty_streams=1)]
    layer.c_start = 540
    g = torch.Generator().manual_seed(2)
    layer.update(*(torch.randn(2, 2, 7, 64, generator=g).to(DEVICE) for _ in range(2)))
    check(layer, query(layer, 3, 2, torch.float16), launch=launch)
    check(layer, query(layer, 3, 2, torch.float32), window=200, launch=launch)


def test_many_query_rows_tile_over_the_m_axis():
    layer = build(seed=10, B=1, H=1, T=150, D=64, n_c=20)
    check(layer, query(layer, 8, 12, torch.float32))  # 96 rows -> two 64-row blocks


def test_tables_stay_out_of_the_layer():
    layer = build(seed=11, B=2, H=2, T=100, D=64, n_c=2)
    before = layer.nbytes, set(layer.t)
    check(layer, query(layer, 2, 1, torch.float32))
    assert (layer.nbytes, set(layer.t)) == before


@pytest.mark.parametrize("case", ["k_block", "dtype", "head_dim", "mask_dtype", "shape"])
def test_unsupported_cases_raise(case):
    q = None
    kw = {}
    if case == "k_block":
        layer = build(T=40, D=64, spec=PackSpec(v_group=32, k_group=32, k_block=8))
    elif case == "head_dim":
        layer = build(T=40, D=96, spec=PackSpec(v_group=32, k_group=32, k_block=16))
    else:
        layer = build(T=40, D=64)
    q = query(layer, 2, 1, torch.float64 if case == "dtype" else torch.float32)
    if case == "mask_dtype":
        kw["mask"] = torch.ones(2, 1, 1, layer.get_seq_length(), dtype=torch.long)
    if case == "shape":
        q = q[:1]
    with pytest.raises(RDKVError):
        kmod.page_decode(q, layer, 0.125, **kw)


# --- end to end ----------------------------------------------------------------------------------------
def _decode_logits(backend, monkeypatch, ids, nxt, batch_mask=None, make=None, **options):
    from conftest import tiny_llama

    monkeypatch.setenv("RDKV_BACKEND", backend)
    model = (make or tiny_llama)(0).to(DEVICE)
    ids, nxt = ids.to(DEVICE), nxt.to(DEVICE)
    batch_mask = batch_mask.to(DEVICE) if batch_mask is not None else None
    kw = {}
    with rdkv.record(model) as rec:
        if batch_mask is not None:
            pos = (batch_mask.cumsum(-1) - 1).clamp_min(0)
            model(ids, attention_mask=batch_mask, position_ids=pos, use_cache=True)
            kw = dict(attention_mask=torch.cat([batch_mask, torch.ones_like(nxt)], 1),
                      position_ids=pos[:, -1:] + 1 + torch.arange(nxt.shape[1], device=DEVICE))
        else:
            model(ids, use_cache=True)
    cache = rdkv.compress(rec, 0.3, v_group=32, k_group=32, k_block=16, **options)
    first = model(nxt, past_key_values=cache, **kw).logits  # L = nxt.shape[1] query positions at once
    tok = first[:, -1:].argmax(-1)
    if batch_mask is not None:
        kw = dict(attention_mask=torch.cat([kw["attention_mask"], torch.ones_like(tok)], 1),
                  position_ids=kw["position_ids"][:, -1:] + 1)
    second = model(tok, past_key_values=cache, **kw).logits  # then one token
    return first, second


def _count_kernel_calls(monkeypatch):
    """Calls of the kernel, which a compressed cache decodes through under the Triton backend."""
    calls = []
    real = kmod.page_decode

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(kmod, "page_decode", counted)
    return calls


def test_end_to_end_tiny_llama_triton_equals_torch(monkeypatch):
    g = torch.Generator().manual_seed(0)
    ids, nxt = torch.randint(0, 96, (1, 150), generator=g), torch.randint(0, 96, (1, 3), generator=g)
    want = _decode_logits("torch", monkeypatch, ids, nxt)
    calls = _count_kernel_calls(monkeypatch)
    got = _decode_logits("triton", monkeypatch, ids, nxt)
    assert len(calls) == 2 * 2  # two decode steps x two layers, all through the kernel
    for a, b in zip(got, want):  # fp32 model: fp32 dots in the kernel, so only summation order differs
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_end_to_end_left_padded_batch(monkeypatch):
    g = torch.Generator().manual_seed(1)
    ids, nxt = torch.randint(0, 96, (2, 80), generator=g), torch.randint(0, 96, (2, 2), generator=g)
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[1, :25] = 0
    want = _decode_logits("torch", monkeypatch, ids, nxt, mask)
    calls = _count_kernel_calls(monkeypatch)
    got = _decode_logits("triton", monkeypatch, ids, nxt, mask)
    assert len(calls) == 2 * 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_end_to_end_pre_rope_keys_triton_equals_torch(monkeypatch, arch):
    """``prerope=True`` caches decode through the kernel: Llama, and Gemma 3 with its two RoPE bases (local and
    global layers), sliding windows and q/k norms."""
    from conftest import tiny_gemma3, tiny_llama

    make = tiny_llama if arch == "llama" else tiny_gemma3
    g = torch.Generator().manual_seed(4)
    ids, nxt = torch.randint(0, 96, (1, 150), generator=g), torch.randint(0, 96, (1, 3), generator=g)
    want = _decode_logits("torch", monkeypatch, ids, nxt, make=make, prerope=True)
    calls = _count_kernel_calls(monkeypatch)
    got = _decode_logits("triton", monkeypatch, ids, nxt, make=make, prerope=True)
    assert len(calls) == 2 * {"llama": 2, "gemma3": 3}[arch]  # two decode steps, every layer through the kernel
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
