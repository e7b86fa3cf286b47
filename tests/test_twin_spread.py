"""The vLLM twin's score against the server's own spread: min, max and coefficient of variation of the real
repeats per metric, whether the twin's median lies inside them; the client pinned off the worker's cores."""
import os
import sys
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from simulator.twins.vllm_twin import VLLMTwinResult, _pin_client


def test_the_summary_gives_the_server_s_spread_and_whether_the_twin_is_inside_it():
    rows = [{"workload": "prefix", "metric": "tpot_p50_s", "run": run, "real": real, "simulated": 0.0065,
             "error": abs(0.0065 - real) / real, "goal": 0.05, "unit": "relative", "run_step_overhead_s": 0.0}
            for run, real in enumerate([0.0051, 0.0068, 0.0090, 0.0060, 0.0070])]
    rows += [{"workload": "prefix", "metric": "ttft_p50_s", "run": 0, "real": 0.2, "simulated": 0.5, "error": 1.5,
              "goal": 0.05, "unit": "relative", "run_step_overhead_s": 0.0}]
    summary = VLLMTwinResult(pd.DataFrame(rows)).summary().set_index("metric")
    tpot = summary.loc["tpot_p50_s"]
    assert (tpot["real_min"], tpot["real_max"], tpot["runs"]) == (0.0051, 0.0090, 5)
    assert tpot["real_cv"] == pytest.approx(pd.Series([0.0051, 0.0068, 0.0090, 0.0060, 0.0070]).std() / 0.00678)
    assert bool(tpot["inside_spread"])
    one = summary.loc["ttft_p50_s"]
    assert not bool(one["inside_spread"]) and pd.isna(one["real_cv"])  # one run: no spread to speak of
    # the noise floor: a twin that predicts the server's median (0.0068) every time, its median error over the runs
    reals = [0.0051, 0.0068, 0.0090, 0.0060, 0.0070]
    assert tpot["noise_floor_error"] == pytest.approx(sorted(abs(0.0068 - r) / r for r in reals)[2])
    assert pd.isna(one["noise_floor_error"])


