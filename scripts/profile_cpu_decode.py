"""One real layer's decode step on a CPU: the CPU path, the oracle and SDPA over the full layer, where the time goes.

    python scripts/profile_cpu_decode.py --model smollm2-135m --tokens 4096 --budget 0.25 --layer 10

One prefill of GPL-3 text, compressed at ``--budget``; then one new token's attention over layer ``--layer``:
median microseconds of ``rdkv.cpu_decode``, ``rdkv.reference`` and SDPA over the same layer's full fp32 cache,
with 2 and 1 threads, on an idle machine and beside a 2-thread matmul, and the share of the CPU path's wall
time its calling thread was on a core (beside the load, on two threads, each op waits for a descheduled
thread); then the bytes the CPU path keeps between steps (none), its top-level torch ops per step and
torch.profiler's top ops.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch
from bench_cpu_decode import LOAD, text_ids

import rdkv
from rdkv import cpu_decode, reference


def median_us(f, n: int = 15) -> tuple[float, float]:
    """Median wall µs of ``f`` and the calling thread's CPU time over the wall time of all ``n`` calls."""
    f()
    ts = []
    cpu = time.thread_time()
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e6, (time.thread_time() - cpu) / sum(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--layer", type=int, default=10)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    with rdkv.record(model) as rec:
        full = rdkv.compat.output_cache(model(text_ids(tok, args.tokens), use_cache=True, logits_to_keep=1))
    layer = rdkv.compress(rec, args.budget).layers[args.layer]
    k, v = full.layers[args.layer].keys, full.layers[args.layer].values
    B, H, _, D = k.shape
    G = model.config.num_attention_heads // H
    layer.update(k[:, :, -1:], v[:, :, -1:])  # one new token in zone C
    packed = layer.nbytes
    q = torch.randn(B, H * G, 1, D)
    scaling = D ** -0.5
    paths = {"CPU path": lambda: cpu_decode.trizone_attention(q, layer, scaling),
             "oracle": lambda: reference.trizone_attention(q, layer, scaling),
             "SDPA, full layer": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    print(f"{args.model} layer {args.layer}, {args.tokens} tokens, budget {args.budget}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; median µs of one decode step's attention\n")
    print("| machine | threads | " + " | ".join(paths) + " | CPU path: calling thread's share of the wall time |\n"
          "|---|---|" + "---|" * (len(paths) + 1))
    for loaded in (False, True):
        load = subprocess.Popen([sys.executable, "-c", LOAD]) if loaded else None
        try:
            if load:
                time.sleep(2)
            for threads in (2, 1):
                torch.set_num_threads(threads)
                timed = [median_us(f) for f in paths.values()]
                cells = " | ".join(f"{us:.0f}" for us, _ in timed)
                print(f"| {'2-thread matmul beside' if loaded else 'idle'} | {threads} | {cells} | {timed[0][1]:.2f} |",
                      flush=True)
        finally:
            torch.set_num_threads(2)
            if load:
                load.kill()
                load.wait()
    from torch.profiler import profile

    with profile() as prof:
        paths["CPU path"]()
    print(f"\nkept between steps: {layer.nbytes - packed:,} B; {sum(e.cpu_parent is None for e in prof.events())} "
          "top-level torch ops per step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
