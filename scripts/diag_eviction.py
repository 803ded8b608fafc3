"""Where a question's attention goes after eviction: per layer, how much of it lands on evicted tokens.

    python scripts/diag_eviction.py --contexts 8000 --budgets 0.25 --methods rdkv-evict-output rdkv rdkv-noevict

One retrieval probe (needle at ``--depth``, question after compression). For each method: the KL from
the full cache over question + answer, the share of V rows evicted, and per layer the share of the
window queries' attention mass the allocation evicted (max over heads) and the largest share of any
question query's attention that falls on evicted tokens (the full cache's attention, recomputed from the
question's recorded queries). This is how the 8k regression of ``evict_to="output"`` was traced.
"""
from __future__ import annotations

import torch

import rdkv
from common import forward, header, parser, probe_inputs, publish, split_method, table
from rdkv.calibrate import kl


def question_mass_on(st, evicted: torch.Tensor, n_q: int) -> float:
    """Largest share of attention any of the last ``n_q`` recorded queries puts on ``evicted`` [H, T]."""
    q = st.window_q[0, :, -n_q:].float()  # [Hq, L, D]
    k = st.key[0].float()  # [H, T + L, D]: the record of the reference pass holds the question's keys too
    G, T = q.shape[0] // k.shape[0], evicted.shape[1]
    s = torch.einsum("hld,htd->hlt", q, k.repeat_interleave(G, 0)) * st.scaling
    causal = torch.arange(k.shape[1])[None, :] <= torch.arange(k.shape[1] - n_q, k.shape[1])[:, None]
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)[..., :T]
    return float((p * evicted.repeat_interleave(G, 0)[:, None, :]).sum(-1).max())


def main() -> None:
    ap = parser(__doc__, [0.25], [8000])
    ap.set_defaults(methods=["rdkv-evict-output", "rdkv", "rdkv-noevict"])
    ap.add_argument("--depth", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    rows = []
    for n in args.contexts:
        prefix, tail, _ = probe_inputs(tok, n, args.depth, "agnostic", args.seed)
        with rdkv.record(model) as rec:
            model(prefix, use_cache=True, logits_to_keep=1)
        window = [rdkv.weights.layer_sums(rec.layers[i], "window").mass[0] for i in sorted(rec.layers)]
        runs = []
        for m in args.methods:
            for b in args.budgets:
                name, extra = split_method(m)
                c = rdkv.compress(rec, b, method=name, **extra)
                runs.append((m, b, [(layer.v_widths()[0] == 0) for layer in c.layers], forward(model, c, tail)))
        with rdkv.record(model) as asked:  # the prefix again, then the question: its queries and keys
            ref = forward(model, rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1)), tail)
        for m, b, evicted, logits in runs:
            shares = [float(((w * e).sum(-1) / w.sum(-1)).max()) for w, e in zip(window, evicted)]
            on_q = [question_mass_on(asked.layers[i], e, tail.shape[1]) for i, e in enumerate(evicted)]
            worst = max(range(len(on_q)), key=on_q.__getitem__)
            rows.append({"context": n, "method": m, "budget": b, "KL": kl(ref, logits),
                         "V rows evicted": sum(float(e.float().mean()) for e in evicted) / len(evicted),
                         "window mass evicted, max head (layers 0-11)": " ".join(f"{x:.2f}" for x in shares[:12]),
                         "question mass on evicted, max (layers 0-11)": " ".join(f"{x:.2f}" for x in on_q[:12]),
                         "worst layer": f"{worst}: {on_q[worst]:.2f}"})
    cols = list(rows[0])
    name = f"eviction_{args.model}_{args.tag or 'diag'}"
    md = (f"# Where the question's attention goes after eviction: {args.model}\n\n{header(args)}\n"
          f"Needle at depth {args.depth}, question after compression, seed {args.seed}.\n\n{table(rows, cols)}\n")
    publish(name, md)


if __name__ == "__main__":
    main()
