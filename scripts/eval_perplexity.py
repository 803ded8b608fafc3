"""Perplexity through a compressed cache, per domain, at equal bytes.

    python scripts/eval_perplexity.py --quick
    python scripts/eval_perplexity.py --contexts 1024 2048 --continuation 256

For each domain (prose: Python's language reference; code: a standard-library module; legal: Python's
LICENSE.txt) prefill N tokens once, compress with every method and budget, then teacher-force the next
M tokens through the compressed cache. Reports the perplexity increase over the full cache (%) and the
mean KL of next-token distributions from the full cache.
"""
from __future__ import annotations

import inspect
import math
import sysconfig
from pathlib import Path

import torch
from tqdm import tqdm

import rdkv
from common import compressions, forward, full_reference, header, kl, parser, table, write


def domain_text(name: str) -> str:
    if name == "prose":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    if name == "code":
        import argparse

        return inspect.getsource(argparse)
    if name == "legal":
        return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    raise ValueError(name)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(-logits.log_softmax(-1).gather(1, targets[:, None]).mean())


def main() -> None:
    ap = parser(__doc__, [0.05, 0.1, 0.25, 0.5], [1024])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--domains", nargs="+", default=["prose", "code", "legal"])
    args = ap.parse_args()
    if args.quick:
        args.budgets, args.continuation = [0.1, 0.25], 128
        args.methods = [m for m in args.methods if m in ("rdkv", "snapkv", "kivi2", "kivi4", "int4")]
    tag = args.tag or ("quick" if args.quick else "full")
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    rdkv.attach(model, all_queries=any(m in ("rdkv-all", "rdkv-paper") for m in args.methods))
    rows = []
    for domain in tqdm(args.domains, desc="domains"):
        ids = tok(domain_text(domain), return_tensors="pt").input_ids
        for n in args.contexts:
            if ids.shape[1] < n + args.continuation + 1:
                print(f"  skip {domain} @ {n}: only {ids.shape[1]} tokens")
                continue
            prefix, tail = ids[:, :n], ids[:, n : n + args.continuation]
            targets = ids[0, n + 1 : n + args.continuation + 1]
            full_cache = model(prefix, use_cache=True, logits_to_keep=1).past_key_values
            runs = [(m, b, c.nbytes / c.fp16_bytes, forward(model, c, tail)) for m, b, c in compressions(model, args.methods, args.budgets)]
            ref = full_reference(model, full_cache, tail)
            base = nll(ref, targets)  # logits at tail position i predict token n + i + 1
            for m, b, ratio, logits in runs:
                cur = nll(logits, targets)
                rows.append({"domain": domain, "context": n, "method": m, "budget": "-" if b is None else b,
                             "bytes/fp16": ratio, "ppl": math.exp(cur), "ppl increase %": 100 * (math.exp(cur - base) - 1),
                             "KL": kl(ref, logits), "protocol": domain})
            rows.append({"domain": domain, "context": n, "method": "full", "budget": 1.0, "bytes/fp16": 1.0,
                         "ppl": math.exp(base), "ppl increase %": 0.0, "KL": 0.0, "protocol": domain})
    cols = ["domain", "context", "method", "budget", "bytes/fp16", "ppl", "ppl increase %", "KL"]
    name = f"perplexity_{args.model}_{tag}"
    md = (f"# Perplexity through the compressed cache: {args.model} ({tag})\n\n{header(args)}\n"
          f"Prefill N tokens, compress, teacher-force the next {args.continuation}.\n\n{table(rows, cols)}\n\n![plot]({name}.png)\n")
    write(name, md, rows, ["ppl increase %", "KL"], args.model)


if __name__ == "__main__":
    main()
