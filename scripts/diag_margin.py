"""How close each answer token of one retrieval probe is to flipping, per method and budget.

    python scripts/diag_margin.py --model gemma3-270m --contexts 1000 --depths 0.1 0.5 0.9 \
        --methods rdkv rdkv-prerope int4 int8 --budgets 0.1 0.25

Exact match on 3 probes hides how far a probe is from failing. The margin of an answer token is its
logit minus the best other token's (teacher-forced); a probe whose full-cache margin is a fraction of a
logit is lost by almost any perturbation, int8 included. One prefill per (context, depth); every method
and budget is compressed from it. Prints a markdown table and saves it under docs/results/.
"""
from __future__ import annotations

import torch

import rdkv
from common import compressions, forward, header, parser, probe_inputs, publish, table, token_margins


def main() -> None:
    ap = parser(__doc__, [0.1, 0.25], [1000])
    ap.set_defaults(methods=["rdkv", "int4", "int8"])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--protocol", default="agnostic", choices=["agnostic", "aware"])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    rows = []
    for n in args.contexts:
        for depth in args.depths:
            prefix, tail, n_ans = probe_inputs(tok, n, depth, args.protocol, args.seed)
            with rdkv.record(model) as rec:
                full_cache = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
            runs = [("full", 1.0, 1.0, forward(model, full_cache, tail))]
            runs += [(m, b, c.nbytes / c.fp16_bytes, forward(model, c, tail))
                     for m, b, c in compressions(rec, args.methods, args.budgets)]
            answer = " ".join(repr(tok.decode(t)) for t in tail[0, -n_ans:].tolist())
            for m, b, ratio, logits in runs:
                margins, rivals = (t.tolist() for t in token_margins(logits, tail, n_ans))
                rows.append({"context": n, "depth": depth, "answer": answer, "method": m,
                             "budget": "-" if b is None else b, "bytes/fp16": ratio,
                             "margins": " ".join(f"{x:+.2f}" for x in margins),
                             "lost to": " ".join(repr(tok.decode(r)) for x, r in zip(margins, rivals) if x < 0) or "-"})
    tag = args.tag or "quick"
    md = (f"# Answer-token margins: {args.model} ({tag}, {args.protocol})\n\n{header(args)}\n"
          f"Margin = answer logit minus the best rival's, per answer token (negative = exact match lost, to "
          f"the rival in 'lost to'). Seed {args.seed}.\n\n"
          f"{table(rows, ['context', 'depth', 'answer', 'method', 'budget', 'bytes/fp16', 'margins', 'lost to'])}\n")
    publish(f"margins_{args.model}_{tag}", md)


if __name__ == "__main__":
    main()
