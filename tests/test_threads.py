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
    (2, 2, 0.0, 2), (2, 2, 0.5, 2), (2, 2, 0.7, 1), (2, 2, 1.9, 1),  # a core is given up above 0.6 of it taken
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


@pytest.mark.skipif(len(allowed_cores()) < 2 or sys.platform != "linux", reason="needs Linux and two cores")
def test_the_monitor_sees_another_process_busy_on_a_core():
    """A busy loop pinned to one of this process's cores is seen as about one core used by others; the measured
    policy then leaves that core to it."""
    core = sorted(allowed_cores())[-1]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: __import__("os").sched_setaffinity(0, {core}))
    try:
        time.sleep(0.3)
        monitor = LoadMonitor(interval_s=0.2)
        time.sleep(0.5)
        others = monitor.update()
        assert others >= 0.7, others
        assert ThreadPolicy(None, monitor).apply() < len(allowed_cores())
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_after_a_pause_the_monitor_measures_without_holding_up_the_step():
    """A run's first step after a pause (its first token) is not held up by the load measurement: the call starts a
    fresh window and returns at once; a call once that window is ``FIRST_WINDOW_S`` old reads it."""
    from lab.worker.threads import FIRST_WINDOW_S, STALE_S

    monitor = LoadMonitor(interval_s=0.2)
    stamp, *ticks = monitor._last
    monitor._last = (stamp - 2 * STALE_S, *ticks)  # as if no engine had stepped for a while
    started = time.perf_counter()
    monitor.update()
    assert time.perf_counter() - started < FIRST_WINDOW_S / 2 and not monitor.known
    time.sleep(FIRST_WINDOW_S * 1.5)
    monitor.update()
    assert monitor.known


def test_the_engine_gives_the_same_tokens_under_any_thread_policy():
    """Threads change which core computes what, not the greedy tokens (fp32, the tiny preset)."""
    prompts = [[1, 2, 3, 4, 5] * 7, [9, 8, 7] * 11]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    before = torch.get_num_threads()
    tokens = [[o.token_ids for o in LLMEngine("tiny", num_blocks=64, cpu_threads=threads).generate(prompts, params)]
              for threads in (None, 1, len(allowed_cores()))]
    assert tokens[0] == tokens[1] == tokens[2]
    assert torch.get_num_threads() == before  # generate gives the caller its count back
