#!/usr/bin/env python
"""Compress-side Triton kernels against the torch paths they replace, on one device, side by side.

Synthetic tensors shaped like one Llama-3.1-8B layer (8 KV heads x 4 query heads, head_dim 128), no model:

* ``token weights``: attention mass of the last 64 prefill queries on every key
  (``rdkv.kernels.token_weights.attention_sums``, two launches, no M x T tensor) vs
  ``rdkv.dense.attend`` chunked the way ``rdkv.weights`` calls it;
* ``quantize V rows``: 2/4-bit codes of every token row, 32-channel groups (``axis=-1``);
* ``quantize K``: 2/4-bit codes of a 16-channel block over all tokens, 128-token groups (``axis=0``).

Each row: median time of both paths (triton.testing.do_bench on CUDA) and the largest difference
(mass: relative to the largest mass; codes: exact equality is expected, the count of differing bytes).

    python scripts/bench_compress_kernels.py --device cuda --out results/
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from common import save_outputs
from rdkv import quant
from rdkv.dense import attend

H, G, D, W = 8, 4, 128, 64


def timer(dev: torch.device):
    if dev.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=25) * 1e-3

    def cpu(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768, 131072])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_compress_kernels.{md,json}")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from rdkv.kernels.quantize_pack import quantize_pack as tq
    from rdkv.kernels.token_weights import attention_sums

    bench = timer(dev)
    dt = torch.float16
    rows = []
    for T in a.contexts:
        g = torch.Generator(device="cpu").manual_seed(T)
        k = torch.randn(1, H, T, D, generator=g).to(dev, dt)
        v = torch.randn(1, H, T, D, generator=g).to(dev, dt)
        q = torch.randn(1, H * G, W, D, generator=g).to(dev, dt)
        k_pos = torch.arange(T, device=dev)
        q_pos = k_pos[-W:]
        valid = torch.ones(1, T, dtype=torch.bool, device=dev)
        scaling = D ** -0.5
        mask = valid[:, None, None, :].expand(-1, 1, W, -1)
        elements = 64 * H * G * T

        def kern():
            return attention_sums(q, k, q_pos, k_pos, scaling, None, None, valid)

        def ref():
            return attend(q, k, v, q_pos, k_pos, scaling, None, None, mask, elements)[1]

        a_k, a_r = kern(), ref()
        err = float((a_k.mass - a_r.mass).abs().max() / a_r.mass.abs().max())
        rows.append(dict(op="token weights (64 queries)", context=T, triton_us=bench(kern) * 1e6, torch_us=bench(ref) * 1e6,
                         diff=f"{err:.1e} rel"))
        x = v.reshape(-1, D)
        kb = k[0, 0, :, :16].contiguous()
        for bits in (2, 4):
            for op, args in ((f"quantize V rows, {bits}-bit", (x, bits, 32, -1)), (f"quantize K block, {bits}-bit", (kb, bits, 128, 0))):
                got, want = tq(*args), quant.quantize_pack_torch(*args)
                bad = sum(int((p != r).sum()) for p, r in zip(got, want))
                rows.append(dict(op=op, context=T, triton_us=bench(lambda: tq(*args)) * 1e6,
                                 torch_us=bench(lambda: quant.quantize_pack_torch(*args)) * 1e6, diff=f"{bad} differ"))
        for r in rows[-5:]:
            print(f"{r['op']:>28} T={T:>6}: triton {r['triton_us']:9.1f} us  torch {r['torch_us']:9.1f} us  "
                  f"x{r['torch_us'] / r['triton_us']:.1f}  ({r['diff']})", flush=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    lines = [f"# Compress-side kernels vs torch ({name})", "",
             f"One layer: {H} KV heads x {G} query heads, head_dim {D}, batch 1, fp16. Times are medians of do_bench.", "",
             "| op | context | Triton us | torch us | torch / Triton | difference |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['context']} | {r['triton_us']:.1f} | {r['torch_us']:.1f} | "
              f"{r['torch_us'] / r['triton_us']:.1f} | {r['diff']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    save_outputs(a.out, "bench_compress_kernels", text, dict(device=name, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
