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


def test_serving_metrics_use_vllm_s_names_and_agree_with_the_run():
    """``serving_metrics``: vLLM's gauges per step, its three latency histograms' samples and each request's queue,
    prefill and decode, all read from one run (a small pool: preemptions; a shared prefix: prefix-cache hits)."""
    import numpy as np

    from lab.engine.serving_metrics import GAUGES, HISTOGRAMS, serving_metrics

    config = RuntimeRunConfig(num_requests=8, prompt_len_range=(8, 24), max_tokens_range=(4, 12),
                              shared_prefix_tokens=16, engine=EngineConfig(block_size=4, num_blocks=20, max_num_seqs=8))
    run = run_runtime(config)
    metrics = serving_metrics(run)
    gauges = metrics.gauges
    assert list(gauges.columns) == ["t_s", *GAUGES] and len(gauges) == len(run.steps)
    usage = gauges["vllm:kv_cache_usage_perc"]
    assert ((usage >= 0) & (usage <= 1)).all() and usage.max() == run.steps["blocks_in_use"].max() / 20
    assert gauges["vllm:num_preemptions_total"].is_monotonic_increasing
    assert gauges["vllm:num_preemptions_total"].iloc[-1] == run.summary["preemptions"] + run.summary["swap_outs"] > 0
    hit_rate = gauges["vllm:prefix_cache_hit_rate"].iloc[-1]
    assert hit_rate == pytest.approx(run.summary["prefix_hit_rate"]) and hit_rate > 0
    assert set(metrics.latencies) == set(HISTOGRAMS)
    # every sequence's gaps between tokens: one fewer than its tokens; they add up to its decode time
    itl = metrics.latencies["vllm:inter_token_latency_seconds"]
    assert len(itl) == run.requests["output_tokens"].sum() - len(run.requests) and (itl > 0).all()
    assert np.allclose(np.sort(metrics.latencies["vllm:e2e_request_latency_seconds"]),
                       np.sort(run.requests["e2e_s"]))
    timeline = metrics.timeline
    assert len(timeline) == 3 * len(run.requests) and (timeline["end_s"] >= timeline["start_s"]).all()
    for _, phases in timeline.groupby("request_id"):
        assert list(phases["phase"]) == ["queue", "prefill", "decode"]
        assert (phases["start_s"].iloc[1:].to_numpy() == phases["end_s"].iloc[:-1].to_numpy()).all()
    first = timeline.set_index(["request_id", "phase"])
    request = run.requests.set_index("request_id")
    for rid in request.index:  # TTFT: queue + prefill; E2E: all three phases
        assert first.loc[(rid, "decode"), "start_s"] - first.loc[(rid, "queue"), "start_s"] == pytest.approx(
            request.loc[rid, "ttft_s"], abs=1e-6)
        assert first.loc[(rid, "decode"), "end_s"] - first.loc[(rid, "queue"), "start_s"] == pytest.approx(
            request.loc[rid, "e2e_s"], abs=1e-6)


def test_histogram_bins_spread_the_values_and_a_single_value_is_not_one_block():
    import numpy as np

    from lab.report.charts import histogram_edges, latency_histograms

    rng = np.random.default_rng(0)
    values = rng.lognormal(0, 0.5, 500)
    edges = histogram_edges(values)
    assert 5 <= len(edges) - 1 <= 40 and edges[0] == values.min() and edges[-1] == values.max()
    counts, _ = np.histogram(values, edges)
    assert counts.max() < 0.5 * len(values)  # not one solid block
    same = histogram_edges([0.02] * 10)
    assert len(same) - 1 == 5 and same[0] < 0.02 < same[-1]
    figure = latency_histograms({"vllm:time_to_first_token_seconds": values / 1e3,
                                 "vllm:inter_token_latency_seconds": [0.02] * 10,
                                 "vllm:e2e_request_latency_seconds": values / 1e2})
    assert len(figure.data) == 3 and [len(bar.x) for bar in figure.data][1] == 5
    assert sum(figure.data[0].y) == 500 and figure.layout.xaxis.title.text == "milliseconds"


def test_a_checkpoint_with_a_tokenizer_gives_text_not_token_ids():
    class Letters:  # the engine only decodes outputs
        def decode(self, ids):
            return "".join(chr(ord("a") + i % 26) for i in ids)

        def encode(self, text):
            return [ord(c) - ord("a") for c in text]

    from lab.models.qwen3 import load_hf_model

    model, _ = load_hf_model("tiny", __import__("torch").float32, __import__("torch").device("cpu"))
    run = run_runtime(RuntimeRunConfig(num_requests=3, max_tokens_range=(3, 5)), hf_model=model, tokenizer=Letters())
    texts = run.requests["output_text"]
    assert [len(t) for t in texts] == list(run.requests["output_tokens"]) and texts.str.isalpha().all()
    assert "output_text" not in run_runtime(RuntimeRunConfig(num_requests=2, max_tokens_range=(2, 3))).requests


def test_the_detached_run_is_the_same_run_and_stops_and_fails_like_it():
    """``run_runtime_detached`` (the runtime page's run) serves the same mix to the same tokens in its own
    process, passes each step's stats back, stops when asked and raises the run's error as the lab's."""
    from lab.engine.live import run_runtime_detached
    from lab.errors import LabError

    config = RuntimeRunConfig(num_requests=4, prompt_len_range=(8, 16), max_tokens_range=(3, 6))
    seen = []
    detached = run_runtime_detached(config, on_step=lambda stats: seen.append(stats.step))
    here = run_runtime(config)
    assert seen == list(detached.steps["step"]) == list(here.steps["step"])
    assert list(detached.requests["output_tokens"]) == list(here.requests["output_tokens"])
    assert not detached.stopped and detached.frames == []
    # the child sees the stop at its next step's report and may run a step or more ahead of the page, so the stopped
    # run is long (~200 steps): a fast engine must not finish it before the stop lands
    long_run = RuntimeRunConfig(num_requests=2, prompt_len_range=(8, 16), max_tokens_range=(200, 200))
    stopped = run_runtime_detached(long_run, on_step=lambda stats: stats.step < 2)
    assert stopped.stopped and 2 <= len(stopped.steps) < 200
    with pytest.raises(LabError, match="KV pool"):
        run_runtime_detached(RuntimeRunConfig(engine=EngineConfig(num_blocks=1)))
