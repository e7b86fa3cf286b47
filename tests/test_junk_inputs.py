"""Hostile input at every public boundary: each call raises a typed error (a ``ValueError`` subclass) naming the
problem, or returns a correct result; never another exception. After an error the object is unchanged and still
gives the right answer. (The block manager has its own junk test, ``test_block_manager_junk.py``.)"""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import paged_kernels
from lab.engine import EngineConfig, LLMEngine, SamplingParams
from simulator import SimConfig, Simulator
from simulator.core.workloads import SyntheticSpec, Workload, load_trace_bytes, synthetic_workload

JUNK = st.one_of(st.integers(-3, 6), st.just(10**30), st.just(-(10**30)), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=3), st.none(), st.booleans(), st.lists(st.integers(-2, 5), max_size=3),
                 st.just(()), st.just({}), st.just(object()))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def typed_or_ok(call):
    """Run ``call``; return (True, result) or (False, error) for a ``ValueError``; anything else fails the test."""
    try:
        return True, call()
    except ValueError as error:
        assert str(error), "an error must say what is wrong"
        return False, error


# ---- the engine -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny", num_blocks=48, block_size=4)


@pytest.fixture(scope="module")
def reference(engine):
    return engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids


def engine_state(engine):
    manager = engine.block_manager
    return (engine.has_unfinished(), manager.num_free_blocks, manager.num_cached_blocks, list(manager.ref_counts),
            len(engine.requests), engine.num_steps)


SAMPLING_FIELDS = ["max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop_token_ids", "ignore_eos"]
PROMPTS = st.one_of(JUNK, st.lists(JUNK, max_size=3), st.lists(st.integers(-5, 10**6), max_size=4))


@SETTINGS
@given(prompt=PROMPTS, field=st.sampled_from(SAMPLING_FIELDS), value=JUNK, many=st.booleans())
def test_junk_requests_never_corrupt_the_engine(engine, reference, prompt, field, value, many):
    small = {"max_tokens": 3, "n": 1}  # keep accepted junk cheap to run
    if field in ("max_tokens", "n") and isinstance(value, int) and not isinstance(value, bool) and value > 3:
        value = 10**30  # huge: must be rejected, never run
    params = SamplingParams(**{**small, field: value})
    before = engine_state(engine)
    ok, _ = typed_or_ok(lambda: engine.generate([prompt, [1, 2]] if many else [prompt], params))
    if not ok:
        assert engine_state(engine) == before
    assert not engine.has_unfinished()
    engine.block_manager.check_invariants()
    assert engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids == reference


@SETTINGS
@given(prompts=JUNK, params=JUNK)
def test_junk_containers_for_generate(engine, reference, prompts, params):
    before = engine_state(engine)
    ok, result = typed_or_ok(lambda: engine.generate(prompts, params))
    assert result == [] if ok else engine_state(engine) == before  # only an empty batch is valid here
    assert engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids == reference


ENGINE_FIELDS = ["block_size", "num_blocks", "attention_backend", "enable_prefix_caching", "max_num_seqs",
                 "max_num_batched_tokens", "scheduling", "preemption_mode", "num_cpu_blocks", "swap_space_bytes",
                 "max_model_len", "dtype", "device", "kv_memory_bytes", "gpu_memory_utilization", "seed",
                 "record_logits"]


@SETTINGS
@given(field=st.sampled_from(ENGINE_FIELDS), value=JUNK)
def test_junk_engine_config_is_rejected_before_anything_loads(field, value):
    config = EngineConfig(**{field: value})
    ok, _ = typed_or_ok(config.check)
    if ok:  # what check() accepts must build (or raise a typed error from the constructor)
        ok, engine = typed_or_ok(lambda: LLMEngine("tiny", config))
        if ok:  # a request the settings allow runs; one they cannot hold is rejected up front
            ok, outputs = typed_or_ok(lambda: engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2,
                                                                                         ignore_eos=True)))
            assert len(outputs[0].token_ids) == 2 if ok else not engine.has_unfinished()


# ---- the simulator ----------------------------------------------------------------------------------------------------
SIM_FIELDS = [name for name in SimConfig.__dataclass_fields__ if name not in ("kernel_csv",)]
TINY = Workload("tiny", np.zeros(4), np.array([8, 9, 30, 5]), np.array([4, 3, 2, 6]))


