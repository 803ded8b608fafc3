"""Prefill time vs compress time (weights, solve, pack) and compress's peak extra memory.

    python scripts/bench_compress.py --contexts 1024 4096 8192
    python scripts/bench_compress.py --model gemma3-270m --contexts 4096 16384 --method rdkv-recon

One prefill per context (plain SDPA, then inside ``rdkv.record``, which also streams the weight
statistics), then ``rdkv.compress`` of that record at each budget. Peak extra memory is the peak
resident-set growth while compress runs, sampled every millisecond, next to the size of the cache as fp16.
"""
from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from contextlib import contextmanager

import torch

import rdkv
from common import split_method


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss():
    """Yields a dict whose 'extra' is the peak RSS growth (bytes) inside the block."""
    base, box, done = rss(), {"peak": 0}, threading.Event()

    def watch():
        while not done.is_set():
            box["peak"] = max(box["peak"], rss())
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield box
    finally:
        done.set()
        t.join()
        box["extra"] = max(0, max(box["peak"], rss()) - base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25])
    ap.add_argument("--method", type=split_method, default=("auto", {}),
                    help="a method name (rdkv.methods.METHODS or common.VARIANTS), optionally with options")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    method, options = args.method
    model, tok = rdkv.models.load(args.model)
    plain = "sdpa"
    text = rdkv.models.retrieval_prompt(max(args.contexts) + 200, 0.5, tok)["context"]
    all_ids = tok(text, return_tensors="pt").input_ids
    print(f"model {args.model}, torch {torch.__version__}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"{time.strftime('%Y-%m-%d')}, method {method} {options or ''}\n")
    print("| tokens | prefill sdpa s | prefill rdkv s | budget | compress s | compress / rdkv prefill | peak extra MB | fp16 cache MB | held / fp16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.contexts:
        ids = all_ids[:, :n]
        model.set_attn_implementation(plain)  # transformers' own attention
        t = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        t_sdpa = time.perf_counter() - t
        rdkv.install(model)
        t = time.perf_counter()
        with rdkv.record(model) as rec:
            model(ids, use_cache=True, logits_to_keep=1)
        t_rdkv = time.perf_counter() - t
        for b in args.budgets:
            with peak_rss() as mem:
                t = time.perf_counter()
                cache = rdkv.compress(rec, b, method=method, **options)
                t_c = time.perf_counter() - t
            print(f"| {ids.shape[1]} | {t_sdpa:.1f} | {t_rdkv:.1f} | {b} | {t_c:.2f} | {t_c / t_rdkv:.2f} | "
                  f"{mem['extra'] / 2**20:.0f} | {cache.fp16_bytes / 2**20:.1f} | {cache.nbytes / cache.fp16_bytes:.4f} |", flush=True)
            del cache


if __name__ == "__main__":
    main()
