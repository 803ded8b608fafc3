"""What the page layout costs over the packed one, at the same allocation: bytes and empty page slots.

    python scripts/bench_page_bytes.py --model smollm2-135m --contexts 1024 4096 --budgets 0.1 0.25

One prefill of the retrieval probe per context, compressed at each budget in the packed layout, then every layer
re-packed in pages (:func:`rdkv.trizone.to_pages`). Bytes are ``nbytes`` of each cache (zone C included, the same
in both); empty slots are the token slots of partly filled pages (the last page of each stream and V class). Until
the allocator rounds to whole pages, this is what a cache in pages takes beyond its budget. Prints a markdown table.
"""
from __future__ import annotations

import argparse

import torch

import rdkv
from rdkv import pages
from rdkv.trizone import to_pages


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25])
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(a.model)
    print(f"| {a.model}: tokens | budget | packed B (of fp16) | pages B (of fp16) | pages / packed | empty page slots |")
    print("|---|---|---|---|---|---|")
    for n in a.contexts:
        ids = tok(rdkv.models.retrieval_prompt(n, 0.5, tok)["context"], return_tensors="pt").input_ids
        with rdkv.record(model) as rec:
            model(ids[:, :-1], use_cache=True, logits_to_keep=1)
        for budget in a.budgets:
            cache = rdkv.compress(rec, budget)
            paged = [to_pages(layer) for layer in cache.layers]
            plans = [pages.segment_plan(seg) for seg in paged]
            slots = sum(int((p.pages * p.page).sum()) for p in plans)
            empty = slots - sum(int(p.counts.sum()) for p in plans)
            nb = sum(seg.nbytes for seg in paged)
            fp16 = cache.fp16_bytes
            print(f"| {ids.shape[1] - 1} | {budget:g} | {cache.nbytes} ({cache.nbytes / fp16:.3f}) | {nb} ({nb / fp16:.3f}) | "
                  f"{nb / cache.nbytes:.3f} | {empty} of {slots} ({empty / slots:.1%}) |")


if __name__ == "__main__":
    main()
