#!/usr/bin/env python
"""A bandwidth model of the decode kernels, from the code the GPU would run, built on a machine without one.

For each kernel (the page kernel ``rdkv.kernels.page_decode`` at batch 1 and 8, 10% and 25%, and the full-cache
anchor ``rdkv.kernels.flash_decode`` at each of ``bench_decode.ANCHOR_SETTINGS``):

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
   pipelined loop keeps ``num_stages - 1`` tiles of K and V in flight; a page's loads are independent (every
   address follows from the page's base), so the page kernel has a whole page in flight. Achievable bandwidth =
   min(ceiling, SMs x in-flight bytes per SM / latency), with the H200's 132 SMs, ``LATENCY_NS`` loaded DRAM
   latency (an assumption, stated in the output) and the copy bandwidth measured on the H200 as ceiling.
5. **Issue rate.** Hiding latency is not enough if the SMs cannot issue the instructions that many bytes
   take. From the SASS (``nvdisasm`` on the cubin) the script counts the instructions of every loop body and
   weights each by how often a step runs it: each V class's page loop by its pages, the anchor's tile loop by its
   tiles. Warp-instructions per step = sum x warps; the issue ceiling = bytes / (warp-instructions / (SMs x 4
   schedulers x ``CLOCK_GHZ``)). Predicted bandwidth = min(copy ceiling, Little's law, issue ceiling), for the page
   kernel scaled by the share of program slots the launch keeps busy (``page_decode.makespan`` over the work
   items the launcher would cut on the GPU).

The kernel over the packed layout that pages replaced was predicted here at 388 GB/s and measured at 398 GB/s on
the H200 (docs/kernels.md): the one check of the model against a GPU so far.

    python scripts/bandwidth_model.py              # pages and anchor at 128k
    python scripts/bandwidth_model.py --out docs/results   # also write bandwidth_model.md
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
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
CLOCK_GHZ = 1.98  # H200 SXM boost clock; one warp-instruction per scheduler per cycle, four schedulers per SM
SMEM_PER_SM = 228 * 1024


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


def sass_loops(kernel) -> tuple[int, list[tuple[int, int]]]:
    """(instructions, loops) of the kernel's SASS: each loop an (first, last) instruction index pair, closed
    by a backward branch, sorted by position (an outer loop before the loops it contains). The branch to
    itself that ends every kernel after ``EXIT`` is not a loop."""
    from triton.backends.nvidia import compiler as nv

    nvdisasm = os.path.join(os.path.dirname(nv.get_ptxas(90).path), "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    n, labels, branches = 0, {}, []
    for ln in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", ln):
            labels[m.group(1)] = n
        elif re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", ln):
            if m := re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", ln):
                branches.append((m.group(1), n))
            n += 1
    return n, sorted((labels[t], i) for t, i in branches if labels.get(t, n) < i)


def issue_gbps(nbytes: float, warp_instructions: float) -> float:
    return nbytes / (warp_instructions / (SMS * 4 * CLOCK_GHZ))  # bytes per ns = GB/s


def programs_per_sm(regs: int, warps: int, smem: int) -> int:
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = SMEM_PER_SM // (smem + 1024) if smem else 32
    return max(0, min(by_regs, by_smem, 64 // warps, 32))


def model_row(name: str, kernel, warps: int, inflight: float, detail: str, issue: tuple[float, float]) -> dict:
    """``issue``: (SASS instructions per thread per tile, issue ceiling in GB/s)."""
    ru = resource_usage(kernel, 90)
    loads = loop_loads(kernel.asm["ptx"])
    n = sum(loads.values())
    share16 = loads.get(16, 0) / n if n else 0.0
    progs = programs_per_sm(ru["regs"], warps, kernel.metadata.shared)
    per_sm = progs * inflight
    little = SMS * per_sm / LATENCY_NS  # bytes / ns = GB/s
    gbps = min(COPY_GBPS, little, issue[1])
    widths = ", ".join(f"{k} B x{v}" for k, v in sorted(loads.items(), reverse=True))
    return dict(name=name, regs=ru["regs"], spill=ru["spill_st"] + ru["spill_ld"], smem=kernel.metadata.shared,
                warps=warps, progs=progs, loads=widths, share16=share16, inflight=inflight, per_sm=per_sm,
                little=little, sass_tile=issue[0], issue=issue[1], gbps=gbps, detail=detail)


def paged_layer(B: int, T: int, budget: float):
    """bench_decode's allocation in pages at the budget (the kept fraction calibrated as ``calibrated_layer`` does),
    sized but not packed: compiling a launch reads no data, so any context fits in this machine's memory."""
    from rdkv import layout, pages
    from rdkv.trizone import TriZoneLayer

    S, fp16, keep = B * bd.H, 2 * B * bd.H * T * bd.D * 2, budget / 0.45
    for _ in range(2):
        vw, kb, perm = bd.synth_allocation(B, T, min(1.0, keep))
        t = pages.sized(vw.view(S, T), kb.view(S, -1), perm.view(S, bd.D), bd.SPEC, T)
        layer = TriZoneLayer(t, batch=B, heads=bd.H, head_dim=bd.D, start=0, prefix_len=T, spec=bd.SPEC,
                             sliding_window=None, dtype16=torch.float16)
        layout.set_zone_c(layer, *(torch.zeros(B, bd.H, bd.FRESH, bd.D, dtype=torch.float16),) * 2)
        ratio = (layer.nbytes - 2 * B * bd.H * bd.FRESH * bd.D * 2) / fp16
        keep *= budget / ratio
    return layer, ratio


