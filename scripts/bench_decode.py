#!/usr/bin/env python
"""Decode-step latency of the TriZone cache vs a full fp16 cache, on synthetic caches (no model needed).

One attention layer shaped like Llama-3.1-8B (8 KV heads, 4 query heads per KV head, head_dim 128),
one new token (L = 1) on top of a compressed prefix of ``context`` tokens plus a 16-token zone C.
For every (context, batch, budget) it times

* ``trizone``   the fused Triton kernel over pages (``rdkv.kernels.page_decode``, ``--device cuda``) or the torch
                reference (``--device cpu``);
* ``sdpa-full`` torch SDPA over the full fp16 cache (FlashAttention backend on GPU; the G query heads
                of a KV head ride as G query rows of one head, which is exact for decode);
* ``flash-full`` the split-K flash-decoding kernel over the full fp16 cache (``rdkv.kernels.flash_decode``,
                GPU only), at the fastest of ``ANCHOR_SETTINGS`` for each (context, batch). Every speed ratio
                is against the faster of the two full-cache paths, ``best full``;
* ``deq-sdpa``  dequantize the TriZone layer to fp16 (``TriZoneLayer.dequantize``) and run SDPA over it,
                i.e. what a format without a fused kernel has to do every step;
* ``pre-RoPE``  the same layer holding pre-RoPE keys (``prerope=True``): the kernel rotates every K channel
                to its tokens' positions inside the dots, so this column is the price of that rotation;

and reports bytes the TriZone step reads (every tensor of the layer plus q: each byte is read once) per
second, as a fraction of the GPU's peak memory bandwidth (nominal figure for known GPUs, and the
bandwidth of a large device-to-device copy measured here).

The compressed caches are packed with :func:`rdkv.trizone.pack_layer` from random K/V with a realistic
allocation: a recent window and sinks at 16 bits, other kept tokens mostly 2-8 bits, a per-stream kept
fraction that varies +-30% between streams (ragged batches), and K channel blocks at 0..16 bits. The
kept fraction is calibrated so the layer's real bytes (codes, scales, zeros, positions, indices)
hit the budget as a fraction of the fp16 cache.

    python scripts/bench_decode.py --device cuda                # 8k/32k/128k x batch 1/8 x 2.5/10/25%
    python scripts/bench_decode.py --device cpu --quick         # small contexts, torch reference
    python scripts/bench_decode.py --device cuda --out results/  # also write bench_decode.{md,json}
    python scripts/bench_decode.py --device cuda --sweep 131072,8,0.1   # launch settings at one point
    python scripts/bench_decode.py --device cuda --sweep 131072,8,0.1 --then-table   # then the table with the best
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from rdkv import layout
import torch.nn.functional as F

from common import save_outputs
from rdkv.layout import PackSpec
from rdkv.trizone import pack_layer

H, G, D = 8, 4, 128
ROPE = torch.cat([10000.0 ** -(torch.arange(0, D, 2) / D), torch.ones(1)])  # a Llama RoPE table (rdkv.rope layout)
SPEC = PackSpec(v_group=32, k_group=128, k_block=16)
FRESH = 16  # zone C tokens
# nominal HBM bandwidth (bytes/s) by device-name substring, first match wins
PEAK = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
        ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12),
        ("RTX 4090", 1.008e12), ("B200", 8.0e12)]
V_MIX = torch.tensor([0.15, 0.35, 0.35, 0.15])  # kept tokens over V widths 2/4/8/16 (besides the 16-bit window)
K_WIDTHS = torch.tensor([0, 2, 4, 4, 8, 8, 16, 16])  # per stream, one width per 16-channel block (shuffled)


# launch settings of the full-cache anchor tried at every (context, batch); the fastest one is reported
ANCHOR_SETTINGS = [dict(block_n=64, num_warps=4, num_stages=3), dict(block_n=64, num_warps=4, num_stages=4),
                   dict(block_n=128, num_warps=8, num_stages=3), dict(block_n=64, num_warps=8, num_stages=2),
                   dict(block_n=32, num_warps=4, num_stages=4)]


def best_anchor(q, k, v, bench) -> tuple[float | None, dict | None]:
    """Graph time of the fastest anchor setting (checked against SDPA), or (None, None) off the GPU."""
    if q.device.type != "cuda":
        return None, None
    from rdkv.kernels.flash_decode import flash_decode

    B, Hq, _, D = q.shape
    want = F.scaled_dot_product_attention(q.view(B, k.shape[1], -1, D), k, v).view(B, Hq, 1, D)
    best = (None, None)
    for setting in ANCHOR_SETTINGS:
        step = lambda: flash_decode(q, k, v, D ** -0.5, **setting)  # noqa: E731
        err = float((step().float() - want.float()).abs().max())
        if err > 1e-2:
            print(f"anchor {setting}: max error {err:.1e} against SDPA, skipped", file=sys.stderr)
            continue
        g = graphed(step)
        t = bench(g or step)
        if best[0] is None or t < best[0]:
            best = (t, setting)
    return best


def synth_allocation(B: int, T: int, keep: float, seed: int = 0):
    """V widths per token [B, H, T], K widths per block [B, H, D/k_block] and channel orders [B, H, D]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    S = B * H
    frac = (keep * (1 + 0.6 * (torch.rand(S, generator=g) - 0.5))).clamp(0, 1)  # ragged allocations
    score = torch.rand(S, T, generator=g)
    recent = min(T, 64)
    n_keep = (frac * T).long().clamp(min=recent + 4, max=T)
    rank = score.argsort(1).argsort(1)
    kept = rank < n_keep.unsqueeze(1)
    kept[:, -recent:] = True
    kept[:, :4] = True
    widths = torch.tensor([2, 4, 8, 16])[torch.multinomial(V_MIX, S * T, replacement=True, generator=g)].view(S, T)
    widths[:, -recent:] = 16
    widths[:, :4] = 16
    vw = torch.where(kept, widths, torch.zeros_like(widths)).view(B, H, T)
    kb = torch.stack([K_WIDTHS[torch.randperm(len(K_WIDTHS), generator=g)] for _ in range(S)]).sort(1).values
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(S)])
    return vw, kb.view(B, H, -1), perm.view(B, H, D)


