"""Threads for a pass through a compressed cache on a shared CPU (rdkv.contention).

The running estimate is checked on readings as a 2-core machine gives them (scripts/bench_cpu_decode.py's load: a
2-thread matmul keeps ~1.0-1.5 cores busy beside a pass, nothing else ~0.0); the reader on this machine's
/proc/stat and on a written one; the hooks on a tiny model, with the estimate set.
"""
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_llama

import rdkv
from rdkv import contention
from rdkv.contention import Contention, busy_seconds


def test_the_estimate_follows_the_cores_others_hold():
    c = Contention()
    assert c.threads(2, 2) == 2
    for _ in range(2):  # passes of 0.3 s beside a load that took 1.4 core-seconds per second
        c.record(busy=0.3 * 1.4 + 0.3, own=0.3, wall=0.3)
    assert c.threads(2, 2) == 1 and c.threads(16, 16) == 15 and c.threads(1, 2) == 1
    for _ in range(2):  # the load is gone
        c.record(busy=0.3, own=0.3, wall=0.3)
    assert abs(c.others - 0.2625) < 1e-9 and c.threads(2, 2) == 2
    for _ in range(10):  # passes shorter than the ticks /proc/stat counts in: pooled until a window fills
        c.record(busy=0.01, own=0.0, wall=0.01)
    assert abs(c.others - 0.2625) < 1e-9 and abs(c.wall - 0.1) < 1e-9
    c.record(busy=0.2, own=0.0, wall=0.1)
    assert abs(c.others - (0.2625 + 0.5 * (1.5 - 0.2625))) < 1e-9 and c.wall == 0.0
    before = c.others
    c.record(busy=0.0, own=0.3, wall=0.3)  # this process's clock ahead of the ticks: nobody else, not fewer
    assert abs(c.others - before / 2) < 1e-9


def test_busy_seconds_reads_per_core_lines(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 900 5000 0 0 0 0 0 0\n"
                    "cpu0 100 10 200 2000 50 5 5 7 0 0\n"
                    "cpu1 800 0 700 3000 0 0 0 0 0 0\n"
                    "intr 12345\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert busy_seconds([0], str(stat)) == pytest.approx(320 / hz)  # idle, iowait and steal are not busy
    assert busy_seconds([0, 1], str(stat)) == pytest.approx(1820 / hz)
    assert busy_seconds([0], str(tmp_path / "missing")) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux only")
def test_busy_seconds_sees_another_process_on_this_machine():
    cores = contention._cores()
    before = busy_seconds(cores)
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"],
                   check=True)
    assert busy_seconds(cores) - before >= 0.4  # its half second of CPU, counted in 10 ms ticks


@pytest.fixture
def model_and_caches(monkeypatch):
    monkeypatch.setenv("RDKV_BACKEND", "torch")
    model = tiny_llama(0)
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(4))
    with rdkv.record(model) as rec:
        full = model(ids, use_cache=True).past_key_values
    cache = rdkv.compress(rec, 0.3, v_group=32, k_group=32, k_block=16)
    seen = []
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        layer.self_attn.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    most = torch.get_num_threads()
    torch.set_num_threads(2)
    yield model, ids[:, -1:], cache, full, seen
    torch.set_num_threads(most)


@pytest.mark.skipif(len(contention._cores()) < 2 or not os.path.exists("/proc/stat"), reason="needs 2 cores, Linux")
def test_a_pass_runs_on_the_cores_others_leave_free(monkeypatch, model_and_caches):
    """Attention and the model's MLPs alike; torch's setting is back after the pass, after a failed pass, and never
    changed for a pass through an ordinary cache."""
    model, nxt, cache, full, seen = model_and_caches
    cores = len(contention._cores())
    monkeypatch.setattr(contention, "CONTENTION", Contention(others=0.0, window=1e9))
    model(nxt, past_key_values=cache)
    assert seen == [2] * 4  # idle: torch's setting
    monkeypatch.setattr(contention, "CONTENTION", Contention(others=cores - 1.0, window=1e9))
    seen.clear()
    model(nxt, past_key_values=cache)
    assert seen == [1] * 4 and torch.get_num_threads() == 2
    seen.clear()
    model(nxt, past_key_values=full)  # an ordinary cache: not rdkv's to change
    assert seen == [2] * 4
    model.model.layers[1].mlp.register_forward_hook(lambda *_: 1 / 0)
    seen.clear()
    with pytest.raises(ZeroDivisionError):
        model(nxt, past_key_values=cache)
    assert seen == [1] * 4 and torch.get_num_threads() == 2


def test_without_proc_stat_a_pass_keeps_torchs_setting(monkeypatch, model_and_caches):
    model, nxt, cache, _, seen = model_and_caches
    monkeypatch.setattr(contention, "CONTENTION", Contention(others=64.0))
    monkeypatch.setattr(contention, "busy_seconds", lambda cores: None)
    model(nxt, past_key_values=cache)
    assert seen == [2] * 4


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux only")
def test_passes_record_what_the_machine_did(monkeypatch, model_and_caches):
    """Each real pass is recorded once, with its wall time, the CPU time this process spent in it and the cores'
    busy time, which counts that CPU time too (to a tick per core)."""
    model, nxt, cache, _, _ = model_and_caches
    c, got = Contention(), []
    monkeypatch.setattr(c, "record", lambda busy, own, wall: got.append((busy, own, wall)))
    monkeypatch.setattr(contention, "CONTENTION", c)
    t = time.perf_counter()
    for _ in range(3):
        model(nxt, past_key_values=cache)
    elapsed, tick = time.perf_counter() - t, 1 / os.sysconf("SC_CLK_TCK")
    assert len(got) == 3 and sum(wall for *_, wall in got) <= elapsed
    for busy, own, wall in got:
        assert 0 < own and 0 < wall and busy >= own - 2 * tick * len(contention._cores())


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux only")
def test_passes_in_two_python_threads_restore_the_setting_after_the_last(monkeypatch):
    """Torch's thread setting is the process's: the pass that ends first must not restore it under the other."""
    import threading

    monkeypatch.setattr(contention, "CONTENTION", Contention(others=64.0, window=1e9))
    most = torch.get_num_threads()
    torch.set_num_threads(2)
    steps = [threading.Event() for _ in range(3)]
    seen = []

    def other():
        contention.begin_pass()
        steps[0].set()
        steps[1].wait()
        contention.end_pass()
        seen.append(torch.get_num_threads())
        steps[2].set()

    try:
        contention.begin_pass()
        worker = threading.Thread(target=other)
        worker.start()
        steps[0].wait()
        steps[1].set()
        steps[2].wait()
        worker.join()
        assert seen == [1]  # the other pass ended first: this one still runs on one thread
        contention.end_pass()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(most)
