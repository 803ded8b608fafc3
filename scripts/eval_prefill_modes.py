"""Quality of rdkv.prefill's two modes against the one-shot compress of the same prompt, at equal budgets.

    python scripts/eval_prefill_modes.py --model smollm2-135m
    python scripts/eval_prefill_modes.py --model gemma3-270m --contexts 1024

Perplexity protocol: for each domain (common.domain_text) an N-token prefix, the next 256 tokens teacher-forced;
mean KL of next-token distributions from the full cache. Retrieval: common.probe_inputs at three depths, both
protocols; exact match of the answer tokens. Each prompt is prefilled once inside rdkv.record for the full cache
and ``compress``, and once more per mode and budget by ``rdkv.prefill`` (which does its own prefill).
"""
from __future__ import annotations

import torch
from tqdm import tqdm

import rdkv
from common import answer_scores, domain_text, forward, header, parser, probe_inputs, publish, table
from rdkv.calibrate import kl

PATHS = {"compress": None, "prefill staged": "staged", "prefill layer": "layer"}


def caches(model, prefix: torch.Tensor, budgets: list[float]):
    """(full cache, {(path, budget): compressed cache}) of one prompt."""
    with rdkv.record(model) as rec:
        full = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
    out = {}
    for b in budgets:
        for path, mode in PATHS.items():
            out[path, b] = rdkv.compress(rec, b) if mode is None else rdkv.prefill(model, prefix, b, mode=mode)
    return full, out


def main() -> None:
    ap = parser(__doc__, [0.05, 0.1, 0.25], [2048])
    ap.add_argument("--domains", nargs="+", default=["prose", "code", "legal"])
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    rows, em = [], {}
    for n in args.contexts:
        for domain in tqdm(args.domains, desc=f"perplexity {n}"):
            ids = tok(domain_text(domain), return_tensors="pt").input_ids[:, : n + args.continuation]
            prefix, tail = ids[:, :n], ids[:, n:]
            full, got = caches(model, prefix, args.budgets)
            ref = forward(model, full, tail)
            row = {"context": n, "domain": domain}
            for (path, b), cache in got.items():
                row[f"{path} @{b}"] = kl(ref, forward(model, cache, tail))
            rows.append(row)
        for protocol in ("agnostic", "aware"):
            for depth in tqdm(args.depths, desc=f"retrieval {n} {protocol}"):
                prefix, tail, n_ans = probe_inputs(tok, n, depth, protocol, args.seed)
                full, got = caches(model, prefix, args.budgets)
                em.setdefault(("full", None, n, protocol), []).append(answer_scores(forward(model, full, tail), tail, n_ans)[1])
                for (path, b), cache in got.items():
                    em.setdefault((path, b, n, protocol), []).append(answer_scores(forward(model, cache, tail), tail, n_ans)[1])
    cols = ["context", "domain"] + [f"{p} @{b}" for b in args.budgets for p in PATHS]
    ratio = [{"context": r["context"], "domain": r["domain"],
              **{f"{p} @{b}": r[f"{p} @{b}"] / r[f"compress @{b}"] for b in args.budgets for p in PATHS}} for r in rows]
    hits = [{"context": n, "protocol": pr, "full": f"{sum(em['full', None, n, pr])}/{len(args.depths)}",
             **{f"{p} @{b}": f"{sum(em[p, b, n, pr])}/{len(args.depths)}" for b in args.budgets for p in PATHS}}
            for n in args.contexts for pr in ("agnostic", "aware")]
    md = (f"# rdkv.prefill modes against one-shot compress: {args.model}\n\n{header(args)}\n"
          f"## KL from the full cache over {args.continuation} teacher-forced tokens\n\n{table(rows, cols)}\n\n"
          f"## The same, as a ratio to compress's KL\n\n{table(ratio, cols)}\n\n"
          f"## Retrieval: answers exactly right (depths {args.depths})\n\n{table(hits, ['context', 'protocol', 'full'] + cols[2:])}\n")
    publish(f"prefill_modes_{args.model}" + (f"_{args.tag}" if args.tag else ""), md)


if __name__ == "__main__":
    main()
