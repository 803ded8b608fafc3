#!/usr/bin/env python
"""End-to-end time per output token: a Llama-3.1-8B-shaped model decoding over a full cache vs rdkv caches.

The model is ``LLAMA_8B`` (Llama-3.1-8B's configuration: 32 layers, 32 query / 8 KV heads, head_dim 128,
hidden 4096, MLP 14336, vocabulary 128256) with **random bf16 weights**: the speed of a decode step does not
depend on the weights' values. Caches are built directly, without a prefill (which would need the full cache
that batch 8 at 128k cannot hold): the full cache is random K/V in a preallocated buffer (:class:`FullLayer`,
written in place each step, so no step copies the cache); an rdkv cache packs one synthetic layer per
(context, batch, budget) as ``scripts/bench_decode.py`` does (a realistic ragged allocation, calibrated to the
budget in real bytes) and gives every model layer its own copy of it, so memory and bandwidth are those of a
real cache of that size.

For each (context, batch) it times greedy decode steps (``model(token, **rdkv.cache_kwargs(cache))`` + argmax) for

* ``full / sdpa``    transformers' SDPA attention over the full cache;
* ``full / flash``   the split-K flash-decoding kernel (``rdkv.kernels.flash_decode``) over the full cache;
* ``rdkv B``         rdkv's attention over the compressed cache at budget B (the fused kernel on a GPU),

reporting ms per token, tokens/s (batch x steps / time), peak memory (``torch.cuda.max_memory_allocated``,
weights included) and the cache's bytes; speed ratios are against the faster full-cache path. A full cache
that does not fit is reported as such, with the bytes it would need. Steps run eagerly: a compressed cache's
zone C grows by concatenation and the kernel's grid depends on its length, so a decode step cannot be
captured in a CUDA graph yet.

    python scripts/bench_generate.py --device cuda                    # 32k/128k x batch 1/8 x 10%/25%
    python scripts/bench_generate.py --device cpu --tiny              # 2-layer model of the same attention shape
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin

import bench_decode as bd
import rdkv
from common import save_outputs
from rdkv.layout import fp16_bytes
from rdkv.trizone import TriZoneCache

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                max_position_embeddings=131072 * 2,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))
TINY = dict(LLAMA_8B, vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
ANCHOR = "rdkv-anchor"  # (a name with "flash" in it would send transformers looking for a hub kernel)


class FullLayer(CacheLayerMixin):
    """A full 16-bit cache layer in a preallocated buffer: ``update`` writes the new tokens in place and returns
    views of the filled part (no copy of the cache per step, unlike a concatenating cache)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, k: torch.Tensor, v: torch.Tensor, n: int):
        super().__init__()
        self.k, self.v, self.n, self.is_initialized = k, v, n, True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        L = key_states.shape[2]
        self.k[:, :, self.n: self.n + L] = key_states
        self.v[:, :, self.n: self.n + L] = value_states
        self.n += L
        return self.k[:, :, : self.n], self.v[:, :, : self.n]

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.n + q, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length


