"""How many intra-op threads torch gives the engine's CPU steps.

On a machine the engine shares (a browser, a Streamlit server, an IDE, another benchmark), an OpenMP parallel region
waits at its barrier for its slowest thread: with every core in the team and one core busy elsewhere, each step
waits for the thread that shares that core, and a decode step became several times slower with two threads than
with one (docs/benchmarks.md, "Under contention"). vLLM pins its OpenMP threads to cores it assumes are its own
(``VLLM_CPU_OMP_THREADS_BIND``); the lab's engine runs beside the app, so it measures instead: ``ThreadPolicy``
(``EngineConfig.cpu_threads=None``) re-reads, at most every quarter second, how much of the cores it may use other
processes took (``/proc/stat`` for all, ``/proc/self/stat`` for its own) and uses the cores they leave idle, with
hysteresis so that a brief spike does not flap the team size."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

BUSY_ABOVE, IDLE_BELOW = 0.6, 0.3  # a core counts as taken by others above this share of it, as free again below
STALE_S, FIRST_WINDOW_S = 1.0, 0.05  # a measurement older than STALE_S is taken again over FIRST_WINDOW_S


def allowed_cores() -> set[int]:
    """The cores this process may run on."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _busy_ticks(cores: set[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks of ``cores`` since boot (``/proc/stat``), or None off Linux."""
    busy = total = 0
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *values = line.split()
                if int(name[3:]) not in cores:
                    continue
                ticks = [int(v) for v in values[:8]]
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    except (OSError, ValueError):
        return None
    return busy, total


def _own_ticks() -> int | None:
    """This process's user + system clock ticks, all threads (``/proc/self/stat``), or None off Linux."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    except (OSError, ValueError, IndexError):
        return None


class LoadMonitor:
    """How many of this process's cores other processes used over the last ``interval_s`` (``others``), measured
    when asked at most once per interval. One per process (``MONITOR``): every engine of the process (the app makes
    a fresh one per run) starts from what was measured before it."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.cores = len(allowed_cores())
        self.others = 0.0
        self.known = False  # whether ``others`` was measured yet (off Linux: never)
        self._last = self._sample()
        self._window = interval_s  # the age a measurement must reach before the next

    def _sample(self) -> tuple | None:
        ticks, own = _busy_ticks(allowed_cores()), _own_ticks()
        return None if ticks is None or own is None else (time.monotonic(), ticks[0], ticks[1], own)

    def update(self) -> float:
        """``others``, measured again if the last measurement is older than ``interval_s``. After a long pause (no
        engine stepped for ``STALE_S``) a fresh window starts now and the next call reads it once it is
        ``FIRST_WINDOW_S`` old: averaged over the pause, a load that began during it would read as a fraction of a
        core. The call that starts the window returns the last value without waiting: a run's first step is its
        first token's time (waiting out the window there added 50 ms to every run's TTFT)."""
        last = self._last
        if last is None:
            return self.others
        age = time.monotonic() - last[0]
        if age > STALE_S:
            self._last, self._window = self._sample(), FIRST_WINDOW_S
            return self.others
        if age < self._window:
            return self.others
        now = self._sample()
        if now is not None:
            wall_ticks = (now[2] - last[2]) / max(1, self.cores)  # each core's ticks advance with the clock
            if wall_ticks > 0:
                self.others = max(0.0, (now[1] - last[1]) - (now[3] - last[3])) / wall_ticks
                self.known = True
            self._last, self._window = now, self.interval_s
        return self.others


MONITOR = LoadMonitor()


@dataclass(slots=True)
class ThreadPolicy:
    """torch's intra-op threads for the engine's steps: ``threads`` fixed, or None for the cores other processes
    leave idle (``MONITOR``; at least one), with hysteresis: a core is given up once others take ``BUSY_ABOVE`` of
    it, taken back once they take less than ``IDLE_BELOW``. ``apply()`` before each step; ``restore()`` gives the
    process back the count it had before."""

    threads: int | None = None
    monitor: LoadMonitor = field(default_factory=lambda: MONITOR)
    _chosen: int = 0
    _before: int = 0

    def __post_init__(self):
        if self.threads is not None and not (isinstance(self.threads, int) and not isinstance(self.threads, bool)
                                             and self.threads >= 1):
            raise ValueError(f"threads must be None (measured) or an int >= 1, got {self.threads!r}")

    def apply(self) -> int:
        """Set torch's thread count for the next step; returns it."""
        current = torch.get_num_threads()
        if not self._before:
            self._before = current
            self._chosen = self.threads or min(current, self.monitor.cores)
        if self.threads is None:
            self.monitor.update()
            if self.monitor.known:
                self._chosen = team_size(self._chosen, self.monitor.cores, self.monitor.others)
        if current != self._chosen:
            torch.set_num_threads(self._chosen)
        return self._chosen

    def restore(self) -> None:
        """torch's thread count as it was before the first ``apply`` (the engine's caller runs other work)."""
        if self._before and torch.get_num_threads() != self._before:
            torch.set_num_threads(self._before)


def team_size(current: int, cores: int, others: float) -> int:
    """The threads to use now, from ``current``, given ``others`` cores used by other processes out of ``cores``."""
    down = max(1, cores - int(others + 1 - BUSY_ABOVE))
    if down < current:
        return down
    up = max(1, cores - int(others + 1 - IDLE_BELOW))
    return up if up > current else current
