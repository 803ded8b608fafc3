"""What storing V (or K) in a Hadamard basis does to quantization error and to answers (``PackSpec.v_rotate``).

Prints two tables for one model: per layer, the relative squared error of 2- and 4-bit V rows (groups of 64
channels) and K channels (groups of 128 tokens), plain and rotated, over a prose prefill; then, on one retrieval
probe, each method's cache bytes and the KL of its answer tokens' distributions from the full cache's, with and
without ``v_rotate``.

    python diag_rotation.py --model smollm2-135m --methods kivi2 rdkv --budgets 0.05 0.1 0.25
"""
from __future__ import annotations

import argparse
import copy

import torch
from transformers import DynamicCache

import rdkv
from common import domain_text, settings, split_method
from rdkv import quant
from rdkv.layout import PackSpec, rotate_v


def rel_error(x: torch.Tensor, bits: int) -> float:
    """Relative squared error of quantizing groups along the last dim of x."""
    return float((quant.fake_quantize(x, bits) - x).square().sum() / x.square().sum())


def layer_errors(k: torch.Tensor, v: torch.Tensor, bits: int) -> list[float]:
    """[V plain, V rotated, K plain, K rotated] at ``bits`` for one layer's k, v [B, H, T, D]."""
    spec = PackSpec()  # the default groups: V rows of v_group channels, K channels over k_group tokens

    def rows(x):
        return x.unflatten(-1, (-1, min(spec.v_group, x.shape[-1])))

    def channels(x):
        T = x.shape[-2] // spec.k_group * spec.k_group
        return x[..., :T, :].transpose(-1, -2).unflatten(-1, (-1, spec.k_group))

    return [rel_error(rows(v), bits), rel_error(rows(rotate_v(v)), bits),
            rel_error(channels(k), bits), rel_error(channels(rotate_v(k)), bits)]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048, help="prose tokens prefilled for the error table")
    ap.add_argument("--context", type=int, default=1000, help="tokens of the retrieval probe")
    ap.add_argument("--methods", nargs="+", default=["kivi2", "rdkv"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.05, 0.1, 0.25])
    args = ap.parse_args()
    model, tok = rdkv.models.load(args.model)

    ids = tok(domain_text("prose"), return_tensors="pt").input_ids[:, 3000 : 3000 + args.tokens]
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    print(f"{args.model}, {args.tokens} prose tokens: relative squared quantization error\n")
    print("| layer | V 2b | V 2b rotated | K 2b | K 2b rotated | V 4b | V 4b rotated | K 4b | K 4b rotated |")
    print("|---|---|---|---|---|---|---|---|---|")
    errs = torch.tensor([layer_errors(lay.keys.float(), lay.values.float(), 2)
                         + layer_errors(lay.keys.float(), lay.values.float(), 4) for lay in cache.layers])
    for i, e in [*enumerate(errs.tolist()), ("mean", errs.mean(0).tolist())]:
        print(f"| {i} | " + " | ".join(f"{x:.4f}" for x in e) + " |")

    probe = rdkv.models.retrieval_prompt(args.context, 0.5, tok)
    ctx = tok(probe["context"], return_tensors="pt").input_ids
    tail = tok(probe["question"] + probe["answer"], return_tensors="pt", add_special_tokens=False).input_ids
    with rdkv.record(model) as rec:
        full = model(ctx, use_cache=True, logits_to_keep=1).past_key_values
    ref = model(tail, past_key_values=copy.deepcopy(full)).logits[0].log_softmax(-1)
    print(f"\nretrieval probe, {ctx.shape[1]} tokens; KL from the full cache, mean over the {tail.shape[1]} "
          "question and answer tokens\n")
    print("| method | budget | bytes / fp16 | KL | bytes / fp16, v_rotate | KL, v_rotate |")
    print("|---|---|---|---|---|---|")
    for text in args.methods:
        method, options = split_method(text)
        for budget in settings(method, args.budgets):
            cells = []
            for rot in (False, True):
                c = rdkv.compress(rec, budget, method=method, **options, v_rotate=rot)
                cells.append(f"{c.nbytes / c.fp16_bytes:.4f}")  # before the probe's tail joins zone C
                lp = model(tail, past_key_values=c).logits[0].log_softmax(-1)
                cells.append(f"{float((ref.exp() * (ref - lp)).sum(-1).mean()):.4f}")
            print(f"| {text} | {budget if budget is not None else '-'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
