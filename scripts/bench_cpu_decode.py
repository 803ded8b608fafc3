"""Milliseconds per generated token on a CPU: the full cache against rdkv's CPU decode and its oracle.

    python scripts/bench_cpu_decode.py --model smollm2-135m --contexts 1024 4096 8192
    python scripts/bench_cpu_decode.py --model gemma3-270m --contexts 1024 4096 16384

One prefill per context (GPL-3 text, fp32 model), compressed at each budget; then greedy ``generate`` of
``--tokens`` tokens from the same prefill through: the full cache (transformers' own, SDPA attention),
rdkv's vectorised CPU decode (``RDKV_BACKEND=torch``, the default on CPU) and the pure-torch oracle
(``RDKV_BACKEND=reference``). Every row is the best of ``--repeats`` runs, taken in turns so drift in the
machine's speed hits every row alike; ``--load`` repeats the measurement while another process runs a
2-thread matmul, as a shared machine does. Each machine state is measured twice, with torch's thread count
as it is and with one thread (what a user of a shared machine may set), every path in both; ratios are against
the faster full cache of the two (a pass through a compressed cache on the CPU decode path runs on the cores
other processes leave free, the model's matmuls included: :mod:`rdkv.contention`).
``--compare REV`` adds the CPU decode path as it was at git revision REV (its ``rdkv/cpu_decode.py``, with the
thread handling that file had, and none at the level of the pass), timed in the same turns, so a change to the
path is measured against its predecessor on one machine state.
``--keep-freed`` has glibc keep the memory a step frees (:func:`keep_freed_memory`) for every row alike.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import importlib.util
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

import rdkv
from rdkv import contention, cpu_decode

LOAD = ("import os, torch\ntorch.set_num_threads(2)\na = torch.randn(1500, 1500)\nparent = os.getppid()\n"
        "while os.getppid() == parent:  # ends with the benchmark, however it ends\n    a @ a\n")


def text_ids(tok, n: int) -> torch.Tensor:
    text = Path("/usr/share/common-licenses/GPL-3")
    body = text.read_text() if text.exists() else rdkv.models.retrieval_prompt(n + 100, 0.5, tok)["context"]
    ids = tok(body, return_tensors="pt").input_ids
    return ids.repeat(1, n // ids.shape[1] + 1)[:, :n]


def ms_per_token(model, ids: torch.Tensor, cache, tokens: int) -> float:
    cache = copy.deepcopy(cache)
    t = time.perf_counter()
    model.generate(ids, **rdkv.cache_kwargs(cache), max_new_tokens=tokens, min_new_tokens=tokens,
                   do_sample=False)
    return (time.perf_counter() - t) * 1e3 / tokens


def keep_freed_memory() -> None:
    """Make glibc keep freed blocks instead of returning each large one to the system, as
    ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824`` do at startup: a decode step that
    allocates megabytes of buffers then reuses the same pages instead of faulting fresh ones in."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    if not (libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)):
        raise SystemExit("--keep-freed needs glibc's mallopt")


