"""The main job: compress a real model's cache at a few budgets and check a retrieval answer.

One prefill of ~1k tokens of Python's own documentation with a "secret code" line hidden in the
middle; the question comes after compression (query-agnostic: compress once, ask later). For each
budget: the bytes the compressed cache really holds against its fp16 size, the greedy answer next to
the full-cache answer, and the time taken.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import rdkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1000, help="context length (tokens)")
    ap.add_argument("--depth", type=float, default=0.5, help="needle depth in the context, 0..1")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.15, 0.1])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)

    model, tok = rdkv.models.load(args.model)
    probe = rdkv.models.retrieval_prompt(args.tokens, args.depth, tok)
    ctx = tok(probe["context"], return_tensors="pt").input_ids
    full_ids = torch.cat([ctx, tok(probe["question"], return_tensors="pt", add_special_tokens=False).input_ids], 1)
    n_ans = len(tok(probe["answer"], add_special_tokens=False).input_ids)

    def answer(cache) -> tuple[str, float]:
        t = time.perf_counter()
        out = model.generate(full_ids, **rdkv.cache_kwargs(cache), max_new_tokens=n_ans, do_sample=False)
        return tok.decode(out[0, full_ids.shape[1]:]), time.perf_counter() - t

    t = time.perf_counter()
    prefill = rdkv.compat.output_cache(model(ctx, use_cache=True, logits_to_keep=1))  # kept: compress(model) needs it
    t_prefill = time.perf_counter() - t
    print(f"{args.model}: {ctx.shape[1]} context tokens, needle at depth {args.depth:.0%}, prefill {t_prefill:.1f}s")
    print(f"expected answer: {probe['answer']!r}\n")
    rows = []
    for budget in args.budgets:
        t = time.perf_counter()
        cache = rdkv.compress(model, budget)  # the model's most recent prefill
        t_compress = time.perf_counter() - t
        held = cache.nbytes
        text, t_answer = answer(cache)
        rows.append((budget, held, cache.fp16_bytes, text, t_compress, t_answer))
    full_text, t_full = answer(copy.deepcopy(prefill))  # a copy: the row below counts the prefill's own bytes

    print("| budget | bytes held | fp16 bytes | held / fp16 | answer | = full cache | compress s | answer s |")
    print("|---|---|---|---|---|---|---|---|")
    for budget, held, fp16, text, tc, ta in rows:
        print(f"| {budget:.2f} | {held:,} | {fp16:,} | {held / fp16:.4f} | {text!r} | {'yes' if text == full_text else 'NO'} "
              f"| {tc:.2f} | {ta:.2f} |")
    print(f"| full | {sum(l.keys.nbytes + l.values.nbytes for l in prefill.layers):,} (fp32) | | | {full_text!r} | | | {t_full:.2f} |")


if __name__ == "__main__":
    main()
