"""The digital twin: a profile of the real engine fits and round-trips; the simulator on a profile plans the same
steps as the engine; malformed or mismatched profiles give clear errors."""
import json
import math

import numpy as np
import pandas as pd
import pytest

from lab.engine import EngineConfig
from lab.kv_cache.pool_view import pool_snapshot
from lab.profiling.profile import (DECODE_SEQS, IDLE_FEATURES, IDLE_KNOTS_S, IDLE_S, LINEAR, PREFILL_LOGIT_ROWS,
                         PREFILL_TOKENS, PREVIOUS_PREFILL_TOKENS, PROFILE_VERSION, STEP_FEATURES, Profile,
                         ProfileError, Profiler, _run_scenario, _scenarios, decode_knots, design_row, feature_names,
                         fit, grouped_samples, plan_quantities, profile_engine, scatter_free_blocks,
                         steady_mean)
from simulator import SimConfig, Simulator
from simulator.twins.twin import TwinCase, TwinConfig, calibrated_twins, replay, run_twin, twin_workload
from simulator.core.workloads import SyntheticSpec, Workload, synthetic_workload

KNOTS = [1, 4, 8, 32]
FIXED = {"constant": 2e-3, "prefill_seqs": 1e-4, "prefill_tokens": 2e-5, "prefill_attention_pairs": 1e-8,
         "decode_kv_tokens": 1e-7, "decode_padded_kv_tokens": 2e-7, "copied_blocks": 5e-5, "swapped_blocks": 8e-5,
         "previous_prefill_tokens": 1e-7, "prefill_step": 8e-4, "decode_step": 6e-4, "after_prefill_step": 2e-4,
         "after_idle@2ms": 1e-3, "after_idle@10ms": 2.5e-3, "after_idle@250ms": 3e-3, "logit_rows@1": 3e-4,
         "logit_rows@4": 1.2e-3, "logit_rows@8": 4e-3, "logit_rows@32": 5e-3}


def fixed_profile(block_size=4, model="tiny"):
    return Profile(model, "cpu", "torch.float32", block_size, "torch", dict(FIXED), list(KNOTS))


def step_quantities(prefill_tokens=0, decode_seqs=0, previous_prefill_tokens=0, prompts=None):
    """One step's quantities: ``prompts`` chunks (default: one if anything is prefilled) that all sample."""
    prompts = int(prefill_tokens > 0) if prompts is None else prompts
    return [1, prompts, prefill_tokens, decode_seqs, 0, 0, 0, 0, 0, 0, previous_prefill_tokens, prompts]


def test_the_logit_rows_enter_piecewise_linearly():
    steps = len(LINEAR) + len(STEP_FEATURES)
    hats = steps + len(IDLE_FEATURES)
    assert design_row(step_quantities(40, 6), KNOTS)[len(LINEAR):steps] == [1.0, 1.0, 0.0]  # prefills and decodes
    assert design_row(step_quantities(0, 6, 300), KNOTS)[len(LINEAR):steps] == [0.0, 1.0, 1.0]  # a step after one
    assert design_row(step_quantities(0, 6), KNOTS)[hats:] == [0, 0.5, 0.5, 0]
    assert design_row(step_quantities(0, 64), KNOTS)[hats:] == [0, 0, 0, 2]
    assert design_row(step_quantities(), KNOTS)[hats:] == [0, 0, 0, 0]
    assert design_row(step_quantities(0, 8), KNOTS)[hats:] == [0, 0, 1, 0]
    # a prompt's last row goes through the LM head with the decode rows: 7 decodes + 1 prompt price as 8 rows
    assert design_row(step_quantities(90, 7), KNOTS)[hats:] == design_row(step_quantities(0, 8), KNOTS)[hats:]
    assert design_row(step_quantities(300, 0, prompts=4), KNOTS)[hats:] == [0, 1, 0, 0]
    # a chunk that does not complete its prompt samples nothing
    partial = step_quantities(90, 7)
    partial[-1] = 0
    assert design_row(partial, KNOTS)[hats:] == design_row(step_quantities(0, 7), KNOTS)[hats:]


def test_the_idle_time_before_a_step_enters_piecewise_linearly_and_levels_off():
    """A step after the engine sat idle runs slower the longer the pause, up to a plateau (on this lab's CPU +0.6 ms
    after 2 ms, +2 ms from about 10-20 ms on): hats on the measured pauses, linear through 0 below the first, flat
    beyond the last; 0 back to back."""
    first = len(LINEAR) + len(STEP_FEATURES)

    def idle_weights(idle_s):
        quantities = step_quantities(64)
        quantities[IDLE_S] = idle_s
        return design_row(quantities, KNOTS)[first:first + len(IDLE_FEATURES)]
    assert IDLE_KNOTS_S == (0.002, 0.01, 0.25) and IDLE_FEATURES[0] == "after_idle@2ms"
    assert idle_weights(0.0) == [0, 0, 0]
    assert idle_weights(0.001) == pytest.approx([0.5, 0, 0])
    assert idle_weights(0.006) == pytest.approx([0.5, 0.5, 0])
    assert idle_weights(0.25) == pytest.approx([0, 0, 1]) and idle_weights(30.0) == pytest.approx([0, 0, 1])
    # every grid but the quick one measures a prefill after each pause, so each hat has its samples
    for grid in ("full", "small"):
        pauses = {settings.get("idle_s") for _, settings, _ in _scenarios(16, grid)} - {None}
        assert pauses == set(IDLE_KNOTS_S), grid


def test_plan_quantities_count_the_prompt_chunks_that_sample():
    from lab.sched.scheduler import PrefillChunk, SchedulerOutput

    out = SchedulerOutput(0)
    out.prefill_chunks = [PrefillChunk("a", 0, 32, samples=["a"]), PrefillChunk("b", 0, 64),
                          PrefillChunk("c", 0, 16, samples=["c0", "c1", "c2"])]  # b's prompt continues next step
    out.num_prefill_tokens, out.num_decode_seqs = 112, 5
    quantities = plan_quantities(out, 16)
    assert quantities[1] == 3 and quantities[PREFILL_LOGIT_ROWS] == 2 and quantities[DECODE_SEQS] == 5


