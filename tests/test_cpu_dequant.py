"""The C products of the CPU decode path (kernels/cpu_dequant.c): how the library is built, its launchers'
checks, that its results do not depend on the thread count and that the path calls it. That it computes what
the torch path and the oracle compute is tested in test_cpu_decode.py, which runs its grid both ways."""
import hashlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kernel_decode import build

from rdkv import cpu_decode, layout
from rdkv.errors import RDKVError
from rdkv.kernels import cpu_dequant

needs_cc = pytest.mark.skipif(cpu_dequant.library() is None, reason="no C compiler builds kernels/cpu_dequant.c here")


@needs_cc
def test_built_once_into_the_cache_directory_then_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("RDKV_CACHE_DIR", raising=False)
    assert cpu_dequant.library.__wrapped__() is not None
    built = list((tmp_path / "rdkv").glob("cpu_dequant-*.so"))
    assert len(built) == 1 and not list((tmp_path / "rdkv").glob(".build-*"))  # no temporary left behind
    stamp = built[0].stat().st_mtime_ns

    def compile_again(*args, **kwargs):
        raise AssertionError("a second load compiled again")

    monkeypatch.setattr(cpu_dequant, "_compile", compile_again)
    assert cpu_dequant.library.__wrapped__() is not None and built[0].stat().st_mtime_ns == stamp


def test_no_compiler_gives_a_warning_and_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="dequantizes in torch"):
        assert cpu_dequant.library.__wrapped__() is None
    assert not list((tmp_path / "c").glob("*.so"))


PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
"""


def _built(tmp_path) -> Path:
    (so,) = (tmp_path / "c").glob("cpu_dequant-*.so")
    return so


@needs_cc
@pytest.mark.parametrize("attack", ["group-writable", "another user's", "truncated", "zero bytes", "replaced"])
def test_a_planted_or_damaged_library_is_rebuilt_never_loaded(monkeypatch, tmp_path, attack):
    """A library in the cache directory is loaded only if it is the current user's, writable by nobody else and the
    file its build recorded; anything else is rebuilt in its place, and a planted library's constructor never runs."""
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path / "c"))
    # built by another process, as in use: this one must not have the library mapped while the test rewrites it
    subprocess.run([sys.executable, "-c", "from rdkv.kernels import cpu_dequant; assert cpu_dequant.library()"],
                   check=True)
    so = _built(tmp_path)
    good = so.read_bytes()
    so.unlink()  # each attack writes a new file under the name
    marker = tmp_path / "constructor-ran"
    (tmp_path / "plant.c").write_text(PLANT % marker)
    subprocess.run(["cc", "-shared", "-fPIC", str(tmp_path / "plant.c"), "-o", str(tmp_path / "plant.so")], check=True)
    if attack in ("group-writable", "another user's", "replaced"):
        so.write_bytes((tmp_path / "plant.so").read_bytes())
        so.chmod(0o700)
    if attack == "group-writable":
        so.chmod(0o777)
        (so.with_suffix(".sha256")).write_text(hashlib.sha256(so.read_bytes()).hexdigest())
    elif attack == "another user's":
        if os.getuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.chown(so, 4242, 4242)
        (so.with_suffix(".sha256")).write_text(hashlib.sha256(so.read_bytes()).hexdigest())
    elif attack == "truncated":
        so.write_bytes(good[: len(good) // 2])
    elif attack == "zero bytes":
        so.write_bytes(b"")
    assert cpu_dequant.library.__wrapped__() is not None
    assert not marker.exists(), "the planted library was loaded"
    assert so.read_bytes() == good and so.stat().st_uid == os.getuid() and so.stat().st_mode & 0o777 == 0o700


@needs_cc
def test_cache_directory_and_library_are_private_whatever_the_umask(monkeypatch, tmp_path):
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path / "c"))
    old = os.umask(0)
    try:
        assert cpu_dequant.library.__wrapped__() is not None
    finally:
        os.umask(old)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    assert _built(tmp_path).stat().st_mode & 0o777 == 0o700
    (tmp_path / "c").chmod(0o777)  # made world-writable since: made private again before use
    assert cpu_dequant.library.__wrapped__() is not None and (tmp_path / "c").stat().st_mode & 0o777 == 0o700