def cpu_decode_at(rev: str) -> types.ModuleType:
    """``rdkv/cpu_decode.py`` as it was at git revision ``rev``, imported beside the current one."""
    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:rdkv/cpu_decode.py"], check=True,
                         capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("rdkv._cpu_decode_at_rev", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "rdkv"  # its relative imports resolve against the installed package
    sys.modules[spec.name] = module  # dataclasses look their module up there
    exec(compile(src, f"{rev}:rdkv/cpu_decode.py", "exec"), module.__dict__)
    return module


def _none() -> None:
    """A revision without thread handling at the level of the pass."""


def measure(model, ids, full, caches: dict, tokens: int, repeats: int, plain: str, thread_counts: list[int],
            previous=None) -> dict[tuple[int, str], float]:
    """Best-of-``repeats`` ms per token of every path, in turns; the full cache through the attention
    implementation ``plain``, each under every count of ``thread_counts``, keyed (threads, path);
    ``previous``: an earlier version of the CPU decode module, timed as "previous"."""
    best: dict[tuple[int, str], float] = {}
    current = cpu_decode.trizone_attention, contention.begin_pass, contention.end_pass
    paths = [("torch", "torch", current)] + ([("previous", "torch", (previous.trizone_attention, _none, _none))]
                                             if previous else [])
    paths.append(("reference", "reference", current))
    most = torch.get_num_threads()
    for _ in range(repeats):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            model.set_attn_implementation(plain)  # the full cache runs transformers' own attention
            key = (threads, "full")
            best[key] = min(best.get(key, 1e9), ms_per_token(model, ids, full, tokens))
            rdkv.install(model)
            try:
                for name, backend, fns in paths:
                    os.environ["RDKV_BACKEND"] = backend
                    cpu_decode.trizone_attention, contention.begin_pass, contention.end_pass = fns
                    for budget, cache in caches.items():
                        key = (threads, f"{name} {budget:g}")
                        best[key] = min(best.get(key, 1e9), ms_per_token(model, ids, cache, tokens))
            finally:
                cpu_decode.trizone_attention, contention.begin_pass, contention.end_pass = current
                os.environ.pop("RDKV_BACKEND")
                torch.set_num_threads(most)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--load", action="store_true", help="also measure beside a competing 2-thread matmul")
    ap.add_argument("--compare", metavar="REV", help="also time rdkv/cpu_decode.py as it was at this git revision")
    ap.add_argument("--keep-freed", action="store_true", help="have glibc keep freed memory (every row alike)")
    args = ap.parse_args()
    if args.keep_freed:
        keep_freed_memory()
    previous = cpu_decode_at(args.compare) if args.compare else None
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    plain = model.config._attn_implementation
    print(f"{args.model} fp32, torch {torch.__version__}, {os.cpu_count()} CPUs ({platform.machine()}), "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}; greedy generate of {args.tokens} tokens, "
          f"best of {args.repeats}{'; glibc keeps freed memory' if args.keep_freed else ''}\n")
    names = {"torch": "CPU decode", "previous": f"CPU decode at {args.compare}", "reference": "oracle"}
    paths = [p for p in names if p != "previous" or previous]
    thread_counts = list(dict.fromkeys((torch.get_num_threads(), 1)))  # torch's setting, then one thread
    cols = [f"{p} {x:g}" for p in paths for x in args.budgets]
    print("| context | machine | threads | full cache ms/token | " + " | ".join(
        f"rdkv {x:.0%} ({names[p]})" for p in paths for x in args.budgets) + " |")
    print("|---" * (len(cols) + 4) + "|")
    for n in args.contexts:
        ids = text_ids(tok, n)
        with rdkv.record(model) as rec:
            full = rdkv.compat.output_cache(model(ids[:, :-1], use_cache=True, logits_to_keep=1))
        caches = {b: rdkv.compress(rec, b) for b in args.budgets}
        del rec
        for loaded in (False, True) if args.load else (False,):
            load = subprocess.Popen([sys.executable, "-c", LOAD]) if loaded else None
            try:
                if load:
                    time.sleep(2)
                best = measure(model, ids, full, caches, args.tokens, args.repeats, plain, thread_counts, previous)
            finally:
                if load:
                    load.kill()
                    load.wait()
            ref = min(best[threads, "full"] for threads in thread_counts)
            for threads in thread_counts:
                cells = [f"{best[threads, 'full']:.0f}"] + [
                    f"{best[threads, c]:.0f} ({best[threads, c] / ref:.2f}x)" for c in cols]
                print(f"| {n:,} | {'2-thread matmul beside' if loaded else 'idle'} | {threads} | " + " | ".join(cells)
                      + " |", flush=True)
        del full, caches


if __name__ == "__main__":
    main()
