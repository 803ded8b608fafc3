"""NVIDIA kvpress's own presses next to rdkv on the retrieval probes, charged for the bytes held.

    python scripts/eval_kvpress.py --quick
    python scripts/eval_kvpress.py --contexts 1000 2000 --budgets 0.025 0.05 0.1 0.25 0.5

kvpress 0.5.5 needs transformers < 5.3, so this runs in an environment with transformers 5.2.x, kvpress
and rdkv (editable) installed side by side: ``./dev kvpress scripts/eval_kvpress.py ...`` sets it up. Probes and protocols are those of eval_retrieval.py:
``agnostic`` prefills the context and teacher-forces question + answer through the cache; ``aware``
prefills context + question[:-1] and teacher-forces the last question token + answer.

Per probe, rdkv goes first: one prefill inside ``rdkv.record``, ``rdkv.compress`` per method and budget
(rdkv and our re-implementations of snapkv, adakv, ...), each charged ``cache.nbytes / cache.fp16_bytes``.
The model then gets its own attention implementation back (kvpress wraps the attention functions
transformers knows at import time; rdkv's own attention is registered later and never sees kvpress's head
masks) and every press runs its own prefill inside ``with press(model)`` on a fresh DynamicCache, with
compression_ratio = 1 - budget (nudged so that floor(T * budget) tokens are kept). The tail is then fed with no press active and with
explicit position ids (an evicted cache is shorter than the positions it covers), as kvpress's pipeline
does. A press is charged what its cache holds: the K and V tensors' elements at 2 bytes each (the fp16
baseline), over the fp16 bytes of the uncompressed cache of the same prefix. AdaKV keeps every tensor
whole and hides evicted entries behind fake keys at decode time, so it holds ~1.0; the fraction it would
hold if its ragged selection were stored compactly is printed separately ("ideal ragged") and is not
what it holds. rdkv's eviction baselines also pay for token positions and per-head metadata, so at equal
bytes they keep slightly fewer tokens than a press (column "tokens kept").

KL is measured from the uncompressed cache run through the plain model (its own attention); the largest
logit gap between that reference and the same cache run through rdkv's attention is recorded below the table.
"""
from __future__ import annotations

import copy
import sys
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvpress  # noqa: E402  (import patches transformers' attention functions for AdaKV's head masks)
import rdkv  # noqa: E402
from common import (answer_scores, by_depth, compressions, forward, header, needs_all_queries, parser,  # noqa: E402
                    probe_inputs, table, write)
from rdkv.calibrate import kl  # noqa: E402

PRESSES = {
    "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
    "adakv": lambda r: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r)),
    "expected": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
    "streaming": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
    "knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
    "tova": lambda r: kvpress.TOVAPress(compression_ratio=r),
    # KVzip: each entry scored by its largest attention while the model repeats the context (one extra pass);
    # like AdaKV it keeps the whole cache and masks the evicted entries, ragged across layers and heads
    "kvzip": lambda r: kvpress.KVzipPress(compression_ratio=r),
}