def test_the_fit_recovers_known_coefficients():
    """Batch sizes 8 and 32 nearly as costly (as a CPU's BLAS makes them): a straight line could not fit this."""
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(200):
        kv_tokens = float(rng.integers(0, 10**4))
        prefills = rng.random() < 0.5  # else a decode-only step (no prefill_step)
        quantities = [1.0, float(rng.integers(1, 30)) * prefills, float(rng.integers(1, 600)) * prefills,
                      float(rng.choice(KNOTS + [0, 16])),
                      float(rng.integers(0, 10**5)), kv_tokens, kv_tokens + float(rng.integers(0, 10**4)),
                      float(rng.integers(0, 4)), float(rng.integers(0, 40)),
                      float(rng.choice([0, 0, *IDLE_KNOTS_S, 0.006, 1.0])),
                      float(rng.integers(0, 2000)) * (rng.random() < 0.5), float(rng.integers(0, 4)) * prefills]
        true = sum(FIXED[name] * value for name, value in zip(feature_names(KNOTS), design_row(quantities, KNOTS)))
        samples.append({"quantities": quantities, "duration_s": true * rng.normal(1.0, 0.005)})
    coefficients, median_error, _ = fit(samples, KNOTS)
    assert median_error < 0.01
    for name in ("constant", "prefill_tokens", *IDLE_FEATURES, "prefill_step", "logit_rows@8", "logit_rows@32"):
        assert coefficients[name] == pytest.approx(FIXED[name], rel=0.1)
    # the two after-prefill terms are small beside the noise and trade off; their sum at a typical size is pinned
    def after_1000(c):
        return c["after_prefill_step"] + 1000 * c["previous_prefill_tokens"]
    assert after_1000(coefficients) == pytest.approx(after_1000(FIXED), rel=0.1)


def test_the_ladder_decodes_every_batch_size_and_each_is_a_knot():
    """A CPU's BLAS picks its kernel by the row count, so a batch's cost is not monotone in its size (MKL on an AMD
    EPYC: 3 rows of the 0.6B LM head took 100 ms, 4 rows 72). The small grid's ladder decodes every size from 16 down
    to 1 once, and a fit with a knot at each prices such a table exactly where interpolation could not."""
    import torch

    from lab.engine import load_model

    assert decode_knots("small") == list(range(1, 17)) + [32, 64] and set(range(1, 33)) <= set(decode_knots("full"))
    name, settings, requests = next(s for s in _scenarios(16, "small") if s[0].startswith("decode ladder"))
    base = EngineConfig(block_size=16, num_blocks=1)
    seen = []
    _run_scenario(load_model("tiny", base)[0], base, settings, requests, torch.Generator().manual_seed(0),
                  lambda quantities, duration_s: seen.append(quantities))
    assert [q[DECODE_SEQS] for q in seen if q[PREFILL_TOKENS] == 0] == list(range(16, 0, -1))

    knots = decode_knots("small")
    batch_ms = {batch: 30 + 70 * (batch % 4 == 3) + 2 * batch for batch in range(1, 17)}  # 3, 7, 11, 15 slow
    samples = [{"quantities": step_quantities(0, batch), "duration_s": ms / 1e3} for batch, ms in batch_ms.items()]
    samples += [{"quantities": step_quantities(tokens), "duration_s": (30 + tokens / 10) / 1e3}
                for tokens in (16, 64, 256)]
    coefficients, _, _ = fit(samples, knots)
    profile = Profile("tiny", "cpu", "torch.float32", 16, "torch", coefficients, knots)
    for batch, ms in batch_ms.items():
        assert profile.quantities_predictor()(step_quantities(0, batch)) == pytest.approx(ms / 1e3, rel=1e-3)


def test_profiled_engines_start_with_their_free_blocks_scattered():
    """A serving engine's free blocks are scattered once requests have come and gone, and on a CPU a decode step
    gathers scattered K/V 3-4 % slower than a fresh pool's consecutive blocks: the profile measures the former."""
    import random

    from lab.kv_cache.block_manager import KVBlockManager

    manager = KVBlockManager(64, 4)
    scatter_free_blocks(manager, random.Random(0))
    manager.check_invariants()
    assert manager.num_free_blocks == 64 and manager.num_used_blocks == 0
    manager.create_sequence("a", num_prompt_tokens=4 * 16)
    table = manager.get_block_table("a")
    assert sorted(table) != table and len(set(table)) == 16
    again = KVBlockManager(64, 4)
    scatter_free_blocks(again, random.Random(0))
    again.create_sequence("a", num_prompt_tokens=4 * 16)
    assert again.get_block_table("a") == table  # seeded


def test_the_fit_predicts_the_mean_of_right_skewed_step_times():
    """A CPU's step times scatter upwards (a slow repeat, never a much faster one); sums of steps (a makespan, a
    TPOT) follow their mean. Weighting each row by 1 / its measured duration would discount exactly the slow ones
    (here: 6 % low); the fit weights by 1 / its fitted duration instead."""
    rng = np.random.default_rng(3)
    samples, true_means = [], []
    for _ in range(300):
        tokens = float(rng.integers(0, 600))
        true = FIXED["constant"] + FIXED["prefill_tokens"] * tokens
        quantities = [1.0, 0.0, tokens] + [0.0] * 9
        samples.append({"quantities": quantities, "duration_s": true * (0.8 + rng.exponential(0.2))})
        true_means.append(true)
    coefficients, _, _ = fit(samples, KNOTS)
    predicted = [coefficients["constant"] + coefficients["prefill_step"] * (s["quantities"][2] > 0)
                 + coefficients["prefill_tokens"] * s["quantities"][2] for s in samples]
    measured = [s["duration_s"] for s in samples]
    assert sum(predicted) == pytest.approx(sum(measured), rel=0.015)
    assert sum(predicted) == pytest.approx(sum(true_means), rel=0.03)


@pytest.mark.parametrize("times, expected, stalled", [
    ([0.004, 0.0046], 0.0043, 0), ([0.0046, 0.2414], 0.0046, 1), ([0.004, 0.0119, 0.005], 0.0209 / 3, 0),
    ([0.002], 0.002, 0)])