def anchor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface over a full cache through the flash-decoding kernel (decode steps:
    the query positions are the cache's last ones, as :func:`rdkv.kernels.flash_decode.flash_decode` assumes)."""
    from rdkv.kernels.flash_decode import flash_decode

    if attention_mask is not None:
        raise ValueError("the flash-decoding anchor serves unpadded decode steps only (register no_mask for it)")
    out = flash_decode(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2), None


def no_mask(*args, **kwargs) -> None:
    """The anchor's mask function: unpadded decode steps need none (and checking one would sync the host)."""
    return None


def register_anchor() -> None:
    AttentionInterface.register(ANCHOR, anchor_attention)
    AttentionMaskInterface.register(ANCHOR, no_mask)


def full_cache(cfg: LlamaConfig, B: int, T: int, steps: int, dev, dtype) -> Cache:
    layers = []
    for _ in range(cfg.num_hidden_layers):
        k = torch.empty(B, cfg.num_key_value_heads, T + steps, cfg.head_dim, device=dev, dtype=dtype)
        v = torch.empty_like(k)
        k[:, :, :T].normal_()
        v[:, :, :T].normal_()
        layers.append(FullLayer(k, v, T))
    return Cache(layers=layers)


def rdkv_cache(cfg: LlamaConfig, B: int, T: int, budget: float, dev, dtype) -> tuple[TriZoneCache, float]:
    one, ratio = bd.calibrated_layer(B, T, budget, dev, torch.float16 if dtype == torch.float32 else dtype)
    layers = [copy.deepcopy(one) for _ in range(cfg.num_hidden_layers)]
    del one
    return TriZoneCache(layers, fp16_bytes=fp16_bytes(T, cfg.head_dim) * B * cfg.num_key_value_heads * len(layers),
                        budget=budget, method="synthetic"), ratio


def cache_bytes(cache) -> int:
    if isinstance(cache, TriZoneCache):
        return cache.nbytes
    return sum(2 * layer.k.numel() * layer.k.element_size() for layer in cache.layers)


def time_steps(model, cache, B: int, start: int, steps: int, warmup: int, dev) -> float:
    """Seconds per greedy decode step (eager), after ``warmup`` steps."""
    tok = torch.zeros(B, 1, dtype=torch.long, device=dev)

    def step(i: int) -> torch.Tensor:
        pos = torch.full((B, 1), start + i, dtype=torch.long, device=dev)
        return model(tok, **rdkv.cache_kwargs(cache), position_ids=pos, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)

    with torch.no_grad():
        for i in range(warmup):
            tok = step(i)
        sync(dev)
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            tok = step(i)
        sync(dev)
    return (time.perf_counter() - t0) / steps


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256, vocabulary 1000 (same attention shape)")
    ap.add_argument("--contexts", type=int, nargs="*")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.10, 0.25])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no GPU is visible", file=sys.stderr)
        return 2
    contexts = a.contexts or ([512] if a.tiny else [32768, 131072])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the CPU runs the model in fp32,
    cfg = LlamaConfig(**(TINY if a.tiny else LLAMA_8B))
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    register_anchor()
    paths = [("full / sdpa", "sdpa", None)] + ([("full / flash", ANCHOR, None)] if dev.type == "cuda" else [])
    paths += [(f"rdkv {b:.0%}", rdkv.attention.NAME, b) for b in a.budgets]
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
    rows = []
    for T in contexts:
        for B in a.batches:
            best_full = None
            for label, impl, budget in paths:
                row = dict(context=T, batch=B, path=label)
                full_need = (fp16_bytes(T + a.steps + a.warmup, cfg.head_dim) * B * cfg.num_key_value_heads
                             * cfg.num_hidden_layers)
                if budget is None and free is not None and full_need > 0.9 * free:
                    row.update(status=f"does not fit: {full_need / 1e9:.1f} GB of cache + {weights / 1e9:.1f} GB weights")
                    rows.append(row)
                    print(row, flush=True)
                    continue
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                try:
                    if budget is None:
                        cache, ratio = full_cache(cfg, B, T, a.steps + a.warmup, dev, dtype), 1.0
                    else:
                        cache, ratio = rdkv_cache(cfg, B, T, budget, dev, dtype)
                    if impl == rdkv.attention.NAME:
                        rdkv.install(model)
                    else:
                        model.set_attn_implementation(impl)
                    start = cache.get_seq_length()
                    nbytes = cache_bytes(cache)
                    secs = time_steps(model, cache, B, start, a.steps, a.warmup, dev)
                except torch.cuda.OutOfMemoryError as e:
                    row.update(status=f"out of memory ({str(e).splitlines()[0][:80]})")
                    rows.append(row)
                    print(row, flush=True)
                    continue
                peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
                row.update(status="ok", bytes_ratio=ratio, cache_GB=nbytes / 1e9, ms_per_token=secs * 1e3,
                           tokens_per_s=B / secs, peak_GB=peak / 1e9 if peak else None)
                if budget is None:
                    best_full = secs if best_full is None else min(best_full, secs)
                row["x_vs_best_full"] = best_full / secs if best_full else None
                rows.append(row)
                print(row, flush=True)
                del cache
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    lines = [f"# End-to-end decode, {'tiny 2-layer' if a.tiny else 'Llama-3.1-8B-shaped'} model, random {dtype} "
             f"weights ({weights / 1e9:.1f} GB), {name}", "",
             f"Greedy decode steps, eager, {a.steps} timed after {a.warmup} warm-up. x = best full-cache ms / this ms.",
             "", "| context | batch | path | bytes/fp16 | cache GB | ms/token | tokens/s | peak GB | x vs best full | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k, fmt: fmt.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"| {r['context']} | {r['batch']} | {r['path']} | {f('bytes_ratio', '{:.3f}')} | {f('cache_GB', '{:.2f}')} | "
                     f"{f('ms_per_token', '{:.2f}')} | {f('tokens_per_s', '{:.1f}')} | {f('peak_GB', '{:.1f}')} | "
                     f"{f('x_vs_best_full', '{:.2f}')} | {r['status']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    save_outputs(a.out, "bench_generate", text, dict(device=name, weights_bytes=weights, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