def attention_modules(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def clear_head_masks(model) -> None:
    """Forget AdaKV's masked entries so no later forward on another cache inherits them."""
    for m in attention_modules(model):
        if getattr(m, "masked_key_indices", None) is not None:
            m.masked_key_indices = None


def held_bytes(cache: DynamicCache) -> int:
    """K and V elements the cache holds, at 2 bytes each (fp16)."""
    return sum(2 * (layer.keys.numel() + layer.values.numel()) for layer in cache.layers)


def fed(model, cache, tail: torch.Tensor, start: int) -> torch.Tensor:
    """Logits [L, V] of teacher-forcing ``tail`` through ``cache`` at positions start.. (float32)."""
    pos = torch.arange(start, start + tail.shape[1]).unsqueeze(0)
    return model(tail, **rdkv.cache_kwargs(cache), position_ids=pos).logits[0].float()


def press_prefill(model, name: str, budget: float, prefix: torch.Tensor) -> DynamicCache:
    """The cache of ``prefix`` prefilled under press ``name`` at ``budget`` (clears AdaKV's old head masks first;
    the caller clears the new ones once it has decoded)."""
    ratio = min(max(1.0 - (budget + 1e-9), 0.0), 1.0 - 1e-9)  # keeps floor(T * budget) tokens per head
    press = PRESSES[name](ratio)
    clear_head_masks(model)
    cache = DynamicCache()
    with press(model):
        model(prefix, **rdkv.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache


def unmasked_fraction(model, cache: DynamicCache, T: int) -> float | None:
    """The fraction of the first ``T`` positions' (layer, head, position) entries a masking press (AdaKV, KVzip)
    left visible; None for a press that evicts by shortening the cache."""
    masks = [getattr(m, "masked_key_indices", None) for m in attention_modules(model)]
    if all(x is None for x in masks):
        return None
    heads = cache.layers[0].keys.shape[1]
    return 1.0 - sum(len(x[0]) for x in masks if x is not None) / (len(cache.layers) * heads * T)


def run_press(model, name: str, budget: float, prefix: torch.Tensor, tail: torch.Tensor, fp16: int) -> dict:
    """One press at one budget: prefill under the press, feed the tail without it."""
    T = prefix.shape[1]
    cache = press_prefill(model, name, budget, prefix)
    held = held_bytes(cache)
    kept = sum(layer.keys.shape[2] for layer in cache.layers) / (len(cache.layers) * T)
    ideal = unmasked_fraction(model, cache, T)
    if ideal is not None:  # AdaKV, KVzip: entries hidden at decode, still held
        kept = ideal
    logits = fed(model, cache, tail, T)
    clear_head_masks(model)
    return dict(ratio=held / fp16, ideal=ideal, kept=kept, logits=logits)


def rdkv_runs(rec: rdkv.Record, methods: list[str], budgets: list[float], tail: torch.Tensor):
    """(method, budget, bytes/fp16, tokens kept, logits) for every rdkv method on the recorded prefill."""
    for m, b, c in compressions(rec, methods, budgets):
        kept = sum(int(layer.kept.sum()) for layer in c.layers)
        kept /= sum(layer.batch * layer.heads * (layer.prefix_len - layer.start) for layer in c.layers)
        yield m, b, c.nbytes / c.fp16_bytes, kept, forward(rec.model, c, tail)


def main() -> None:
    ap = parser(__doc__, [0.025, 0.05, 0.1, 0.25, 0.5], [1000, 2000])
    ap.set_defaults(methods=["rdkv", "rdkv-aware", "rdkv-pool", "snapkv", "adakv", "streaming", "knorm"])
    ap.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES),
                    help="kvpress presses to run (default: all)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--protocols", nargs="+", default=["agnostic", "aware"], choices=["agnostic", "aware"])
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.depths, args.budgets = [1000], [0.1, 0.5, 0.9], [0.05, 0.1, 0.25]
    tag = args.tag or ("quick" if args.quick else "full")
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    if needs_all_queries(model, args.methods):
        ap.error("methods with weights='all' need rdkv.record(model, all_queries=True); not run here")
    plain = model.config._attn_implementation  # the presses' attention (rdkv.record installs its own)

    raw = defaultdict(list)  # (protocol, source, method, budget) -> per-probe dicts
    ref_gap = 0.0  # largest |logit| gap between the plain and the rdkv-attention full-cache reference
    jobs = [(n, d, p) for n in args.contexts for d in args.depths for p in args.protocols]
    bar = tqdm(total=len(jobs) * (1 + len(args.presses) * len(args.budgets)), desc="prefills")
    for n, depth, protocol in jobs:
        prefix, tail, n_ans = probe_inputs(tok, n, depth, protocol, args.seed)
        T = prefix.shape[1]

        # rdkv and its re-implemented baselines: one recorded prefill, many compressions
        clear_head_masks(model)
        with rdkv.record(model) as rec:
            full_cache = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
        fp16 = held_bytes(full_cache)
        runs = [("rdkv", *r) for r in rdkv_runs(rec, args.methods, args.budgets, tail)]
        ref_rdkv = forward(model, copy.deepcopy(full_cache), tail)
        del rec
        model.set_attn_implementation(plain)
        bar.update()

        # the plain model's reference, through the same feeding path the presses use
        ref = fed(model, copy.deepcopy(full_cache), tail, T)
        ref_gap = max(ref_gap, float((ref - ref_rdkv).abs().max()))
        del full_cache
        runs.append(("-", "full", 1.0, 1.0, 1.0, ref))
        extra = {}
        for name in args.presses:
            for b in args.budgets:
                bar.set_postfix_str(f"{protocol} d={depth} {name}@{b}")
                r = run_press(model, name, b, prefix, tail, fp16)
                runs.append(("kvpress", name, b, r["ratio"], r["kept"], r["logits"]))
                extra["kvpress", name, b] = r["ideal"]
                bar.update()

        for source, m, b, ratio, kept, logits in runs:
            nll, em, margin = answer_scores(logits, tail, n_ans)
            raw[protocol, source, m, b].append(dict(ratio=ratio, kept=kept, nll=nll, em=em, margin=margin, kl=kl(ref, logits),
                                                    depth=depth, n=n, ideal=extra.get((source, m, b))))
    bar.close()

    rows = []
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    for (protocol, source, m, b), rs in raw.items():
        label = m if source != "kvpress" else f"kvpress:{m}"
        ideals = [r["ideal"] for r in rs if r["ideal"] is not None]
        rows.append({"protocol": protocol, "method": label, "source": source, "budget": "-" if b is None else b,
                     "bytes/fp16": mean(rs, "ratio"), "tokens kept": mean(rs, "kept"),
                     "ideal ragged (not held)": sum(ideals) / len(ideals) if ideals else "-",
                     "EM": mean(rs, "em"), "NLL": mean(rs, "nll"), "KL": mean(rs, "kl"),
                     "EM by depth": " ".join(str(sum(r["em"] for r in rs if r["depth"] == d)) for d in args.depths),
                     "margin by depth": by_depth(rs, args.depths),
                     "probes": len(rs)})
    order = {"-": 0, "rdkv": 1, "kvpress": 2}
    rows.sort(key=lambda r: (r["protocol"], order[r["source"]], r["method"], r["bytes/fp16"]))
    cols = ["protocol", "method", "budget", "bytes/fp16", "tokens kept", "ideal ragged (not held)", "EM", "NLL",
            "KL", "EM by depth", "margin by depth", "probes"]
    name = f"kvpress_{args.model}_{tag}"
    md = (f"# kvpress presses and rdkv on the retrieval probes: {args.model} ({tag})\n\n"
          f"{header(args).rstrip()}, kvpress {version('kvpress')}\n\n"
          f"Contexts {args.contexts} tokens, depths {args.depths} (EM by depth counts correct probes per depth over "
          f"contexts; margin by depth is their mean answer margin: see common.answer_scores), seed {args.seed}. Rows `kvpress:*` are NVIDIA kvpress's presses (prefill under the press, "
          f"tail fed without it); the other rows are rdkv's methods (`snapkv`, `adakv`, `streaming`, `knorm` are "
          f"rdkv's re-implementations, packed and charged by rdkv). `bytes/fp16` is what each cache holds after "
          f"prefill over the uncompressed fp16 cache; for kvpress that is its K/V tensors at 2 bytes per element. "
          f"`tokens kept` is the mean fraction of (layer, head, position) entries kept; for `kvpress:adakv` it is "
          f"the fraction not masked, equal to `ideal ragged (not held)`: AdaKV holds the full cache and masks "
          f"evicted entries with fake keys at decode.\n\n{table(rows, cols)}\n\n"
          f"Reference check: the full cache's tail logits through the plain model and through rdkv's attention "
          f"differ by at most {ref_gap:.2e}.\n\n![plot]({name}.png)\n")
    write(name, md, rows, ["EM", "KL"], args.model)


if __name__ == "__main__":
    main()
