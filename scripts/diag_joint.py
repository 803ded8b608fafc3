"""Is eviction additive? Per layer: the real output error of evicting the allocation's set together
against the sum of its tokens' separate (additive) prices.

    python scripts/diag_joint.py --model gemma3-270m --budgets 0.25 --methods rdkv --tag prose

Prefill ``--contexts`` tokens of the prose domain (eval_perplexity's text), compress, and for every
layer take the set of V rows the allocation evicted. For the window queries the weights came from and
for the next 256 tokens' queries (the continuation, teacher-forced through the full cache), report the
summed squared attention-output error of dropping that set (exact, renormalised attention) and the
additive estimate sum_q sum_{t in E} p_qt^2 ||v_t - o_q||^2. Their ratio is what ``evict_jointly``
(rdkv.distortion.eviction_cross) adds back.
"""
from __future__ import annotations

import torch

import rdkv
from common import dense_probs, domain_text, header, parser, publish, split_method, table, weight_window


def eviction_errors(st, q: torch.Tensor, keep: torch.Tensor) -> tuple[float, float, float]:
    """(exact error, additive estimate, mean evicted mass) over queries q [Hq, L, D] (the last L
    positions) of dropping the tokens not in ``keep`` [H, T], T = the layer's last T keys."""
    T = keep.shape[-1]
    v = st.value[0, :, -T:].float()
    G = q.shape[0] // v.shape[0]
    p, _ = dense_probs(st, q, T)
    vr, gone = v.repeat_interleave(G, 0), ~keep.repeat_interleave(G, 0)[:, None, :]
    o = p @ vr
    kept = p * ~gone
    exact = (kept @ vr / kept.sum(-1, keepdim=True) - o).square().sum(-1).sum()
    additive = (p.square() * (vr[:, None] - o[:, :, None]).square().sum(-1) * gone).sum()
    return float(exact), float(additive), float((p * gone).sum(-1).mean())


def main() -> None:
    ap = parser(__doc__, [0.25], [1024])
    ap.set_defaults(methods=["rdkv"], model="gemma3-270m")
    ap.add_argument("--continuation", type=int, default=256)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    ids = tok(domain_text("prose"), return_tensors="pt").input_ids
    rows = []
    for n in args.contexts:
        prefix, tail = ids[:, :n], ids[:, n : n + args.continuation]
        # the continuation's queries: a record keeping them all, of prefix + tail through a plain cache
        with rdkv.record(model, window=args.continuation) as seen:
            cache = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
            model(tail, **rdkv.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        later = seen.layers
        with rdkv.record(model) as rec:
            model(prefix, use_cache=True, logits_to_keep=1)
        for m in args.methods:
            name, extra = split_method(m)
            for b in args.budgets:
                c = rdkv.compress(rec, b, method=name, **extra)
                for i, layer in enumerate(c.layers):
                    st, keep = rec.layers[i], layer.v_widths()[0] > 0
                    window = weight_window(model, m, st.sliding_window is not None)
                    win = eviction_errors(st, st.window_q[0, :, -window:], keep)
                    # the continuation's keys: the prefix's held ones (compressed) plus the tail's (kept)
                    lt = later[i]
                    held = torch.ones(keep.shape[0], min(lt.key.shape[2], keep.shape[1] + tail.shape[1]), dtype=torch.bool)
                    held[:, : held.shape[1] - tail.shape[1]] = keep[:, keep.shape[1] - (held.shape[1] - tail.shape[1]) :]
                    cont = eviction_errors(lt, lt.window_q[0], held)
                    rows.append({"context": n, "method": m, "budget": b, "layer": i,
                                 "V rows evicted": float((~keep).float().mean()),
                                 "window: exact / additive": win[0] / max(win[1], 1e-30), "window: evicted mass": win[2],
                                 "continuation: exact / additive": cont[0] / max(cont[1], 1e-30),
                                 "continuation: evicted mass": cont[2]})
    md = (f"# Is eviction additive? {args.model}, prose\n\n{header(args)}\n"
          f"Exact output error of evicting each layer's set together over its additive price, for the weight "
          f"queries and for the next {args.continuation} tokens' queries.\n\n{table(rows, list(rows[0]))}\n")
    publish(f"joint_{args.model}_{args.tag or 'diag'}", md)


if __name__ == "__main__":
    main()