def synth_layer(B: int, T: int, keep: float, dev: torch.device, seed: int = 0, dtype=torch.float16):
    """A layer packed from random K/V with :func:`synth_allocation` and ``FRESH`` zone C tokens."""
    k = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    v = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    vw, kb, perm = synth_allocation(B, T, keep, seed)
    layer = pack_layer(k, v, 0, vw.to(dev), kb.to(dev), perm.to(dev), SPEC, dtype, None, T)
    layer.update(torch.randn(B, H, FRESH, D, device=dev, dtype=dtype), torch.randn(B, H, FRESH, D, device=dev, dtype=dtype))
    del k, v
    return layer


def calibrated_layer(B, T, budget, dev, dtype=torch.float16):
    """Pack at a first-guess kept fraction, then once more at the fraction that hits the budget."""
    fp16 = 2 * B * H * T * D * 2
    keep = budget / 0.45
    for _ in range(2):
        layer = synth_layer(B, T, min(1.0, keep), dev, dtype=dtype)
        ratio = (layer.nbytes - 2 * B * H * FRESH * D * 2) / fp16
        keep *= budget / ratio
    return layer, ratio


def timer(dev: torch.device, quick: bool):
    if dev.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100) * 1e-3

    def cpu(fn):
        fn()
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < (0.3 if quick else 1.0):
            fn()
            n += 1
        return (time.perf_counter() - t0) / n

    return cpu


def graphed(fn):
    """``fn`` captured in a CUDA graph (replay = GPU time without Python launch overhead), or None."""
    try:
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay
    except Exception as e:  # report, keep benchmarking eagerly
        print(f"CUDA graph capture failed ({type(e).__name__}: {e}); graph columns left empty", file=sys.stderr)
        return None


def peak_bandwidth(dev: torch.device) -> tuple[str, float | None, float | None]:
    if dev.type != "cuda":
        return "cpu", None, None
    name = torch.cuda.get_device_name(dev)
    nominal = next((bw for key, bw in PEAK if key in name), None)
    x = torch.empty(1 << 28, dtype=torch.uint8, device=dev)  # 256 MiB copy: read + write
    y = torch.empty_like(x)
    import triton.testing

    secs = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=30) * 1e-3
    return name, nominal, 2 * x.numel() / secs


