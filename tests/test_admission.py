"""Admission asks whether the whole request can ever run, with one rule in every scheduling mode and in both
executors: a request is refused up front (``RequestRejectedError``) or it completes, never admitted to fail inside
``step()`` (issue 70: a 16-token prompt with one output token in a pool of exactly 16 slots, n = 40 samples in a
24-block pool)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.engine import LLMEngine, SamplingParams
from lab.sched.scheduler import SCHEDULING_MODES, RequestRejectedError
from simulator.core.engine import SimConfig
from simulator.core.runs import simulate
from simulator.core.workloads import Workload


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_one_output_token_needs_no_decode_block(mode):
    """16 prompt tokens and one output token in a pool of exactly 16 slots: the token is sampled at the prefill, no
    decode follows, so no decode block is taken (prefill-first and chunked refused it, vllm ran it)."""
    engine = LLMEngine("tiny", block_size=16, num_blocks=1, scheduling=mode)
    outputs = engine.generate([list(range(1, 17))], SamplingParams(max_tokens=1, ignore_eos=True))
    assert len(outputs[0].outputs[0]) == 1


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_samples_that_cannot_start_together_are_refused_up_front(mode):
    """n = 40 samples of an 8-token prompt in 24 blocks of 4: their first decode blocks (or copies of the shared
    last block) are taken together at admission, 42 blocks: refused with its reason, not a RuntimeError in step()."""
    engine = LLMEngine("tiny", block_size=4, num_blocks=24, scheduling=mode, max_num_seqs=64)
    with pytest.raises(RequestRejectedError, match="40 samples") as refused:
        engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=4, n=40, ignore_eos=True))
    assert refused.value.reason == "capacity" and not engine.has_unfinished()
    outputs = engine.generate([list(range(1, 9))], SamplingParams(max_tokens=4, n=10, ignore_eos=True))
    assert len(outputs[0].outputs) == 10


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(1, 40), output=st.integers(1, 12), n=st.integers(1, 12), blocks=st.integers(1, 24),
       block_size=st.sampled_from([1, 3, 4, 16]), mode=st.sampled_from(SCHEDULING_MODES),
       allocator=st.sampled_from(["paged", "contiguous-oracle", "contiguous-grow"]))
def test_a_request_is_refused_or_completes_in_the_simulator(prompt, output, n, blocks, block_size, mode, allocator):
    workload = Workload("one", np.zeros(2), np.array([prompt, prompt]), np.array([output, output]), n=n)
    config = SimConfig(allocator=allocator, block_size=block_size, capacity_tokens=blocks * block_size,
                       scheduling=mode, max_num_seqs=16, max_model_len=64)
    summary = simulate(workload, config).summary
    assert summary["num_requests_completed"] + summary["num_requests_rejected"] == 2


@settings(max_examples=6, deadline=None)
@given(prompt=st.integers(1, 24), output=st.integers(1, 6), n=st.integers(1, 6), blocks=st.integers(1, 12),
       block_size=st.sampled_from([1, 3, 4]), mode=st.sampled_from(SCHEDULING_MODES))
def test_a_request_is_refused_or_completes_in_the_engine(prompt, output, n, blocks, block_size, mode):
    engine = LLMEngine("tiny", block_size=block_size, num_blocks=blocks, scheduling=mode)
    params = SamplingParams(max_tokens=output, n=n, ignore_eos=True, temperature=1.0, seed=0)
    try:
        engine.add_request(list(range(1, prompt + 1)), params)
    except RequestRejectedError:
        return
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert len(done) == 1 and all(len(sample) == output for sample in done[0].outputs)