def test_a_stalled_repeat_is_left_out_of_its_step_s_mean(times, expected, stalled):
    """A repeat more than three times its shape's fastest was held up by something else; the others' mean stays
    (a slow repeat under three times counts: step times scatter upwards and sums follow their mean)."""
    assert steady_mean(times) == (pytest.approx(expected), stalled)


def test_one_stalled_step_after_a_pause_does_not_price_every_step_after_a_pause():
    """Minimized from a vLLM profile measured in the thirteenth-session twin run: a 192-token prefill after a 250 ms
    pause timed at 241 ms in one of its two repeats (4.6 ms in the other). Averaged in, the fit put 60 ms on the
    after-idle term, and every step after a pause of tens of ms was priced up to 10 ms longer."""
    truth = dict.fromkeys(feature_names([1, 4, 16]), 0.0) | {
        "constant": 1.3e-3, "prefill_tokens": 5e-6, "prefill_step": 5e-4, "decode_kv_tokens": 1e-7,
        "after_idle@10ms": 7.5e-4, "after_idle@250ms": 1.9e-3, "logit_rows@1": 1e-5, "logit_rows@4": 4e-5,
        "logit_rows@16": 3e-4}

    def shape(prefill=0, decode=0, idle=0.0):
        return (1.0, float(prefill > 0), float(prefill), float(decode), 0.0, 100.0 * decode, 0.0, 0.0, 0.0, idle,
                0.0, float(prefill > 0))
    shapes = [shape(prefill=n) for n in (16, 64, 192, 512)] + [shape(decode=n) for n in (1, 4, 16)]
    shapes += [shape(prefill=n, idle=idle) for idle in (0.01, 0.25) for n in (64, 192)]
    stalled_shape = shape(prefill=192, idle=0.25)

    def duration(quantities, coefficients=truth):
        row = design_row(list(quantities), [1, 4, 16])
        return sum(coefficients[name] * x for name, x in zip(feature_names([1, 4, 16]), row))
    groups = {key: [duration(key), 1.02 * duration(key)] for key in shapes}
    groups[stalled_shape] = [duration(stalled_shape), 0.2414]
    sources = {key: ["s"] for key in shapes}
    kept = grouped_samples(groups, sources)
    assert [s["stalled"] for s in kept].count(1) == 1 and sum(s["repeats"] for s in kept) == 2 * len(shapes) - 1

    def priced(samples):
        return duration(stalled_shape, fit(samples, [1, 4, 16])[0])
    assert priced(kept) == pytest.approx(duration(stalled_shape), rel=0.1)
    averaged = [dict(sample, duration_s=float(np.mean(groups[tuple(sample["quantities"])]))) for sample in kept]
    assert priced(averaged) > 5 * duration(stalled_shape)  # what the mean of every repeat made of it


def test_a_quick_profile_of_the_tiny_engine_fits_and_round_trips(tmp_path):
    profile = profile_engine("tiny", block_size=4, repeats=1, grid="quick")
    assert len(profile.samples) >= 8 and set(profile.coefficients) == set(feature_names(profile.decode_knots))
    assert all(v >= 0 and math.isfinite(v) for v in profile.coefficients.values())
    assert math.isfinite(profile.holdout_median_rel_error) and any(s["holdout"] for s in profile.samples)
    # the first decode of "decode 4x32" records the size of the prefill before it
    assert any(s["quantities"][PREVIOUS_PREFILL_TOKENS] == 128 and s["quantities"][PREFILL_TOKENS] == 0
               for s in profile.samples)
    assert 0 < profile.add_request_s < 0.01  # measured: tens of microseconds a request
    path = tmp_path / "new" / "folder" / "p.json"  # as `--out` allows: folders created, not a lost profile
    profile.save(path)
    assert Profile.load(path) == profile


def test_steps_beyond_the_profile_s_grid_are_named_with_both_ranges():
    """A profile measured decodes of 2 sequences up to 64 tokens and a 128-token prefill; a run that decodes one
    sequence of 1,000 tokens (a total inside the grid's) is priced by extrapolation, and says so."""
    from lab.profiling.profile import RANGE_QUANTITIES

    profile = fixed_profile()
    decode = [1, 0, 0, 2, 0, 128, 128, 0, 0, 0, 0, 0]  # 2 sequences of 64 tokens
    prefill = [1, 1, 128, 0, 8256, 0, 0, 0, 0, 0, 0, 1]
    profile.samples = [{"quantities": q, "duration_s": 1e-3, "repeats": 1, "holdout": False} for q in (decode, prefill)]
    highest = [0.0] * len(RANGE_QUANTITIES)
    step_time = profile.predictor(highest)
    plan = type("Plan", (), dict(blocks_to_swap_out=[], blocks_to_swap_in=[], num_decode_seqs=1,
                                 decode_max_kv_len=1000, prefill_chunks=[], num_prefill_tokens=0,
                                 prefill_attention_pairs=0, decode_kv_tokens=1000, blocks_to_copy=[]))()
    assert step_time(plan) == profile.quantities_predictor()([1, 0, 0, 1, 0, 1000, 1000, 0, 0, 0, 0, 0])
    assert profile.beyond_measured(highest) == ("decode_kv_tokens up to 1,000 (measured up to 128); decode_context "
                                                "up to 1,000 (measured up to 64)")
    assert profile.beyond_measured(list(map(min, highest, [128, 8256, 2, 128, 0, 0, 64]))) == ""  # within the grid


def test_the_measured_range_is_each_range_quantity_s_largest_sample():
    from lab.profiling.profile import RANGE_QUANTITIES, range_quantities

    rng, profile = np.random.default_rng(), fixed_profile()
    assert profile.measured_range() == [0.0] * len(RANGE_QUANTITIES)  # no samples
    for size in (1, 2, 37):
        rows = rng.integers(0, 5000, (size, 12)).astype(float)
        rows[rng.random(size) < 0.3, 3] = 0  # some steps decode nothing: no context
        profile.samples = [{"quantities": row.tolist(), "duration_s": 1e-3} for row in rows]
        expected = [max(column) for column in zip(*(range_quantities(row.tolist()) for row in rows))]
        assert profile.measured_range() == expected


