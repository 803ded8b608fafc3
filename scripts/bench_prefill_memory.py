"""Peak memory and time of a prefill that ends in a compressed cache, three ways, each in a fresh process:

* ``full``: a plain prefill (the model as ``rdkv.models.load`` returns it) that keeps its full cache;
* ``record``: the same prefill inside ``rdkv.record`` (its cache and the record kept);
* ``record+compress``: the prefill inside ``rdkv.record``, then ``rdkv.compress`` at the budget;
* ``prefill``: ``rdkv.prefill`` (``mode="staged"``: 8-bit copies of each layer until the surprisal prior is known);
* ``prefill-layer``: ``rdkv.prefill(mode="layer")``, which packs each layer right after its attention.

    python scripts/bench_prefill_memory.py --model gemma3-270m --contexts 8192 16384 32768
    python scripts/bench_prefill_memory.py --model gemma3-270m --contexts 4096 8192 16384 32768 --cap-gb 1.0

On a GPU (``--device cuda``) peak and held are ``torch.cuda.max_memory_allocated`` / ``memory_allocated`` above
what was allocated just before the call. ``--model llama-8b-random`` is Llama-3.1-8B's shape with random bf16
weights and random token ids (scripts/bench_generate.py's configuration; memory does not depend on the weights'
values, the allocation does, so its quality means nothing), ``llama-tiny-random`` a 2-layer one for checks:

    python scripts/bench_prefill_memory.py --model llama-8b-random --dtype bfloat16 --device cuda --contexts 32768 131072 --paths full prefill prefill-layer

On a CPU, peak is the resident set sampled every 2 ms during the call, above the resident set just before it (the loaded
model, paged in by a 16-token forward, and the token ids); ``held`` is what stays resident once the call's garbage is gone and only its cache
is kept. With ``--cap-gb G`` each cell instead runs under an address-space limit of G GiB above what the loaded
process has mapped, and the table says which contexts each path completes.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time

import torch

PATHS = ("full", "record", "record+compress", "prefill", "prefill-layer")
RANDOM = ("llama-8b-random", "llama-tiny-random")  # random-weight shapes (scripts/bench_generate.py)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def cell(args) -> dict:
    """One measurement in this process (run by the parent through a subprocess)."""
    import rdkv

    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    sys.path.insert(0, os.path.dirname(__file__))
    dtype, gpu = getattr(torch, args.dtype), args.device == "cuda"
    if args.model in RANDOM:
        from bench_generate import LLAMA_8B, TINY
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**(LLAMA_8B if args.model == "llama-8b-random" else TINY))
        with torch.device(args.device):
            model = LlamaForCausalLM(cfg).to(dtype).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, args.context), device=args.device)
    else:
        from common import domain_text

        model, tok = rdkv.models.load(args.model, dtype=dtype)
        model.to(args.device)
        ids = tok(domain_text("prose"), return_tensors="pt").input_ids[:, : args.context].to(args.device)
        assert ids.shape[1] == args.context, f"the text has only {ids.shape[1]} tokens"
    model(ids[:, :16])  # pages the weights in: they are mapped from disk, resident only once read
    gc.collect()
    if args.cap_gb:
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + int(args.cap_gb * 2**30), resource.RLIM_INFINITY))
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    used = torch.cuda.memory_allocated if gpu else rss
    base, peak, done = used(), [used()], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    if not gpu:
        watcher.start()
    t0 = time.perf_counter()
    try:
        if args.path == "full":
            cache = rdkv.compat.output_cache(model(ids, use_cache=True, logits_to_keep=1))
            nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        elif args.path == "record":
            with rdkv.record(model) as rec:
                cache = rdkv.compat.output_cache(model(ids, use_cache=True, logits_to_keep=1))
            nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        elif args.path == "record+compress":
            with rdkv.record(model) as rec:
                model(ids, use_cache=True, logits_to_keep=1)
            cache = rdkv.compress(rec, args.budget)
            del rec
            nbytes = cache.nbytes
        else:
            cache = rdkv.prefill(model, ids, args.budget, mode="layer" if args.path == "prefill-layer" else "staged")
            nbytes = cache.nbytes
    except (MemoryError, RuntimeError) as e:  # torch reports a refused allocation as a RuntimeError (OOM too)
        done.set()
        return {"ok": False, "error": str(e).splitlines()[0][:120]}
    if gpu:
        torch.cuda.synchronize()
        peak[0] = torch.cuda.max_memory_allocated()
    seconds = time.perf_counter() - t0
    done.set()
    if not gpu:
        watcher.join()
    gc.collect()
    return {"ok": True, "peak_mb": (max(peak[0], used()) - base) / 1e6, "held_mb": (used() - base) / 1e6,
            "cache_mb": nbytes / 1e6, "seconds": seconds}


def run_cell(args, path: str, context: int) -> dict:
    cmd = [sys.executable, __file__, "--cell", path, "--model", args.model, "--dtype", args.dtype, "--device", args.device,
           "--contexts", str(context), "--budget", str(args.budget)] + (["--cap-gb", str(args.cap_gb)] if args.cap_gb else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:  # killed, or failed outside the measured call
        return {"ok": False, "error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:120]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cap-gb", type=float, default=None)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--cell", choices=PATHS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        args.path, args.context = args.cell, args.contexts[0]
        print(json.dumps(cell(args)), flush=True)
        return
    import transformers

    print(f"Command: `python {' '.join(sys.argv)}`  \nMachine: {os.cpu_count()} CPUs ({platform.machine()}), torch "
          f"{torch.__version__}, transformers {transformers.__version__}; date {time.strftime('%Y-%m-%d')}; "
          f"{args.model} {args.dtype} on {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
          f"budget {args.budget}\n")
    if args.cap_gb:
        print("| context | " + " | ".join(f"{p} under {args.cap_gb} GiB" for p in args.paths) + " |")
        print("|---|" + "---|" * len(args.paths))
    else:
        print("| context | path | peak above model MB | held after MB | cache MB | seconds | peak / full |")
        print("|---|---|---|---|---|---|---|")
    for n in args.contexts:
        rows = {p: run_cell(args, p, n) for p in args.paths}
        if args.cap_gb:
            print(f"| {n} | " + " | ".join("runs" if r["ok"] else f"fails ({r['error']})" for r in rows.values()) + " |",
                  flush=True)
            continue
        full = rows.get("full", {}).get("peak_mb")
        for p, r in rows.items():
            if not r["ok"]:
                print(f"| {n} | {p} | failed: {r['error']} | | | | |", flush=True)
                continue
            ratio = f"{r['peak_mb'] / full:.2f}" if full else "-"
            print(f"| {n} | {p} | {r['peak_mb']:.0f} | {r['held_mb']:.0f} | {r['cache_mb']:.1f} | {r['seconds']:.1f} | "
                  f"{ratio} |", flush=True)


if __name__ == "__main__":
    main()