def page_row(B: int, T: int, budget: float) -> dict:
    """The page kernel (rdkv.kernels.page_decode) at its default launch. A page's loads have no dependence on one
    another, so a program has one page in flight; each V class runs its own page loop, weighted by its pages."""
    from rdkv import pages
    from rdkv.kernels import page_decode as pk

    layer, ratio = paged_layer(B, T, budget)
    q = torch.randn(B, bd.H * bd.G, 1, bd.D, dtype=torch.float16)
    cfg = pk.page_launch_config(bd.D, pk.block_m_for(bd.G), torch.float16, None)
    plan = pages.segment_plan(layer)
    # the work items a launch on the GPU would cut (the launcher counts this machine's program slots as 4)
    split = pk.choose_pages(plan.page0[:, 4].tolist(), SMS * pk.programs_per_sm(cfg))
    calls = recorded(pk, ("_page_attn", "_lse_merge"),
                     lambda: pk.page_decode(q, layer, bd.D ** -0.5, launch=pk.LaunchConfig(split=split * plan.page)))
    grid, args, kwargs = calls["_page_attn"][0]
    kernel = compile_as_launched(pk._page_attn, args, kwargs, 90)
    _, loops = sass_loops(kernel)
    outer = [(a, e) for a, e in loops if not any(c < a and e < f for c, f in loops)]
    if len(outer) != 5:  # the page loops of V classes 2, 4, 8, 16 in source order, then zone C's
        raise RuntimeError(f"expected 5 outermost loops (4 page loops + zone C) in the SASS, found {outer}")
    body = torch.tensor([float(e - a + 1) for a, e in outer[:4]], dtype=torch.float64)
    class_pages = plan.pages.sum(0).double()
    per_thread = float(class_pages @ body)
    warps = kwargs["num_warps"]
    issue = (per_thread / float(class_pages.sum()), issue_gbps(layer.nbytes, per_thread * warps))
    page_bytes = plan.total / float(class_pages.sum())
    row = model_row(f"page kernel, batch {B}, {T // 1024}k, {budget:.0%} (bytes {ratio:.3f})", kernel, warps, page_bytes,
                    f"{page_bytes / 1024:.1f} KB per {plan.page}-token page, all in flight; SASS per page, V classes "
                    f"2/4/8/16: {'/'.join(f'{x:.0f}' for x in body.tolist())}", issue)
    # the SMs stream pages only while every program slot is busy: the schedule's share of busy slots
    slots = SMS * row["progs"]
    npg = plan.page0[:, 4].tolist()
    fill = sum(npg) / (slots * pk.makespan(npg, split, slots))
    row.update(batch=B, budget=budget, ratio=ratio, fill=fill, gbps=row["gbps"] * fill,
               detail=row["detail"] + f"; {grid[0]} programs of {split} pages on {slots} slots: {fill:.0%} busy")
    return row


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
        _, loops = sass_loops(kernel)
        body = max(e - a + 1 for a, e in loops)  # the tile loop (the merge kernel is compiled apart)
        tiles = B * bd.H * -(-T // setting["block_n"])
        issue = (float(body), issue_gbps(2 * B * bd.H * T * bd.D * 2, tiles * body * setting["num_warps"]))
        rows.append(model_row(f"anchor {setting}", kernel, setting["num_warps"], tile * max(1, stages - 1),
                              f"{tile // 1024} KB K+V tile x {max(1, stages - 1)} ahead", issue))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=131072,
                    help="context of the page kernel's rows (batch 1 and 8, budgets 10%% and 25%%) and of the anchor")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    T = a.context
    paged = [page_row(B, T, budget) for B in (1, 8) for budget in (0.10, 0.25)]
    anchors = anchor_rows(8, T)
    rows = paged + anchors
    lines = [f"# Bandwidth model (sm_90, {SMS} SMs, loaded latency {LATENCY_NS:.0f} ns assumed, ceiling = measured "
             f"copy {COPY_GBPS:.0f} GB/s of nominal {NOMINAL_GBPS:.0f})", "",
             f"Issue ceiling at {CLOCK_GHZ} GHz, 4 warp-instructions per cycle per SM; predicted = min(copy, Little, issue).",
             "",
             "| kernel | regs | spill B | smem KB | warps | programs/SM | loads in loops (bytes/thread x count) | "
             "16-B share | in flight / program | in flight / SM | Little GB/s | SASS / tile / thread | issue GB/s | "
             "predicted GB/s | of nominal | phase |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['regs']} | {r['spill']} | {r['smem'] / 1024:.0f} | {r['warps']} | {r['progs']} | "
                     f"{r['loads']} | {r['share16']:.0%} | {r['inflight'] / 1024:.1f} KB | {r['per_sm'] / 1024:.1f} KB | "
                     f"{r['little']:.0f} | {r['sass_tile']:.0f} | {r['issue']:.0f} | "
                     f"{r['gbps']:.0f} | {r['gbps'] / NOMINAL_GBPS:.0%} | {r['detail']} |")
    head = next(r for r in paged if r["batch"] == 8 and r["budget"] == 0.10)
    anchor = max(anchors, key=lambda r: r["gbps"])
    # step time ratio: the anchor reads the fp16 cache, the page kernel its compressed bytes
    speed = head["gbps"] / anchor["gbps"] / head["ratio"]
    lines += ["", f"page kernel, batch 8, {T // 1024}k, 10%: predicted {head['gbps'] / NOMINAL_GBPS:.0%} of HBM peak "
                  f"(latency {head['little']:.0f} GB/s, issue {head['issue']:.0f} GB/s, {head['fill']:.0%} of program "
                  f"slots busy), anchor {anchor['gbps'] / NOMINAL_GBPS:.0%}: {speed:.1f}x the anchor's step"]
    text = "\n".join(lines) + "\n"
    print(text)
    save_outputs(a.out, "bandwidth_model", text, dict(rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