def test_a_profile_priced_simulation_reports_where_it_extrapolated(tmp_path):
    profile = profile_engine("tiny", block_size=16, repeats=1, grid="quick")
    config = SimConfig(allocator="paged", block_size=16, capacity_tokens=64_000, max_model_len=4096, profile=profile)
    short = Simulator(twin_workload("fixed", 4, None, 16, 8), config).run().summary
    long = Simulator(twin_workload("fixed", 4, None, 3000, 8), config).run().summary
    assert short["profile_extrapolation"] == ""
    assert "prefill_tokens up to 6,000" in long["profile_extrapolation"]  # two prompts a step (8,192-token budget)
    assert "decode_context up to 3,008" in long["profile_extrapolation"]
    assert "profile_extrapolation" not in Simulator(twin_workload("fixed", 4, None, 16, 8),
                                                    SimConfig(capacity_tokens=64_000)).run().summary
    twin = run_twin(twin_workload("fixed", 2, None, 600, 4), TwinConfig("tiny", EngineConfig(block_size=16)), profile)
    assert "decode_context up to 608" in twin.extrapolation  # the twin says so beside its errors


def test_profiling_keeps_freed_memory_for_reuse():
    """A fresh engine per scenario must not pay a page fault per 4 KiB of activations in its timed steps (a long-lived
    engine does not): freed blocks up to 32 MiB stay in the process. By default glibc gives a big step's freed
    activations back to the system, 18,400 page faults a step here. Checked in fresh processes: the heap of this
    one depends on the tests before."""
    import subprocess
    import sys

    code = """if True:
        import ctypes, json, resource, sys
        from lab.profiling.profile import steady_state_allocator
        if sys.argv[1] == "steady" and not steady_state_allocator():
            print("null"); sys.exit()
        libc = ctypes.CDLL(None)
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        libc.memset.argtypes, libc.free.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], [ctypes.c_void_p]
        def faults_of_a_step(sizes=(24 << 20,) * 4):  # a big step's activations, written, then freed
            before, blocks = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
            for size in sizes:
                blocks.append(ctypes.c_void_p())
                assert libc.posix_memalign(ctypes.byref(blocks[-1]), 64, size) == 0
                libc.memset(blocks[-1], 1, size)
            for block in blocks:
                libc.free(block)
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        print(json.dumps([faults_of_a_step() for _ in range(8)]))
    """

    def run(mode):
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    steady = run("steady")
    if steady is None:
        pytest.skip("the C library has no mallopt (not glibc)")
    # the heap grows to hold the step once or twice, then it is reused. Not every step is free: a machine's own
    # reclaim may page out a heap block now and then (this VM's DAMON pageout scheme did, 6,144 faults in one step)
    assert sorted(steady[2:])[1] < 64, steady
    default = run("default")
    # without it glibc trims what a step freed (more than its dynamic threshold, at most 64 MiB) every time
    assert min(default[2:]) > 1000, default
    assert sum(steady[2:]) < sum(default[2:]) / 3, (steady, default)


def test_admitting_requests_delays_the_next_step_by_the_profile_s_add_request_time():
    """The engine admits arrivals between steps (``add_request``, 34 us a request on the tiny CPU model): three
    requests at t = 0 start the first step 3 x add_request_s late, and a request arriving at an idle engine its own
    prefill by one add_request_s; step durations are unchanged."""
    workload = Workload("admit", np.array([0.0, 0.0, 0.0, 5.0]), np.array([20, 20, 20, 20]), np.array([4, 4, 4, 4]))
    charged, free = fixed_profile(), fixed_profile()
    charged.add_request_s = 1e-3
    config = dict(capacity_tokens=4096, block_size=4, record_steps=True)
    runs = {name: Simulator(workload, SimConfig(profile=profile, **config)).run()
            for name, profile in (("charged", charged), ("free", free))}
    ttft = {name: (run.requests["first_token_s"] - run.requests["arrival_s"]).to_numpy() for name, run in runs.items()}
    assert ttft["charged"][:3] - ttft["free"][:3] == pytest.approx([3e-3] * 3)
    assert ttft["charged"][3] - ttft["free"][3] == pytest.approx(1e-3)
    assert (runs["charged"].steps["duration_s"].to_numpy() == runs["free"].steps["duration_s"].to_numpy()).all()


def test_a_step_after_the_engine_idled_is_priced_by_how_long_it_idled():
    """Requests at 0, 0.01, 0.05 and 5 s: the second arrives while the first runs (no idle time), the third after
    the engine sat idle some 20 ms (priced between the 10 and 250 ms pauses), the fourth after ~5 s (flat beyond
    250 ms: 3 ms here); in a clocked run and in a replay told so."""
    workload = Workload("gaps", np.array([0.0, 0.01, 0.05, 5.0]), np.array([20, 20, 20, 20]), np.array([4, 4, 4, 4]))
    priced, free = fixed_profile(), fixed_profile()
    free.coefficients.update(dict.fromkeys(IDLE_FEATURES, 0.0))
    config = dict(capacity_tokens=4096, block_size=4, record_steps=True)
    ttft, requests = {}, {}
    for name, profile in (("priced", priced), ("free", free)):
        requests[name] = Simulator(workload, SimConfig(profile=profile, **config)).run().requests
        ttft[name] = (requests[name]["first_token_s"] - requests[name]["arrival_s"]).to_numpy()
    idle_s = 0.05 - requests["free"]["finish_s"].iloc[1]  # the third request's wait on an empty engine
    assert 0.01 < idle_s < 0.25 and requests["free"]["finish_s"].iloc[0] > 0.01
    expected = ((0.25 - idle_s) * 2.5e-3 + (idle_s - 0.01) * 3e-3) / 0.24
    assert ttft["priced"][:2] == pytest.approx(ttft["free"][:2], abs=1e-12)
    assert ttft["priced"][2] - ttft["free"][2] == pytest.approx(expected)
    assert ttft["priced"][3] - ttft["free"][3] == pytest.approx(3e-3)
    back_to_back, idled = (replay(workload, SimConfig(profile=priced, **config), [0, 0, 4, 8], idle)["duration_s"]
                           .to_numpy() for idle in ({}, {8: 0.006}))
    assert idled[8] - back_to_back[8] == pytest.approx((1e-3 + 2.5e-3) / 2)  # halfway between the 2 and 10 ms pauses
    assert (np.delete(idled, 8) == np.delete(back_to_back, 8)).all()