@pytest.mark.skipif(sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and two cores")
def test_the_client_moves_off_the_worker_s_cores_and_back():
    before = os.sched_getaffinity(0)
    worker = {max(before)}
    restore = _pin_client(SimpleNamespace(pinned=worker))
    try:
        assert os.sched_getaffinity(0) == before - worker
    finally:
        os.sched_setaffinity(0, restore)
    assert restore == before
    assert _pin_client(SimpleNamespace(pinned=set())) is None  # vLLM bound nothing: nothing to do


@pytest.mark.parametrize("points, expected", [
    ([(32, 0.003), (128, 0.004), (384, 0.007), (32, 0.004), (128, 0.0045), (384, 0.009)], "line"),
    ([(32, 0.005), (128, 0.004), (384, 0.003)], "flat"),  # falling with length: one overhead for every prompt
    ([(32, -0.002), (384, 0.004)], "origin"),  # a negative intercept: the line through zero
    ([(64, -0.001), (64, -0.002)], "flat"),  # one length, faster than priced: no overhead at all
    ([(32, -0.01), (384, -0.002)], "flat")])  # rising but below zero throughout (a clean run's calibration gave a
    # negative slope through the origin, and an arrival before its send)
def test_the_request_overhead_is_a_line_in_the_prompt_length_never_below_zero(points, expected):
    """The single prompts' TTFT beyond the priced steps, per prompt length, gives ``a + b * prompt_tokens``:
    through the medians per length (one slow repeat does not tilt it), both terms never negative."""
    from simulator.twins.vllm_twin import _overhead_line, engine_arrivals

    a, b = _overhead_line(points)
    assert a >= 0 and b >= 0
    lengths = sorted({length for length, _ in points})
    medians = [float(np.median([e for at, e in points if at == length])) for length in lengths]
    if expected == "line":
        assert b > 0 and a > 0 and all(abs(a + b * x - m) < 1e-3 for x, m in zip(lengths, medians))
    elif expected == "origin":
        assert a == 0 and b > 0
    else:
        assert b == 0 and a == pytest.approx(max(0.0, float(np.median(medians))))
    arrivals = engine_arrivals(np.zeros(2), a + b * np.array([32, 384]), 0.0)  # one overhead per request
    assert arrivals[1] - arrivals[0] == pytest.approx(b * 352)


def test_in_flight_counts_the_requests_a_request_finds_in_the_engine():
    """Arrived before it and not finished by then; a request never served (NaN finish) is not counted."""
    from simulator.twins.vllm_twin import in_flight

    arrivals = np.array([0.0, 0.1, 0.2, 0.5, 0.5, 0.9])
    finishes = np.array([0.4, 0.3, np.nan, 0.6, 0.7, 1.0])
    assert in_flight(arrivals, finishes).tolist() == [0, 1, 2, 0, 0, 0]  # at 0.5 the unserved one is not counted


def _served(sent, prompt_tokens, output_tokens):
    from lab.peer.server import ServerRun
    from simulator.core.workloads import Workload

    workload = Workload("t", np.zeros(len(sent)), np.array(prompt_tokens), np.array(output_tokens)).check()
    return workload, ServerRun(pd.DataFrame({"sent_s": sent}), pd.DataFrame(), pd.DataFrame(), 0.0, 0.0)


def test_a_request_sent_while_others_run_reaches_the_engine_later_by_its_share_of_their_load():
    """The request overhead grows by ``request_overhead_per_running_s`` per request the first pass finds in flight:
    a lone request is unchanged, one sent while three decode waits 3 x that longer for its first token; none of it
    without the term (the prediction then is the one-pass prediction, to the last bit)."""
    from lab.profiling.profile import Profile, feature_names
    from simulator.core.engine import SimConfig
    from simulator.twins.vllm_twin import ServerCalibration, simulate_run

    profile = Profile("tiny", "cpu", "float32", 32, "vllm",
                      dict.fromkeys(feature_names([1]), 0.0) | {"constant": 0.002}, [1])
    config = SimConfig(allocator="paged", block_size=32, capacity_tokens=64 * 32, max_model_len=2048,
                       scheduling="vllm", profile=profile)
    workload, run = _served([0.0, 0.0, 0.0, 0.05, 1.0], [32] * 5, [40, 40, 40, 2, 2])
    flat = ServerCalibration(0.0, 0.001, 0.0)
    loaded = ServerCalibration(0.0, 0.001, 0.0, request_overhead_per_running_s=0.004)
    ttft = {name: simulate_run(workload, run, config, calibration).requests
            for name, calibration in (("flat", flat), ("loaded", loaded))}
    first = {name: (frame["first_token_s"] - frame["arrival_s"]).to_numpy() for name, frame in ttft.items()}
    assert first["loaded"][3] - first["flat"][3] == pytest.approx(3 * 0.004, abs=0.0021)  # to the next step
    assert first["loaded"][4] == pytest.approx(first["flat"][4])  # alone on an idle engine
    assert first["loaded"][0] == pytest.approx(first["flat"][0])  # the first finds nobody
    again = simulate_run(workload, run, config, flat)
    pd.testing.assert_frame_equal(again.requests, ttft["flat"])


@pytest.mark.parametrize("points, expected", [
    ([(8, 0.0016), (8, 0.0008), (4, 0.0004)], 0.0001),  # the median of extra / in flight
    ([(8, -0.002), (8, -0.001)], 0.0),  # faster than priced under load: no share
    ([(0, 0.003)], 0.0)])  # nothing in flight: nothing to divide
def test_the_share_per_request_in_flight_is_a_median_never_below_zero(points, expected):
    from simulator.twins.vllm_twin import _per_running_slope

    assert _per_running_slope(points) == pytest.approx(expected)
