"""What whole pages cost: the cache compress writes against its budget, and the bytes of its empty page slots.

    python scripts/bench_page_bytes.py --model smollm2-135m --contexts 1024 4096 --budgets 0.1 0.25

One prefill of the retrieval probe per context, compressed at each budget. Bytes are ``nbytes`` (zone C empty);
empty slots are the token slots of partly filled pages, which the allocator leaves only where a stream has too
few tokens to fill them (:func:`rdkv.solvers.allocate.fit_pages`), each charged a page's bytes per token of its
class; "without them" is what the same allocation would hold if pages had no empty slots. Prints a markdown
table.
"""
from __future__ import annotations

import argparse
import time

import torch

import rdkv
from rdkv import pages


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25])
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(a.model)
    print(f"| {a.model}: tokens | budget | page tokens | pages B (of fp16) | without them | "
          "empty page slots | compress s |")
    print("|---|---|---|---|---|---|---|")
    for n in a.contexts:
        ids = tok(rdkv.models.retrieval_prompt(n, 0.5, tok)["context"], return_tensors="pt").input_ids
        with rdkv.record(model) as rec:
            model(ids[:, :-1], use_cache=True, logits_to_keep=1)
        for budget in a.budgets:
            t = time.perf_counter()
            cache = rdkv.compress(rec, budget)
            took = time.perf_counter() - t
            plans = [pages.segment_plan(seg) for seg in cache.layers]
            fp16, nb = cache.fp16_bytes, cache.nbytes
            slots = sum(int((p.pages * p.page).sum()) for p in plans)
            empty = slots - sum(int(p.counts.sum()) for p in plans)
            dense = nb - sum(int(((p.pages * p.page - p.counts) * p.page_size).sum()) // p.page for p in plans)
            sizes = "/".join(map(str, sorted({p.page for p in plans})))
            print(f"| {ids.shape[1] - 1} | {budget:g} | {sizes} | {nb} ({nb / fp16:.4f}) | {dense} ({dense / fp16:.4f}) | "
                  f"{empty} of {slots} ({empty / max(1, slots):.1%}) | {took:.2f} |")


if __name__ == "__main__":
    main()