def test_the_step_after_a_prefill_pays_for_it():
    """The profile's after_prefill_step and previous_prefill_tokens terms (the prefill's activations evicted what the
    next step reads: on the tiny CPU model the first decode after a 512-token prefill runs ~15 % slower) price only
    the step right after a prefill, by that prefill's size, in a clocked run and in a replay."""
    workload = Workload("one", np.array([0.0]), np.array([20]), np.array([4]))
    priced, free = fixed_profile(), fixed_profile()
    free.coefficients.update(after_prefill_step=0.0, previous_prefill_tokens=0.0)
    config = dict(capacity_tokens=4096, block_size=4, record_steps=True)
    durations = {name: Simulator(workload, SimConfig(profile=profile, **config)).run().steps["duration_s"].to_numpy()
                 for name, profile in (("priced", priced), ("free", free))}
    extra = durations["priced"] - durations["free"]
    assert extra[1] == pytest.approx(2e-4 + 20 * 1e-7) and extra[0] == extra[2] == extra[3] == 0
    replayed = replay(workload, SimConfig(profile=priced, **config), [0])["duration_s"].to_numpy()
    assert (replayed == durations["priced"]).all()


def test_calibrated_twins_take_turns_and_compare_every_case():
    workload = synthetic_workload(SyntheticSpec(preset="random", num_requests=12, input_len=40, output_len=12,
                                                range_ratio=0.5, seed=4))
    cases = {"recompute": TwinCase(workload, EngineConfig(block_size=4, num_blocks=40)),
             "swap": TwinCase(lambda runs: workload, EngineConfig(block_size=4, num_blocks=40,
                                                                 preemption_mode="swap", num_cpu_blocks=64))}
    profile, results = calibrated_twins("tiny", cases, grid="quick", repeats=2)
    assert {s["repeats"] for s in profile.samples} >= {2} and list(results) == ["recompute", "swap"]
    for result in results.values():
        table = result.table.set_index("metric")
        assert table.loc["schedule_identical", "simulated"] == 1.0 and table.loc["preemptions", "real"] > 0
        assert result.workload is workload and "noise_floor" in table
    with pytest.raises(ValueError, match="same block_size"):
        calibrated_twins("tiny", {"a": TwinCase(workload, EngineConfig(block_size=4)),
                                  "b": TwinCase(workload, EngineConfig(block_size=8))}, grid="quick")


def test_profiling_in_rounds_needs_a_measured_round_and_keeps_the_samples_of_each():
    profiler = Profiler("tiny", block_size=4, grid="quick")
    profiler.run_round()  # warm-up: not recorded
    with pytest.raises(ProfileError, match="measured round"):
        profiler.result()
    profiler.run_round()
    profiler.run_round()
    profile = profiler.result()
    assert profiler.rounds_run == 3 and {s["repeats"] for s in profile.samples} >= {2}


def test_the_timed_engine_starts_with_its_free_blocks_scattered(monkeypatch):
    """As the profile's engines do: a fresh pool would hand the first request consecutive blocks."""
    import simulator.twins.twin as twin

    tables = []

    class Recorded(twin.LLMEngine):
        def step(self):
            outputs = super().step()
            if self.num_steps == 1:
                tables.extend(pool_snapshot(self.block_manager).block_tables.values())
            return outputs

    monkeypatch.setattr(twin, "LLMEngine", Recorded)
    workload = synthetic_workload(SyntheticSpec(preset="fixed", num_requests=1, input_len=60, output_len=3,
                                                rate=math.inf))
    twin.run_real(workload, TwinConfig(engine=EngineConfig(block_size=4, num_blocks=256)))
    timed = tables[-1]  # the warm-up engines' tables come first
    assert len(timed) == 15 and timed != sorted(timed)


def test_a_model_with_a_short_context_profiles_the_scenarios_it_can_hold():
    from lab.engine import EngineConfig, load_model

    hf_model = load_model("tiny", EngineConfig())[0]
    full = Profiler(hf_model, block_size=16)
    assert any(name == "prefill 4096" for name, _, _ in full.scenarios)
    hf_model.config.max_position_embeddings = 600  # e.g. a checkpoint trained on short contexts
    short = Profiler(hf_model, block_size=16)
    names = [name for name, _, _ in short.scenarios]
    assert "prefill 512" in names and "prefill 1024" not in names and "decode 4x384" in names
    assert "prefill 128 after a cached prefix" in names  # 256 cached + 128 + 1 output
    assert len(short.generators) == short.num_scenarios < full.num_scenarios


TWIN_CASES = {
    "light": dict(num_blocks=256),
    "heavy with preemption": dict(num_blocks=40),
    "chunked": dict(num_blocks=60, scheduling="chunked", max_num_batched_tokens=64),
    "swap": dict(num_blocks=40, preemption_mode="swap", num_cpu_blocks=128),
}


@pytest.mark.parametrize("case", list(TWIN_CASES))
def test_the_twin_plans_the_engine_s_schedule(case):
    workload = synthetic_workload(SyntheticSpec(preset="random", num_requests=16, input_len=40, output_len=12,
                                                range_ratio=0.5, seed=4))
    result = run_twin(workload, TwinConfig(engine=EngineConfig(block_size=4, **TWIN_CASES[case])), fixed_profile())
    assert result.first_difference == "", result.first_difference
    table = result.table.set_index("metric")
    assert table.loc["schedule_identical", "simulated"] == 1.0
    assert table.loc["preemptions", "real"] == table.loc["preemptions", "simulated"]
    assert table.loc["peak_blocks_in_use", "real"] == table.loc["peak_blocks_in_use", "simulated"]
    if case != "light":
        assert table.loc["preemptions", "real"] > 0


