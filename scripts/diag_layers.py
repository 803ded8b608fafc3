"""Which layers does a method lose in? Per layer: the continuation's KL when only that layer is compressed.

    python scripts/diag_layers.py --model gemma3-270m --methods rdkv int4 --budgets 0.25 --domains legal

Prefill ``--contexts`` tokens of a domain (eval_perplexity's texts), compress with every method, then for
each layer i teacher-force the next ``--continuation`` tokens through the full cache with layer i alone
replaced by the method's compressed layer. Each layer's KL from the full cache says where a method's
distortion comes from; their sum is near the all-layer KL when the layers' errors add up. The table
also gives each layer's own bytes (compressed over fp16), the share of V rows evicted and at 2/4/8/16
bits, the mean K width, and where the squared attention goes: the share that lands on V rows kept at 2 bits
or fewer, for the window queries the weights came from and for the continuation's queries. Where the two
differ, the weights misjudged what later queries read.
"""
from __future__ import annotations

import copy

import torch
from tqdm import tqdm

import rdkv
from rdkv.calibrate import plain_prefill, swap_in
from common import compressions, dense_probs, domain_text, forward, header, parser, publish, table, weight_window
from rdkv.calibrate import kl


def width_shares(layer) -> dict[str, float]:
    """Share of this layer's V rows at each width (0 = evicted), and its mean K width."""
    vw, kw = layer.v_widths().float(), layer.k_widths().float()
    return {f"V@{b}": float((vw == b).float().mean()) for b in (0, 2, 4, 8, 16)} | {"K bits": float(kw.mean())}


def low_width_share(st, q: torch.Tensor, low: torch.Tensor, n: int) -> float:
    """Share of the squared attention that queries q [Hq, L, D] (the layer's last L positions recorded in
    ``st``) put on the prefix's last T tokens that lands on the ``low`` ones [H, T]."""
    p, k_pos = dense_probs(st, q, st.key.shape[2])
    p2 = p.square()[..., (k_pos >= n - low.shape[-1]) & (k_pos < n)]
    low = low.repeat_interleave(q.shape[0] // low.shape[0], 0)[:, None, :]
    return float((p2 * low).sum() / p2.sum().clamp_min(1e-30))


def main() -> None:
    ap = parser(__doc__, [0.25], [1024])
    ap.set_defaults(methods=["rdkv", "int4"], model="gemma3-270m")
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--domains", nargs="+", default=["legal"])
    ap.add_argument("--start", type=float, default=0.0, help="where the window starts, as a fraction of the text")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    rows = []
    for domain in args.domains:
        ids = tok(domain_text(domain), return_tensors="pt").input_ids
        for n in args.contexts:
            a = int(args.start * max(0, ids.shape[1] - n - args.continuation))
            prefix, tail = ids[:, a : a + n], ids[:, a + n : a + n + args.continuation]
            with rdkv.record(model, window=args.continuation) as seen:  # the continuation's queries
                model(tail, **rdkv.cache_kwargs(plain_prefill(model, prefix)), use_cache=True, logits_to_keep=1)
            later = seen.layers
            with rdkv.record(model) as rec:
                full = plain_prefill(model, prefix)

            def through(cache) -> torch.Tensor:
                return forward(model, cache, tail)

            ref = through(copy.deepcopy(full))
            for m, b, c in compressions(rec, args.methods, args.budgets):
                total = kl(ref, through(copy.deepcopy(c)))
                for i, layer in enumerate(tqdm(c.layers, desc=f"{domain} {m} {b}", leave=False)):
                    st, low = rec.layers[i], layer.v_widths()[0] <= 2
                    window = weight_window(model, m, st.sliding_window is not None)  # the queries the weights came from
                    row = {"domain": domain, "method": m, "budget": "-" if b is None else b, "layer": i,
                           "sliding": st.sliding_window is not None,
                           "V<=2 bits: window p2 share": low_width_share(st, st.window_q[0, :, -window:], low, n),
                           "V<=2 bits: continuation p2 share": low_width_share(later[i], later[i].window_q[0], low, n),
                           "layer bytes/fp16": layer.nbytes / (4 * full.layers[i].keys.numel()),
                           "KL this layer alone": kl(ref, through(swap_in(full, c, [i]))), "KL all layers": total}
                    rows.append(row | width_shares(layer))
    cols = ["domain", "method", "budget", "layer", "sliding", "layer bytes/fp16", "KL this layer alone",
            "KL all layers", "V@0", "V@2", "V@4", "V@8", "V@16", "K bits", "V<=2 bits: window p2 share",
            "V<=2 bits: continuation p2 share"]
    md = (f"# Per-layer distortion: {args.model} ({args.tag or 'layers'})\n\n{header(args)}\n"
          f"Window at {args.start:.0%} of the text; {args.continuation} tokens teacher-forced through the full cache "
          f"with one layer compressed.\n\n{table(rows, cols)}\n")
    publish(f"layers_{args.model}_{args.tag or 'layers'}", md)


if __name__ == "__main__":
    main()
