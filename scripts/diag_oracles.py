"""Which part of a compressed cache loses a RULER answer? Oracles: the method's own allocation packed again with
one part of it changed, each cache answering the same question greedily.

    python scripts/diag_oracles.py --model gemma3-270m --task niah_single --context 8192 --sample 0 --method rdkv-reconstruct --budget 0.1

One prefill of the sample as ``eval_ruler.py`` builds it (``--protocol agnostic``: the context alone; ``aware``: the
question in the prompt), allocated once by ``--method`` at ``--budget``. Each row packs that allocation with one
change and answers question ``--question`` through it:

* ``as allocated``: the cache ``rdkv.compress`` returns (checked to fit the budget);
* ``every token at 16 bits``: nothing evicted or quantized, a check that the rows start from the full cache's
  answer;
* ``kept tokens at 16 bits``: the same tokens kept, unquantized, K too (what eviction alone loses);
* ``evicted tokens back at W bits``: the evicted tokens' V rows at W, the kept tokens and K as allocated (at 16,
  what quantization alone loses; at 2, what the lowest width buys back);
* ``K blocks at 2 bits or more``: the K blocks the allocation keeps only as channel means raised to 2 bits, V as
  allocated (what K's mean-only blocks lose);
* ``sliding-window layers whole at W bits`` (hybrid models): every token and K block of those layers at W, above or
  below the allocation's widths, the full-attention layers as allocated;
* ``sliding-window layers' last N tokens at 2 bits``: those tokens' V rows at 2 bits or more and every K block of
  those layers at 2 bits or more, the rest as allocated (how much of the window a later question needs); and the
  same with K as allocated (whether the window's end needs its keys too);
* ``layers L's last 128 tokens at 2 bits``, for each ``--tails-on`` list L: the same on those sliding-window
  layers only (which layers need the window's end);
* ``layer i at 16 bits`` and ``every layer but i at 16 bits``, for each layer of ``--layers`` (by default the
  full-attention layers of a hybrid model, else none): whether that layer's compression is enough to lose the
  answer, or needed to; ``layer i's evicted tokens back at W bits``: whether that layer's eviction is.

The bytes column is each cache's size over the fp16 bytes of what the prefill holds, before the question is fed.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import ruler
import torch
from common import add_sample_args, method_arg, method_of
from eval_ruler import greedy, prompts

import rdkv
from rdkv.methods import HeldLayer
from rdkv.pipeline import dtype16, held_layers, pack_held, weigh
from rdkv.quant import OPTION
from rdkv.trizone import TriZoneCache

TAILS = (64, 128, 256, 384)  # how much of a sliding-window layer's end the tail oracles keep
# (layer index, held layer, V options [B, H, T], K options [B, H, D / k_block]) -> the options to pack instead
# (rdkv.quant.OPTION indices, as an Allocation holds them)
Change = Callable[[int, HeldLayer, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def as_allocated(i: int, h: HeldLayer, v: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return v, k


def whole(width: int) -> Change:
    """Every token the layer holds at ``width`` (V) and every K block at ``width``."""
    def change(i: int, h: HeldLayer, v: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(h.present, OPTION[width], OPTION[0]).to(v.dtype), torch.full_like(k, OPTION[width])
    return change


def kept_at_16(i: int, h: HeldLayer, v: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens' V rows and every K block at 16 bits, the evicted tokens still evicted."""
    return torch.where(v > OPTION[0], OPTION[16], OPTION[0]).to(v.dtype), torch.full_like(k, OPTION[16])


def evicted_back(width: int) -> Change:
    """The evicted tokens' V rows back at ``width``, the rest as allocated."""
    return lambda i, h, v, k: (torch.where(h.present & (v == OPTION[0]), OPTION[width], v).to(v.dtype), k)