@pytest.mark.parametrize("sharing", ["system prompt", "mooncake hash_ids"])
def test_the_twin_plans_the_engine_s_prefix_cache_hits(sharing):
    """Where the workload shares prefixes, the real run's prompts share them too (one random token per
    distinct id of the workload's own), so the engine's prefix cache hits where the simulator's does and the schedules stay identical.
    With random prompts the engine prefilled the shared tokens again: the schedules parted at the second step."""
    if sharing == "system prompt":
        workload = synthetic_workload(SyntheticSpec(preset="random", num_requests=12, input_len=40, output_len=8,
                                                    range_ratio=0.5, shared_prefix_tokens=24, seed=2))
    else:  # a Mooncake trace's 512-token blocks: two conversations share their first block, one shares nothing
        workload = Workload("mooncake", np.zeros(3), np.array([600, 700, 300]), np.array([4, 6, 5]),
                            prompt_block_ids=[[0, 1], [0, 2], [3]])
    result = run_twin(workload, TwinConfig(engine=EngineConfig(block_size=4, num_blocks=1024)), fixed_profile())
    assert result.first_difference == "", result.first_difference
    assert result.real_steps["num_prefill_tokens"].sum() < workload.prompt_tokens.sum()  # the cache hit


def test_the_real_run_is_warmed_up_on_its_own_workload_s_first_steps(monkeypatch):
    """Before the clock starts, throw-away engines run the workload's first steps (its largest prefill), so the
    timed run's first step does not fault in memory a long-running engine would have mapped; the timed engine's
    log starts with the same first step, untouched by the warm-up."""
    import simulator.twins.twin as twin

    engines = []

    class Recorded(twin.LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(twin, "LLMEngine", Recorded)
    workload = synthetic_workload(SyntheticSpec(preset="fixed", num_requests=12, input_len=50, output_len=6,
                                                rate=math.inf))
    engine = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256)
    run = twin.run_real(workload, TwinConfig(engine=engine))
    timed, *warm = engines
    assert run.engine is timed and len(warm) == twin.WARM_UP_RUNS
    for throwaway in warm:
        log = throwaway.step_log()
        assert len(log) == twin.WARM_UP_STEPS
        assert log.iloc[0]["num_prefill_tokens"] == 250  # five 50-token prompts fill the 256-token budget
        first = ["num_prefill_tokens", "num_running", "blocks_in_use"]  # (it queues at most max_num_seqs requests)
        assert log[first].iloc[0].equals(run.steps[first].iloc[0])
        # no larger than the warm-up can use: beside a pool sized from a GPU's free memory, a second would not fit
        assert throwaway.block_manager.num_physical_blocks == 8 * 14 < run.engine.block_manager.num_physical_blocks
    assert run.steps["num_finished"].sum() == 12 and len(run.admitted_after) == 12


BAD_PROFILES = [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (json.dumps({"version": 99}).encode(), "version"),
    (json.dumps({"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "f", "backend": "torch",
                 "block_size": 4,
                 "coefficients": {**FIXED, "constant": -1.0}, "decode_knots": KNOTS, "samples": []}).encode(),
     r"coefficients must be numbers in \[0, 1000\]"),
    (json.dumps({"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "f", "backend": "torch",
                 "block_size": 4,
                 "coefficients": {**FIXED, "constant": 1e308}, "decode_knots": KNOTS, "samples": []}).encode(),
     r"coefficients must be numbers in \[0, 1000\]"),
    (json.dumps({"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "f", "backend": "torch",
                 "block_size": "4", "coefficients": FIXED, "decode_knots": KNOTS, "samples": []}).encode(),
     "block_size"),
    (json.dumps({"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "f", "backend": "torch",
                 "block_size": 4, "coefficients": FIXED, "decode_knots": [4, 1], "samples": []}).encode(),
     "decode_knots"),
    (json.dumps({"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "f", "backend": "torch",
                 "block_size": 4, "coefficients": FIXED, "decode_knots": [1, 4, 8], "samples": []}).encode(),
     "for exactly"),
    (json.dumps({"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "f", "backend": "torch",
                 "block_size": 4, "coefficients": FIXED, "decode_knots": KNOTS,
                 "samples": [{"quantities": [1.0] * 11, "duration_s": 0.002}]}).encode(),  # a version-7 sample
     "sample 0 must hold 12 numeric quantities"),
    (json.dumps({"version": PROFILE_VERSION, "model": "tiny", "device": "cpu", "dtype": "f", "backend": "torch",
                 "block_size": 4, "coefficients": FIXED, "decode_knots": KNOTS, "samples": [],
                 "add_request_s": -1e-5}).encode(), "add_request_s must be a finite number >= 0"),
]


@pytest.mark.parametrize("data,message", BAD_PROFILES,
                         ids=["text", "list", "version", "negative", "huge", "type", "knot order", "knots vs coefficients",
                              "short sample", "negative add_request_s"])
def test_malformed_profiles_are_rejected(tmp_path, data, message):
    (tmp_path / "p.json").write_bytes(data)
    with pytest.raises(ProfileError, match=message):
        Profile.load(tmp_path / "p.json")
    with pytest.raises(ValueError, match=message):
        Simulator(synthetic_workload(SyntheticSpec(num_requests=5)),
                  SimConfig(profile=str(tmp_path / "p.json"), capacity_tokens=4096))


def test_mismatched_profiles_are_rejected():
    workload = synthetic_workload(SyntheticSpec(num_requests=5))
    with pytest.raises(ProfileError, match="block_size 4, not 16"):
        Simulator(workload, SimConfig(profile=fixed_profile(4), capacity_tokens=4096, block_size=16))
    with pytest.raises(ValueError, match="needs capacity_tokens"):
        Simulator(workload, SimConfig(profile=fixed_profile(16)))
    with pytest.raises(ProfileError, match="model 'qwen3-0.6b'"):
        run_twin(workload, TwinConfig(engine=EngineConfig(block_size=16)), fixed_profile(16, model="qwen3-0.6b"))


