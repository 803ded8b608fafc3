#!/usr/bin/env python
"""A bandwidth model of the decode kernels, from the code the GPU would run, built on a machine without one.

For each kernel (the TriZone kernel at its default launch settings, and the full-cache anchor
``rdkv.kernels.flash_decode`` at each of ``bench_decode.ANCHOR_SETTINGS``):

1. **Compile exactly what a launch compiles.** The launcher runs on CPU tensors of the benchmark's shape with
   the kernel replaced by a recorder; the recorded arguments go through Triton's own binder
   (``create_function_from_signature``: 16-byte alignment of pointers, ints divisible by 16, ints equal to 1
   become constants), and ``triton.compile`` builds the same specialisation for ``GPUTarget("cuda", 90, 32)``.
   (Compiling without those hints, as a bare signature does, gives scalar loads and other register counts.)
2. **Read the PTX.** Global loads inside loops (a backward branch closes a loop), by width per thread:
   ``ld.global.v4`` / ``cp.async`` 16 bytes, down to 2-byte scalar loads; the share of 16-byte loads.
3. **Occupancy.** Registers (ptxas -v) and shared memory give programs per SM (65536 registers in
   256-register warp units, 228 KB shared memory with 1 KB reserved per program, 64 warps, 32 programs).
4. **Little's law.** Bytes in flight per SM = programs per SM x bytes each program has in flight. A
   program's loads in flight are those of one *phase*: loads with no dependence on each other. The anchor's
   pipelined loop keeps ``num_stages - 1`` tiles of K and V in flight; the TriZone tile loop walks its K
   channel blocks one after another (each block's address comes from a table load, then its codes feed a
   dot), then loads the V tile, so a phase is about one tile's bytes / (K blocks + 1), and with
   ``num_stages`` > 1 the K-block loops are software-pipelined (cp.async), ``num_stages - 1`` blocks ahead. Achievable bandwidth =
   min(ceiling, SMs x in-flight bytes per SM / latency), with the H200's 132 SMs, ``LATENCY_NS`` loaded DRAM
   latency (an assumption, stated in the output) and the copy bandwidth measured on the H200 as ceiling.

    python scripts/bandwidth_model.py              # TriZone at batch 8, 32k, 10% + the anchor settings
    python scripts/bandwidth_model.py --out docs/results   # also write bandwidth_model.md
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels
import torch  # noqa: E402

import bench_decode as bd  # noqa: E402
from common import save_outputs  # noqa: E402
from compile_check import compile_as_launched, recorded, resource_usage  # noqa: E402

SMS = 132  # H200 (and H100 SXM) streaming multiprocessors
COPY_GBPS = 4104.0  # device-to-device copy measured on the H200 (docs/results/gpu/bench_decode_h200_v1.md)
NOMINAL_GBPS = 4800.0
LATENCY_NS = 600.0  # loaded HBM latency assumed for Little's law
SMEM_PER_SM = 228 * 1024
# TriZone launch settings modelled: the default, and pipelined K-block loops (cp.async) at 4 warps
TRIZONE_SETTINGS = [dict(), dict(num_warps=4, num_stages=2), dict(num_warps=4, num_stages=3), dict(num_warps=4, num_stages=4)]


def loop_loads(ptx: str) -> Counter:
    """Bytes per thread of every global load inside a loop of the PTX -> instruction count."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    label_at = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"(\$L__BB\d+_\d+):", ln))}
    in_loop = [False] * len(lines)
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)
        if m and label_at.get(m.group(1), i + 1) < i:  # a backward branch closes a loop
            for j in range(label_at[m.group(1)], i + 1):
                in_loop[j] = True
    out = Counter()
    for ln, hot in zip(lines, in_loop):
        if not hot:
            continue
        if m := re.search(r"cp\.async\.c[ag]\.shared\.global\S*\s+\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)", ln):
            out[int(m.group(1), 0)] += 1
        elif m := re.search(r"ld\.global\S*?(?:\.v(\d))?\.[bufs](\d+)\s", ln):
            out[int(m.group(1) or 1) * int(m.group(2)) // 8] += 1
    return out


def programs_per_sm(regs: int, warps: int, smem: int) -> int:
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = SMEM_PER_SM // (smem + 1024) if smem else 32
    return max(0, min(by_regs, by_smem, 64 // warps, 32))


def model_row(name: str, kernel, warps: int, inflight: float, detail: str) -> dict:
    ru = resource_usage(kernel, 90)
    loads = loop_loads(kernel.asm["ptx"])
    n = sum(loads.values())
    share16 = loads.get(16, 0) / n if n else 0.0
    progs = programs_per_sm(ru["regs"], warps, kernel.metadata.shared)
    per_sm = progs * inflight
    gbps = min(COPY_GBPS, SMS * per_sm / LATENCY_NS)  # bytes / ns = GB/s
    widths = ", ".join(f"{k} B x{v}" for k, v in sorted(loads.items(), reverse=True))
    return dict(name=name, regs=ru["regs"], spill=ru["spill_st"] + ru["spill_ld"], smem=kernel.metadata.shared,
                warps=warps, progs=progs, loads=widths, share16=share16, inflight=inflight, per_sm=per_sm,
                gbps=gbps, detail=detail)


def trizone_rows(B: int, T: int, budget: float) -> list[dict]:
    from rdkv.kernels import trizone_decode as kmod

    layer, ratio = bd.calibrated_layer(B, T, budget, torch.device("cpu"))
    q = torch.randn(B, bd.H * bd.G, 1, bd.D, dtype=torch.float16)
    block_n = kmod.launch_config(bd.D, kmod.block_m_for(bd.G), torch.float16).block_n  # every setting below keeps it
    tiles = -(-layer.kept // block_n).sum().item()  # tile-loop iterations over all streams (~)
    tile_bytes = layer.nbytes / tiles
    k_blocks = bd.D // layer.spec.k_block
    phase = tile_bytes / (k_blocks + 1)
    rows = []
    for setting in TRIZONE_SETTINGS:
        calls = recorded(kmod, ("_trizone_attn", "_lse_merge"),
                         lambda: kmod.trizone_decode(q, layer, bd.D ** -0.5, launch=kmod.LaunchConfig(**setting)))
        grid, args, kwargs = calls["_trizone_attn"][0]
        assert kwargs["BLOCK_N"] == block_n
        kernel = compile_as_launched(kmod._trizone_attn, args, kwargs, 90)
        ahead = max(1, kwargs["num_stages"] - 1)  # a pipelined K-block loop has this many blocks' loads in flight
        rows.append(model_row(f"TriZone {setting or 'default'}, batch {B}, {T // 1024}k, {budget:.0%} (bytes {ratio:.3f})",
                              kernel, kwargs["num_warps"], phase * ahead,
                              f"{tile_bytes / 1024:.1f} KB per {block_n}-token tile over {k_blocks} K blocks "
                              f"+ V: {phase:.0f} B per phase x {ahead} in flight"))
    # the page layout of docs/kernels.md: the same bytes, a tile's loads independent (one phase), the default's
    # occupancy
    today = rows[0]
    rows.append(dict(today, name="page layout (design: default's bytes and registers, one phase per tile)", loads="-",
                     share16=1.0, inflight=tile_bytes, per_sm=today["progs"] * tile_bytes,
                     gbps=min(COPY_GBPS, SMS * today["progs"] * tile_bytes / LATENCY_NS),
                     detail="a tile's K sections, V codes and metadata loaded at once from one page base"))
    return rows


def anchor_rows(B: int, T: int) -> list[dict]:
    from rdkv.kernels import flash_decode as fd

    q = torch.randn(B, bd.H * bd.G, 1, bd.D, dtype=torch.float16)
    k = torch.empty(B, bd.H, T, bd.D, dtype=torch.float16)
    rows = []
    for setting in bd.ANCHOR_SETTINGS:
        calls = recorded(fd, ("_flash_decode", "_lse_merge"), lambda: fd.flash_decode(q, k, k, bd.D ** -0.5, **setting))
        grid, args, kwargs = calls["_flash_decode"][0]
        kernel = compile_as_launched(fd._flash_decode, args, kwargs, 90)
        tile = 2 * setting["block_n"] * bd.D * 2
        stages = setting["num_stages"]
        rows.append(model_row(f"anchor {setting}", kernel, setting["num_warps"], tile * max(1, stages - 1),
                              f"{tile // 1024} KB K+V tile x {max(1, stages - 1)} ahead"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768,
                    help="per-tile figures do not depend on it; 32k keeps the CPU packing small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = trizone_rows(a.batch, a.context, a.budget) + anchor_rows(a.batch, a.context)
    lines = [f"# Bandwidth model (sm_90, {SMS} SMs, loaded latency {LATENCY_NS:.0f} ns assumed, ceiling = measured "
             f"copy {COPY_GBPS:.0f} GB/s of nominal {NOMINAL_GBPS:.0f})", "",
             "| kernel | regs | spill B | smem KB | warps | programs/SM | loads in loops (bytes/thread x count) | "
             "16-B share | in flight / program | in flight / SM | predicted GB/s | of nominal | phase |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['regs']} | {r['spill']} | {r['smem'] / 1024:.0f} | {r['warps']} | {r['progs']} | "
                     f"{r['loads']} | {r['share16']:.0%} | {r['inflight'] / 1024:.1f} KB | {r['per_sm'] / 1024:.1f} KB | "
                     f"{r['gbps']:.0f} | {r['gbps'] / NOMINAL_GBPS:.0%} | {r['detail']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    save_outputs(a.out, "bandwidth_model", text, dict(rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
