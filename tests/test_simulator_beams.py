"""Beam search in the simulator: beams share blocks and fork/die through the shared scheduler; the pools end empty;
the memory saving grows with the width and matches the real engine at tiny scale."""
import math

import numpy as np
import pytest

from lab.engine.beam import BeamSearchParams, memory_saving
from lab.engine import LLMEngine
from simulator import SimConfig, Simulator, Workload
from simulator.core.beams import BeamSurvival
from simulator.core.metrics import CATEGORIES
from simulator.core.workloads import SyntheticSpec, synthetic_workload
from tests.pool_checks import invariants_ok


def beams(width, num_requests=40, rate=50.0, seed=3, **spec):
    return synthetic_workload(SyntheticSpec(preset="alpaca", num_requests=num_requests, rate=rate, seed=seed,
                                            beam_width=width, **spec))


BEAMS = [object()] * 4  # the live beams (the model reads only how many)


def test_survival_counts_are_a_seeded_split_of_the_beams():
    first, again = BeamSurvival(0, 7), BeamSurvival(0, 7)
    for _ in range(50):
        counts = first.parent_counts(BEAMS[:4])
        assert counts == again.parent_counts(BEAMS[:4]) and sum(counts) == 4 and len(counts) == 4
    other_seed, other_request = BeamSurvival(1, 7), BeamSurvival(0, 8)
    draws = [[survival.parent_counts(BEAMS[:4]) for _ in range(20)] for survival in (BeamSurvival(0, 7), other_seed,
                                                                              other_request)]
    assert draws[0] != draws[1] and draws[0] != draws[2]
    # drawn many steps at a time, the stream is the one a draw a step gives
    rng, weights = np.random.default_rng((0, 7)), 0.5 ** np.arange(4)
    one_at_a_time = [np.bincount(rng.choice(4, size=4, p=weights / weights.sum()), minlength=4).tolist()
                     for _ in range(150)]
    assert draws[0] == one_at_a_time[:20]
    survival = BeamSurvival(0, 7)
    assert [survival.parent_counts(BEAMS[:4]) for _ in range(150)] == one_at_a_time
    assert sum(survival.parent_counts(BEAMS[:3])) == 3  # a beam fewer: fresh draws of three


@pytest.mark.parametrize("modes", [dict(), dict(preemption_mode="swap", num_cpu_blocks=400),
                                   dict(scheduling="chunked", max_num_batched_tokens=64)],
                         ids=["recompute", "swap", "chunked"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_beams_fork_and_die_without_leaking_blocks(modes, block_size):
    workload = beams(4, rate=math.inf, shared_prefix_tokens=8)
    sim = Simulator(workload, SimConfig(allocator="paged", block_size=block_size, capacity_tokens=960,
                                        max_points=100_000, **modes))
    result = sim.run()
    summary, series = result.summary, result.timeseries
    assert summary["num_requests_completed"] == len(workload)
    assert summary["generated_tokens"] == 4 * int(workload.output_tokens.sum())
    assert summary["preemptions"] > 0  # the small pool exercises preemption of beams too
    manager = sim.policy.manager
    assert invariants_ok(manager) and manager.num_used_blocks == 0
    if sim.policy.cpu_manager is not None:
        assert sim.policy.cpu_manager.num_used_blocks == 0
    assert (series[list(CATEGORIES)].sum(axis=1) == summary["capacity_tokens"]).all()
    assert (series[list(CATEGORIES)] >= 0).all().all()
    assert 0 < summary["sharing_saving_frac"] < 1


def test_the_saving_grows_with_the_width_and_parallel_samples_share_less():
    config = SimConfig(allocator="paged", model="opt-13b", gpu="a100-40gb", capacity_tokens=10**7)
    savings = [Simulator(beams(width, num_requests=60), config).run().summary["sharing_saving_frac"]
               for width in (1, 2, 4, 6)]
    assert savings[0] == 0 and savings[1] < savings[2] < savings[3]
    sampled = Simulator(synthetic_workload(SyntheticSpec(preset="alpaca", num_requests=60, rate=50.0, seed=3, n=4)),
                        config).run().summary["sharing_saving_frac"]
    assert 0 < sampled < savings[2]  # samples share only the prompt; beams also their common history


def test_contiguous_baselines_share_nothing_and_copy_beams():
    workload = beams(4, num_requests=20)
    config = SimConfig(allocator="contiguous-oracle", model="opt-13b", gpu="a100-40gb", capacity_tokens=10**6)
    summary = Simulator(workload, config).run().summary
    assert summary["sharing_saving_frac"] == 0 and summary["bytes_copied"] > 0
    assert summary["num_requests_completed"] == 20


@pytest.mark.parametrize("width", [2, 4])
def test_simulated_saving_is_close_to_the_engine_s(width):
    """The same lengths through the real engine's beam search (tiny Qwen3) and through the simulator."""
    prompt_lens, max_tokens = (19, 24, 12, 31), 24
    generator = np.random.default_rng(width)
    prompts = [generator.integers(0, 1024, n).tolist() for n in prompt_lens]
    engine = LLMEngine("tiny", num_blocks=1024, block_size=4)
    results = engine.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    measured = memory_saving([u for r in results for u in r.block_usage])
    workload = Workload("tiny", np.zeros(4), np.array(prompt_lens), np.full(4, max_tokens), beam_width=width)
    simulated = Simulator(workload, SimConfig(allocator="paged", block_size=4, capacity_tokens=4096,
                                              model="opt-13b")).run().summary["sharing_saving_frac"]
    assert math.isclose(simulated, measured, rel_tol=0.25), (simulated, measured)


@pytest.mark.parametrize("bad, message", [
    (dict(beam_width=0), "beam_width"), (dict(beam_width=2, n=2), "not both"), (dict(beam_width=1.5), "beam_width")])
def test_bad_beam_widths_are_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        synthetic_workload(SyntheticSpec(preset="alpaca", num_requests=5, **bad))
    if "n" not in bad:
        workload = Workload("w", np.zeros(2), np.array([5, 6]), np.array([3, 4]), **bad)
        with pytest.raises(ValueError, match=message):
            Simulator(workload, SimConfig())
