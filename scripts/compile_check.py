#!/usr/bin/env python
"""Compile every variant of the Triton kernels (TriZone decode over pages, its merge, the full-cache anchor; compress
side: quantize + pack, token weights) for sm_90 and sm_80 without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` runs the whole pipeline down to
a cubin (decode kernels are compiled as launched: the launcher runs on a small CPU layer with the kernels
replaced by recorders, and Triton's own binder turns the recorded arguments into the specialisation a GPU
launch gets) with the ptxas that ships in the triton wheel (triton/backends/nvidia/bin/ptxas; no CUDA driver
or GPU needed). The script then reads register count, spill bytes and local stack from that cubin
(``ptxas -v`` on the generated PTX, ``cuobjdump --dump-resource-usage`` as a fallback) and the shared
memory from the kernel metadata, prints a table and exits non-zero if any variant spills registers, needs more
registers than an SM holds (65536 per SM: registers x threads of one program) or more shared memory than the device
has (228 KB per SM on sm_90, 164 KB on sm_80).

    python scripts/compile_check.py            # every variant, both archs
    python scripts/compile_check.py --quick    # one variant per head_dim on sm_90 (the CI test)
    python scripts/compile_check.py --family compress   # only kernels/quantize_pack.py and token_weights.py
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)  # compile for real even if a test run set the interpreter

SMEM_LIMIT = {90: 228 * 1024, 80: 164 * 1024}
REGISTER_FILE = 65536  # 32-bit registers per SM, sm_80 and sm_90
PTR_DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}


def variants(quick: bool) -> list[dict]:
    """(head_dim, query dtype, query rows per program, flags) variants the launcher can produce."""
    out = []
    if quick:
        for D, dtype in ((64, "bf16"), (128, "fp16"), (256, "fp32")):
            out.append(dict(D=D, dtype=dtype, GL=4, L=1, flags=(False, False, False), kb=16))
        out.append(dict(D=256, dtype="fp16", GL=4, L=1, flags=(False, False, False), kb=16, vg=(64, 32, 32)))
        out.append(dict(D=256, dtype="fp16", GL=4, L=1, flags=(False, False, False), kb=16, rope=True))
        out.append(dict(D=256, dtype="fp16", GL=64, L=8, flags=(False, False, False), kb=16, kernel="merge"))
        out.append(dict(D=128, dtype="fp16", GL=4, L=1, flags=(False, False, False), kb=16, kernel="flash"))
        return out
    for D, dtype in itertools.product((64, 128, 256), ("fp16", "bf16", "fp32")):  # the full-cache anchor
        out.append(dict(D=D, dtype=dtype, GL=4, L=1, flags=(False, False, False), kb=16, kernel="flash"))
    for D, (GL, L) in itertools.product((64, 128, 256), ((4, 1), (64, 8))):
        out.append(dict(D=D, dtype="fp16", GL=GL, L=L, flags=(False, False, False), kb=16, kernel="merge"))
    for D, dtype, (GL, L) in itertools.product((64, 128, 256), ("fp16", "bf16", "fp32"), ((4, 1), (24, 3), (64, 8))):
        out.append(dict(D=D, dtype=dtype, GL=GL, L=L, flags=(False, False, False), kb=16))
    for D in (64, 128, 256):  # window + mask + softcap together (the heaviest masking path), and k_block 32
        out.append(dict(D=D, dtype="fp16", GL=8, L=1, flags=(True, True, True), kb=16))
        out.append(dict(D=D, dtype="bf16", GL=8, L=1, flags=(False, False, False), kb=32))
        out.append(dict(D=D, dtype="fp16", GL=24, L=3, flags=(False, False, False), kb=16, vg=(64, 32, 16)))  # per width
    for D, dtype, (GL, L) in itertools.product((64, 128, 256), ("fp16", "fp32"), ((4, 1), (64, 8))):
        out.append(dict(D=D, dtype=dtype, GL=GL, L=L, flags=(False, False, False), kb=16, rope=True))  # pre-RoPE keys
    return out


class Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records the call, launches nothing."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def recorded(module, names: tuple[str, ...], call) -> dict:
    """Run ``call()`` with the kernels ``names`` of ``module`` replaced by recorders: name -> [(grid, args, kwargs)]."""
    real = {n: getattr(module, n) for n in names}
    recs = {n: Recorder() for n in names}
    for n in names:
        setattr(module, n, recs[n])
    try:
        call()
    finally:
        for n, fn in real.items():
            setattr(module, n, fn)
    return {n: recs[n].calls for n in names}


def compile_as_launched(fn, args, kwargs, arch: int):
    """Compile ``fn`` for sm_``arch`` with the specialisation Triton's launcher derives from these arguments
    (16-byte-aligned pointers, ints divisible by 16, ints equal to 1 as constants): the code a GPU would run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def decode_call(v: dict):
    """A TriZone decode call of variant ``v`` on CPU tensors (a small random layer with every V and K width)."""
    import torch

    from rdkv.kernels import page_decode
    from rdkv import layout
    from rdkv.layout import PackSpec
    from rdkv.trizone import pack_layer

    D, GL, L = v["D"], v["GL"], v["L"]
    window, mask, softcap = v["flags"]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[v["dtype"]]
    B, H, T = 2, 2, 300
    g = torch.Generator().manual_seed(0)
    spec = PackSpec(v_group=v.get("vg", 32), k_group=128, k_block=v["kb"])
    widths = torch.tensor([0, 2, 4, 8, 16])
    vw = widths[torch.randint(0, 5, (B, H, T), generator=g)]
    kb = widths[torch.randint(0, 5, (B, H, D // v["kb"]), generator=g)].sort(-1).values
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(B * H)]).view(B, H, D)
    k, val = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    layer = pack_layer(k, val, 0, vw, kb, perm, spec, torch.bfloat16 if v["dtype"] == "bf16" else torch.float16,
                       64 if window else None, T)
    layer.update(torch.randn(B, H, L + 2, D, generator=g), torch.randn(B, H, L + 2, D, generator=g))
    if v.get("rope"):
        layout.set_rope_table(layer, torch.cat([10000.0 ** -(torch.arange(0, D, 2) / D), torch.ones(1)]))
    q = torch.randn(B, H * (GL // L), L, D, generator=g).to(dtype)
    bool_mask = torch.ones(B, 1, L, layer.get_seq_length(), dtype=torch.bool) if mask else None
    return lambda: page_decode.page_decode(q, layer, D ** -0.5, None, 30.0 if softcap else None, bool_mask)


def resource_usage(kernel, arch: int) -> dict:
    """Registers, spill bytes and stack of a compiled kernel.

    Re-runs the bundled ptxas on the kernel's PTX with the flags triton itself uses (``-lineinfo
    --regAllocOptLevel=2``, fma fusion on) plus ``-v``, and cross-checks the register count against the
    cubin triton produced (``cuobjdump --dump-resource-usage``).
    """
    from triton.backends.nvidia import compiler as nv

    ptxas = nv.get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        r = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", ptx, "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True)
        cubin = os.path.join(d, "triton.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        dump = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if not regs:
        raise RuntimeError(f"could not read ptxas -v output:\n{log}")
    real = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    if real and int(real.group(1)) != int(regs.group(1)):
        raise RuntimeError(f"ptxas -v says {regs.group(1)} registers, triton's cubin {real.group(1)}: flags drifted")
    return dict(regs=int(regs.group(1)), spill_st=int(spill.group(1)) if spill else 0,
                spill_ld=int(spill.group(2)) if spill else 0, stack=int(stack.group(1)) if stack else 0)


def flash_call(v: dict):
    """A full-cache anchor call of variant ``v`` at its default launch settings (a 4k-token cache)."""
    import torch

    from rdkv.kernels.flash_decode import flash_decode

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[v["dtype"]]
    q = torch.zeros(1, 8 * (v["GL"] // v["L"]), v["L"], v["D"], dtype=dtype)
    k = torch.zeros(1, 8, 4096, v["D"], dtype=dtype)
    return lambda: flash_decode(q, k, k, v["D"] ** -0.5)


def compile_one(v: dict, arch: int) -> dict:
    """Compile the attention, merge or anchor kernel of a decode variant exactly as its launch would."""
    from rdkv.kernels import flash_decode as fd
    from rdkv.kernels import page_decode as pd

    if v.get("kernel") == "flash":
        m, name = fd, "_flash_decode"
        calls = recorded(fd, (name, "_lse_merge"), flash_call(v))
    else:
        m, name = pd, "_lse_merge" if v.get("kernel") == "merge" else "_page_attn"
        calls = recorded(pd, ("_page_attn", "_lse_merge"), decode_call(v))
    grid, args, kwargs = calls[name][0]
    t0 = time.time()
    k = compile_as_launched(getattr(m, name), args, kwargs, arch)
    return dict(v, arch=arch, block_m=kwargs["BLOCK_M"], block_n=kwargs.get("BLOCK_N", kwargs.get("PT", 0)),
                warps=kwargs["num_warps"],
                smem=k.metadata.shared, secs=time.time() - t0, **resource_usage(k, arch))


# --- compress-side kernels: kernels/quantize_pack.py, kernels/token_weights.py ------------------------
COMPRESS_KERNELS = ("qrows", "qcols", "tw_rows", "tw_cols")


def compress_variants(quick: bool) -> list[dict]:
    """Quantize + pack (bits, group, channels C for the K layout, input dtype) and token-weight
    (head_dim, dtype, query rows G*M per KV head, flags w/m/s) variants the launchers can produce."""
    none = (False, False, False)
    if quick:
        return [dict(kernel="qrows", bits=2, group=128, dtype="fp16"),
                dict(kernel="qcols", bits=2, group=64, C=128, dtype="fp16"),
                dict(kernel="tw_rows", D=128, dtype="fp16", rows=256, flags=none),
                dict(kernel="tw_cols", D=128, dtype="fp16", rows=256, flags=none)]
    out = [dict(kernel="qrows", bits=b, group=g, dtype="fp16") for b, g in itertools.product((2, 4, 8), (32, 64, 128))]
    out += [dict(kernel="qrows", bits=2, group=128, dtype="fp32"), dict(kernel="qrows", bits=2, group=128, dtype="bf16"),
            dict(kernel="qrows", bits=8, group=1024, dtype="fp32")]  # the largest row tile the launcher allows
    out += [dict(kernel="qcols", bits=b, group=g, C=C, dtype="fp16")
            for b, g, C in itertools.product((2, 4, 8), (16, 64), (64, 128, 256))]  # K: a page of channels at a width
    out.append(dict(kernel="qcols", bits=2, group=64, C=128, dtype="fp32"))
    for kern, D in itertools.product(("tw_rows", "tw_cols"), (64, 128, 256)):
        out += [dict(kernel=kern, D=D, dtype="fp16", rows=16, flags=none),  # one 16-row block (e.g. G=1, M=16)
                dict(kernel=kern, D=D, dtype="fp16", rows=256, flags=none),  # 64-row blocks (window 64 x G=4)
                dict(kernel=kern, D=D, dtype="bf16", rows=256, flags=none),
                dict(kernel=kern, D=D, dtype="fp32", rows=256, flags=none),
                dict(kernel=kern, D=D, dtype="fp16", rows=256, flags=(True, True, True))]
    return out


def compile_compress(v: dict, arch: int) -> dict:
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rdkv.kernels import quantize_pack as qp
    from rdkv.kernels import token_weights as tw

    kern, xt = v["kernel"], PTR_DTYPES[v["dtype"]]
    if kern == "qrows":
        bytes_pad, block_r, warps = qp.rows_config(v["group"], v["bits"], 1 << 20)
        fn, stages = qp._quantize_rows, 1
        consts = dict(GROUP=v["group"], BYTES_PAD=bytes_pad, BITS=v["bits"], BLOCK_R=block_r)
        ptrs = dict(x_ptr=xt, out_ptr="*u8", scale_ptr="*fp16", zero_ptr="*fp16")
        tile = f"BR{block_r} BY{bytes_pad}"
    elif kern == "qcols":
        block_r, block_b, warps = qp.cols_config(v["group"], v["bits"], v["C"])
        fn, stages = qp._quantize_cols, 1
        consts = dict(BITS=v["bits"], BLOCK_R=block_r, BLOCK_B=block_b)
        ptrs = dict(x_ptr=xt, out_ptr="*u8", scale_ptr="*fp16", zero_ptr="*fp16", gstart_ptr="*i64", glen_ptr="*i32")
        tile = f"BR{block_r} BB{block_b}"
    else:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[v["dtype"]]
        D = v["D"]
        block_m, block_n, warps = tw.launch_config(D, v["rows"], dtype)
        window, mask, softcap = v["flags"]
        fn, stages = (tw._tw_rows if kern == "tw_rows" else tw._tw_cols), 1
        consts = dict(D=D, D_PAD=max(16, tw._pow2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
                      DOT={"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[v["dtype"]],
                      PREC="ieee" if v["dtype"] == "fp32" else "tf32", HAS_WINDOW=window, HAS_MASK=mask, SOFTCAP=softcap)
        ptrs = dict(q_ptr=xt, k_ptr=xt, qpos_ptr="*i32", kpos_ptr="*i32", mask_ptr="*u8", mrow_ptr="*fp32",
                    lrow_ptr="*fp32", q2_ptr="*fp32", mass_ptr="*fp32", mass2_ptr="*fp32", scaling="fp32", softcap="fp32")
        tile = f"BM{block_m} BN{block_n}"
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): c for k, c in consts.items()})
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    secs = time.time() - t0
    return dict(v, arch=arch, tile=tile, warps=warps, smem=k.metadata.shared, secs=secs, **resource_usage(k, arch))


def compress_shape(v: dict) -> str:
    if v["kernel"] in ("qrows", "qcols"):
        return f"b{v['bits']} g{v['group']}" + (f" C{v['C']}" if v["kernel"] == "qcols" else "")
    return f"D{v['D']} rows{v['rows']}"


def _job(args):
    v, arch = args
    try:
        return compile_compress(v, arch) if v.get("kernel") in COMPRESS_KERNELS else compile_one(v, arch)
    except Exception as e:  # report every failure in the table, then fail
        return dict(v, arch=arch, error=f"{type(e).__name__}: {e}".splitlines()[0][:200])


def problems_of(r: dict) -> list[str]:
    problems = []
    if r["spill_st"] or r["spill_ld"]:
        problems.append("spills")
    if r["smem"] > SMEM_LIMIT[r["arch"]]:
        problems.append(f"smem > {SMEM_LIMIT[r['arch']] // 1024} KB")
    if r["regs"] * 32 * r["warps"] > REGISTER_FILE:  # one program would not fit an SM: the launch fails
        problems.append(f"{r['regs']} regs x {32 * r['warps']} threads > {REGISTER_FILE}")
    return problems


def report_line(lead: str, r: dict, launch) -> bool:
    """Print one variant's row (``launch()`` formats its launch columns); True if it fails."""
    if "error" in r:
        print(f"{lead}  FAIL {r['error']}")
        return True
    problems = problems_of(r)
    print(f"{lead} {launch()} {r['regs']:>4} {r['spill_st']:>3}/{r['spill_ld']:<3} {r['stack']:>5} "
          f"{r['smem'] / 1024:>7.1f} {r['secs']:>5.1f}  {'; '.join(problems) or 'ok'}")
    return bool(problems)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one fp16 variant per head_dim, sm_90 only")
    ap.add_argument("--arch", type=int, action="append", help="80 and/or 90 (default both; --quick: 90)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", help="comma-separated filters key=value on variants, e.g. dtype=fp32,D=256")
    ap.add_argument("--family", choices=("all", "decode", "compress"), default="all",
                    help="decode: kernels/page_decode.py, lse_merge.py and flash_decode.py; compress: kernels/quantize_pack.py and token_weights.py")
    a = ap.parse_args(argv)
    archs = a.arch or ([90] if a.quick else [90, 80])
    want = dict(kv.split("=") for kv in a.only.split(",")) if a.only else {}
    pool = (variants(a.quick) if a.family != "compress" else []) + (compress_variants(a.quick) if a.family != "decode" else [])
    jobs = [(v, arch) for arch in archs for v in pool
            if all(str(v.get(k, "attn" if k == "kernel" else None)) == x for k, x in want.items())]
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(_job, jobs))
    else:
        rows = [_job(j) for j in jobs]
    bad = 0
    head = f"{'kernel':>9} {'arch':>5} {'D':>4} {'dtype':>5} {'G*L':>4} {'L':>2} {'kb':>3} {'flags':>5} {'BM':>3} {'BN':>3} {'warps':>5} " \
           f"{'regs':>4} {'spill':>7} {'stack':>5} {'smem KB':>7} {'secs':>5}  status"
    decode_rows = [r for r in rows if r.get("kernel") not in COMPRESS_KERNELS]
    compress_rows = [r for r in rows if r.get("kernel") in COMPRESS_KERNELS]
    if decode_rows:
        print(head)
    for r in decode_rows:
        flags = "".join(c if f else "-" for c, f in zip("wms", r["flags"]))
        name = (r.get("kernel") or "attn") + ("+rope" if r.get("rope") else "")
        lead = f"{name:>9} sm_{r['arch']:<2} {r['D']:>4} {r['dtype']:>5} {r['GL']:>4} {r['L']:>2} {r['kb']:>3} {flags:>5}"
        bad += report_line(lead, r, lambda: f"{r['block_m']:>3} {r['block_n']:>3} {r['warps']:>5}")
    if compress_rows:
        if decode_rows:
            print()
        print(f"{'kernel':>7} {'arch':>5} {'dtype':>5} {'shape':>14} {'flags':>5} {'tile':>10} {'warps':>5} {'regs':>4} "
              f"{'spill':>7} {'stack':>5} {'smem KB':>7} {'secs':>5}  status")
    for r in compress_rows:
        flags = "".join(c if f else "-" for c, f in zip("wms", r.get("flags", (False,) * 3)))
        lead = f"{r['kernel']:>7} sm_{r['arch']:<2} {r['dtype']:>5} {compress_shape(r):>14} {flags:>5}"
        bad += report_line(lead, r, lambda: f"{r['tile']:>10} {r['warps']:>5}")
    print(f"{len(rows)} variants, {bad} failing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
