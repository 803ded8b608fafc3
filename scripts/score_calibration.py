"""Would calibration text choose a setting? Mean log KL per method on text the evaluations do not score.

    python scripts/score_calibration.py --model gemma3-270m --methods rdkv rdkv-wgl256 rdkv-w256

The measure ``rdkv.tune_prior`` ranks priors by (common.calibration_texts: 1,024 tokens of prose and of the
``collections`` module; the first 75% compressed, the rest teacher-forced; budgets 10% and 25%), applied
to any methods, so a setting an evaluation favours can be checked against held-out text before it is
made a default or a per-model choice.
"""
from __future__ import annotations

import collections
import math

import torch

import rdkv
from common import calibration_texts, header, parser, method_of, publish, table
from rdkv.calibrate import _measure


def main() -> None:
    ap = parser(__doc__, [0.1, 0.25], [1024])
    ap.set_defaults(methods=["rdkv", "rdkv-wgl256"])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    texts = calibration_texts(tok)
    calls = []
    for m in args.methods:
        calls += [((m, b), b, method_of(model, m)) for b in args.budgets]
    kls = collections.defaultdict(list)
    for key, _, kl in _measure(model, texts, 0.75, calls):
        kls[key].append(kl)
    rows = []
    for m in args.methods:
        got = {b: kls[m, b] for b in args.budgets}
        logs = [math.log(max(x, 1e-12)) for v in got.values() for x in v]
        rows.append({"method": m, "mean log KL": sum(logs) / max(1, len(logs))}
                    | {f"KL at {b:g} (prose, code)": ", ".join(f"{x:.4g}" for x in v) for b, v in got.items()})
    rows.sort(key=lambda r: r["mean log KL"])
    md = (f"# Calibration-text scores: {args.model} ({args.tag or 'calibration'})\n\n{header(args)}\n"
          f"Lower is better; the first row is what a calibration-based choice would pick.\n\n"
          f"{table(rows, list(rows[0]))}\n")
    publish(f"calibration_{args.model}_{args.tag or 'calibration'}", md)


if __name__ == "__main__":
    main()
