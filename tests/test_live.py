"""``lab.engine.live``: the runtime page's seeded request mix and its run on the engine, without Streamlit."""
import pytest

from lab.engine import EngineConfig
from lab.engine.live import RuntimeRunConfig, random_requests, run_runtime, throttled


def test_random_requests_are_seeded_share_the_prefix_and_respect_the_ranges():
    prompts, outputs = random_requests(20, (3, 9), (1, 4), vocab_size=50, seed=7, shared_prefix_tokens=5)
    assert (prompts, outputs) == random_requests(20, (3, 9), (1, 4), vocab_size=50, seed=7, shared_prefix_tokens=5)
    assert prompts != random_requests(20, (3, 9), (1, 4), vocab_size=50, seed=8, shared_prefix_tokens=5)[0]
    assert all(p[:5] == prompts[0][:5] and 8 <= len(p) <= 14 for p in prompts)
    assert all(1 <= o <= 4 for o in outputs) and all(0 <= t < 50 for p in prompts for t in p)
    with pytest.raises(ValueError, match="prompt length range"):
        random_requests(2, (5, 4), (1, 1), vocab_size=50)


def test_run_serves_every_request_with_the_engine_settings_given():
    config = RuntimeRunConfig(num_requests=10, prompt_len_range=(5, 30), max_tokens_range=(2, 9),
                              engine=EngineConfig(block_size=3, num_blocks=24, max_num_seqs=4, scheduling="chunked",
                                                  max_num_batched_tokens=16, preemption_mode="swap",
                                                  num_cpu_blocks=64))
    run = run_runtime(config, frame_every=2)
    _, outputs = random_requests(10, (5, 30), (2, 9), vocab_size=1, seed=0)
    assert not run.stopped and len(run.requests) == 10
    assert sorted(run.requests["output_tokens"]) == sorted(outputs)  # ignore_eos: each request its drawn length
    steps = run.steps
    assert steps["num_running"].max() <= 4 and steps["num_prefill_tokens"].max() <= 16
    assert steps["blocks_in_use"].max() <= 24 and run.summary["num_kv_blocks"] == 24
    assert [stats.step for stats, _ in run.frames] == list(steps["step"][steps["step"] % 2 == 0])
    assert all(pool.host_pool is not None for _, pool in run.frames)


def test_on_step_returning_false_stops_the_run_early():
    seen = []
    run = run_runtime(RuntimeRunConfig(num_requests=4), on_step=lambda stats, pool: seen.append(stats.step) or
                      len(seen) < 3)
    assert run.stopped and seen == [1, 2, 3] and len(run.steps) == 3


def test_throttled_passes_the_first_call_then_at_most_one_per_interval():
    now, calls = [0.0], []
    show = throttled(lambda *args, **kwargs: calls.append((args, kwargs)), 1.0, clock=lambda: now[0])
    for t in (0.0, 0.3, 0.99, 1.0, 1.5, 2.2, 2.3):
        now[0] = t
        show(t, label="x")
    assert [args[0] for args, _ in calls] == [0.0, 1.0, 2.2] and calls[0][1] == {"label": "x"}
