"""The vLLM twin's model of the server around its engine: a frontend that shares its time among the requests it
holds, prefilled tokens priced beyond the offline profile, and a calibration that finds both on a stand-in server
whose true values are known."""
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from lab.peer.server import ServerRun
from lab.profiling.profile import Profile, feature_names
from simulator.core.engine import SimConfig
from simulator.core.workloads import Workload
from simulator.twins import vllm_twin
from simulator.twins.vllm_twin import ServerCalibration, engine_arrivals, shared_frontend, simulate_run


@pytest.mark.parametrize("sent, work, expected", [
    ([0.0, 0.0, 0.0, 0.0], 1.0, [4.0, 4.0, 4.0, 4.0]),  # a burst leaves together
    ([0.0, 1.0, 2.0, 3.0], 1.0, [1.0, 2.0, 3.0, 4.0]),  # one at a time: each after its own work
    ([0.0, 0.5, 10.0, 10.2], 1.0, [1.5, 2.0, 11.8, 12.0]),  # halves shared after the second arrives
    ([0.0, 0.0, 0.5], 0.0, [0.0, 0.0, 0.5]),  # no frontend
    ([], 1.0, [])])
def test_the_frontend_shares_its_time_among_the_requests_it_holds(sent, work, expected):
    assert shared_frontend(np.array(sent, dtype=float), work) == pytest.approx(expected)


def test_requests_reach_the_engine_in_the_order_they_were_sent_whatever_their_overheads():
    """A request with a long prompt (a larger overhead) does not let one sent after it overtake it: the engine
    takes them in order (and the simulator needs them sorted)."""
    arrivals = engine_arrivals(np.array([0.0, 0.0001, 0.0002]), np.array([0.009, 0.001, 0.004]), 0.0005)
    assert np.all(np.diff(arrivals) >= 0) and arrivals[0] >= 0.009


def _profile() -> Profile:
    coefficients = dict.fromkeys(feature_names([1, 16]), 0.0) | {"constant": 0.0015, "prefill_tokens": 5e-6,
                                                                  "logit_rows@16": 0.0008}
    return Profile("tiny", "cpu", "float32", 32, "vllm", coefficients, [1, 16])


def _config(profile: Profile) -> SimConfig:
    return SimConfig(allocator="paged", block_size=32, capacity_tokens=255 * 32, max_model_len=2048,
                     max_num_seqs=16, max_num_batched_tokens=512, scheduling="vllm", profile=profile,
                     max_points=100_000)


def test_the_calibration_prices_each_prefilled_token_and_every_step():
    profile = _profile()
    priced = ServerCalibration(step_overhead_s=0.001, prefill_token_overhead_s=4e-6).priced(profile)
    assert priced.coefficients["constant"] == pytest.approx(0.0025)
    assert priced.coefficients["prefill_tokens"] == pytest.approx(9e-6)
    assert profile.coefficients["prefill_tokens"] == 5e-6  # the profile itself untouched


def _stand_in(truth: ServerCalibration, profile: Profile):
    """A server that is the simulator priced with ``truth``: what it "measures" for each run the calibration sends."""
    config = truth.applied(_config(profile), profile)

    def run_server_workload(url, requests, model=None, **_):
        sent = np.array([request.arrival_s for request in requests])
        workload = Workload("stand-in", sent, np.array([len(request.prompt) for request in requests]),
                            np.array([request.max_tokens for request in requests])).check()
        placeholder = ServerRun(pd.DataFrame({"sent_s": sent}), pd.DataFrame(), pd.DataFrame(), 0.0, 0.0)
        result = simulate_run(workload, placeholder, config, truth).requests
        frame = pd.DataFrame({"sent_s": sent, "first_token_s": result["first_token_s"].to_numpy(),
                              "finish_s": result["finish_s"].to_numpy(), "output_tokens": workload.output_tokens,
                              "prompt_tokens": workload.prompt_tokens, "error": ""})
        return ServerRun(frame, pd.DataFrame(), pd.DataFrame(), 0.0, 0.0)
    return run_server_workload


def test_the_calibration_finds_a_known_server_s_prefill_cost_and_frontend(monkeypatch):
    """A stand-in server whose steps cost 6 us more per prefilled token than the profile says, whose frontend takes
    0.75 ms per request (shared) and whose requests take 4 ms to reach the engine: the calibration finds those
    values (on its grids) and then predicts the stand-in's first tokens of a burst it was not fitted on."""
    profile = _profile()
    truth = ServerCalibration(step_overhead_s=0.0, request_overhead_s=0.004, request_interval_s=0.00075,
                              prefill_token_overhead_s=6e-6)
    monkeypatch.setattr(vllm_twin, "run_server_workload", _stand_in(truth, profile))
    found = vllm_twin.calibrate_server("http://stand-in", "m", _config(profile), vocab=1000, repeats=1)
    assert found.prefill_token_overhead_s == pytest.approx(6e-6)
    assert found.request_interval_s == pytest.approx(0.00075)
    assert found.request_overhead_s == pytest.approx(0.004, abs=2e-4)
    assert found.step_overhead_s == pytest.approx(0.0, abs=1e-4)
    assert not found.interval_at_bound and not found.prefill_token_at_bound and found.bound_note == ""
    burst = Workload("burst", np.zeros(24), np.full(24, 40), np.full(24, 8)).check()
    run = vllm_twin.run_server_workload("http://stand-in", vllm_twin.server_requests(burst, 1000, 3), "m")
    predicted = simulate_run(burst, run, found.applied(_config(profile), profile), found).requests
    assert predicted["first_token_s"].to_numpy() == pytest.approx(run.requests["first_token_s"].to_numpy(), rel=0.02)


def test_a_search_that_ends_at_its_bound_says_so():
    at_bound = replace(ServerCalibration(), prefill_token_at_bound=True)
    assert "a prefilled token's cost" in at_bound.bound_note and "largest value searched" in at_bound.bound_note
    both = replace(at_bound, interval_at_bound=True)
    assert "the request interval and a prefilled token's cost" in both.bound_note


@pytest.mark.parametrize("count, stride, best", [(33, 4, 7), (17, 2, 16), (17, 2, 0), (5, 4, 3), (1, 2, 0)])
def test_the_coarse_to_fine_search_finds_a_single_minimum_scoring_each_value_once(count, stride, best):
    from simulator.twins.vllm_twin import _coarse_to_fine

    calls = []

    def score(index):
        calls.append(index)
        return (index - best) ** 2
    assert _coarse_to_fine(count, score, stride) == (best, 0)
    assert len(calls) == len(set(calls)) and len(calls) <= count // stride + 2 * stride


def test_a_profile_kept_before_stalled_repeats_were_left_out_is_not_reused(monkeypatch):
    """The page's kept profile of vLLM's engine is named by its scenarios and by the rule that made its samples: one
    kept under another stall rule (or before there was one) is measured again, not reused."""
    config = vllm_twin.VLLMTwinConfig()
    now = vllm_twin.profile_cache_path(config)
    assert now == vllm_twin.profile_cache_path(config)  # the same settings find the same file
    monkeypatch.setattr(vllm_twin, "STALL_RATIO", 10.0)
    assert vllm_twin.profile_cache_path(config) != now