@SETTINGS
@given(field=st.sampled_from(SIM_FIELDS), value=JUNK)
def test_junk_sim_config_gives_a_typed_error_or_a_complete_run(field, value):
    base = dict(capacity_tokens=4096, max_model_len=64)
    if field in ("capacity_tokens", "max_model_len", "max_num_seqs", "max_points", "max_num_batched_tokens",
                 "grow_initial_extra", "num_cpu_blocks") and isinstance(value, int) and value > 10**6:
        pass  # huge integers must still be handled (rejected or run without allocating them)
    ok, result = typed_or_ok(lambda: Simulator(TINY, SimConfig(**{**base, field: value})).run())
    if ok:
        done = result.summary["num_requests_completed"] + result.summary["num_requests_rejected"]
        assert done == 4 and math.isclose(sum(result.summary[k] for k in (
            "token_states_frac", "reserved_frac", "internal_fragmentation_frac", "external_fragmentation_frac", "free_frac")), 1.0)


@SETTINGS
@given(field=st.sampled_from(list(SyntheticSpec.__dataclass_fields__)), value=JUNK)
def test_junk_synthetic_spec(field, value):
    base = dict(num_requests=20)
    if field == "num_requests" and isinstance(value, int) and value > 10**5:
        value = 10**30
    ok, workload = typed_or_ok(lambda: synthetic_workload(SyntheticSpec(**{**base, field: value})))
    if ok:
        assert len(workload) > 0 and (workload.prompt_tokens >= 1).all() and (workload.output_tokens >= 1).all()


CELLS = st.one_of(st.integers(-5, 50), st.just(2**70), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=3), st.just(""))


@SETTINGS
@given(rows=st.lists(st.tuples(CELLS, CELLS, CELLS), min_size=0, max_size=4), header=st.booleans(),
       raw=st.binary(max_size=40), use_raw=st.booleans())
def test_junk_trace_files(rows, header, raw, use_raw):
    text = ("arrival_time_s,prompt_tokens,output_tokens\n" if header else "") + \
        "".join(",".join(map(str, row)) + "\n" for row in rows)
    data = raw if use_raw else text.encode()
    ok, workload = typed_or_ok(lambda: load_trace_bytes(data, "junk.csv"))
    if ok:
        assert len(workload) > 0 and (workload.prompt_tokens >= 1).all() and (workload.output_tokens >= 0).all()
        assert np.isfinite(workload.arrival_s).all()


# ---- kernel ops -------------------------------------------------------------------------------------------------------
def _caches(num_blocks=6, heads=2, block_size=3, head_dim=8):
    return torch.zeros(num_blocks, heads, block_size, head_dim), torch.zeros(num_blocks, heads, block_size, head_dim)


TENSORISH = st.one_of(JUNK, st.sampled_from(["int_tensor", "float_tensor", "wrong_rank", "negative", "huge"]))


def tensorish(kind, shape, dtype=torch.float32):
    if kind == "int_tensor":
        return torch.ones(shape, dtype=torch.int64)
    if kind == "float_tensor":
        return torch.randn(shape, dtype=dtype)
    if kind == "wrong_rank":
        return torch.ones(shape + (2,), dtype=dtype)
    if kind == "negative":
        return -torch.ones(shape, dtype=torch.int64) * 7
    if kind == "huge":
        return torch.full(shape, 2**40, dtype=torch.int64)
    return kind


@SETTINGS
@given(op=st.sampled_from(["write", "copy", "swap", "attention"]), position=st.integers(0, 5), junk=TENSORISH)
def test_junk_kernel_arguments(op, position, junk):
    key_cache, value_cache = _caches()
    before = (key_cache.clone(), value_cache.clone())
    if op == "write":
        args = [torch.randn(2, 2, 8), torch.randn(2, 2, 8), key_cache, value_cache, torch.tensor([0, 4])]
        shapes = [(2, 2, 8), (2, 2, 8), tuple(key_cache.shape), tuple(key_cache.shape), (2,)]
        call = paged_kernels.write_kv_cache
    elif op == "copy":
        args = [key_cache, value_cache, [(0, 1)]]
        shapes = [tuple(key_cache.shape), tuple(key_cache.shape), (1, 2)]
        call = paged_kernels.copy_blocks
    elif op == "swap":
        dst_key, dst_value = _caches()
        args = [key_cache, value_cache, dst_key, dst_value, [(0, 1)]]
        shapes = [tuple(key_cache.shape)] * 4 + [(1, 2)]
        call = paged_kernels.swap_blocks
    else:
        args = [torch.randn(2, 4, 8), key_cache, value_cache, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                torch.tensor([5, 4], dtype=torch.int32), 0.3]
        shapes = [(2, 4, 8), tuple(key_cache.shape), tuple(key_cache.shape), (2, 2), (2,), ()]
        call = paged_kernels.paged_attention_decode
    position = position % len(args)
    args[position] = tensorish(junk, shapes[position])
    ok, result = typed_or_ok(lambda: call(*args))
    if not ok:
        assert all(torch.equal(a, b) for a, b in zip(before, (key_cache, value_cache)))  # nothing written
    elif op == "attention":
        assert torch.isfinite(result).all()
