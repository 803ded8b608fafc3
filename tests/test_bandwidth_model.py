"""The bandwidth model's SASS reader finds the loops a compiled kernel runs (no GPU needed).

``scripts/bandwidth_model.py`` weights each outermost loop (a page loop of the page kernel) by how often a step runs
it, so it must tell loops in real SASS from the loops inside them: a kernel with a runtime loop inside another is
compiled for sm_90 in a subprocess (the kernel tests may have set ``TRITON_INTERPRET=1`` in this one) and its loops
are read back.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_kernel_compile import _nvidia_backend

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent('''
    import sys
    sys.path.insert(0, sys.argv[1])
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import bandwidth_model as bm

    @triton.jit
    def nested(x_ptr, out_ptr, n, m):
        acc = 0.0
        for i in range(n):
            for j in range(m):
                acc += tl.load(x_ptr + i * m + j)
            acc = acc * 0.5
        tl.store(out_ptr, acc)

    @triton.jit
    def flat(x_ptr, out_ptr, n):
        tl.store(out_ptr, tl.load(x_ptr + n))

    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    k = triton.compile(ASTSource(nested, signature={**sig, "m": "i32"}, constexprs={}), target=GPUTarget("cuda", 90, 32))
    f = triton.compile(ASTSource(flat, signature=sig, constexprs={}), target=GPUTarget("cuda", 90, 32))
    print(repr((bm.sass_loops(k), bm.sass_loops(f), bm.issue_gbps(1.0, 132 * 4 * 1.98))))
''')


@pytest.mark.skipif(not _nvidia_backend(), reason="this triton install has no NVIDIA backend / bundled ptxas")
def test_sass_loops_of_a_nested_kernel(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(probe), str(ROOT / "scripts")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (n, loops), (n_flat, flat_loops), gbps = eval(r.stdout.strip().splitlines()[-1])
    assert flat_loops == [] and n_flat > 0  # straight-line code: no loop, not even the end-of-kernel branch
    outer = [(a, b) for a, b in loops if any(a < c and e < b for c, e in loops)]
    assert len(outer) == 1  # the i loop; ptxas may split the j loop into an unrolled body and a remainder
    (a, b), = outer
    assert 0 <= a < b < n and len(loops) >= 2 and loops[0] == (a, b)  # sorted: the outer loop before its inner ones
    assert gbps == pytest.approx(1.0)  # 132 SMs x 4 schedulers x 1.98 GHz issue that many warp-instructions in 1 ns
