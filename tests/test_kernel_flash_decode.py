"""The full-cache split-K flash-decoding kernel (the speed anchor), under TRITON_INTERPRET=1 on CPU, against
:func:`rdkv.dense.attend`.

Tolerances: fp32 runs "ieee" dots and differs from the reference only by summation order (atol 2e-5 / rtol
1e-4, as the TriZone kernel's tests). fp16 rounds q * scaling * log2(e) and p to fp16 before the dots
(relative 2^-11 each), the same error budget the TriZone kernel's fp16 tests derive: atol 5e-3 / rtol 5e-3.
RDKV_TEST_DEVICE=cuda runs the same cases compiled on a GPU.
"""
import importlib
import os
import sys

DEVICE = os.environ.get("RDKV_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"RDKV_TEST_DEVICE={DEVICE} but no GPU is visible", allow_module_level=True)

from rdkv import RDKVError
from rdkv.dense import attend

for _name in ("rdkv.kernels.lse_merge", "rdkv.kernels.flash_decode"):  # redecorate under the interpreter
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
from rdkv.kernels import flash_decode as fd  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
if DEVICE != "cpu":
    TOL[torch.float32] = dict(atol=1e-4, rtol=1e-4)


def inputs(B, H, G, L, T, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, L, D, generator=g)
    k = torch.randn(B, H, T, D, generator=g) * 1.5
    k[..., 3] += 8.0  # an outlier channel: large, peaked scores
    v = torch.randn(B, H, T, D, generator=g)
    return (x.to(dtype).to(DEVICE) for x in (q, k, v))


def reference(q, k, v):
    T, L = k.shape[2], q.shape[2]
    pos = torch.arange(T, device=k.device)
    out, _ = attend(q.float(), k.float(), v.float(), pos[T - L:], pos, q.shape[-1] ** -0.5)
    return out


#        B  H  G  L  T     D    dtype
GRID = [(1, 1, 1, 1, 1, 64, torch.float32),  # one token
        (2, 2, 4, 1, 300, 128, torch.float16),
        (1, 2, 8, 3, 257, 64, torch.float32),  # L > 1: causal among the new positions
        (3, 1, 3, 1, 1000, 256, torch.float16),
        (1, 1, 16, 5, 130, 64, torch.float16),  # 80 query rows: two row blocks
        (2, 1, 4, 1, 64, 32, torch.float32)]


@pytest.mark.parametrize("B,H,G,L,T,D,dtype", GRID, ids=[f"B{c[0]}H{c[1]}G{c[2]}L{c[3]}T{c[4]}D{c[5]}-{str(c[6])[6:]}"
                                                          for c in GRID])
def test_matches_dense_attention(B, H, G, L, T, D, dtype):
    q, k, v = inputs(B, H, G, L, T, D, dtype, seed=T + D)
    got = fd.flash_decode(q, k, v, D ** -0.5)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), reference(q, k, v).to(got.device), **TOL[dtype])


@pytest.mark.parametrize("split,block_n,stages", [(64, 16, 1), (100, 32, 2), (10_000, 64, 3)])
def test_launch_settings_give_the_same_result(split, block_n, stages):
    """Many small work items (splits cut mid-tile after rounding), one item per stream, pipelining depths."""
    q, k, v = inputs(2, 2, 4, 2, 333, 64, torch.float32, seed=1)
    got = fd.flash_decode(q, k, v, 64 ** -0.5, split=split, block_n=block_n, num_stages=stages)
    torch.testing.assert_close(got, reference(q, k, v).to(got.device), **TOL[torch.float32])


def test_strided_cache_views():
    """A cache view with a non-contiguous token axis (every other token of a larger buffer)."""
    q, k, v = inputs(1, 2, 2, 1, 400, 64, torch.float32, seed=2)
    ks, vs = k[:, :, ::2], v[:, :, ::2]
    got = fd.flash_decode(q, ks, vs, 64 ** -0.5)
    torch.testing.assert_close(got, reference(q, ks, vs).to(got.device), **TOL[torch.float32])


def test_default_split_fills_the_machine():
    assert fd.default_split(8, 131072, 64, torch.device("cpu")) == 65536  # 4 SMs x 4 waves / 8 streams: 2 items
    assert fd.default_split(64, 100, 64, torch.device("cpu")) == 128  # never below one tile, whole tiles


@pytest.mark.parametrize("case", ["dtype", "head_dim", "shape", "mixed", "block_n", "L"])
def test_bad_inputs_raise(case):
    q, k, v = inputs(1, 2, 2, 1, 50, 64, torch.float32)
    kw = {}
    if case == "dtype":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "head_dim":
        q, k, v = q[..., :48], k[..., :48], v[..., :48]
    elif case == "shape":
        q = q[:, :3]
    elif case == "mixed":
        k = k.half()
    elif case == "block_n":
        kw["block_n"] = 48
    elif case == "L":
        q = q.expand(-1, -1, 51, -1)
    with pytest.raises(RDKVError):
        fd.flash_decode(q, k, v, 0.125, **kw)


def test_end_to_end_decode_through_the_anchor_equals_sdpa():
    """scripts/bench_generate.py's full-cache paths on its tiny model (Llama-3.1-8B attention shape): greedy
    steps through the anchor's attention function give SDPA's logits (fp32 model: summation order only)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_generate as bg
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**bg.TINY)
    model = LlamaForCausalLM(cfg).eval().to(DEVICE)
    bg.register_anchor()
    logits = {}
    for impl in ("sdpa", bg.ANCHOR):
        torch.manual_seed(1)
        cache = bg.full_cache(cfg, 2, 100, 2, torch.device(DEVICE), torch.float32)
        model.set_attn_implementation(impl)
        tok = torch.tensor([[3], [7]], device=DEVICE)
        with torch.no_grad():
            out = [model(tok, past_key_values=cache, position_ids=torch.full((2, 1), 100 + i, device=DEVICE)).logits
                   for i in range(2)]
        assert cache.get_seq_length() == 102
        logits[impl] = torch.cat(out, 1)
    torch.testing.assert_close(logits[bg.ANCHOR], logits["sdpa"], atol=1e-4, rtol=1e-4)
