"""What the allocator's settings do to one prefill: tokens kept, key bits, modelled distortion, time.

    python scripts/bench_allocation.py

One SmolLM2 prefill of the 1k retrieval probe (needle at depth 0.5, question in the prompt), compressed
with allocation passes 1 and 3, per-layer and global scope, and with the solver's swap search (which
``rdkv.solvers.allocate`` leaves off) switched back on for comparison. Prints a markdown table.
"""
from __future__ import annotations

import time

import torch

import rdkv
import rdkv.solvers.allocate as allocate


def main() -> None:
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load("smollm2-135m")
    probe = rdkv.models.retrieval_prompt(1000, 0.5, tok)
    ids = tok(probe["context"] + probe["question"], return_tensors="pt").input_ids
    with rdkv.record(model) as rec:
        model(ids, use_cache=True, logits_to_keep=1)
    rdkv.compress(rec, 0.25)  # pays the one-off surprisal pass
    plain = allocate.lagrangian
    print("| passes | scope | swap | budget | tokens kept | mean K bits | modelled D | compress s |")
    print("|---|---|---|---|---|---|---|---|")
    for passes, scope, swap in [(1, "layer", False), (3, "layer", False), (1, "global", False), (3, "global", False),
                                (3, "layer", True)]:
        allocate.lagrangian = (lambda D, R, b, swap=False: plain(D, R, b, swap=True)) if swap else plain
        for budget in (0.05, 0.1, 0.25):
            t = time.perf_counter()
            cache = rdkv.compress(rec, budget, passes=passes, scope=scope)
            dt = time.perf_counter() - t
            vw = torch.cat([layer.v_widths().flatten() for layer in cache.layers])
            kw = torch.cat([layer.k_widths().flatten() for layer in cache.layers])
            print(f"| {passes} | {scope} | {'on' if swap else 'off'} | {budget} | {float((vw > 0).float().mean()):.3f} | "
                  f"{float(kw.float().mean()):.1f} | {cache.distortion:.1f} | {dt:.2f} |")
    allocate.lagrangian = plain


if __name__ == "__main__":
    main()
