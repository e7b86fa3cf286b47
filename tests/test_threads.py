"""The engine's thread policy (lab.worker.threads): fewer threads when other processes take a core, back when they
leave it, a fixed count when asked, torch's count restored for the caller."""
import subprocess
import sys
import time

import pytest
import torch

from lab.engine import EngineConfig, LLMEngine, SamplingParams
from lab.engine.llm_engine import EngineConfigError
from lab.worker.threads import LoadMonitor, ThreadPolicy, allowed_cores, team_size


@pytest.mark.parametrize("current, cores, others, expected", [
    (2, 2, 0.0, 2), (2, 2, 0.4, 2), (2, 2, 0.5, 1), (2, 2, 1.9, 1),  # a core is given up above 0.45 of it taken
    (1, 2, 0.5, 1), (1, 2, 0.35, 1), (1, 2, 0.2, 2),  # and taken back below 0.3 only: no flapping in between
    (4, 4, 1.7, 2), (2, 2, 5.0, 1),  # never below one thread
])
def test_the_team_gives_a_core_up_above_and_takes_it_back_below_the_thresholds(current, cores, others, expected):
    assert team_size(current, cores, others) == expected


def test_a_fixed_count_is_kept_and_the_caller_s_count_restored():
    before = torch.get_num_threads()
    policy = ThreadPolicy(1)
    assert policy.apply() == 1 and torch.get_num_threads() == 1
    policy.restore()
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_a_thread_count_that_is_not_a_positive_int_is_refused(value):
    with pytest.raises(EngineConfigError, match="cpu_threads"):
        EngineConfig(cpu_threads=value).check()


def _busy_on(core: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: __import__("os").sched_setaffinity(0, {core}))


@pytest.mark.skipif(len(allowed_cores()) < 2 or sys.platform != "linux", reason="needs Linux and two cores")
def test_the_monitor_sees_another_process_busy_on_a_core():
    """A busy loop pinned to one of this process's cores is seen as about one core used by others; the measured
    policy then leaves that core to it."""
    busy = _busy_on(sorted(allowed_cores())[-1])
    try:
        monitor = LoadMonitor()
        monitor.update()
        time.sleep(0.5)
        assert monitor.update() >= 0.7, monitor.others
        assert ThreadPolicy(None, monitor).apply() < len(allowed_cores())
    finally:
        busy.kill()
        busy.wait()


class _SyntheticProcStat:
    """``lab.worker.threads._sample`` on two cores, with ``load`` cores kept busy by other processes from now on
    (the rest of the machine, and the other test workers, left out)."""

    def __init__(self):
        self.load, self.busy, self.last = 0.0, 0.0, time.monotonic()
        self.waiting_share, self.waiting = 0.0, 0.0  # this process's threads waiting for a core, per second

    def sample(self):
        now = time.monotonic()
        self.busy += self.load * (now - self.last) * 100
        self.waiting += self.waiting_share * (now - self.last)
        self.last = now
        return now, int(self.busy), int(2 * 100 * now), 0.0, self.waiting


@pytest.fixture
def synthetic():
    """(the synthetic /proc, a monitor of two cores reading it); torch's thread count restored after."""
    from lab.worker import threads

    stat, before = _SyntheticProcStat(), torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(threads, "_sample", stat.sample)
        patch.setattr(threads, "CLOCK_TICKS", 100)
        monitor = LoadMonitor()
        monitor.cores = 2
        yield stat, monitor
    torch.set_num_threads(before)


def test_a_load_that_began_between_two_runs_is_seen_at_the_next_run_s_first_step(synthetic):
    """The monitor keeps sampling between runs: a run that starts half a second after another process took a core
    gives that core up from its first step on (a measurement started at the first step came 50-300 ms late, and
    each of those steps waited on the busy core), without waiting for a measurement; and takes the core back once
    the process is gone."""
    from lab.worker import threads

    stat, monitor = synthetic
    ThreadPolicy(None, monitor).apply()  # an earlier run's step: the sampler runs from here on
    time.sleep(0.5)
    assert monitor.known and monitor.others < 0.1, monitor.others
    stat.load = 1.0  # no engine steps meanwhile
    time.sleep(0.5)
    started = time.perf_counter()
    assert ThreadPolicy(None, monitor).apply() == 1
    assert time.perf_counter() - started < threads.FIRST_WINDOW_S / 2  # no window waited for
    stat.load = 0.0
    time.sleep(0.5)
    assert ThreadPolicy(None, monitor).apply() == 2


def test_threads_waiting_for_a_core_give_it_up_before_the_window_sees_the_load(synthetic):
    """A load that begins during a run at two threads: the window's busy time reads it as a fraction of a core for a
    fifth of a second (each step waiting on the busy core meanwhile), but the team's thread on that core waits half
    its time at once, and the next sample gives the core up; once the waits stop, the window decides again."""
    from lab.worker import threads

    stat, monitor = synthetic
    policy = ThreadPolicy(None, monitor)
    policy.apply()
    time.sleep(0.3)
    assert policy.apply() == 2
    stat.waiting_share = 0.5  # the busy time of the window has not moved yet
    time.sleep(3 * threads.SAMPLE_S)
    assert monitor.others >= 1.0 and policy.apply() == 1
    stat.waiting_share = 0.0
    time.sleep(3 * threads.SAMPLE_S)
    assert monitor.others < 0.3 and policy.apply() == 2


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_sampler_stops_when_no_engine_asks_and_starts_again_when_one_does(monkeypatch):
    from lab.worker import threads

    monkeypatch.setattr(threads, "IDLE_STOP_S", 0.2)
    monitor = LoadMonitor()
    monitor.update()
    sampler = monitor._thread
    assert sampler.is_alive()
    sampler.join(2.0)
    assert not sampler.is_alive()
    monitor.update()
    assert monitor._thread is not sampler and monitor._thread.is_alive()


def test_the_engine_gives_the_same_tokens_under_any_thread_policy():
    """Threads change which core computes what, not the greedy tokens (fp32, the tiny preset)."""
    prompts = [[1, 2, 3, 4, 5] * 7, [9, 8, 7] * 11]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    before = torch.get_num_threads()
    tokens = [[o.token_ids for o in LLMEngine("tiny", num_blocks=64, cpu_threads=threads).generate(prompts, params)]
              for threads in (None, 1, len(allowed_cores()))]
    assert tokens[0] == tokens[1] == tokens[2]
    assert torch.get_num_threads() == before  # generate gives the caller its count back
