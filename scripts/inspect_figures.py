"""Render the figures of docs/inspect.md (and README) and print the shares its text quotes.

    python scripts/inspect_figures.py

SmolLM2-135M, the 1k retrieval probe with the needle at depth 0.5, the default ``rdkv`` method, exactly
as notebooks/inspect_allocation.ipynb does it; writes docs/img/{v_widths,needle_tokens_025,needle_tokens_010}.png.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import torch

import rdkv
from rdkv import plots

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def main() -> None:
    matplotlib.use("Agg")
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load("smollm2-135m")
    probe = rdkv.models.retrieval_prompt(1000, 0.5, tok)
    ctx = tok(probe["context"], return_tensors="pt").input_ids
    with rdkv.record(model) as rec:
        model(ctx, use_cache=True, logits_to_keep=1)
    needle = f"The secret code {probe['code']}"
    at = plots.locate(tok, ctx[0], needle)
    span = range(at, at + len(tok(needle + " unlocks the hidden piano", add_special_tokens=False).input_ids))
    for budget, name in ((0.25, "025"), (0.1, "010")):
        cache = rdkv.compress(rec, budget)
        print(f"--- budget {budget}\n" + str(cache.report()).split("\n\n")[0])
        grid = plots.v_width_grid(cache)  # [layers, heads, T]
        per_layer = (grid == 0).float().mean((1, 2))
        print(f"evicted per layer: {per_layer.min():.0%}..{per_layer.max():.0%}")
        streams = grid.flatten(0, 1)
        print("needle tokens kept in (share of streams): "
              + ", ".join(f"{tok.decode(ctx[0, i])!r} {(streams[:, i] > 0).float().mean():.0%}" for i in span))
        plots.token_widths(cache, tok, ctx, around=at, window=48).savefig(IMG / f"needle_tokens_{name}.png", dpi=100)
        if budget == 0.25:
            plots.v_width_heatmap(cache, head=0).savefig(IMG / "v_widths.png", dpi=100)


if __name__ == "__main__":
    main()