# launch settings of the page kernel around its default (docs/kernels.md): warps, tokens per tile (at most a page),
# pipelining of the page loop, a register cap that trades spills for programs per SM
SWEEP = [dict(), dict(num_warps=8), dict(num_warps=4), dict(block_n=32), dict(num_warps=4, num_stages=2),
         dict(num_warps=8, num_stages=2), dict(num_warps=4, maxnreg=128), dict(num_warps=8, maxnreg=128)]


def sweep(spec: str, dev: torch.device, out: str | None):
    """Graph time of the fused step over launch settings (tokens per tile, warps, pipelining, register cap)
    at one (context, batch, budget), each checked against the torch reference: the measurement behind
    ``launch_config``'s choices. Returns the fastest setting as a ``LaunchConfig`` (None if none ran)."""
    from rdkv.kernels.page_decode import LaunchConfig, page_decode
    from rdkv.reference import trizone_attention

    T, B, budget = int(spec.split(",")[0]), int(spec.split(",")[1]), float(spec.split(",")[2])
    layer, ratio = calibrated_layer(B, T, budget, dev)
    q = torch.randn(B, H * G, 1, D, device=dev, dtype=torch.float16)
    want = trizone_attention(q.float(), layer, D ** -0.5)
    bench = timer(dev, False)
    read = layer.nbytes + q.numel() * q.element_size()
    lines = [f"# Launch sweep: context {T}, batch {B}, budget {budget} (bytes {ratio:.3f}), {torch.cuda.get_device_name(dev)}",
             "", "Max |error| is against the torch reference in fp32 (fp16 kernel output: one ulp at |out| ~ 1 is 1e-3).", "",
             "| block_n | warps | stages | register cap | graph us | GB/s read | max error |",
             "|---|---|---|---|---|---|---|"]
    best = (float("inf"), None)
    for combo in SWEEP:
        launch = LaunchConfig(**combo)
        t = err = None
        try:
            err = float((page_decode(q, layer, D ** -0.5, launch=launch).float() - want).abs().max())
            g = graphed(lambda: page_decode(q, layer, D ** -0.5, launch=launch))
            t = bench(g) if g else None
        except Exception as e:  # a setting the compiler refuses (e.g. out of registers): say so, go on
            print(f"{combo}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        if t and err is not None and err < 1e-2 and t < best[0]:
            best = (t, launch)
        row = (f"| {launch.block_n or '-'} | {launch.num_warps or '-'} | {launch.num_stages or 1} | {launch.maxnreg or '-'} | "
               f"{t * 1e6 if t else float('nan'):.1f} | {read / t / 1e9 if t else float('nan'):.0f} | "
               f"{err if err is not None else float('nan'):.1e} |")
        print(row, flush=True)
        lines.append(row)
    lines += ["", f"Fastest: {best[1]} at {best[0] * 1e6:.1f} us."]
    text = "\n".join(lines) + "\n"
    print(text)
    save_outputs(out, "bench_decode_sweep", text)
    return best[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small contexts (1k/4k), batch 1/2: a CPU smoke run")
    ap.add_argument("--contexts", type=int, nargs="*")
    ap.add_argument("--batches", type=int, nargs="*")
    ap.add_argument("--budgets", type=float, nargs="*")
    ap.add_argument("--no-deq", action="store_true", help="skip the dequantize-then-SDPA baseline")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_decode.md/json (default $OUT)")
    ap.add_argument("--sweep", metavar="CONTEXT,BATCH,BUDGET",
                    help="time the kernel over launch settings at one point (GPU only), then stop, or with "
                         "--then-table run the table with the fastest setting")
    ap.add_argument("--then-table", action="store_true")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no GPU is visible", file=sys.stderr)
        return 2
    if a.sweep:
        if dev.type != "cuda":
            print("--sweep times the Triton kernel: it needs --device cuda", file=sys.stderr)
            return 2
        launch = sweep(a.sweep, dev, a.out)
        if not a.then_table:
            return 0
        print(f"table with launch setting {launch}", flush=True)
    else:
        launch = None
    contexts = a.contexts or ([1024, 4096] if a.quick else [8192, 32768, 131072])
    batches = a.batches or ([1, 2] if a.quick else [1, 8])
    budgets = a.budgets or [0.025, 0.10, 0.25]
    setting = ""
    if dev.type == "cuda":
        from rdkv.kernels.page_decode import page_decode, page_launch_config

        cfg = page_launch_config(D, 16, torch.float16, launch)
        setting = (f"block_n {cfg.block_n}, {cfg.num_warps} warps, {cfg.num_stages} stage(s)"
                   + (f", at most {cfg.maxnreg} registers" if cfg.maxnreg else ""))
        fused = lambda q, layer, scaling: page_decode(q, layer, scaling, launch=launch)  # noqa: E731
    else:
        from rdkv.reference import trizone_attention as fused
    bench = timer(dev, a.quick)
    name, nominal, copy_bw = peak_bandwidth(dev)
    torch.manual_seed(0)
    rows = []
    for T, B in ((T, B) for T in contexts for B in batches):
        seq = T + FRESH
        q = torch.randn(B, H * G, 1, D, device=dev, dtype=torch.float16 if dev.type == "cuda" else torch.float32)
        k_full = torch.randn(B, H, seq, D, device=dev, dtype=q.dtype)
        v_full = torch.randn_like(k_full)
        qg = q.view(B, H, G, D)  # decode: G query heads of one KV head = G query rows, no mask needed
        full = lambda: F.scaled_dot_product_attention(qg, k_full, v_full)  # noqa: E731
        t_full = bench(full)
        g_full = graphed(full) if dev.type == "cuda" else None
        tg_full = bench(g_full) if g_full else None
        del g_full
        t_anchor, anchor_setting = best_anchor(q, k_full, v_full, bench)
        full_bytes = 2 * k_full.numel() * k_full.element_size()
        t_best_full = min(t for t in (tg_full or t_full, t_anchor) if t)  # the faster full-cache path (GPU time)
        k_full = v_full = None  # free them before the compressed runs (the closure above reads these names)
        for budget in budgets:
            layer, ratio = calibrated_layer(B, T, budget, dev)
            scaling = D ** -0.5
            step = lambda: fused(q, layer, scaling)  # noqa: E731
            t_tz = bench(step)
            g_tz = graphed(step) if dev.type == "cuda" else None
            tg_tz = bench(g_tz) if g_tz else None
            del g_tz
            layout.set_rope_table(layer, ROPE.to(dev))  # the same layer with pre-RoPE keys (graph time on a GPU)
            g_rope = graphed(step) if dev.type == "cuda" else None
            tg_rope = bench(g_rope) if g_rope else bench(step)
            del g_rope
            layout.set_rope_table(layer, None)
            t_deq = None
            if not a.no_deq:
                def deq_sdpa():
                    K, V, _, valid = layer.dequantize()
                    K = torch.cat([K.to(q.dtype), layout.zone_c(layer)[0].reshape(B * H, -1, D)], 1)
                    V = torch.cat([V.to(q.dtype), layout.zone_c(layer)[1].reshape(B * H, -1, D)], 1)
                    ok = torch.cat([valid, valid.new_ones(B * H, FRESH)], 1)[:, None, None, :]
                    return F.scaled_dot_product_attention(q.view(B * H, G, 1, D).transpose(1, 2), K[:, None], V[:, None],
                                                          attn_mask=ok)
                t_deq = bench(deq_sdpa)
            read = layer.nbytes + q.numel() * q.element_size()
            t_k = tg_tz or t_tz  # GPU time of the step (graph replay) when available
            bw = read / t_k
            rows.append(dict(context=T, batch=B, budget=budget, bytes_ratio=ratio, kept=float(layer.kept.float().mean() / T),
                             trizone_us=t_tz * 1e6, sdpa_full_us=t_full * 1e6, deq_sdpa_us=t_deq * 1e6 if t_deq else None,
                             trizone_graph_us=tg_tz * 1e6 if tg_tz else None,
                             rope_us=tg_rope * 1e6,
                             sdpa_full_graph_us=tg_full * 1e6 if tg_full else None,
                             flash_full_us=t_anchor * 1e6 if t_anchor else None, flash_setting=anchor_setting,
                             flash_full_bw_GBps=full_bytes / t_anchor / 1e9 if t_anchor else None,
                             speedup_vs_best_full=t_best_full / t_k,
                             speedup_vs_full=t_full / t_tz, speedup_vs_deq=(t_deq / t_tz) if t_deq else None,
                             speedup_graph=(tg_full / tg_tz) if tg_tz and tg_full else None,
                             bytes_read=read, bw_GBps=bw / 1e9, full_bw_GBps=full_bytes / t_full / 1e9,
                             frac_peak=bw / nominal if nominal else None, frac_copy=bw / copy_bw if copy_bw else None))
            r = rows[-1]
            print(f"ctx {T:>6} B {B} budget {budget:>5.3f} (bytes {ratio:.3f}, kept {r['kept']:.3f}): trizone "
                  f"{r['trizone_us']:9.1f} us  full {r['sdpa_full_us']:9.1f} us  x{r['speedup_vs_full']:.2f}"
                  + (f"  deq {r['deq_sdpa_us']:9.1f} us" if t_deq else "")
                  + (f"  graph {r['trizone_graph_us']:.1f} vs {r['sdpa_full_graph_us']:.1f} us" if tg_tz and tg_full else "")
                  + (f"  flash-full {r['flash_full_us']:.1f} us" if t_anchor else "")
                  + f"  x{r['speedup_vs_best_full']:.2f} vs best full"
                  + f"  pre-RoPE {r['rope_us']:.1f} us"
                  + f"  {r['bw_GBps']:.0f} GB/s", flush=True)
            layer = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    lines = [f"# TriZone decode benchmark ({name}, {'fused Triton kernel' if dev.type == 'cuda' else 'torch reference'})", "",
             f"One layer, {H} KV heads x {G} query heads/KV head, head_dim {D}, L=1, zone C {FRESH} tokens, "
             f"PackSpec(v_group={SPEC.v_group}, k_group={SPEC.k_group}, k_block={SPEC.k_block}).",
             f"Peak bandwidth: nominal {nominal / 1e9:.0f} GB/s, measured copy {copy_bw / 1e9:.0f} GB/s." if nominal and copy_bw
             else (f"Measured copy bandwidth {copy_bw / 1e9:.0f} GB/s (device not in the nominal table)." if copy_bw else ""),
             f"TriZone = the kernel ({setting}); "
             "pre-RoPE = the same layer with pre-RoPE keys, rotated at decode (graph time on a GPU). "
             "Eager times include Python launch overhead; graph times replay the step in a CUDA graph (GPU time). "
             "GB/s = bytes the TriZone step reads / its graph time (eager time if no graph). flash-full = the split-K "
             "anchor over the full cache (graph time, fastest setting of ANCHOR_SETTINGS; its GB/s = full-cache bytes / "
             "time); x best = best full-cache time (SDPA graph or flash-full) / TriZone graph time.",
             "", "| context | batch | budget | bytes/fp16 | kept | TriZone us | SDPA full us | x vs full | TriZone graph us | "
             "SDPA graph us | x graph | flash-full us | flash-full GB/s | x best | pre-RoPE us | deq+SDPA us | x vs deq | "
             "GB/s read | of peak | of copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda x, fmt: (fmt.format(x) if x is not None else "-")  # noqa: E731
        lines.append(f"| {r['context']} | {r['batch']} | {r['budget']:.3f} | {r['bytes_ratio']:.3f} | {r['kept']:.3f} | "
                     f"{r['trizone_us']:.1f} | {r['sdpa_full_us']:.1f} | {r['speedup_vs_full']:.2f} | "
                     f"{f(r['trizone_graph_us'], '{:.1f}')} | {f(r['sdpa_full_graph_us'], '{:.1f}')} | "
                     f"{f(r['speedup_graph'], '{:.2f}')} | {f(r['flash_full_us'], '{:.1f}')} | "
                     f"{f(r['flash_full_bw_GBps'], '{:.0f}')} | {r['speedup_vs_best_full']:.2f} | {r['rope_us']:.1f} | "
                     f"{f(r['deq_sdpa_us'], '{:.1f}')} | "
                     f"{f(r['speedup_vs_deq'], '{:.2f}')} | {r['bw_GBps']:.0f} | "
                     f"{f(r['frac_peak'], '{:.0%}')} | {f(r['frac_copy'], '{:.0%}')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    save_outputs(a.out, "bench_decode", text, dict(device=name, nominal_bw=nominal, copy_bw=copy_bw, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
