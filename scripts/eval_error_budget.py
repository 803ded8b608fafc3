"""Does the solver's modelled distortion predict the measured output distortion? And compress(error=eps).

    python scripts/eval_error_budget.py --quick
    python scripts/eval_error_budget.py --contexts 512 1024 --budgets 0.05 0.1 0.25 0.5 --eps 0.01 0.03 0.1 0.3
    python scripts/eval_error_budget.py --model gemma3-270m --methods rdkv-hybrid

One RDKV method per run (``--methods NAME[:options]``, default ``rdkv``): the calibration is per method.

1. Calibrate once (``rdkv.calibrate``) on prose and code the evaluation does not use.
2. For each domain (prose, code, legal) and context N: prefill once, compress at every budget, record the
   modelled distortion D of the allocation and the measured KL from the full cache over the next M
   tokens (teacher-forced). Report Spearman's rank correlation of D with KL over all points and per
   context; and, across layers, of each layer's share of D with the error it causes in its own attention
   output for the continuation's queries (over the compressed prefix, the layer's inputs held fixed).
3. For each eps: ``compress(error=eps)`` on the same prefills; report bytes, predicted and measured KL.
"""
from __future__ import annotations

import statistics

from scipy.stats import spearmanr
from tqdm import tqdm

import torch

import rdkv
from common import calibration_texts, domain_text, forward, header, parser, split_method, table, write
from rdkv.calibrate import kl
from rdkv.dense import allowed_keys
from rdkv.reference import partial_attention


def layer_error(asked: rdkv.Record, cache, full_cache, n_tail: int) -> list[float]:
    """Per layer: squared error of the attention output over the prefix for the continuation's queries (the
    last ones that ``asked``, the record of the full reference pass, kept: at most its window), compressed vs
    full, per query."""
    out = []
    for i, layer in enumerate(cache.layers):
        st = asked.layers[i]
        B, Hq, W, D = st.window_q.shape
        S, G, n = layer.batch * layer.heads, Hq // layer.heads, min(n_tail, W)
        q = st.window_q[:, :, -n:].float().reshape(S, G * n, D)
        q_pos = torch.arange(st.seen - n, st.seen).repeat(G)
        window = layer.sliding_window
        fk, fv = full_cache.layers[i].keys.float(), full_cache.layers[i].values.float()
        f_pos = torch.arange(layer.prefix_len - fk.shape[2], layer.prefix_len)
        ref, _ = partial_attention(q, fk.reshape(S, -1, D), fv.reshape(S, -1, D),
                                   allowed_keys(q_pos, f_pos, window).expand(S, -1, -1), st.scaling, st.softcap)
        K, V, pos, valid = layer.dequantize()
        got, _ = partial_attention(q, K, V, allowed_keys(q_pos, pos, window) & valid.unsqueeze(1), st.scaling, st.softcap)
        out.append(float((got - ref).square().sum(-1).mean()))
    return out


