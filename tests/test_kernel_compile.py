"""The Triton kernels compile for sm_90 without spills or excess shared memory (no GPU needed).

Runs ``scripts/compile_check.py --quick`` (decode: the page kernel at head_dim 64 bf16, 128 fp16 and 256 fp32, with
V groups per width and with pre-RoPE keys at 256, the merge kernel and the full-cache anchor;
compress side: one variant of each of the four quantize / token-weight kernels) in a subprocess, so the real Triton compiler runs even when the kernel tests use the interpreter. The full
matrix (both archs, every dtype / query-row / flag variant) is ``python scripts/compile_check.py``.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia import compiler as nv

        return os.path.exists(nv.get_ptxas(90).path)
    except Exception:
        return False


@pytest.mark.skipif(not _nvidia_backend(), reason="this triton install has no NVIDIA backend / bundled ptxas")
def test_compile_check_quick():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_check.py"), "--quick"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failing" in r.stdout
