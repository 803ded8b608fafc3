"""How many threads a model's pass through a compressed cache takes on a CPU that other work shares.

A CPU decode step is thousands of torch ops of microseconds to milliseconds each (attention's unpacks and
products, the model's matmuls), and on all threads each op's parallel region waits for every thread: when other
processes hold the cores, every op stalls on a descheduled thread. On 2 cores beside a 2-thread matmul, SmolLM2's
steps ran 2-4x slower on torch's two threads than on one, the full cache's too (docs/benchmarks.md). So each pass
is timed against the CPU time the machine's other processes took on the cores this process may run on (their busy
time in ``/proc/stat`` less this process's own), and the next pass runs on the cores they leave free: between one
and torch's setting, which is restored after the pass. The reading needs no step on all threads to tell an idle
machine from a loaded one, where a step on one thread beside the load keeps its core much of the time and says
nothing of the others. Where ``/proc/stat`` cannot be read (outside Linux), passes keep torch's setting.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def busy_seconds(cores: list[int], stat: str = "/proc/stat") -> float | None:
    """CPU seconds every process has spent on ``cores`` since boot (user, nice, system, irq and softirq time of
    their ``cpuN`` lines; idle, iowait and time stolen by a hypervisor are not busy here), None if unreadable."""
    want, busy = {f"cpu{c}" for c in cores}, 0
    try:
        with open(stat) as f:
            for line in f:
                name, *ticks = line.split()
                if name in want:
                    user, nice, system, _idle, _iowait, irq, softirq = map(int, ticks[:7])
                    busy += user + nice + system + irq + softirq
    except (OSError, ValueError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass
class Contention:
    """A running estimate of the cores other processes keep busy, from windows of at least ``window`` seconds of
    passes (``/proc/stat`` counts in ticks of 10 ms: a window of 0.2 s on 2 cores holds 40)."""

    others: float = 0.0
    weight: float = 0.5  # of the newest window in the running mean: contention is seen, and gone, in a window or two
    window: float = 0.2
    busy: float = 0.0  # the open window: the cores' busy seconds, this process's CPU seconds and the wall seconds
    own: float = 0.0
    wall: float = 0.0

    def threads(self, most: int, cores: int) -> int:
        """Threads for the next pass: the ``cores`` other processes leave free, rounded, at least 1, at most ``most``."""
        return max(1, min(most, int(cores - self.others + 0.5)))

    def record(self, busy: float, own: float, wall: float) -> None:
        """One pass: seconds the cores were busy, of CPU this process used, of wall time."""
        self.busy, self.own, self.wall = self.busy + busy, self.own + own, self.wall + wall
        if self.wall >= self.window:
            others = max(self.busy - self.own, 0.0) / self.wall
            self.others += self.weight * (others - self.others)
            self.busy = self.own = self.wall = 0.0


CONTENTION = Contention()  # one per process: contention is the machine's, not a cache's
_PASS = threading.local()  # ``start``: a pass's readings at its start
_OPEN = {"passes": 0, "threads": 1}  # passes under way in any Python thread, torch's setting before the first
_LOCK = threading.Lock()


def begin_pass() -> None:
    """A model's forward pass through a compressed CPU cache begins: run it on the threads :data:`CONTENTION`
    leaves free. Torch's setting is the process's: passes under way in several Python threads share the one
    :func:`end_pass` restores after the last of them."""
    cores = _cores()
    busy = busy_seconds(cores)
    if busy is None:
        return
    with _LOCK:
        if not _OPEN["passes"]:
            _OPEN["threads"] = torch.get_num_threads()
        _OPEN["passes"] += 1
        torch.set_num_threads(CONTENTION.threads(_OPEN["threads"], len(cores)))
    _PASS.start = cores, busy, time.process_time(), time.perf_counter()


def end_pass() -> None:
    """The pass :func:`begin_pass` began has ended, or failed: recorded, and torch's setting back after the last."""
    start = _PASS.__dict__.pop("start", None)
    if start is None:
        return
    cores, busy, own, wall = start
    now = busy_seconds(cores)
    with _LOCK:
        if now is not None:
            CONTENTION.record(now - busy, time.process_time() - own, time.perf_counter() - wall)
        _OPEN["passes"] -= 1
        if not _OPEN["passes"]:
            torch.set_num_threads(_OPEN["threads"])