def k_at_least_2(i: int, h: HeldLayer, v: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every K block kept at its channel means (0 bits) raised to 2 bits, the rest as allocated."""
    return v, k.clamp_min(OPTION[2])


def tail(n: int, keys: bool = True) -> Change:
    """The layer's last ``n`` tokens at 2 bits or more (V) and, with ``keys``, its K blocks at 2 bits or more, the
    rest as allocated."""
    def change(i: int, h: HeldLayer, v: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        last = torch.arange(v.shape[-1], device=v.device) >= v.shape[-1] - n
        return torch.where(h.present & last, v.clamp_min(OPTION[2]), v), k_at_least_2(i, h, v, k)[1] if keys else k
    return change


def on(layers: set[int], change: Change) -> Change:
    """``change`` on ``layers`` only, the others as allocated."""
    return lambda i, h, v, k: change(i, h, v, k) if i in layers else (v, k)


def oracles(held: list[HeldLayer], layers: list[int], tails_on: list[list[int]] = ()) -> list[tuple[str, Change]]:
    """The rows of the module docstring, for these held layers."""
    sliding = {i for i, h in enumerate(held) if h.stats.sliding_window is not None}
    every = set(range(len(held)))
    rows = [("as allocated", as_allocated), ("every token at 16 bits", whole(16)), ("kept tokens at 16 bits", kept_at_16)]
    rows += [(f"evicted tokens back at {w} bits", evicted_back(w)) for w in (16, 2)]
    rows += [("K blocks at 2 bits or more", k_at_least_2)]
    if sliding:
        rows += [(f"sliding-window layers whole at {w} bits", on(sliding, whole(w))) for w in (16, 2)]
        rows += [(f"sliding-window layers' last {n} tokens at 2 bits", on(sliding, tail(n))) for n in TAILS]
        rows += [(f"the same, last {n}, K as allocated", on(sliding, tail(n, keys=False))) for n in TAILS[1:3]]
        rows += [(f"layers {','.join(map(str, group))}'s last 128 tokens at 2 bits", on(set(group) & sliding, tail(128)))
                 for group in tails_on]
    for i in layers:
        rows += [(f"layer {i} at 16 bits", on({i}, whole(16))),
                 (f"every layer but {i} at 16 bits", on(every - {i}, whole(16)))]
        rows += [(f"layer {i}'s evicted tokens back at {w} bits", on({i}, evicted_back(w))) for w in (2, 16)]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_args(ap, "niah_single", "agnostic")
    ap.add_argument("--method", default="rdkv-reconstruct", type=method_arg,
                    help="a method as eval_ruler.py takes it, options after a colon (rdkv:surprisal=2)")
    ap.add_argument("--question", type=int, default=0, help="which of the sample's questions to ask")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--layers", type=int, nargs="*", default=None,
                    help="layers to give 16 bits, and to leave alone compressed, one at a time (default: the full-attention layers of a hybrid model)")
    ap.add_argument("--tails-on", nargs="*", default=[], type=lambda x: [int(i) for i in x.split(",")],
                    help="comma-separated sliding-window layers to give their last 128 tokens at 2 bits, one row per list (0,1,2,3,4)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)
    s = ruler.sample(args.task, tok, args.context, args.sample, "prose")
    if not 0 <= args.question < len(s.questions):
        ap.error(f"--question {args.question}: this sample has questions 0 to {len(s.questions) - 1}")
    prefix, asks = prompts(tok, s, args.protocol, "cpu")[0 if args.protocol == "agnostic" else args.question]
    ids = dict(asks)[args.question]
    with rdkv.record(model) as rec:
        full = rdkv.compat.output_cache(model(prefix, use_cache=True, logits_to_keep=1))
    print(f"{args.model}, {args.task} at {args.context} tokens, sample {args.sample}, {args.protocol}, {args.method} at "
          f"{args.budget}; question {args.question}, expected: {s.questions[args.question].answers}\n")
    print("| cache | bytes / fp16 | greedy answer |\n|---|---|---|")
    print(f"| full | 1 | {greedy(model, full, ids, s.max_new_tokens, tok).strip()!r} |")
    del full
    m = method_of(model, args.method).for_record(rec)
    weigh(rec, m)
    held, fp16 = held_layers(rec, m)
    alloc = m.allocate(rec, held, fp16, args.budget)
    hybrid = any(h.stats.sliding_window is not None for h in held)
    layers = args.layers if args.layers is not None else [
        i for i, h in enumerate(held) if hybrid and h.stats.sliding_window is None]
    for name, change in oracles(held, layers, args.tails_on):
        packed = [pack_held(h, *change(i, h, v, k), perm, m.spec, dtype16(model))
                  for i, (h, v, k, perm) in enumerate(zip(held, alloc.v, alloc.k, alloc.perm))]
        cache = TriZoneCache(packed, fp16_bytes=int(sum(fp16)), method=m.name)
        size = cache.nbytes / cache.fp16_bytes
        if change is as_allocated and size > args.budget:
            raise SystemExit(f"{args.method} packed {size:.5f} of the fp16 bytes, over the budget {args.budget}")
        print(f"| {name} | {size:.4f} | {greedy(model, cache, ids, s.max_new_tokens, tok).strip()!r} |")


if __name__ == "__main__":
    main()
