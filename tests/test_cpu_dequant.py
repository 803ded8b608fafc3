"""The C products of the CPU decode path (kernels/cpu_dequant.c): how the library is built, its launchers'
checks, that its results do not depend on the thread count and that the path calls it. That it computes what
the torch path and the oracle compute is tested in test_cpu_decode.py, which runs its grid both ways."""
import os

import numpy as np
import pytest
import torch
from test_kernel_decode import build

from rdkv import cpu_decode
from rdkv.errors import RDKVError
from rdkv.kernels import cpu_dequant

needs_cc = pytest.mark.skipif(cpu_dequant.library() is None, reason="no C compiler builds kernels/cpu_dequant.c here")


@needs_cc
def test_built_once_into_the_cache_directory_then_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_dequant.library.__wrapped__() is not None
    built = list((tmp_path / "rdkv").glob("cpu_dequant-*.so"))
    assert len(built) == 1 and not list((tmp_path / "rdkv").glob("tmp*"))  # no build directory left behind
    stamp = built[0].stat().st_mtime_ns

    def compile_again(*args, **kwargs):
        raise AssertionError("a second load compiled again")

    monkeypatch.setattr(cpu_dequant.subprocess, "run", compile_again)
    assert cpu_dequant.library.__wrapped__() is not None and built[0].stat().st_mtime_ns == stamp


def test_no_compiler_gives_a_warning_and_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="dequantizes in torch"):
        assert cpu_dequant.library.__wrapped__() is None
    assert not list((tmp_path / "rdkv").glob("*.so"))


@needs_cc
def test_launchers_reject_what_does_not_fit():
    layer = build(seed=1, B=1, H=2, T=200, D=64, n_c=0)
    counts = layer.t["v_counts"].numpy().astype(np.int64)
    stored = {w: (layer.t[f"v{w}.codes"], layer.t[f"v{w}.scale"], layer.t[f"v{w}.zero"]) for w in (2, 4, 8)}
    stored[16] = (layer.t["v16"], None, None)
    groups = {w: layer.spec.v_group_of(w) for w in (2, 4, 8)}
    N = int(counts.sum(1).max())
    out, p = torch.zeros(2, 3, 64), torch.rand(2, 3, N)
    cpu_dequant.attend(out, p, stored, groups, counts)
    with pytest.raises(RDKVError, match="attend: p must be float32"):
        cpu_dequant.attend(out, p[..., :-1], stored, groups, counts)
    with pytest.raises(RDKVError, match="attend: p must be float32"):
        cpu_dequant.attend(out, p.transpose(0, 1).contiguous().transpose(0, 1), stored, groups, counts)
    with pytest.raises(RDKVError, match="counts: expected a contiguous int64 array"):
        cpu_dequant.attend(out, p, stored, groups, counts.astype(np.int32))
    with pytest.raises(RDKVError, match="out: expected a contiguous CPU tensor"):
        cpu_dequant.attend(out.half(), p, stored, groups, counts)
    bad = {**stored, 4: (stored[4][0][:-1], stored[4][1], stored[4][2])}
    with pytest.raises(RDKVError, match="class 4 codes"):
        cpu_dequant.attend(out, p, bad, groups, counts)
    codes, scale, zero = (layer.t[f"k4.{x}"] for x in ("codes", "scale", "zero"))
    kb, kg = layer.spec.k_block, layer.spec.k_group
    one = np.array([0]), np.array([min(len(codes), 10)]), np.array([0])
    past = np.array([len(codes) - 1]), np.array([2]), np.array([0])
    cpu_dequant.keys(torch.empty(1, kb, 16), {4: (codes, scale, zero)}, kg, np.array([4]), *one)
    with pytest.raises(RDKVError, match="keys: a pair runs past its width's stored rows"):
        cpu_dequant.keys(torch.empty(1, kb, 16), {4: (codes, scale, zero)}, kg, np.array([4]), *past)

    def scores(width, row0, n, group0, stream):
        cpu_dequant.scores(torch.zeros(2, 3, 16), {4: (codes, scale, zero)}, kg, np.array([width]), row0, n, group0,
                           np.array([stream]), torch.rand(1, 3, kb))

    scores(4, *one, 1)
    with pytest.raises(RDKVError, match="runs past its width's stored rows"):
        scores(4, *past, 1)
    with pytest.raises(RDKVError, match="stream is outside 0..1"):
        scores(4, *one, 2)
    with pytest.raises(RDKVError, match="widths must be in"):
        scores(3, *one, 1)


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
    for name in ("scores", "attend", "keys"):
        fn = getattr(cpu_dequant, name)
        monkeypatch.setattr(cpu_dequant, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    layer = build(seed=3, B=1, H=2, T=300, D=64, n_c=2)
    cpu_decode.trizone_attention(torch.randn(1, 4, 1, 64), layer, 0.125)
    assert calls == ["scores", "attend"]
