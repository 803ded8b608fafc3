"""The CPU decode's products over a TriZone segment in pages, in C (``cpu_dequant.c``): the query's scores against
the keys and the probabilities' sum over the values, each read from a page's codes into a buffer the L1 cache holds.

A decode step through a small model's compressed cache is, in torch, a few hundred ops per layer, each
paying microseconds of fixed cost and most a pass over megabytes of floats (shift, mask, convert, scale,
offset, gather, product); the C functions read each code once and never write the dequantized keys or values
out (:func:`page_keys` does, for pre-RoPE keys, which are rotated in torch). They are built on first use with the
system C compiler (``$CC``, else ``cc``) into the user's cache directory, keyed by the source, the flags and
the CPU, then loaded with ctypes: about a second once per machine, nothing to install. Where no compiler
works, :func:`library` returns None and :mod:`rdkv.cpu_decode` reads the page oracle
(:func:`rdkv.pages.dequantize`, the reference for these functions; the tests hold the two equal).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from rdkv.cachedir import cache_dir, trusted as _trusted
from rdkv.errors import RDKVError
from rdkv.pages import PagePlan

SOURCE = Path(__file__).with_name("cpu_dequant.c")
# The first that builds. 256-bit vectors: a value row's loops run 16 to 32 times, which 512-bit vectors of bytes
# (64 lanes) would leave wholly to the scalar remainder.
FLAGS = (["-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp"], ["-O3", "-march=native", "-fopenmp"],
         ["-O3", "-fopenmp"], ["-O3"])



def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and flags where /proc/cpuinfo says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join([x for x in lines if x.startswith(("model name", "flags"))][:2])


BUILD_SECONDS = 30.0  # every compiler run of one build together; past it the torch path runs
ELF = b"\x7fELF"


def _compile(cmd: list[str], timeout: float) -> None:
    """Run the compiler in a process group of its own, killed with everything it started once ``timeout`` passes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=err)


def _intact(so: Path) -> bool:
    """Whether ``so`` is the current user's, writable by nobody else, and the file its build recorded: an ELF
    image whose sha256 matches the one written beside it (a truncated, emptied or replaced file does not)."""
    digest = so.with_suffix(".sha256")
    if not (_trusted(so) and _trusted(digest)):
        return False
    data = so.read_bytes()
    return data[:4] == ELF and hashlib.sha256(data).hexdigest() == digest.read_text().strip()