@pytest.mark.parametrize("field,value,message", [
    ("device", "cuda:0", "device cuda, but this engine runs cpu"),
    ("dtype", "torch.bfloat16", "dtype torch.bfloat16, but this engine runs torch.float32"),
    ("backend", "cupy", "attention backend cupy, but this engine runs torch"),
])
def test_a_profile_of_another_device_dtype_or_backend_is_rejected_before_any_run(monkeypatch, field, value, message):
    """A profile measured on a GPU (bf16, the cupy kernels) does not price a CPU engine: the twin says so before
    it runs anything."""
    import dataclasses

    import simulator.twins.twin as twin

    monkeypatch.setattr(twin, "run_real", lambda *args: pytest.fail("ran the engine with a mismatched profile"))
    profile = dataclasses.replace(fixed_profile(16), **{field: value})
    with pytest.raises(ProfileError, match=message):
        run_twin(synthetic_workload(SyntheticSpec(num_requests=2)), TwinConfig(engine=EngineConfig(block_size=16)),
                 profile)


def test_timed_arrivals_replay_the_real_schedule_step_for_step():
    workload = synthetic_workload(SyntheticSpec(preset="random", num_requests=16, input_len=40, output_len=12,
                                                range_ratio=0.5, rate=200.0, seed=6))
    result = run_twin(workload, TwinConfig(engine=EngineConfig(block_size=4, num_blocks=40)), fixed_profile())
    table = result.table.set_index("metric")
    assert table.loc["replay_schedule_identical", "simulated"] == 1.0
    assert table.loc["replay_step_time_median", "rel_error"] >= 0


@pytest.mark.parametrize("modes", [dict(num_blocks=60), dict(num_blocks=16, num_cpu_blocks=8, scheduling="chunked",
                                                             preemption_mode="swap", max_num_batched_tokens=24)],
                         ids=["plain", "chunked-swap"])
def test_the_simulator_s_clock_queues_arrivals_as_the_engine_and_the_replay_do(monkeypatch, modes):
    """On its clock the simulator queues a request before the first step that starts at or after its arrival (a
    request arriving during a step joins at the next one, as in ``run_real``), and a step after idle time is priced by its length; the replay, given the steps at which the clock queued each request and
    the idle steps, reproduces that run step for step, durations included."""
    workload = synthetic_workload(SyntheticSpec(preset="random", num_requests=40, input_len=24, output_len=10,
                                                range_ratio=0.5, rate=20.0, burstiness=0.3, seed=4))
    engine = {"scheduling": "prefill-first", "preemption_mode": "recompute", "num_cpu_blocks": 0,
              "max_num_batched_tokens": 4096, **modes}
    config = SimConfig(allocator="paged", block_size=4, capacity_tokens=engine["num_blocks"] * 4, max_model_len=4096,
                       scheduling=engine["scheduling"], preemption_mode=engine["preemption_mode"],
                       num_cpu_blocks=engine["num_cpu_blocks"], max_num_batched_tokens=engine["max_num_batched_tokens"],
                       profile=fixed_profile(), record_steps=True)
    queued_after, step_starts, idle_steps = [], {}, {}
    arrive, iterate = Simulator._arrive, Simulator._iterate

    def recording_arrive(sim, request):
        queued_after.append(sim.scheduler.num_steps)
        arrive(sim, request)

    def recording_iterate(sim):
        step_starts.setdefault(sim.scheduler.num_steps, sim.time)
        if sim.idle_s:
            idle_steps[sim.scheduler.num_steps] = sim.idle_s
        iterate(sim)

    monkeypatch.setattr(Simulator, "_arrive", recording_arrive)
    monkeypatch.setattr(Simulator, "_iterate", recording_iterate)
    clocked = Simulator(workload, config).run().steps
    monkeypatch.undo()
    starts = [step_starts[step] for step in range(len(clocked))] + [math.inf]
    for arrival, steps_before in zip(workload.arrival_s, queued_after):
        assert (steps_before == 0 or starts[steps_before - 1] < arrival) and arrival <= starts[steps_before]
    assert idle_steps and 0 < sum(a > 0 for a in queued_after) < len(workload)
    assert any(arrival < starts[steps_before] for arrival, steps_before in zip(workload.arrival_s, queued_after))
    if engine["preemption_mode"] == "swap":
        assert clocked["num_swapped_out"].sum() > 0
    pd.testing.assert_frame_equal(replay(workload, config, queued_after, idle_steps), clocked)


def test_the_fidelity_benchmark_reports_every_metric_for_every_load(monkeypatch):
    from simulator.twins import twin

    monkeypatch.setitem(twin.BENCH_MODELS, "tiny", twin.BenchModel("quick", 6, 16, 6, 64, repeats=2,
                                                                          light_requests=4, chunked_budget=12))
    table = twin.bench_twin(("tiny",))  # the model's own repeats
    for load in ("saturated", "light", "chunked"):
        rows = table[table["load"] == load].set_index("metric")
        identical = "replay_schedule_identical" if load == "light" else "schedule_identical"
        assert set(twin.METRICS) <= set(rows.index) and rows.loc[identical, "simulated"] == 1.0
        assert rows.loc["speedup_vs_real_time", "rel_error"] > 1 and (rows["noise_floor"].dropna() >= 0).all()
    rates = table[table["metric"] == "arrival_rate_req_s"].set_index("load")["real"]
    assert rates["saturated"] == float("inf") and 0 < rates["light"] < float("inf")
    sizes = table[table["metric"] == "num_requests"].set_index("load")["real"]
    assert sizes["saturated"] == 6 and sizes["light"] == 4
    assert sizes["chunked"] == 6
    with pytest.raises(ValueError, match="no benchmark settings"):
        twin.bench_twin(("qwen3-8b",))


