"""What an installed model's prefill record costs: its bytes against the cache's, and a decode step's time.

    python scripts/bench_record.py --model smollm2-135m --contexts 2048 8192 --predict 32768
    python scripts/bench_record.py --model gemma3-270m --contexts 2048 8192 --predict 32768

Since ``rdkv.install(model)`` (which ``rdkv.models.load`` runs) every prefill into an empty cache leaves a record
with the cache it returns: each layer's last 256 queries, the token ids and the final hidden states (the
cache's tensors themselves are referenced, not copied). Per context it prefills once (GPL-3 text, fp32 model),
prints the record's extra bytes (every storage it holds that the cache does not) measured beside the same figure
computed from the model's shapes (``--predict`` adds rows from shapes alone, for contexts too long to prefill here), and times greedy
decode steps through the ordinary cache: the installed model against the same model with transformers' SDPA
and no rdkv hooks, in turns, best of ``--repeats``.
"""
from __future__ import annotations

import argparse
import copy
import platform
import time
from datetime import date

import torch

import rdkv
from rdkv.attention import RECORD_WINDOW, prefill_record
from rdkv.compat import cache_kwargs, output_cache
from bench_cpu_decode import text_ids


def storages(*tensors) -> dict[int, int]:
    """The bytes of each distinct storage the tensors live in (a view holds its whole storage)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


def predicted(model, T: int) -> tuple[int, int]:
    """(record's extra bytes, cache bytes) of a batch-1 prefill of T tokens, from the model's shapes. Until its
    first update a transformers sliding-window layer is a view of every key of the prefill, so the cache holds T
    tokens on every layer, and the record's sliding-layer keys are views of the same storage."""
    c = model.config.get_text_config()
    layers, D = c.num_hidden_layers, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    el = next(model.parameters()).element_size()
    queries = layers * min(T, RECORD_WINDOW) * c.num_attention_heads * D * el
    return queries + layers * T + T * 8 + T * c.hidden_size * el, layers * 2 * T * c.num_key_value_heads * D * el


def step_ms(model, cache, nxt: torch.Tensor, steps: int) -> float:
    cache = copy.deepcopy(cache)
    t = time.perf_counter()
    for _ in range(steps):
        nxt = model(nxt, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t) * 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--predict", type=int, nargs="*", default=[32768])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = rdkv.models.load(args.model)  # installed
    plain = copy.deepcopy(model)
    for h in plain._rdkv_pass_hooks:
        h.remove()
    plain.set_attn_implementation("sdpa")
    print(f"{args.model}, {date.today()}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}\n")
    print("| context | cache MB | record MB (measured) | record MB (from shapes) | record / cache | "
          "decode ms, installed | decode ms, plain SDPA | installed / plain |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.contexts:
        ids = text_ids(tok, T)
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache, rec = output_cache(out), prefill_record(model)
        held = storages(*(t for layer in cache.layers for t in (layer.keys, layer.values)))
        mine = storages(rec.ids, rec.hidden, *(t for st in rec.layers.values()
                                               for t in (st.key, st.value, st.window_q, st.valid)))
        extra, held = sum(n for p, n in mine.items() if p not in held), sum(held.values())
        want_extra, want_held = predicted(model, T)
        nxt = ids[:, -1:]
        runs = {"installed": [], "plain": []}
        for _ in range(args.repeats):
            runs["installed"].append(step_ms(model, cache, nxt, args.steps))
            runs["plain"].append(step_ms(plain, cache, nxt, args.steps))
        a, b = min(runs["installed"]), min(runs["plain"])
        print(f"| {T:,} | {held / 2**20:.1f} (shapes: {want_held / 2**20:.1f}) | {extra / 2**20:.2f} | "
              f"{want_extra / 2**20:.2f} | {extra / held:.4f} | {a:.1f} | {b:.1f} | {a / b:.3f} |")
        del out, cache, rec
    for T in args.predict:
        e, h = predicted(model, T)
        print(f"| {T:,} | {h / 2**20:.1f} (shapes) | | {e / 2**20:.2f} | {e / h:.4f} | | | |")


if __name__ == "__main__":
    main()
