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
