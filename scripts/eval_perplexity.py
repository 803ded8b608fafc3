"""Perplexity through a compressed cache, per domain, at equal bytes.

    python scripts/eval_perplexity.py --quick
    python scripts/eval_perplexity.py --contexts 1024 2048 --continuation 256
    python scripts/eval_perplexity.py --methods rdkv --budgets 0.1 0.25 --continuation 2048 --fold 0 256 --tag fold

For each domain (prose: Python's language reference; code: a standard-library module; legal: Python's
LICENSE.txt) prefill N tokens once, compress with every method and budget, then teacher-force the next
M tokens through the compressed cache. Reports the perplexity increase over the full cache (%) and the
mean KL of next-token distributions from the full cache.

``--fold R`` (0 = never) runs each compressed cache with a zone-C fold policy (rdkv.fold): the
continuation is then fed ``--step`` tokens per forward, so a fold happens within ``--step`` tokens of
zone C reaching R + keep, and the table reports the bytes held at the end of the continuation.
"""
from __future__ import annotations

import collections
import copy
import math

import torch
from tqdm import tqdm

import rdkv
from common import (add_tune_prior, compressions, domain_text, fitted_gains, forward, header, needs_all_queries,
                    parser, table, tune_prior, write)
from rdkv.calibrate import kl


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(-logits.log_softmax(-1).gather(1, targets[:, None]).mean())


def continue_through(model, cache, tail: torch.Tensor, fold: int, step: int) -> torch.Tensor:
    """Teacher-force ``tail`` through ``cache`` (in ``step``-token forwards when folding)."""
    if not fold:
        return forward(model, cache, tail)
    cache.set_fold(rdkv.FoldPolicy(every=fold, budget=cache.budget or cache.nbytes / cache.fp16_bytes))
    return torch.cat([forward(model, cache, tail[:, a : a + step]) for a in range(0, tail.shape[1], step)])


def windows(length: int, span: int, count: int) -> list[int]:
    """Start offsets of ``count`` windows of ``span`` tokens spread evenly over ``length`` tokens (they
    overlap only when the text is shorter than count * span)."""
    if length < span:
        return []
    last = length - span
    return sorted({round(i * last / (count - 1)) for i in range(count)}) if count > 1 else [0]


def prefills(model, tok, domains: list[str], contexts: list[int], continuation: int, count: int,
             all_queries: bool = False):
    """Prefill every window: yields (domain, N, record, full cache, the next ``continuation`` token ids, their
    targets), the record (``rdkv.record(model, all_queries=...)``) of the window's N-token prefix, ready to
    compress."""
    for domain in tqdm(domains, desc="domains"):
        ids = tok(domain_text(domain), return_tensors="pt").input_ids
        for n in contexts:
            starts = windows(ids.shape[1], n + continuation + 1, count)
            if not starts:
                print(f"  skip {domain} @ {n}: only {ids.shape[1]} tokens")
            for a in starts:
                with rdkv.record(model, all_queries=all_queries) as rec:
                    full_cache = rdkv.compat.output_cache(model(ids[:, a : a + n], use_cache=True, logits_to_keep=1))
                yield (domain, n, rec, full_cache, ids[:, a + n : a + n + continuation],
                       ids[0, a + n + 1 : a + n + continuation + 1])


def main() -> None:
    ap = parser(__doc__, [0.05, 0.1, 0.25, 0.5], [1024])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--domains", nargs="+", default=["prose", "code", "legal"])
    ap.add_argument("--windows", type=int, default=1,
                    help="prefix + continuation windows per domain, spread over the text; scores are means over them")
    ap.add_argument("--fold", type=int, nargs="+", default=[0], help="zone-C fold sizes to compare (0 = never)")
    ap.add_argument("--step", type=int, default=16, help="tokens per forward when folding")
    add_tune_prior(ap)
    args = ap.parse_args()
    if args.quick:
        args.budgets, args.continuation = [0.1, 0.25], 128
        args.methods = [m for m in args.methods if m in ("rdkv", "snapkv", "kivi2", "kivi4", "int4")]
    tag = args.tag or ("quick" if args.quick else "full")
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    prior = tune_prior(model, tok, args)
    gains = fitted_gains(model, tok, args.methods, prior)
    raw = collections.defaultdict(list)  # (domain, n, method, budget, fold) -> per-window dicts
    for domain, n, rec, full_cache, tail, targets in prefills(model, tok, args.domains, args.contexts,
                                                              args.continuation, args.windows,
                                                              needs_all_queries(model, args.methods)):
        # the full cache's logits first, so each compression is scored as it comes: one window's logits are
        # held, not one per method and budget (268 MB each with Gemma 3's vocabulary)
        ref = forward(model, full_cache, tail)
        base = nll(ref, targets)  # logits at tail position i predict token n + i + 1
        raw[domain, n, "full", 1.0, 0].append(dict(ratio=1.0, end=1.0, nll=base, base=base, kl=0.0))
        for m, b, c in compressions(rec, args.methods, args.budgets, gains, prior):
            # a plain fp16 cache of the same layers after the continuation
            ratio = c.nbytes / c.fp16_bytes
            fp16_end = c.fp16_bytes + args.continuation * sum(4 * l.batch * l.heads * l.head_dim for l in c.layers)
            for i, fold in enumerate(args.fold):
                cache = c if i == len(args.fold) - 1 else copy.deepcopy(c)
                logits = continue_through(model, cache, tail, fold, args.step)
                raw[domain, n, m, b, fold].append(dict(ratio=ratio, end=cache.nbytes / fp16_end, nll=nll(logits, targets),
                                                       base=base, kl=kl(ref, logits)))
    rows = []
    for (domain, n, m, b, fold), rs in raw.items():
        mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        rows.append({"domain": domain, "context": n, "method": m, "budget": "-" if b is None else b,
                     "fold": fold or "-", "bytes/fp16": mean("ratio"), "bytes/fp16 at end": mean("end"),
                     "ppl": math.exp(mean("nll")), "ppl increase %": 100 * (math.exp(mean("nll") - mean("base")) - 1),
                     "KL": mean("kl"), "windows": len(rs), "protocol": domain})
    rows.sort(key=lambda r: (args.domains.index(r["domain"]), r["context"], r["method"] == "full"))
    cols = ["domain", "context", "method", "budget", "bytes/fp16", "ppl", "ppl increase %", "KL"]
    if args.windows > 1:
        cols.append("windows")
    if args.fold != [0]:
        cols[4:4] = ["fold"]
        cols[6:6] = ["bytes/fp16 at end"]
    name = f"perplexity_{args.model}_{tag}"
    md = (f"# Perplexity through the compressed cache: {args.model} ({tag})\n\n{header(args)}\n"
          f"Prefill N tokens, compress, teacher-force the next {args.continuation}"
          f"{f'; {args.windows} windows per domain spread over its text, scores averaged over them (ppl from the mean NLL)' if args.windows > 1 else ''}."
          f"\n\n{table(rows, cols)}\n\n![plot]({name}.png)\n")
    write(name, md, rows, ["ppl increase %", "KL"], args.model)


if __name__ == "__main__":
    main()