def test_the_cli_profiles_then_runs_the_twin_and_writes_both_step_times(tmp_path, capsys):
    from lab.cli.main import main
    from simulator.cli.main import main as simulator_main

    profile, table, steps = tmp_path / "p.json", tmp_path / "twin.csv", tmp_path / "steps.csv"
    assert main(["profile", "--grid", "quick", "--repeats", "1", "--block-size", "4", "--out", str(profile)]) == 0
    printed = capsys.readouterr().out
    assert "held-out relative error" in printed and "per scenario" in printed and "prefill 64" in printed
    from lab.profiling.profile import Profile, _scenarios

    listed = set(Profile.load(profile).scenario_errors()["scenario"])
    assert listed == {name for name, _, _ in _scenarios(4, "quick")}  # every scenario, shared shapes too
    assert simulator_main(["twin", "--profile", str(profile), "--num-requests", "6", "--input-len", "20", "--output-len", "5",
                 "--block-size", "4", "--num-blocks", "24", "--max-num-seqs", "3", "--out", str(table),
                 "--steps-out", str(steps)]) == 0
    rows = pd.read_csv(table).set_index("metric")
    assert rows.loc["schedule_identical", "simulated"] == 1.0
    log = pd.read_csv(steps)
    assert len(log) > 5 and (log["real_duration_s"] > 0).all() and (log["simulated_duration_s"] > 0).all()
    assert log["num_running"].max() == 3  # both sides capped by --max-num-seqs
    printed = capsys.readouterr().out
    assert "measured / modelled step time through the run" in printed and "measured_over_modelled" in printed
    assert simulator_main(["twin", "--profile", str(profile), "--block-size", "16", "--num-requests", "2"]) == 2  # mismatch


def test_step_pricing_through_the_run_shows_a_slowdown_under_sustained_load():
    """Measured and modelled step seconds summed over consecutive stretches of the run: a run whose real steps slow
    down halfway while the model prices them alike shows the climb; no stretches where the replay did not match."""
    from simulator.twins.twin import TwinResult

    real = pd.DataFrame({"step": range(10), "duration_s": [0.05] * 5 + [0.07] * 5})
    replayed = pd.DataFrame({"step": range(10), "duration_s": [0.05] * 10})
    result = TwinResult(pd.DataFrame(), real, replayed, "", 0.6, 0.01, replayed_steps=replayed)
    parts = result.pricing_through_run(parts=2)
    assert parts["steps"].tolist() == [5, 5] and parts["first_step"].tolist() == [0, 5]
    assert parts["part"].tolist() == [1, 2]
    assert parts["measured_over_modelled"].tolist() == pytest.approx([1.0, 1.4])
    assert parts["measured_s"].sum() == pytest.approx(0.6)
    assert len(result.pricing_through_run(parts=50)) == 10  # never more stretches than steps
    assert TwinResult(pd.DataFrame(), real, replayed, "step 3", 0.6, 0.01).pricing_through_run().empty


def test_scenario_errors_compare_each_scenario_s_median_with_the_fit():
    profile = fixed_profile()
    time_of = profile.quantities_predictor()
    decode = [1.0, 0.0, 0.0, 4.0, 0.0, 200.0, 256.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    prefill = [1.0, 1.0, 64.0, 0.0, 2080.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    profile.samples = [{"quantities": decode, "duration_s": time_of(decode) * 1.25, "scenario": "slow decode"},
                       {"quantities": decode, "duration_s": time_of(decode) * 1.25, "scenario": "slow decode"},
                       {"quantities": prefill, "duration_s": time_of(prefill), "scenario": "prefill",
                        "scenarios": ["prefill", "slow decode"]}]  # a shape two scenarios produced counts in both
    table = profile.scenario_errors().set_index("scenario")
    assert table.loc["slow decode", "samples"] == 3 and table.loc["prefill", "samples"] == 1
    assert table.loc["slow decode", "rel_error"] == pytest.approx(1 / 1.25 - 1)
    assert table.loc["prefill", "rel_error"] == pytest.approx(0.0, abs=1e-12)


def test_the_twin_workload_honours_rate_lengths_and_trace_times(tmp_path, capsys):
    from simulator.cli.main import main

    assert (twin_workload("alpaca", 20).arrival_s == 0).all()  # no rate: all at t = 0
    timed = twin_workload("alpaca", 20, rate=5.0)
    assert timed.arrival_s[-1] > 0 and len(timed) == 20
    fixed = twin_workload("fixed", 3, input_len=30, output_len=7)
    assert list(fixed.prompt_tokens) == [30] * 3 and list(fixed.output_tokens) == [7] * 3
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n2,12,6\n4,14,7\n")
    assert list(twin_workload(str(trace), 2, time_scale=0.5).arrival_s) == [0.0, 1.0]
    assert list(twin_workload(str(trace), 3, rate=2.0).arrival_s) == [0.0, 0.5, 1.0]  # rescaled: 2 per second
    with pytest.raises(ValueError, match="a rate or a time scale, not both"):
        twin_workload(str(trace), 2, rate=3.0, time_scale=0.5)
    fixed_profile().save(tmp_path / "p.json")  # the CLI passes its arguments through and reports the error
    assert main(["twin", "--profile", str(tmp_path / "p.json"), "--workload", str(trace), "--rate", "3",
                 "--time-scale", "2"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("block_size,num_blocks,max_model_len", [(32, 256, 2048), (16, 64, 512), (7, 300, 4096)])
def test_the_vllm_profile_decodes_batches_that_fill_the_pool(block_size, num_blocks, max_model_len):
    """A serving run's decode steps read up to the whole pool: the vLLM profile measures decode batches that fill
    most of it (in whole blocks, with their outputs), so the twin does not price those steps by extrapolation."""
    from lab.peer.profiling import POOL_DECODE_FILL, vllm_scenarios

    pool_tokens = (num_blocks - 1) * block_size
    without = vllm_scenarios(block_size, "small", max_model_len)
    scenarios = vllm_scenarios(block_size, "small", max_model_len, pool_tokens)
    added = scenarios[len(without):]
    assert scenarios[:len(without)] == without and added
    biggest = 0
    for _, _, requests in added:
        blocks = sum(-(-(prompt + outputs) // block_size) for prompt, outputs, _ in requests)
        assert blocks <= num_blocks - 1, "a pool scenario must fit vLLM's usable pool"
        assert all(prompt % block_size == 0 and prompt + outputs <= max_model_len for prompt, outputs, _ in requests)
        biggest = max(biggest, sum(prompt + outputs for prompt, outputs, _ in requests))
    assert biggest >= min(0.75 * POOL_DECODE_FILL * pool_tokens, max(len(r) for _, _, r in added) * max_model_len / 2)
    assert vllm_scenarios(block_size, "quick", max_model_len, pool_tokens) == vllm_scenarios(block_size, "quick",
                                                                                              max_model_len)