def test_a_cache_directory_of_another_user_is_not_used(monkeypatch, tmp_path):
    if os.getuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    (tmp_path / "c").mkdir()
    os.chown(tmp_path / "c", 4242, 4242)
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path / "c"))
    with pytest.warns(RuntimeWarning, match="belongs to another user"):
        assert cpu_dequant.library.__wrapped__() is None
    assert not list((tmp_path / "c").iterdir())


def test_a_hanging_compiler_falls_back_in_time_once(monkeypatch, tmp_path):
    """A compiler that never returns (with a child of its own) is killed at the build's deadline; the failure is
    remembered, so the next process falls back at once, and the warning says how to retry."""
    cc = tmp_path / "hang"
    cc.write_text("#!/bin/sh\nsleep 1000 &\nsleep 1000\n")
    cc.chmod(0o755)
    monkeypatch.setenv("RDKV_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(cpu_dequant, "BUILD_SECONDS", 2.0)
    t = time.monotonic()
    with pytest.warns(RuntimeWarning, match="stopped after 2 s.*delete .*failed to retry"):
        assert cpu_dequant.library.__wrapped__() is None
    assert time.monotonic() - t < 10
    t = time.monotonic()
    with pytest.warns(RuntimeWarning, match="failed before.*delete .*to retry"):
        assert cpu_dequant.library.__wrapped__() is None
    assert time.monotonic() - t < 1
    (failed,) = (tmp_path / "c").glob("*.failed")
    failed.unlink()
    cc.write_text("#!/bin/sh\nexit 1\n")
    with pytest.warns(RuntimeWarning, match="no C compiler built"):  # retried once the memo is gone
        assert cpu_dequant.library.__wrapped__() is None


@needs_cc
def test_launchers_reject_what_does_not_fit():
    layer = build(seed=1, B=1, H=2, T=200, D=64, n_c=0)
    seg = cpu_decode._page_segment(layer)
    N = int(layout.counts(layer).long().sum(1).max())
    out, p, q = torch.zeros(2, 3, 64), torch.rand(2, 3, N), torch.rand(2, 3, 64)
    cpu_dequant.page_attend(out, p, seg)
    for bad in (p[..., :-1], p.transpose(0, 1).contiguous().transpose(0, 1), p.double()):
        with pytest.raises(RDKVError, match="page_attend: p must be float32"):
            cpu_dequant.page_attend(out, bad, seg)
    with pytest.raises(RDKVError, match="out: expected a contiguous CPU tensor"):
        cpu_dequant.page_attend(out.half(), p, seg)
    pos = torch.zeros(2, N, dtype=torch.long)
    cpu_dequant.page_scores(torch.zeros(2, 3, N), seg, q, pos)
    with pytest.raises(RDKVError, match=f"page_scores: out has {N - 1} columns, a stream holds {N} tokens"):
        cpu_dequant.page_scores(torch.zeros(2, 3, N - 1), seg, q)
    with pytest.raises(RDKVError, match="q: expected a contiguous CPU tensor"):
        cpu_dequant.page_scores(torch.zeros(2, 3, N), seg, q.half())
    with pytest.raises(RDKVError, match="positions: expected"):
        cpu_dequant.page_scores(torch.zeros(2, 3, N), seg, q, pos.int())
    cpu_dequant.page_keys(torch.empty(2, 64, N), pos, seg)
    with pytest.raises(RDKVError, match=f"page_keys: out has {N - 1} columns"):
        cpu_dequant.page_keys(torch.empty(2, 64, N - 1), pos[:, 1:].contiguous(), seg)
    with pytest.raises(RDKVError, match="table: expected a contiguous int64 array"):
        cpu_dequant.page_attend(out, p, seg._replace(table=seg.table.astype(np.int32)))
    with pytest.raises(RDKVError, match="channel means"):
        cpu_dequant.page_attend(out, p, seg._replace(k_mean=seg.k_mean.float()))


@needs_cc
def test_the_result_does_not_depend_on_the_thread_count():
    """The C functions split their work over torch's thread count (what rdkv.contention sets for a pass, so it
    changes with the load on the machine), but every float is summed in one order: one thread and several give
    the same floats, as do two runs."""
    layer = build(seed=2, B=2, H=2, T=3000, D=128, n_c=0)
    q = torch.randn(2, 8, 1, 128, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.trizone_attention(q, layer, 128 ** -0.5)
        torch.set_num_threads(max(2, os.cpu_count() or 1))
        many = cpu_decode.trizone_attention(q, layer, 128 ** -0.5)
        again = cpu_decode.trizone_attention(q, layer, 128 ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many) and torch.equal(many, again)


@needs_cc
def test_the_cpu_path_scores_and_attends_in_c_where_it_builds(monkeypatch):
    calls = []
    for name in ("page_scores", "page_attend", "page_keys"):
        fn = getattr(cpu_dequant, name)
        monkeypatch.setattr(cpu_dequant, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    layer = build(seed=3, B=1, H=2, T=300, D=64, n_c=2)
    cpu_decode.trizone_attention(torch.randn(1, 4, 1, 64), layer, 0.125)
    assert calls == ["page_scores", "page_attend"]


SANITIZED = ["tests/test_untrusted_file.py", "tests/test_cpu_dequant.py::test_launchers_reject_what_does_not_fit",
             "tests/test_cpu_dequant.py::test_the_result_does_not_depend_on_the_thread_count"] + [
    f"tests/test_cpu_decode.py::{name}[C]" for name in (
        "test_every_mix_of_width_classes_and_unsorted_k_blocks", "test_ragged_and_empty_streams",
        "test_sliding_windows_masks_and_softcap", "test_folds_and_other_pack_specs")]
OVERFLOW = """
import ctypes, numpy as np, os, torch
from rdkv import pages
from rdkv.kernels import cpu_dequant
from rdkv.layout import PackSpec
lib = cpu_dequant.bind(ctypes.CDLL(os.environ["RDKV_TEST_C_LIBRARY"]))
spec = PackSpec(v_group=32, k_group=64, k_block=16)
t = pages.pack(torch.randn(1, 32, 64), torch.randn(1, 32, 64), 0, torch.full((1, 32), 4), torch.full((1, 4), 4),
               torch.arange(64).expand(1, 64), spec, torch.float16, page=16)
table = cpu_dequant.page_table(pages.plan(t, spec, 64, 32, 16))
buf = t["pages"].numpy()[:-16].copy()  # the last page's last positions cut off
q, out, pos = np.zeros((1, 1, 64), np.float32), np.zeros((1, 1, 32), np.float32), np.zeros((1, 32), np.int64)
lib.rdkv_page_scores(buf.ctypes.data, table.ctypes.data, None, 0, 1, 16, 64, q.ctypes.data, 1, 32, out.ctypes.data,
                     2, pos.ctypes.data, 1)
"""


def test_the_c_products_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """cpu_dequant.c built with AddressSanitizer and UndefinedBehaviorSanitizer runs the crafted and fuzzed cache
    files and the C path's oracle grid without a report; a deliberate read past a buffer shows the sanitizer is
    live. Skipped where the compiler or its runtimes lack them."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    so = tmp_path / "sanitized.so"
    flags = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
             "-fopenmp", "-shared", "-fPIC"]
    try:
        built = subprocess.run([*cc, *flags, str(cpu_dequant.SOURCE), "-o", str(so)], capture_output=True, timeout=120)
        runtimes = [subprocess.run([*cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
                    for name in ("libasan.so", "libubsan.so")]
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"no C compiler: {e}")
    if built.returncode or not all(os.path.isabs(r) and os.path.exists(r) for r in runtimes):
        pytest.skip(f"{cc[0]} builds no sanitizer runtime here: {built.stderr[-300:]!r}")
    env = {**os.environ, "LD_PRELOAD": ":".join(runtimes), "ASAN_OPTIONS": "detect_leaks=0",
           "UBSAN_OPTIONS": "print_stacktrace=1", "RDKV_TEST_C_LIBRARY": str(so)}
    root = Path(__file__).resolve().parents[1]
    live = subprocess.run([sys.executable, "-c", OVERFLOW], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert live.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in live.stderr, live.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SANITIZED], env=env,
                          cwd=root, capture_output=True, text=True, timeout=900)
    report = done.stdout + done.stderr
    assert done.returncode == 0 and "Sanitizer" not in report and "runtime error" not in report, report[-4000:]
