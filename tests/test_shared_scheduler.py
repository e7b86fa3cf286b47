"""One scheduler, two executors: the engine (Qwen3) and the simulator (a clock) must plan identical steps."""
import functools
import itertools
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from lab.engine import LLMEngine, SamplingParams
from lab.sched.scheduler import STEP_LOG_COLUMNS, SchedulerError
from simulator import SimConfig, Simulator, Workload

PLAN_COLUMNS = [c for c in STEP_LOG_COLUMNS if c != "duration_s"]


def make_prompts(lengths, shared_prefix=0, seed=0):
    """A shared prefix, then tails that differ from each other in their first token (so two prompts are identical
    only when both are the prefix alone, as in the simulator's shared-prefix workloads). No tail starts with the
    token the model generates after the prefix alone: a prompt that is the prefix alone, preempted and recomputed,
    caches its first generated token's block, and a tail starting with that token would hit it in the engine, which
    the simulator, not knowing what the model generates, cannot foresee (a fuzzed case found it)."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 1024, (shared_prefix,), generator=generator).tolist()
    firsts = torch.randperm(1024, generator=generator).tolist()
    if shared_prefix and shared_prefix in lengths:
        firsts.remove(greedy_next_token(tuple(prefix)))
    return [prefix + ([firsts[i]] + torch.randint(0, 1024, (n - shared_prefix - 1,), generator=generator).tolist()
                      if n > shared_prefix else []) for i, n in enumerate(lengths)]


@functools.cache
def greedy_next_token(prompt: tuple[int, ...]) -> int:
    """The first token the tiny model generates, greedily, after ``prompt``."""
    engine = LLMEngine("tiny", num_blocks=-(-len(prompt) // 16) + 2)
    return engine.generate([list(prompt)], SamplingParams(max_tokens=1, ignore_eos=True))[0].outputs[0][0]


def engine_and_simulator_logs(prompts, outputs, n=1, shared_prefix=0, block_size=4, num_blocks=40,
                              num_cpu_blocks=0, **modes):
    """Step logs of the engine (greedy, ignore_eos, output lengths given) and of the simulator configured alike."""
    engine = LLMEngine("tiny", block_size=block_size, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, **modes)
    params = [SamplingParams(max_tokens=o, n=n, ignore_eos=True) for o in outputs]
    results = engine.generate(prompts, params)
    workload = Workload("twin", np.zeros(len(prompts)), np.array([len(p) for p in prompts]), np.array(outputs), n=n,
                        shared_prefix_tokens=shared_prefix)
    config = SimConfig(allocator="paged", block_size=block_size, capacity_tokens=num_blocks * block_size,
                       num_cpu_blocks=num_cpu_blocks, max_model_len=engine.max_model_len, record_steps=True,
                       model="qwen3-0.6b", **{"max_num_seqs": 64, "max_num_batched_tokens": 4096, **modes})
    simulated = Simulator(workload, config).run()
    return engine, results, engine.step_log(), simulated


def assert_same_plan(real, simulated):
    """The engine's step log ``real`` and the simulator's (``simulated``: a ``SimResult`` or a step log) agree in
    every column but ``duration_s``."""
    simulated = getattr(simulated, "steps", simulated)
    assert len(real) == len(simulated), (len(real), len(simulated))
    mismatch = (real[PLAN_COLUMNS].to_numpy() != simulated[PLAN_COLUMNS].to_numpy()).any(axis=1)
    if mismatch.any():
        first = int(np.argmax(mismatch))
        raise AssertionError(f"step {first + 1} differs:\nengine    {real[PLAN_COLUMNS].iloc[first].to_dict()}\n"
                             f"simulator {simulated[PLAN_COLUMNS].iloc[first].to_dict()}")


MODES = [dict(scheduling=s, preemption_mode=p) for s, p in itertools.product(["prefill-first", "chunked"],
                                                                            ["recompute", "swap"])]
MODES.append(dict(scheduling="vllm", preemption_mode="recompute"))  # vLLM V1's admission (docs/vllm.md)


@pytest.mark.parametrize("modes", MODES, ids=lambda m: f"{m['scheduling']}-{m['preemption_mode']}")
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("n", [1, 3])
def test_engine_and_simulator_plan_identical_steps(modes, caching, n):
    lengths, outputs = [9, 23, 5, 17, 30, 12], [7, 12, 9, 5, 10, 8]
    prompts = make_prompts(lengths, shared_prefix=4, seed=n)
    num_blocks = 14 if n == 1 else 20  # small: forces preemption
    engine, _, real, simulated = engine_and_simulator_logs(
        prompts, outputs, n=n, shared_prefix=4, num_blocks=num_blocks, enable_prefix_caching=caching,
        max_num_batched_tokens=24, **modes)
    assert_same_plan(real, simulated)
    assert real["num_preempted"].sum() + real["num_swapped_out"].sum() > 0, "the pool should force preemption"
    if modes["preemption_mode"] == "swap":
        assert real["num_swapped_out"].sum() > 0 and real["cpu_blocks_in_use"].max() > 0
    if modes["scheduling"] != "prefill-first":
        assert ((real["num_prefill_tokens"] > 0) & (real["num_decode_seqs"] > 0)).any()
    assert real["blocks_in_use"].iloc[-1] == 0 and real["cpu_blocks_in_use"].iloc[-1] == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_physical_blocks


@pytest.mark.parametrize("modes", MODES, ids=lambda m: f"{m['scheduling']}-{m['preemption_mode']}")
@pytest.mark.parametrize("tier", [4, 64])
def test_the_offload_tier_plans_identically(modes, tier):
    """A pool small enough to evict cached blocks (stored to the tier) that preempted and later prompts find
    again (loaded from it): both executors store and load the same blocks in the same steps. With swapping, swapped
    sequences and the tier share one host pool (8 blocks of swap space plus the tier's): both show, never more than
    the pool together, and the tokens are those of a run without the tier."""
    lengths, outputs = [9, 23, 5, 17, 30, 12, 21, 8], [7, 12, 9, 5, 10, 8, 6, 11]
    prompts = make_prompts(lengths, shared_prefix=8, seed=5)
    swap = modes["preemption_mode"] == "swap"
    engine, results, real, simulated = engine_and_simulator_logs(
        prompts, outputs, shared_prefix=8, num_blocks=14, max_num_batched_tokens=24, kv_offload_blocks=tier,
        max_num_seqs=3, num_cpu_blocks=8 if swap else 0, **modes)
    assert_same_plan(real, simulated)
    assert real["num_offload_stored"].sum() > 0
    host = engine.policy.cpu_manager.num_physical_blocks
    assert host == tier + (8 if swap else 0) and engine.block_manager.offload.stats.peak_blocks <= host
    assert (real["cpu_blocks_in_use"] + real["tier_blocks_in_use"] <= host).all()
    if swap:
        both = (real["cpu_blocks_in_use"] > 0) & (real["tier_blocks_in_use"] > 0)
        assert both.any(), "swapped blocks and tier blocks should share the host pool at some step"
        plain = LLMEngine("tiny", block_size=4, num_blocks=14, num_cpu_blocks=8, max_num_batched_tokens=24,
                          max_num_seqs=3, **modes)
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outputs]
        assert [o.token_ids for o in results] == [o.token_ids for o in plain.generate(prompts, params)]
    else:  # a recomputed prompt finds its own evicted blocks on the host
        assert real["num_offload_loaded"].sum() > 0


@dataclass
class FuzzCase:
    """A drawn workload (prompt and output lengths, a shared prefix, each request's arrival as a step count) and the
    engine settings both executors get."""

    lengths: list[int]
    outputs: list[int]
    n: int
    shared_prefix: int
    seed: int
    arrival_steps: list[int]
    engine: dict

    @property
    def prompts(self):
        return make_prompts(self.lengths, self.shared_prefix, self.seed)


@st.composite
def fuzz_cases(draw):
    """Up to six requests and an engine whose pool holds the longest one and up to 20 blocks more (often few enough
    to preempt), in every mode."""
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    outputs = draw(st.lists(st.integers(1, 12), min_size=len(lengths), max_size=len(lengths)))
    gaps = draw(st.lists(st.integers(0, 5), min_size=len(lengths), max_size=len(lengths)))
    n, block_size = draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 4, 16]))
    longest = max(p + o for p, o in zip(lengths, outputs))
    preemption = draw(st.sampled_from(["recompute", "swap"]))
    engine = dict(block_size=block_size, num_blocks=-(-longest // block_size) + n + draw(st.integers(0, 20)),
                  num_cpu_blocks=draw(st.integers(0, 12)) if preemption == "swap" else 0,  # moot with recompute
                  enable_prefix_caching=draw(st.booleans()),
                  scheduling=draw(st.sampled_from(["prefill-first", "chunked", "vllm"])), preemption_mode=preemption,
                  max_num_batched_tokens=draw(st.integers(4, 64)), max_num_seqs=n + draw(st.integers(0, 6)),
                  kv_offload_blocks=draw(st.sampled_from([0, 0, 2, 16])))
    if not engine["enable_prefix_caching"]:
        engine["kv_offload_blocks"] = 0  # the tier keeps prefix-cache blocks: refused without them
    return FuzzCase(lengths, outputs, n, draw(st.integers(0, min(lengths))), draw(st.integers(0, 10_000)),
                    list(itertools.accumulate(gaps)), engine)


FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 25)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def test_the_fuzzed_prompts_leave_nothing_for_generated_tokens_to_hit():
    """The case a longer fuzz found (seed 41 of a 13-token prefix, block size 2, chunked, recompute): one prompt is
    the prefix alone; no other prompt's tail starts with what the model generates after it, so the engine and the
    simulator plan alike."""
    lengths = [31, 32, 61, 172, 57, 33, 13, 143, 65, 25, 192, 20, 62, 150, 124, 98, 88, 63]
    outputs = [24, 23, 34, 40, 13, 27, 30, 5, 9, 6, 8, 33, 26, 20, 7, 44, 20, 57]
    prompts = make_prompts(lengths, shared_prefix=13, seed=41)
    generated = greedy_next_token(tuple(prompts[6]))
    assert prompts[6] == prompts[0][:13] and generated not in [prompt[13] for prompt in prompts if len(prompt) > 13]
    _, _, real, simulated = engine_and_simulator_logs(
        prompts, outputs, shared_prefix=13, block_size=2, num_blocks=141, enable_prefix_caching=True,
        scheduling="chunked", max_num_batched_tokens=64, max_num_seqs=20)
    assert_same_plan(real, simulated)
    assert real["num_preempted"].sum() > 0  # the prefix-alone prompt among them: what cached its generated block


@FUZZ
@given(case=fuzz_cases())
def test_fuzzed_workloads_plan_identically(case):
    _, results, real, simulated = engine_and_simulator_logs(case.prompts, case.outputs, n=case.n,
                                                            shared_prefix=case.shared_prefix, **case.engine)
    assert_same_plan(real, simulated)
    assert [len(o) for r in results for o in r.outputs] == [o for o in case.outputs for _ in range(case.n)]


def run_with_staggered_arrivals(engine, prompts, params, arrival_steps):
    """Queue request i once the engine has run ``arrival_steps[i]`` steps (or, when it has nothing left to run,
    at once, as an idle engine takes the next arrival), as ``simulator.twins.twin.run_real`` records its arrivals; returns
    the step count at which each request was queued."""
    admitted_after, request = [], 0
    while request < len(prompts) or engine.has_unfinished():
        while request < len(prompts) and (arrival_steps[request] <= engine.num_steps or not engine.has_unfinished()):
            engine.add_request(prompts[request], params[request])
            admitted_after.append(engine.num_steps)
            request += 1
        engine.step()
    return admitted_after


@FUZZ
@given(case=fuzz_cases())
def test_fuzzed_staggered_arrivals_replay_identically(case):
    """Requests that arrive while others run, are preempted or are swapped out: the twin's replay (each request
    queued into the simulator after as many steps as the engine had run when it queued it) plans the engine's steps
    exactly."""
    from simulator.twins.twin import replay, sim_config
    from tests.test_profile_twin import fixed_profile

    engine = LLMEngine("tiny", **case.engine)
    params = [SamplingParams(max_tokens=o, n=case.n, ignore_eos=True) for o in case.outputs]
    admitted_after = run_with_staggered_arrivals(engine, case.prompts, params, case.arrival_steps)
    workload = Workload("twin", np.zeros(len(case.lengths)), np.array(case.lengths), np.array(case.outputs),
                        n=case.n, shared_prefix_tokens=case.shared_prefix)
    replayed = replay(workload, sim_config(engine, fixed_profile(case.engine["block_size"])), admitted_after)
    assert_same_plan(engine.step_log(), replayed)
    finished = sorted(engine.finished, key=lambda r: r.request_id)
    assert [len(o) for r in finished for o in r.outputs] == [o for o in case.outputs for _ in range(case.n)]


def test_samples_count_against_max_num_seqs():
    """Three requests of n=4 under max_num_seqs=8: at most 8 sequences ever run (the old engine ran 12)."""
    engine = LLMEngine("tiny", num_blocks=512, max_num_seqs=8)
    seen = []
    engine.on_step = lambda stats: seen.append(stats.num_running)
    engine.generate(make_prompts([5, 6, 7]), SamplingParams(max_tokens=4, n=4, ignore_eos=True))
    assert max(seen) == 8


def test_a_prompt_waiting_for_memory_is_built_once(monkeypatch):
    """A request at the head of the queue is offered every step until memory frees; its prompt ids (O(length) to
    build and check: 100k tokens in a Mooncake trace) were built on every offer, which made a long-context replay
    with prefix caching 60x slower than one without; built again to cache its blocks as it finished, they made the
    replay 1.4x slower. Built once per request now, and never checked again."""
    from simulator.core.workloads import Workload as WorkloadClass

    built = []
    real_ids = WorkloadClass.prompt_token_ids
    monkeypatch.setattr(WorkloadClass, "prompt_token_ids",
                        lambda workload, request: built.append(request) or real_ids(workload, request))
    # the second prompt waits 20 steps for the first request's blocks
    workload = Workload("wait", np.zeros(2), np.array([40, 40]), np.array([20, 2]), shared_prefix_tokens=4)
    config = SimConfig(allocator="paged", block_size=4, capacity_tokens=64, model="qwen3-0.6b", record_steps=True)
    result = Simulator(workload, config).run()
    assert (result.steps["num_waiting"] > 0).sum() >= 20 and result.summary["preemptions"] == 0
    assert built == [0, 1]


def test_requests_that_can_never_run_are_rejected_with_the_reason():
    engine = LLMEngine("tiny", num_blocks=512, max_num_seqs=4)
    with pytest.raises(ValueError, match="n=5 samples exceed max_num_seqs=4"):
        engine.add_request([1, 2, 3], SamplingParams(n=5))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("scheduling", ["prefill-first", "chunked"])
def test_a_group_that_could_never_come_back_is_recomputed_not_parked(scheduling):
    """One request of 3 samples in a pool that cannot hold all three grown samples: swapping the whole group out
    would park it forever (it could never be swapped back in), so the scheduler recomputes samples instead."""
    _, results, real, simulated = engine_and_simulator_logs(
        make_prompts([6]), [14], n=3, block_size=2, num_blocks=16, num_cpu_blocks=64, preemption_mode="swap",
        scheduling=scheduling)
    assert_same_plan(real, simulated)
    assert real["num_preempted"].sum() > 0 and [len(o) for o in results[0].outputs] == [14, 14, 14]


@pytest.mark.parametrize("modes", MODES, ids=lambda m: f"{m['scheduling']}-{m['preemption_mode']}")
def test_the_plan_s_longest_decode_sequence_is_the_longest_one_decoding(modes):
    """``decode_max_kv_len`` (kept in a lazily pruned heap, so the simulator need not visit sequences) equals the
    longest KV length in the decode batch, through preemption, swapping and chunked prefill."""
    engine = LLMEngine("tiny", block_size=3, num_blocks=18,
                       num_cpu_blocks=40 if modes["preemption_mode"] == "swap" else 0, **modes)
    prompts = make_prompts([9, 23, 5, 17, 30, 12, 2], seed=7)
    for prompt, output in zip(prompts, [7, 12, 9, 5, 10, 8, 14]):
        engine.add_request(prompt, SamplingParams(max_tokens=output, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        plan = engine.last_plan
        lengths = [engine.scheduler.kv_len(seq) for seq in plan.decode_seqs or []]
        assert plan.decode_max_kv_len == (max(lengths) if lengths else 0), plan.step
        checked += bool(lengths)
    assert checked > 10 and engine.num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
def test_a_long_prefill_threshold_caps_chunks_alike_in_both_executors(caching):
    """vLLM's ``long_prefill_token_threshold``: while more than one request runs or waits, no request takes more
    than that many prompt tokens in a step; the engine and the simulator plan the same steps under it."""
    lengths, outputs = [9, 23, 5, 17, 30, 12], [7, 12, 9, 5, 10, 8]
    prompts = make_prompts(lengths, shared_prefix=4, seed=1)
    engine, _, real, simulated = engine_and_simulator_logs(
        prompts, outputs, shared_prefix=4, num_blocks=14, enable_prefix_caching=caching, max_num_batched_tokens=24,
        scheduling="vllm", long_prefill_token_threshold=5)
    assert_same_plan(real, simulated)
    capped = real[real["num_running"] + real["num_waiting"] > 1]
    assert (capped["num_prefill_tokens"] <= 5 * (capped["num_running"] + capped["num_finished"])).all()
    assert real["num_preempted"].sum() > 0


@pytest.mark.parametrize("settings, words", [(dict(long_prefill_token_threshold=-1), "integer >= 0"),
                                             (dict(long_prefill_token_threshold=8), "not prefill-first")])
def test_a_long_prefill_threshold_out_of_place_is_refused(settings, words):
    with pytest.raises(SchedulerError, match=words):
        LLMEngine("tiny", scheduling="prefill-first", **settings)


@pytest.mark.parametrize("case", [
    FuzzCase([1, 1, 1, 21, 14, 1], [1, 1, 1, 4, 12, 1], 2, 0, 0, [0] * 6,
             dict(block_size=1, num_blocks=40, num_cpu_blocks=1, enable_prefix_caching=True, scheduling="vllm",
                  preemption_mode="swap", max_num_batched_tokens=4, max_num_seqs=4, kv_offload_blocks=16)),
    FuzzCase([1, 1, 1, 20, 1, 1], [1] * 6, 1, 0, 0, [0] * 6,
             dict(block_size=1, num_blocks=22, num_cpu_blocks=0, enable_prefix_caching=True, scheduling="vllm",
                  preemption_mode="recompute", max_num_batched_tokens=4, max_num_seqs=1, kv_offload_blocks=16)),
    FuzzCase([1, 1, 1, 1, 1, 16], [1, 1, 1, 1, 6, 6], 3, 0, 0, [0] * 6,
             dict(block_size=1, num_blocks=37, num_cpu_blocks=8, enable_prefix_caching=True,
                  scheduling="prefill-first", preemption_mode="swap", max_num_batched_tokens=4, max_num_seqs=6,
                  kv_offload_blocks=16)),
    FuzzCase([1, 1, 1], [1, 4, 4], 1, 0, 0, [0] * 3,
             dict(block_size=1, num_blocks=6, num_cpu_blocks=0, enable_prefix_caching=True, scheduling="prefill-first",
                  preemption_mode="recompute", max_num_batched_tokens=4, max_num_seqs=2, kv_offload_blocks=2))],
    ids=["vllm-swap-tier-n2", "vllm-tier", "swap-tier-host-full", "tier-keeps-prompt-blocks-only"])
def test_fuzz_finds_plan_alike(case):
    """Cases a fuzz run found: the vllm policy with an offload tier (prompts taken whole, as the tier stores them),
    a swap-in whose evicted blocks find the shared host pool all taken by swapped sequences (nothing stored), and a
    preempted sequence's sampled blocks, evicted for another's decode: not stored in the tier, which keeps prompt
    blocks (the simulator cached a stream's sampled blocks as prompt blocks)."""
    _, results, real, simulated = engine_and_simulator_logs(case.prompts, case.outputs, n=case.n,
                                                            shared_prefix=case.shared_prefix, **case.engine)
    assert_same_plan(real, simulated)
    assert [len(o) for r in results for o in r.outputs] == [o for o in case.outputs for _ in range(case.n)]