def main() -> None:
    ap = parser(__doc__, [0.05, 0.1, 0.25, 0.5], [512, 1024])
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--domains", nargs="+", default=["prose", "code", "legal"])
    ap.add_argument("--eps", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3])
    ap.add_argument("--calibration-offset", type=int, default=30000, help="prose token where calibration text starts")
    ap.set_defaults(methods=["rdkv"])
    args = ap.parse_args()
    method, extra = split_method(args.methods[0])
    if len(args.methods) != 1 or not (method == rdkv.methods.AUTO or isinstance(rdkv.methods.named(method), rdkv.RDKV)):
        ap.error(f"give one RDKV method (the calibration is per method), got {args.methods}")
    if args.quick:
        args.contexts, args.domains, args.budgets, args.eps = [512], ["prose", "code"], [0.05, 0.1, 0.25], [0.03, 0.1]
    tag = args.tag or ("quick" if args.quick else "full")
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    a = args.calibration_offset
    cal = rdkv.calibrate(model, calibration_texts(tok, a), method=method, **extra)
    rows, points, layer_points = [], [], []
    jobs = [(d, n) for d in args.domains for n in args.contexts]
    for domain, n in tqdm(jobs, desc="prefills"):
        ids = tok(domain_text(domain), return_tensors="pt").input_ids
        prefix, tail = ids[:, :n], ids[:, n : n + args.continuation]
        with rdkv.record(model) as rec:
            full_cache = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
        caches = [("budget", b, rdkv.compress(rec, b, method=method, **extra)) for b in args.budgets]
        for eps in args.eps:
            try:
                caches.append(("error", eps, rdkv.compress(rec, error=eps, calibration=cal, method=method, **extra)))
            except rdkv.RDKVError as e:
                print(f"  skip error={eps} on {domain}@{n}: {e}")
        ratios = [c.nbytes / c.fp16_bytes for _, _, c in caches]  # before the tail grows zone C
        logits = [forward(model, c, tail) for _, _, c in caches]
        with rdkv.record(model) as asked:  # the prefix again, then the continuation: its queries
            ref = forward(model, rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1)), tail)
        for how, x, c in caches[: len(args.budgets)]:
            layer_points.append((c.layer_distortion, layer_error(asked, c, full_cache, tail.shape[1])))
        for (how, x, c), ratio, lg in zip(caches, ratios, logits):
            got = kl(ref, lg)
            row = {"domain": domain, "context": n, "asked": f"{how}={x:g}", "bytes/fp16": ratio,
                   "D (modelled)": c.distortion, "KL predicted": cal.predict(c.distortion), "KL measured": got,
                   "method": f"{args.methods[0]} {how}", "KL": got}
            rows.append(row)
            if how == "budget":
                points.append((n, domain, c.distortion, got))
    rho = spearmanr([p[2] for p in points], [p[3] for p in points]).statistic
    per_ctx = {n: spearmanr([p[2] for p in points if p[0] == n], [p[3] for p in points if p[0] == n]).statistic
               for n in args.contexts}
    rho_layers = [spearmanr(d, e).statistic for d, e in layer_points]
    err = [r for r in rows if r["asked"].startswith("error")]
    within = sum(r["KL measured"] <= float(r["asked"].split("=")[1]) for r in err)
    within2 = sum(r["KL measured"] <= 2 * float(r["asked"].split("=")[1]) for r in err)
    cols = ["domain", "context", "asked", "bytes/fp16", "D (modelled)", "KL predicted", "KL measured"]
    name = f"error_budget_{args.model}_{tag}"
    md = (f"# Modelled distortion vs measured KL, and compress(error=eps): {args.model} ({tag})\n\n{header(args)}\n"
          f"Calibration: `rdkv.calibrate` on prose tokens {a}..{a + 1024} and the first 1024 tokens of the "
          f"`collections` module (768 compressed, 256 scored each): KL <= {cal.a:.3g} * D^{cal.p:.3g} "
          f"(least-squares slope, intercept above all {len(cal.points)} points).\n\n"
          f"Spearman rank correlation of modelled D with measured KL over {len(points)} (domain, context, budget) "
          f"points: **{rho:.3f}**; per context: "
          + ", ".join(f"{n}: {r:.3f}" for n, r in per_ctx.items())
          + f".\n\nAcross layers (each layer's part of D against its own attention-output error for the continuation's "
          f"queries, {len(rho_layers)} allocations): Spearman median **{statistics.median(rho_layers):.3f}**, "
          f"range {min(rho_layers):.3f}..{max(rho_layers):.3f}.\n\nError budget: measured KL <= eps in {within} of {len(err)} `compress(error=eps)` calls, "
          f"<= 2 eps in {within2}.\n\n"
          f"{table(rows, cols)}\n\n![plot]({name}.png)\n")
    write(name, md, rows, ["KL"], f"{args.model}: KL vs bytes")


if __name__ == "__main__":
    main()
