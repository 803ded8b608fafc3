"""Where do a RULER sample's needles go in a compressed cache? Per layer that can see them: each needle
sentence's V widths, the layer's kept tokens, its mean K width and its share of the cache's bytes; and the greedy
answer.

    python scripts/diag_needles.py --model gemma3-270m --task niah_multikey --context 16384 --sample 0 --method rdkv-aware --budgets 0.025 0.1
    python scripts/diag_needles.py --context 16384 --method rdkv-aware rdkv-aware:carry=1 --budgets 0.025

One prefill of the sample as ``eval_ruler.py`` builds it (``--protocol aware``: the first question in the prompt;
``agnostic``: the context alone), compressed by each ``--method`` at each budget. Every line "One of the special magic
numbers for <key> is: <value>." of the context is a needle (the asked one and its distractors); for each, the
share of its tokens kept and the mean V width of those kept, in every layer that holds all the needles (a
sliding-window layer holds only its window). A wrong answer that names a distractor's value points at the layers
that kept the distractor and not the asked needle.
"""
from __future__ import annotations

import argparse
import copy

import ruler
import torch
from common import add_sample_args, method_arg, method_of, settings, split_method
from eval_ruler import greedy, prompts

import rdkv

def needle_spans(tok, ids: list[int], context: str) -> list[tuple[str, str, range]]:
    """(key, value, token positions) of every needle sentence of the context, found in the prompt's ids."""
    out = []
    for m in ruler.NEEDLE.finditer(context):
        sub = tok(m.group(0), add_special_tokens=False).input_ids
        for sub in (sub, sub[1:]):  # the second try: the first token merged with the text before it
            at = next((i for i in range(len(ids) - len(sub) + 1) if ids[i : i + len(sub)] == sub), None)
            if at is not None:
                break
        else:
            raise ValueError(f"needle {m.group(0)!r} is not in the prompt's tokens")
        out.append((m.group(1), m.group(2), range(at, at + len(sub))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_args(ap, "niah_multikey", "aware")
    ap.add_argument("--method", nargs="+", default=["rdkv-aware"], type=method_arg,
                    help="methods as eval_ruler.py takes them, options after a colon (rdkv:surprisal=2)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.025, 0.1])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    s = ruler.sample(args.task, tok, args.context, args.sample, "prose")
    prefix, asks = prompts(tok, s, args.protocol, "cpu")[0]
    spans = needle_spans(tok, prefix[0].tolist(), s.context)
    asked = s.questions[0].answers
    print(f"{args.model}, {args.task} at {args.context} tokens, sample {args.sample}, {args.protocol}; asked: {asked}\n")
    with rdkv.record(model) as rec:
        full = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
    print("| method | budget | layer | kept tokens | mean K bits | bytes | " + " | ".join(
        f"{v}{' (asked)' if v in asked else ''} at {p.start}: kept, mean V bits" for _, v, p in spans) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(spans))
    answers = [("full", "-", greedy(model, copy.deepcopy(full), asks[0][1], s.max_new_tokens, tok))]
    del full
    for name, b in [(m, b) for m in args.method for b in settings(split_method(m)[0], args.budgets)]:
        cache = rdkv.compress(rec, b, method=method_of(model, name))
        answers.append((name, b, greedy(model, copy.deepcopy(cache), asks[0][1], s.max_new_tokens, tok)))
        for li, layer in enumerate(cache.layers):
            vw = layer.v_widths()[0].float()  # [H, held]
            cells = []
            for _, _, pos in spans:
                if pos.start < layer.start:
                    break
                w = vw[:, pos.start - layer.start : pos.stop - layer.start]
                kept = (w > 0).float().mean()
                cells.append(f"{kept:.0%}, {w[w > 0].mean():.1f}" if kept > 0 else "0%")
            if len(cells) < len(spans):
                continue  # a sliding-window layer that does not hold every needle
            print(f"| {name} | {b} | {li} | {int((vw > 0).sum())} of {vw.numel()} | "
                  f"{layer.k_widths().float().mean():.1f} | {layer.nbytes / cache.nbytes:.1%} | " + " | ".join(cells) + " |")
    print("\n| method | budget | greedy answer |\n|---|---|---|")
    for name, b, answer in answers:
        print(f"| {name} | {b} | {answer.strip()!r} |")


if __name__ == "__main__":
    main()
