"""The vLLM twin's score against the server's own spread: min, max and coefficient of variation of the real
repeats per metric, whether the twin's median lies inside them; the client pinned off the worker's cores."""
import os
import sys
from types import SimpleNamespace

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
