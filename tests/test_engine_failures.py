"""A step that raises part-way leaves the engine consistent: the next steps give the tokens an undisturbed engine
gives, no block leaks, and a failed ``generate``/``beam_search`` leaves nothing behind."""
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from lab.engine.beam import BeamSearchParams
from lab.engine import LLMEngine, SamplingParams

MAX_TOKENS = 8
PHASES = ["execute_copies", "prepare", "forward", "sample", "_accept"]


class Injected(Exception):
    """The fault a test injects."""


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(4321)
    return [torch.randint(0, 1024, (n,), generator=generator).tolist() for n in (3, 9, 17, 30, 5)]


def _params():
    return [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, n=2),
            SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_k=20,
                                                                  seed=3),
            SamplingParams(max_tokens=MAX_TOKENS)]


def _engine(scheduling, preemption, model=None):
    return LLMEngine(model or "tiny", block_size=4, num_blocks=26, scheduling=scheduling, preemption_mode=preemption,
                     max_num_batched_tokens=24 if scheduling == "chunked" else 4096)


def _run(engine, prompts, fail_at=None):
    """Serve ``prompts`` step by step; ``fail_at=(step, phase)`` makes that phase of that step raise once."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, _params())]
    step, failures = 0, 0
    while engine.has_unfinished():
        step += 1
        if fail_at is not None and fail_at[0] == step:
            owner = {"sample": engine.sampler, "_accept": engine}.get(fail_at[1], engine.runner)
            original = getattr(owner, fail_at[1])

            def broken(*args, **kwargs):
                setattr(owner, fail_at[1], original)
                if fail_at[1] == "_accept":  # fail after some tokens were accepted
                    original(*args, **kwargs)
                raise Injected(fail_at)

            setattr(owner, fail_at[1], broken)
            try:
                engine.step()
            except Injected:
                failures += 1
            finally:
                setattr(owner, fail_at[1], original)
            continue
        engine.step()
    by_id = {o.request_id: o.outputs for o in engine.finished}
    return [by_id[i] for i in ids], failures


@pytest.fixture(scope="module")
def undisturbed(prompts):
    return {(s, p): _run(_engine(s, p), prompts)[0] for s in ("prefill-first", "chunked")
            for p in ("recompute", "swap")}


@pytest.mark.parametrize("scheduling", ["prefill-first", "chunked"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("step", [1, 4])  # the Hypothesis test below draws the others
def test_a_failed_step_is_undone_and_the_run_gives_the_same_tokens(prompts, undisturbed, scheduling, preemption,
                                                                   phase, step):
    engine = _engine(scheduling, preemption)
    outputs, failures = _run(engine, prompts, (step, phase))
    assert failures == 1
    assert outputs == undisturbed[scheduling, preemption]
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_physical_blocks
    manager.check_invariants()


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=st.integers(1, 25), phase=st.sampled_from(PHASES), scheduling=st.sampled_from(["prefill-first", "chunked"]),
       preemption=st.sampled_from(["recompute", "swap"]))
# a seeded sample whose token was accepted before the fault keeps its generator's draw (it was rewound, then drew
# the same number again)
@example(step=3, phase="_accept", scheduling="chunked", preemption="recompute")
# a sample whose accepted token was its last (max_tokens) when the fault came finishes on recovery, not one later
@example(step=8, phase="_accept", scheduling="prefill-first", preemption="recompute")
def test_a_fault_anywhere_changes_no_token(prompts, undisturbed, step, phase, scheduling, preemption):
    outputs, _ = _run(_engine(scheduling, preemption), prompts, (step, phase))
    assert outputs == undisturbed[scheduling, preemption]


def test_a_failed_generate_leaves_no_request_and_no_block(prompts, monkeypatch):
    engine = LLMEngine("tiny", block_size=4, num_blocks=64)
    calls = {"n": 0}
    original = engine.runner.forward

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_physical_blocks
    reference = LLMEngine("tiny", block_size=4, num_blocks=64).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    again = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.outputs for o in again] == [o.outputs for o in reference]


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8, 5e-324])
def test_tiny_temperatures_sample_greedily(prompts, temperature):
    engine = LLMEngine("tiny", num_blocks=64)
    greedy = engine.generate(prompts[:2], SamplingParams(max_tokens=4))
    tiny = engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=temperature, seed=1))
    assert [o.outputs for o in tiny] == [o.outputs for o in greedy]


@pytest.mark.parametrize("failing_call", [1, 2, 4])
def test_a_failed_beam_search_leaves_the_engine_usable(prompts, monkeypatch, failing_call):
    engine = LLMEngine("tiny", block_size=4, num_blocks=64)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    expected = engine.beam_search([prompts[1]], params)
    calls = {"n": 0}
    original = engine.runner.forward

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise Injected
        return original(*args)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    with pytest.raises(Injected):
        engine.beam_search([prompts[1]], params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_physical_blocks
    again = engine.beam_search([prompts[1]], params)
    assert [s.token_ids for s in again[0].sequences] == [s.token_ids for s in expected[0].sequences]


def test_beam_search_names_a_bad_prompt_list():
    engine = LLMEngine("tiny", num_blocks=64)
    with pytest.raises(ValueError, match="list of prompts"):
        engine.beam_search(5, BeamSearchParams(beam_width=2, max_tokens=2))