def _build(cmd: list[str], so: Path, timeout: float) -> None:
    """Compile to a private temporary name, check it, record its sha256 beside it, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=so.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        _compile([*cmd, "-o", tmp], timeout)
        data = Path(tmp).read_bytes()
        if data[:4] != ELF:
            raise OSError(f"the compiler wrote {len(data)} bytes that are not an ELF library")
        os.chmod(tmp, 0o700)
        digest = so.with_suffix(".sha256")
        digest.write_text(hashlib.sha256(data).hexdigest())
        digest.chmod(0o600)
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of cpu_dequant.c) with its functions' argument types set."""
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    INT = ctypes.c_int
    lib.rdkv_page_scores.argtypes = [P, P, P, INT, I64, I64, I64, P, I64, I64, P, INT, P, INT]
    lib.rdkv_page_keys.argtypes = [P, P, P, INT, I64, I64, I64, I64, INT, P, P, INT]
    lib.rdkv_page_attend.argtypes = [P, P, I64 * 3, INT, I64, I64, I64, P, I64, I64, P, INT]
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (with one warning) where it cannot be built or trusted.

    It lives in rdkv's private cache directory (:func:`rdkv.cachedir.cache_dir`, ``$RDKV_CACHE_DIR``), is loaded
    only if it is the current user's, writable by nobody else and matches the sha256 its build recorded (else it
    is built again), and is built within :data:`BUILD_SECONDS` in all. A build that fails is remembered for that
    source and compiler, so later processes take the torch path at once; the warning names the file to delete to
    retry."""
    src = SOURCE.read_bytes()
    cc = shlex.split(os.environ.get("CC") or "cc")
    try:
        cache = cache_dir()
    except (RDKVError, OSError) as e:
        warnings.warn(f"rdkv: CPU decode dequantizes in torch (slower): {e}", RuntimeWarning, stacklevel=2)
        return None
    failed = cache / f"cpu_dequant-{hashlib.sha256(src + repr(cc).encode()).hexdigest()[:16]}.failed"
    if _trusted(failed):
        warnings.warn(f"rdkv: CPU decode dequantizes in torch (slower): building kernels/cpu_dequant.c with {cc[0]} "
                      f"failed before ({failed.read_text()[:500]}); delete {failed} to retry", RuntimeWarning,
                      stacklevel=2)
        return None
    deadline, errors = time.monotonic() + BUILD_SECONDS, []
    for flags in FLAGS:
        key = hashlib.sha256(src + repr((cc, flags, platform.machine(), _cpu())).encode()).hexdigest()[:16]
        so = cache / f"cpu_dequant-{key}.so"
        if not _intact(so):
            try:
                _build([*cc, *flags, "-shared", "-fPIC", str(SOURCE)], so, deadline - time.monotonic())
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                errors.append(f"{' '.join(cc + flags)}: {getattr(e, 'stderr', '') or e}")
                if time.monotonic() >= deadline:
                    errors.append(f"stopped after {BUILD_SECONDS:.0f} s")
                    break
                continue
        try:
            return bind(ctypes.CDLL(str(so)))
        except OSError as e:  # e.g. a cache directory mounted noexec
            errors.append(f"loading {so}: {e}")
    text = "; ".join(errors)[:2000]
    with open(os.open(failed, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    warnings.warn(f"rdkv: no C compiler built kernels/cpu_dequant.c, CPU decode dequantizes in torch (slower): {text}; "
                  f"delete {failed} to retry", RuntimeWarning, stacklevel=2)
    return None


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _check(name: str, x: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if x.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)) or tuple(x.shape) != shape \
            or not x.is_contiguous() or x.device.type != "cpu":
        raise RDKVError(f"{name}: expected a contiguous CPU tensor {shape} of {dtype}, got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")


def _int64(name: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if x.dtype != np.int64 or x.shape != shape or not x.flags.c_contiguous:
        raise RDKVError(f"{name}: expected a contiguous int64 array {shape}, got {x.shape} {x.dtype}")
    return x


PAGE_FIELDS, COUNT_FIELD = 34, 21  # int64 fields of a stream's row of the page table; its class counts (cpu_dequant.c)


def page_table(p: PagePlan) -> np.ndarray:
    """[S, PAGE_FIELDS] int64: a stream's channels, first channel per K width 0-16, K section offsets, K scale offset,
    V offset, class boundaries along its pages, tokens, page sizes and first-page offsets per class, first mean."""
    rows = torch.cat([p.chans, p.ch0, p.k_off, p.k_meta[:, None], p.v_off[:, None], p.page0, p.counts, p.page_size,
                      p.class_base, p.mean0[:, None]], 1)
    return np.ascontiguousarray(rows.cpu().long().numpy())


class PageSegment(NamedTuple):
    """What the C functions read of a paged segment: its bytes, the table, the channel means, the V groups of
    classes 2, 4, 8, tokens per page, head_dim and whether 16-bit rows are bf16."""

    pages: torch.Tensor
    table: np.ndarray
    k_mean: torch.Tensor
    groups: tuple[int, int, int]
    page: int
    head_dim: int
    bf16: bool
    pos_bytes: int


def _most(seg: PageSegment) -> int:
    """The most tokens a stream holds."""
    return int(seg.table[:, COUNT_FIELD:COUNT_FIELD + 4].sum(1).max(initial=0))


def _page_args(seg: PageSegment, S: int) -> tuple:
    _check("page bytes", seg.pages, torch.uint8, (seg.pages.numel(),))
    _int64("table", seg.table, (S, PAGE_FIELDS))
    _check("channel means", seg.k_mean, torch.float16, (seg.k_mean.numel(),))
    return (seg.pages.data_ptr(), seg.table.ctypes.data, seg.k_mean.data_ptr(), int(seg.bf16), S, seg.page,
            seg.head_dim)


def page_scores(out: torch.Tensor, seg: PageSegment, q: torch.Tensor, pos: torch.Tensor | None = None) -> None:
    """``out`` [S, GL, N] float32 := ``q`` [S, GL, D] float32 (each stream's permuted channel order) dotted with every
    kept key, in storage order (columns past a stream's count untouched); ``pos`` [S, N] int64 (if given) := the
    tokens' positions."""
    S, GL, N = out.shape
    _check("out", out, torch.float32, (S, GL, N))
    _check("q", q, torch.float32, (S, GL, seg.head_dim))
    if pos is not None:
        _check("positions", pos, torch.int64, (S, N))
    if _most(seg) > N:
        raise RDKVError(f"page_scores: out has {N} columns, a stream holds {_most(seg)} tokens")
    if library().rdkv_page_scores(*_page_args(seg, S), q.data_ptr(), GL, N, out.data_ptr(), seg.pos_bytes, _ptr(pos),
                                  torch.get_num_threads()):
        raise MemoryError("rdkv_page_scores: out of memory for its per-thread buffers")


def page_keys(out: torch.Tensor, pos: torch.Tensor, seg: PageSegment) -> None:
    """``out`` [S, D, N] float32 := every stream's keys channel-major in its permuted channel order, ``pos`` [S, N]
    int64 := their positions; zero past a stream's count."""
    S, D, N = out.shape
    _check("out", out, torch.float32, (S, seg.head_dim, N))
    _check("positions", pos, torch.int64, (S, N))
    if _most(seg) > N:
        raise RDKVError(f"page_keys: out has {N} columns, a stream holds {_most(seg)} tokens")
    if library().rdkv_page_keys(*_page_args(seg, S), N, seg.pos_bytes, out.data_ptr(), pos.data_ptr(),
                                torch.get_num_threads()):
        raise MemoryError("rdkv_page_keys: out of memory for its per-thread buffers")


def page_attend(out: torch.Tensor, p: torch.Tensor, seg: PageSegment) -> None:
    """``out`` [S, GL, D] float32 (channel 2j + i at column i * D/2 + j) += ``p`` [S, GL, N] float32 (columns in
    storage order) times the segment's values."""
    S, GL, D = out.shape
    _check("out", out, torch.float32, (S, GL, seg.head_dim))
    if p.dtype != torch.float32 or p.shape[:2] != (S, GL) or p.stride(2) != 1 or p.stride(0) != GL * p.stride(1) \
            or _most(seg) > p.shape[2] or D % 2 or p.device.type != "cpu":
        raise RDKVError(f"page_attend: p must be float32 [{S}, {GL}, >= every stream's count] with rows of unit stride, "
                        f"got {p.dtype} {tuple(p.shape)} strides {p.stride()}; D={D} must be even")
    buf, table, _, bf16, *_ = _page_args(seg, S)
    if library().rdkv_page_attend(buf, table, (ctypes.c_int64 * 3)(*seg.groups), bf16, S, seg.page, D, p.data_ptr(),
                                  GL, p.stride(1), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("rdkv_page_attend: out of memory")
