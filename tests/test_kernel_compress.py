"""Compress-side Triton kernels on CPU under TRITON_INTERPRET=1 against their torch references.

Quantize + pack (``rdkv.kernels.quantize_pack``) must equal ``rdkv.quant`` bit for bit: codes, scales and
zeros, compared with ``torch.equal`` (values; a zero of -0.0 equals one of +0.0). The kernel rounds half
to even exactly (from ``floor``) and divides with IEEE ``div_rn``, so no tie or last-bit mismatch is
allowed; ties are constructed on purpose below.

Token weights (``rdkv.kernels.token_weights``) against the sums of ``rdkv.dense.attend``. Tolerances:
* scores: the kernel's ``tl.dot`` multiplies in the input dtype and accumulates in fp32; fp16 / bf16
  products are exact in fp32 and fp32 inputs use "ieee" dots, so a score differs from the reference (fp32
  einsum on upcast inputs) only by summation order: ~sqrt(D) * 2^-24 * sum|q_d k_d| * scaling, ~1e-6
  relative here.
* each p: base-2 exponent ``s * log2(e) - m`` is rounded once more than ``exp(s - m)``; for |s - m| <= ~40
  (the largest gaps that still give p > 1e-17) that is <= 40 * 2^-24 ~ 2.4e-6 relative, plus a few ulps
  from exp2 / the reciprocal of the denominator, which itself carries the same relative error.
* mass is a sum of positive terms, so its relative error is at most the largest per-term one (~5e-6);
  mass2 squares p, doubling it (~1e-5). rtol 5e-5 leaves 5x margin; atol 1e-6 only absorbs fp32
  summation noise on near-zero columns (a wrong tile or mask moves a column by O(1 / T) >> 1e-6).
* q2 is a sum of exact squares in a different order: rtol 1e-5; nq is a count: exact.
bf16 runs only on a GPU (the interpreter computes bf16 wrongly). RDKV_TEST_DEVICE=cuda runs the same
tests compiled on a GPU.
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

from rdkv import RDKVError, layout, quant
from rdkv.dense import attend

for _name in ("rdkv.kernels.quantize_pack", "rdkv.kernels.token_weights"):
    if _name in sys.modules:  # imported earlier without the interpreter: redecorate
        importlib.reload(sys.modules[_name])
from rdkv.kernels import quantize_pack as qmod  # noqa: E402
from rdkv.kernels import token_weights as tmod  # noqa: E402


def same(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.cpu(), b.cpu())


def rows_data(R, N, seed, dtype=torch.float32):
    """Random rows with the awkward cases mixed in: outliers 1e4, constant rows (fp16-representable or
    not), a negative constant, and a sign-straddling row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, N, generator=g) * 2
    x[0, N // 3] = 1e4
    if R > 5:
        x[1] = 0.3  # constant, rounds up in fp16: hi - zero < 0, so scale <= 0 and codes 0
        x[2] = -7.25  # constant, exact in fp16
        x[3, : N // 2] = -1e4
        x[4] = 0.0
        x[5] = 0.1  # constant rounding *down* in fp16: a tiny positive scale and codes 3 / 15 / 255, not 0
    return x.to(dtype).to(DEVICE)


# --- quantize + pack -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_rows_matches_quant(bits, group):
    for R, seed in ((1, 0), (37, 1), (300, 2)):  # 37 / 300: not multiples of any row block
        x = rows_data(R, 2 * group, seed + bits + group)
        want = quant.quantize(x.unflatten(-1, (-1, group)), bits)
        got = qmod.quantize_pack(x, bits, group)
        same(got, (quant.pack(want[0].flatten(-2), bits), want[1], want[2]))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_rows_ties_round_half_to_even(bits):
    top = (1 << bits) - 1
    x = torch.zeros(3, 32)
    x[:, 1] = float(top)  # lo = 0, hi = 2^b - 1: scale exactly 1, so x = k + 1/2 is an exact tie
    x[:, 2:] = (torch.arange(30).float() % top + 0.5).view(1, 30)
    x[1] *= 0.25  # scale 1/4 (exact in fp16): ties again, other codes
    x[2] = x[2] * 2 - 100.0  # a zero point and scale 2 (both exact): ties at odd multiples
    got = qmod.quantize_pack(x.to(DEVICE), bits, 32)
    same(got, quant.quantize_pack_torch(x, bits, 32))
    codes = quant.unpack(got[0].cpu(), bits)
    ties = [0, 2, 2, 0] if bits == 2 else [0, 2, 2, 4]  # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 3.5 -> 4 (2 bits: 0.5 again)
    assert codes[0, 2:6].tolist() == ties


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_rows_leading_dims_strides_dtypes_and_odd_groups(dtype):
    x = rows_data(2 * 3 * 11, 64, 5, dtype).view(2, 3, 11, 64)
    same(qmod.quantize_pack(x, 4, 32), quant.quantize_pack_torch(x, 4, 32))
    xt = rows_data(64, 40, 6, dtype).t()  # [40, 64] non-contiguous
    same(qmod.quantize_pack(xt, 2, 16), quant.quantize_pack_torch(xt, 2, 16))
    x = rows_data(9, 72, 7, dtype)  # groups of 24 / 12 / 36 channels: padded tiles, masked bytes
    for bits, group in ((2, 24), (4, 12), (8, 36)):
        same(qmod.quantize_pack(x, bits, group), quant.quantize_pack_torch(x, bits, group))
    empty = qmod.quantize_pack(x[:0], 4, 24)
    assert [t.shape for t in empty] == [(0, 36), (0, 3), (0, 3)]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [7, 32, 128])
def test_quantize_cols_k_layout(bits, group):
    """Groups of ``group`` tokens per channel, restarting at each segment (short last groups, an empty
    segment), codes packed along the channels."""
    x = rows_data(300, 16, bits * group)
    x[40:47, 3] = 2.5  # a constant channel in one group
    seg = torch.tensor([1, 150, 0, 49, 100], device=DEVICE)
    same(qmod.quantize_pack(x, bits, group, axis=0, segments=seg), quant.quantize_pack_torch(x, bits, group, 0, seg))
    same(qmod.quantize_pack(x[:37], bits, group, axis=0), quant.quantize_pack_torch(x[:37], bits, group, 0))
    x = rows_data(90, 24, 3, torch.float16)  # 24 channels: a padded channel tile
    same(qmod.quantize_pack(x, bits, group, axis=0), quant.quantize_pack_torch(x, bits, group, 0))


def test_pages_pack_writes_the_same_bytes_through_the_kernel(monkeypatch):
    """rdkv.pages.pack quantizes through quantize_pack: K once per packed width (every channel, groups of a page
    restarting at each (stream, V class)), V once per class. Through the kernel its pages are the torch path's,
    byte for byte."""
    from rdkv import pages
    from rdkv.layout import PackSpec

    g = torch.Generator().manual_seed(0)
    S, T, D = 4, 150, 64
    spec = PackSpec(v_group=32, k_group=32, k_block=16)
    k, v = torch.randn(S, T, D, generator=g), torch.randn(S, T, D, generator=g)
    vw = torch.tensor([0, 2, 4, 8, 16])[torch.randint(0, 5, (S, T), generator=g)]
    kb = torch.tensor([0, 2, 4, 8, 16])[torch.randint(0, 5, (S, D // 16), generator=g)]
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(S)])
    calls, real = [], qmod.quantize_pack
    monkeypatch.setattr(qmod, "quantize_pack", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    out = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("RDKV_BACKEND", backend)
        out[backend] = pages.pack(*(x.to(DEVICE) for x in (k, v)), 0, *(x.to(DEVICE) for x in (vw, kb, perm)), spec,
                                  torch.float16)
    assert sorted(calls) == [2, 2, 4, 4, 8, 8]  # the kernel ran once per V class and once per K width
    assert out["torch"].keys() == out["triton"].keys()
    for name, x in out["torch"].items():
        assert torch.equal(x.cpu(), out["triton"][name].cpu()), name


def test_quantize_pack_raises():
    x = torch.randn(4, 64, device=DEVICE)
    bad = [
        dict(bits=3, group=32), dict(bits=4, group=48), dict(bits=2, group=30),
        dict(bits=4, group=32, segments=torch.tensor([4])),
        dict(bits=4, group=32, axis=0, segments=torch.tensor([3], device=DEVICE)),
        dict(bits=4, group=2048),
    ]
    for kw in bad:
        with pytest.raises(RDKVError):
            qmod.quantize_pack(x if kw.get("group") != 2048 else torch.randn(1, 2048, device=DEVICE), **kw)
    with pytest.raises(RDKVError):
        qmod.quantize_pack(x[:, :6], 2, 3, axis=0)  # 6 channels: not whole bytes at 2 bits
    for axis in (0, 1):  # 3-d input: only the last axis
        with pytest.raises(RDKVError):
            qmod.quantize_pack(x.view(2, 2, 64), 4, 32, axis=axis)
    with pytest.raises(RDKVError):
        qmod.quantize_pack(x.to(torch.int32), 4, 32)
    for v in (7e4, float("nan"), float("inf")):
        y = x.clone()
        y[1, 2] = v
        with pytest.raises(ValueError):  # RDKVError is a ValueError, as quant.scale_zero raises
            qmod.quantize_pack(y, 4, 32)
        with pytest.raises(ValueError):
            quant.quantize_pack_torch(y, 4, 32)


def test_quant_quantize_pack_dispatches(monkeypatch):
    calls = []
    real = qmod.quantize_pack
    monkeypatch.setattr(qmod, "quantize_pack", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = rows_data(10, 64, 9)
    monkeypatch.setenv("RDKV_BACKEND", "torch")
    want = layout.quantize_pack(x, 2, 32)
    assert not calls
    monkeypatch.setenv("RDKV_BACKEND", "triton")
    same(layout.quantize_pack(x, 2, 32), want)
    assert len(calls) == 1
    want = quant.quantize(x.unflatten(-1, (-1, 32)), 2)
    same(want[1:], quant.quantize_pack_torch(x, 2, 32)[1:])


# --- token weights ---------------------------------------------------------------------------------------
SUM_TOL = dict(atol=1e-6, rtol=5e-5)


def tw_case(B, H, G, M, T, D, dtype, window=None, softcap=None, masked=False, start=0, seed=0, kdtype=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, M, D, generator=g).to(dtype)
    k = torch.randn(B, H, T, D, generator=g) * 1.5
    k[..., 3] += 6.0  # an outlier channel, as real keys have
    k = k.to(kdtype or dtype)
    k_pos = torch.arange(start, start + T)
    q_pos = torch.arange(start + T - M, start + T)  # the last M positions (some before every key if M > T)
    key_mask = None
    if masked:
        key_mask = torch.rand(B, T, generator=g) > 0.3
        key_mask[-1, : T // 2] = False  # left padding
        if B > 1:
            key_mask[0] = False  # a sequence with nothing valid: rows see nothing
    q, k, q_pos, k_pos = q.to(DEVICE), k.to(DEVICE), q_pos.to(DEVICE), k_pos.to(DEVICE)
    key_mask = key_mask.to(DEVICE) if key_mask is not None else None
    mask = key_mask[:, None, None, :].expand(-1, 1, M, -1) if key_mask is not None else None
    scaling = D ** -0.5
    _, want = attend(q, k, k, q_pos, k_pos, scaling, window, softcap, mask)
    got = tmod.attention_sums(q, k, q_pos, k_pos, scaling, window, softcap, key_mask)
    for name in ("mass", "mass2", "q2", "nq"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert torch.isfinite(a).all(), name
    torch.testing.assert_close(got.mass, want.mass, **SUM_TOL)
    torch.testing.assert_close(got.mass2, want.mass2, **SUM_TOL)
    torch.testing.assert_close(got.q2, want.q2, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.nq, want.nq)
    return got, want


#        B  H  G  M   T    D    dtype           window softcap masked start
TW_GRID = [
    (1, 1, 1, 64, 1, 64, torch.float32, None, None, False, 0),  # one key: most rows see nothing
    (1, 2, 3, 64, 100, 64, torch.float16, None, None, False, 0),  # T not a multiple of the key tile
    (2, 1, 4, 64, 150, 128, torch.float32, None, None, True, 0),  # masked keys, an all-invalid sequence
    (1, 2, 4, 17, 90, 256, torch.float16, 40, None, False, 500),  # sliding window, offset positions
    (2, 2, 1, 8, 70, 128, torch.float16, None, 20.0, True, 0),  # softcap + mask
    (1, 1, 3, 64, 130, 256, torch.float32, 50, 30.0, True, 3),  # everything at once
    (1, 1, 4, 33, 64, 64, torch.float32, None, None, False, 0),  # 132 rows: three row blocks
    (1, 2, 1, 1, 80, 128, torch.float32, None, None, False, 0),  # one query
]


@pytest.mark.parametrize("B,H,G,M,T,D,dtype,window,softcap,masked,start", TW_GRID,
                         ids=[f"B{c[0]}H{c[1]}G{c[2]}M{c[3]}T{c[4]}D{c[5]}-{str(c[6])[6:]}-w{c[7]}-c{c[8]}-m{int(c[9])}"
                              for c in TW_GRID])
def test_token_weights_match_attend(B, H, G, M, T, D, dtype, window, softcap, masked, start):
    tw_case(B, H, G, M, T, D, dtype, window, softcap, masked, start, seed=T + D)


def test_token_weights_mixed_dtypes_and_strided_inputs():
    tw_case(1, 2, 2, 16, 50, 64, torch.float32, kdtype=torch.float16)  # fp32 dots over fp16 keys
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 12, 4, 64, generator=g).transpose(1, 2).to(DEVICE)  # [1, 4, 12, 64], non-contiguous
    k = torch.randn(1, 40, 2, 64, generator=g).transpose(1, 2).to(DEVICE)
    pos = torch.arange(40, device=DEVICE)
    _, want = attend(q, k, k, pos[-12:], pos, 0.125)
    got = tmod.attention_sums(q, k, pos[-12:], pos, 0.125)
    torch.testing.assert_close(got.mass, want.mass, **SUM_TOL)
    torch.testing.assert_close(got.q2, want.q2, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter computes bf16 wrongly")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_token_weights_bf16_on_gpu(D):
    tw_case(2, 2, 4, 64, 700, D, torch.bfloat16, masked=True)


def test_token_weights_raise():
    q, k = torch.randn(1, 4, 8, 64, device=DEVICE), torch.randn(1, 2, 20, 64, device=DEVICE)
    qp, kp = torch.arange(12, 20, device=DEVICE), torch.arange(20, device=DEVICE)
    for args in ((q[:, :3], k, qp, kp), (q, k[..., :32], qp, kp), (q, k, qp[:4], kp), (q, k, qp.float(), kp),
                 (q.to(torch.int32), k, qp, kp), (torch.randn(1, 2, 8, 512), torch.randn(1, 2, 20, 512), qp, kp)):
        with pytest.raises(RDKVError):
            tmod.attention_sums(*args, 0.1)
    with pytest.raises(RDKVError):
        tmod.attention_sums(q, k, qp, kp, 0.1, softcap=0.0)
    with pytest.raises(RDKVError):
        tmod.attention_sums(q, k, qp, kp, 0.1, key_mask=torch.ones(1, 19, dtype=torch.bool, device=DEVICE))
    with pytest.raises(RDKVError):
        tmod.attention_sums(q, k, qp, kp, 0.1, key_mask=torch.ones(1, 20, device=DEVICE))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_window_weights_route_through_the_kernel(monkeypatch, arch):
    """rdkv.weights' window form on tiny models (GQA Llama; Gemma 3 with sliding-window layers that keep
    only their window): RDKV_BACKEND=triton sends it through the kernel, with the same sums as the torch
    path (left-padded batch: the key-validity mask is live)."""
    from conftest import tiny_gemma3, tiny_llama

    import rdkv
    from rdkv.weights import layer_sums

    model = (tiny_llama if arch == "llama" else tiny_gemma3)(0).to(DEVICE)
    ids = torch.randint(0, 96, (2, 90), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones(2, 90, dtype=torch.long, device=DEVICE)
    mask[1, :20] = 0
    with rdkv.record(model) as rec:
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), use_cache=True)
    calls = []
    real = tmod.attention_sums
    monkeypatch.setattr(tmod, "attention_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    for st in rec.layers.values():
        monkeypatch.setenv("RDKV_BACKEND", "torch")
        want = layer_sums(st, "window", st.start + 5)
        monkeypatch.setenv("RDKV_BACKEND", "triton")
        got = layer_sums(st, "window", st.start + 5)
        torch.testing.assert_close(got.mass, want.mass, **SUM_TOL)
        torch.testing.assert_close(got.mass2, want.mass2, **SUM_TOL)
        torch.testing.assert_close(got.q2, want.q2, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.nq, want.nq)
    assert len(calls) == len(rec.layers)
