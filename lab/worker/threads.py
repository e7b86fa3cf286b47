"""How many intra-op threads torch gives the engine's CPU steps.

On a machine the engine shares (a browser, a Streamlit server, an IDE, another benchmark), an OpenMP parallel region
waits at its barrier for its slowest thread: with every core in the team and one core busy elsewhere, each step
waits for the thread that shares that core, and a decode step became several times slower with two threads than
with one (docs/benchmarks.md, "Under contention"). vLLM pins its OpenMP threads to cores it assumes are its own
(``VLLM_CPU_OMP_THREADS_BIND``); the lab's engine runs beside the app, so it measures instead: ``ThreadPolicy``
(``EngineConfig.cpu_threads=None``) reads, before each step, how much of the cores it may use other processes took
over the last fifth of a second (``LoadMonitor``: ``/proc/stat`` for all, the process's CPU clock for its own, its
threads' waits for a core for a load that began in the last 50 ms; kept current by a sampling thread) and uses the cores they leave idle, with hysteresis so that a brief spike does not
flap the team size."""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

# A core counts as taken by others above BUSY_ABOVE of it, as free again below IDLE_BELOW. With the team on every core
# and a busy process on one, others read 0.5-0.8 of a core (the team's threads spin at barriers on the CPU it leaves).
BUSY_ABOVE, IDLE_BELOW = 0.45, 0.3
SAMPLE_S, WINDOW_S = 0.05, 0.2  # the monitor reads /proc every SAMPLE_S and reports the last WINDOW_S
FIRST_WINDOW_S = 0.05  # the shortest window it reports
IDLE_STOP_S = 30.0  # it stops sampling once no engine has asked for this long (the next request starts it again)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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


class LoadMonitor:
    """How many of this process's cores other processes used over the last ``window_s`` (``others``): the cores'
    busy time (``/proc/stat``) less this process's own CPU time, or what its threads' waits for a core say, if
    more (``measure``). A daemon thread samples every ``sample_s`` while engines ask (``update``), so a run's first
    step sees a load that began before it, and a load that begins during a run is seen within a sample's interval
    (one that ends, within a window); waiting for a window at each step would hold up the step, and one averaged
    over a pause reads a load that began in it as a fraction of a core. One per process (``MONITOR``):
    every engine of the process (the app makes a fresh one per run) starts from what was measured before it."""

    def __init__(self, sample_s: float = SAMPLE_S, window_s: float = WINDOW_S):
        self.sample_s, self.window_s = sample_s, window_s
        self.cores = len(allowed_cores())
        self.others = 0.0
        self.known = False  # whether ``others`` was measured yet (off Linux: never)
        self._samples: deque = deque()
        self._asked = time.monotonic()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def update(self) -> float:
        """``others`` as last measured; starts the sampler if it is not running in this process (the first call, one
        after ``IDLE_STOP_S`` without calls, or the first in a forked child)."""
        self._asked = time.monotonic()
        if self._pid != os.getpid() or self._thread is None or not self._thread.is_alive():
            self._start()
        return self.others

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid() and self._thread is not None and self._thread.is_alive():
                return
            first = _sample()
            if first is None:
                return
            self._samples, self._pid = deque([first]), os.getpid()
            self._thread = threading.Thread(target=self._run, name="lab-load-monitor", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while time.monotonic() - self._asked < IDLE_STOP_S:
            time.sleep(self.sample_s)
            self.measure()

    def measure(self) -> None:
        """Take a sample and set ``others``: over the samples of the last ``window_s`` (once they span
        ``FIRST_WINDOW_S``), the cores' busy time less this process's; or, if more, twice the share of the last
        sample's interval that this process's threads spent runnable but waiting for a core (a thread that waits
        half its time shares its core with another task). The first reads a load that began within the window as
        a fraction of a core; the second sees it within one interval."""
        now = _sample()
        if now is None:
            return
        samples = self._samples
        samples.append(now)
        while len(samples) > 2 and now[0] - samples[1][0] >= self.window_s:
            samples.popleft()
        first, last = samples[0], samples[-2]
        wall_ticks = (now[2] - first[2]) / max(1, self.cores)  # each core's ticks advance with the clock
        if now[0] - first[0] >= FIRST_WINDOW_S and wall_ticks > 0:
            own_ticks = (now[3] - first[3]) * CLOCK_TICKS
            others = max(0.0, (now[1] - first[1]) - own_ticks) / wall_ticks
            waiting = (now[4] - last[4]) / max(1e-9, now[0] - last[0]) if now[4] is not None and last[4] is not None \
                else 0.0
            self.others = max(others, min(float(self.cores), 2.0 * waiting))
            self.known = True

def _waiting_s() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a core, all threads, since each began
    (``/proc/self/task/*/schedstat``, the second field), or None where the kernel does not say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[1])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def _sample() -> tuple | None:
    """(monotonic time, busy ticks, total ticks of this process's cores, this process's CPU seconds, its threads'
    seconds waiting for a core or None), or None off Linux."""
    ticks = _busy_ticks(allowed_cores())
    return None if ticks is None else (time.monotonic(), ticks[0], ticks[1], time.process_time(), _waiting_s())

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
