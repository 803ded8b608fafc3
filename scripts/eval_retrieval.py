"""Key-value retrieval ("needle") at equal bytes: every method on one prefill per context and depth.

    python scripts/eval_retrieval.py --quick
    python scripts/eval_retrieval.py --contexts 1000 2000 4000 --budgets 0.025 0.05 0.1 0.25 0.5

Protocols: ``agnostic`` (the question comes after compression: compress a document once, ask later)
and ``aware`` (the question ends the compressed prompt; only its last token and the answer are fed
through the compressed cache). Scores per method and budget: exact match of every answer token
(teacher-forced argmax), answer NLL, and the mean KL of next-token distributions from the full cache
over the tokens fed after compression. Bytes are what the compressed cache holds / its fp16 size.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from tqdm import tqdm

import rdkv
from common import (add_tune_prior, answer_scores, by_depth, compressions, fitted_gains, forward, header, needs_all_queries,
                    parser, probe_inputs, table, tune_prior, write)
from rdkv.calibrate import kl


def main() -> None:
    ap = parser(__doc__, [0.025, 0.05, 0.1, 0.25, 0.5], [1000, 2000, 4000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="one probe per seed (its own needle and filler), context and depth; default: --seed")
    ap.add_argument("--protocols", nargs="+", default=["agnostic", "aware"], choices=["agnostic", "aware"])
    add_tune_prior(ap)
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.depths, args.budgets = [1000], [0.1, 0.5, 0.9], [0.05, 0.1, 0.25]
    tag = args.tag or ("quick" if args.quick else "full")
    seeds = args.seeds or [args.seed]
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    all_queries = needs_all_queries(model, args.methods)
    prior = tune_prior(model, tok, args)
    gains = fitted_gains(model, tok, args.methods, prior)

    raw = defaultdict(list)  # (protocol, method, budget) -> per-probe dicts
    jobs = [(n, d, s, p) for n in args.contexts for d in args.depths for s in seeds for p in args.protocols]
    for n, depth, seed, protocol in tqdm(jobs, desc="prefills"):
        prefix, tail, n_ans = probe_inputs(tok, n, depth, protocol, seed)
        with rdkv.record(model, all_queries=all_queries) as rec:
            full_cache = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
        ref = forward(model, full_cache, tail)
        runs = [(m, b, c.nbytes / c.fp16_bytes, forward(model, c, tail))
                for m, b, c in compressions(rec, args.methods, args.budgets, gains, prior)]
        runs.append(("full", 1.0, 1.0, ref))
        for m, b, ratio, logits in runs:
            nll, em, margin = answer_scores(logits, tail, n_ans)
            raw[protocol, m, b].append(dict(ratio=ratio, nll=nll, em=em, margin=margin, kl=kl(ref, logits), depth=depth, n=n))

    rows = []
    for (protocol, m, b), rs in raw.items():
        rows.append({"protocol": protocol, "method": m, "budget": "-" if b is None else b,
                     "bytes/fp16": sum(r["ratio"] for r in rs) / len(rs),
                     "EM": sum(r["em"] for r in rs) / len(rs), "NLL": sum(r["nll"] for r in rs) / len(rs),
                     "KL": sum(r["kl"] for r in rs) / len(rs),
                     "EM by depth": " ".join(str(sum(r["em"] for r in rs if r["depth"] == d)) for d in args.depths),
                     "margin by depth": by_depth(rs, args.depths),
                     "probes": len(rs)})
    rows.sort(key=lambda r: (r["protocol"], r["method"] != "full", r["method"], r["bytes/fp16"]))
    cols = ["protocol", "method", "budget", "bytes/fp16", "EM", "NLL", "KL", "EM by depth", "margin by depth", "probes"]
    name = f"retrieval_{args.model}_{tag}"
    md = (f"# Retrieval at equal bytes: {args.model} ({tag})\n\n{header(args)}\n"
          f"Contexts {args.contexts} tokens, depths {args.depths} (EM by depth counts correct probes per depth over "
          f"contexts and seeds; margin by depth is their mean answer margin: see common.answer_scores), seeds {seeds}.\n\n{table(rows, cols)}\n\n![plot]({name}.png)\n")
    write(name, md, rows, ["EM", "KL"], args.model)


if __name__ == "__main__":
    main()
