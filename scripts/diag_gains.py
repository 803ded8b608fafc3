"""Does weighing each layer by its measured sensitivity let one knapsack over all layers beat a budget per layer?

    python scripts/diag_gains.py --model gemma3-270m --methods rdkv-hybrid --budgets 0.25

The solver's distortion is attention-output error, in each layer's own units: it does not say how much of
it reaches the logits. ``rdkv.fit_layer_gains`` measures that on calibration text (common.calibration_texts)
at the budget: each layer's KL with only it compressed, over its modelled distortion. This prints those gains
(power 1, geometric mean 1) and, on eval_perplexity's windows, compares the method as it is (a budget per
layer), one knapsack over all layers (``scope="global"``), and that knapsack with each layer's distortion
times gain**p (``layer_gains``) for each ``--powers`` p. eval_retrieval and eval_perplexity take the same
knapsack as a method option: ``rdkv-hybrid:scope=global,layer_gains=fit`` (power 1/2).
"""
from __future__ import annotations

import math

import torch
import rdkv
from common import calibration_texts, compressions, forward, header, parser, publish, split_method, table
from rdkv.calibrate import kl
from eval_perplexity import nll, prefills


def main() -> None:
    ap = parser(__doc__, [0.25], [1024])
    ap.set_defaults(methods=["rdkv"])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--domains", nargs="+", default=["prose", "code", "legal"])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--powers", type=float, nargs="+", default=[0.5, 1.0], help="layer_gains = gain ** p")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    found = {}
    for m in args.methods:
        name, extra = split_method(m)
        for b in args.budgets:
            found[m, b] = rdkv.fit_layer_gains(model, calibration_texts(tok), name, b, power=1.0, **extra)
    variants = []  # (label, method string, budget, extra options)
    for (m, b), g in found.items():
        variants += [(m, m, b, {}), (f"{m} global", m, b, {"scope": "global"})]
        variants += [(f"{m} global, gains^{p:g}", m, b, {"scope": "global", "layer_gains": tuple(x**p for x in g)})
                     for p in args.powers]
    raw: dict = {}
    for domain, n, rec, full, tail, targets in prefills(model, tok, args.domains, args.contexts, args.continuation,
                                                        args.windows):
        ref = forward(model, full, tail)
        base = nll(ref, targets)
        for label, m, b, opts in variants:
            for _, _, c in compressions(rec, [m], [b], **opts):
                ratio, lg = c.nbytes / c.fp16_bytes, forward(model, c, tail)
                raw.setdefault((domain, n, label), []).append((ratio, nll(lg, targets) - base, kl(ref, lg)))
    rows = [{"domain": d, "context": n, "allocation": label, "bytes/fp16": sum(r[0] for r in rs) / len(rs),
             "ppl increase %": 100 * (math.exp(sum(r[1] for r in rs) / len(rs)) - 1), "KL": sum(r[2] for r in rs) / len(rs)}
            for (d, n, label), rs in raw.items()]
    gain_lines = "\n".join(f"- `{m}` at {b}: " + " ".join(f"{x:.3g}" for x in g) for (m, b), g in found.items())
    md = (f"# Layer gains and one knapsack over all layers: {args.model} ({args.tag or 'gains'})\n\n{header(args)}\n"
          f"Gains per layer (KL per unit of modelled distortion on calibration text, geometric mean 1):\n\n{gain_lines}\n\n"
          f"Prefill N tokens, compress, teacher-force the next {args.continuation}; means over {args.windows} windows "
          f"per domain.\n\n{table(rows, ['domain', 'context', 'allocation', 'bytes/fp16', 'ppl increase %', 'KL'])}\n")
    publish(f"gains_{args.model}_{args.tag or 'gains'}", md)


if __name__ == "__main__":
    main()
