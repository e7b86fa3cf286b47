"""Strict parsing and finite numbers: a trace is read as written or refused with the line named, a non-finite or
out-of-range number never drives the clock, every search loop ends, and a sweep store keys runs by content."""
import argparse
import dataclasses
import json
import math
import sqlite3

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import simulator
from lab.errors import LabError
from simulator.cli.sweep import int_list
from simulator.core.engine import SimConfig, SimulationError, Simulator
from simulator.experiments.plan import PlanError, RateSearch, run_plan
from simulator.experiments.sweep import StoreError, run_sweep
from simulator.core.workloads import TraceFormatError, Workload, WorkloadError, load_trace

GENERIC_HEADER = "arrival_time_s,prompt_tokens,output_tokens"
NON_FINITE = [math.nan, math.inf, -math.inf, 1e-320, 1e308, -1.0]


# ---- traces -----------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 4096), st.integers(1, 4096)), min_size=1,
                     max_size=12),
       bad_row=st.integers(0, 11), extra=st.sampled_from([-2, -1, 1, 2]), azure=st.booleans())
def test_a_row_with_a_field_too_many_or_too_few_is_refused_with_its_line(tmp_path_factory, rows, bad_row, extra,
                                                                          azure):
    rows = sorted(rows)
    bad_row %= len(rows)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens" if azure else GENERIC_HEADER]
    for index, row in enumerate(rows):
        fields = [str(v) for v in row]
        if azure:
            fields[0] = f"2023-11-16 18:{row[0] // 600:02d}:{row[0] % 60:02d}.0000000"
        if index == bad_row:
            fields = fields + ["7"] * extra if extra > 0 else fields[:extra]
        lines.append(",".join(fields))
    path = tmp_path_factory.mktemp("t") / "trace.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=f"line {bad_row + 2} has|not sorted"):
        load_trace(path)


@settings(max_examples=40, deadline=None)
@given(record=st.dictionaries(st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "x"]),
                              st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=5),
                                        st.none(), st.lists(st.integers(0, 5), max_size=3)), max_size=5))
def test_a_mooncake_record_is_read_as_written_or_refused(tmp_path_factory, record):
    import json

    path = tmp_path_factory.mktemp("m") / "trace.jsonl"
    path.write_text(json.dumps(record) + "\n")
    try:
        workload = load_trace(path)
    except TraceFormatError:
        return
    assert workload.prompt_tokens.tolist() == [record["input_length"]]
    assert workload.output_tokens.tolist() == [record["output_length"]]


def test_a_well_formed_generic_trace_reads_column_by_column(tmp_path):
    path = tmp_path / "ok.csv"
    path.write_text(" arrival_time_s , prompt_tokens,output_tokens\n0,10,3\n0.5,20,4\n\n")
    workload = load_trace(path)
    assert workload.prompt_tokens.tolist() == [10, 20] and workload.output_tokens.tolist() == [3, 4]
    assert workload.arrival_s.tolist() == [0.0, 0.5]


@pytest.mark.parametrize("stamp", ["1000", "9999", "2023", "1700000000", "16/11/2023 18:15", "2023-11-16",
                                   "18:15:46", "2023-11-16 18:15:46.6805900 extra"])
def test_azure_timestamps_must_be_dates_and_times(tmp_path, stamp):
    path = tmp_path / "azure.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{stamp},10,5\n")
    with pytest.raises(TraceFormatError, match="row 2, column TIMESTAMP"):
        load_trace(path)


def test_azure_timestamps_in_the_trace_s_format_read(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,5\n"
                    "2023-11-16 18:15:48.1805900,12,6\n")
    assert load_trace(path).arrival_s.tolist() == pytest.approx([0.0, 1.5])


@pytest.mark.parametrize("content, message", [
    (b"\xef\xbb\xbfarrival_time_s,prompt_tokens,output_tokens\n0,1,1\n", "byte-order mark"),
    (b"\narrival_time_s,prompt_tokens,output_tokens\n0,1,1\n", "line 1 is blank"),
    (b"\xff\xfea\x00r\x00", "UTF-16"),
    (b"arrival_time_s,prompt_tokens,output_tokens\n0,1,1\n1,\xff\xfe,1\n", "line 3: byte 0xff"),
    (b"arrival_time_s,prompt_tokens, prompt_tokens ,output_tokens\n0,1,1,1\n", "more than once"),
    (b"arrival_time_s,prompt_tokens,output_tokens\n0,1,1\n\n1,2,2\n", "line 3 is blank"),
    (b"arrival_time_s,prompt_tokens,output_tokens\n", "no rows"),
    (b"", "empty"),
    (b'{"timestamp": 0, "input_length": 5, "output_length": 2, "input_length": 6}\n', "given twice"),
    (b'\xef\xbb\xbf{"timestamp": 0, "input_length": 5, "output_length": 2}\n', "byte-order mark"),
    (b'{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": \xc3\x28}\n',
     "line 2: byte 0xc3"),
])
def test_encodings_and_headers_are_named_for_what_they_are(tmp_path, content, message):
    path = tmp_path / ("trace.jsonl" if b"{" in content else "trace.csv")
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_an_error_never_echoes_a_huge_field(tmp_path, suffix):
    huge = "9" * 5_000_000 + "x"
    path = tmp_path / f"trace.{suffix}"
    if suffix == "csv":
        path.write_text(f"{GENERIC_HEADER}\n0,{huge},1\n")
    else:
        path.write_text(json.dumps({"timestamp": 0, "input_length": huge, "output_length": 1}) + "\n")
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path)
    assert len(str(caught.value)) < 400


# ---- numbers ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["rate", "burstiness", "range_ratio"])
@pytest.mark.parametrize("value", NON_FINITE + [0.0, 1e-310])
def test_synthetic_spec_numbers_are_finite_and_in_range(field, value):
    spec = simulator.SyntheticSpec(preset="random", num_requests=50, **{field: value})
    valid = {"rate": (math.inf, 1e308), "range_ratio": (0.0, 1e-310, 1e-320)}  # inf: all at t = 0
    if value in valid.get(field, ()):
        assert np.isfinite(simulator.synthetic_workload(spec).arrival_s).all()
        return
    with pytest.raises(LabError):
        simulator.synthetic_workload(spec)


REAL_SIM_FIELDS = [f.name for f in dataclasses.fields(SimConfig) if f.type in ("float", "float | None")]


@pytest.mark.parametrize("field", REAL_SIM_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0])
def test_non_finite_sim_config_numbers_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Simulator(simulator.make_workload("fixed", num_requests=3), SimConfig(**{field: value}))


@pytest.mark.parametrize("column, value", [("arrival_s", math.nan), ("arrival_s", math.inf), ("arrival_s", -1.0),
                                           ("prompt_tokens", 0), ("output_tokens", -3), ("prompt_tokens", 2.5),
                                           ("output_tokens", math.nan)])
def test_a_workload_built_in_code_is_checked(column, value):
    columns = {"arrival_s": np.array([0.0, 1.0, 2.0]), "prompt_tokens": np.array([5.0, 6.0, 7.0]),
               "output_tokens": np.array([2.0, 3.0, 4.0])}
    columns[column][1] = value
    with pytest.raises(WorkloadError, match=column):
        simulator.simulate(Workload("code", **columns))


@pytest.mark.parametrize("broken", [
    dict(arrival_s=np.array([0.0, 2.0, 1.0])),  # unsorted
    dict(prompt_tokens=np.array([5, 6])),  # lengths differ
    dict(arrival_s=np.array([[0.0, 1.0, 2.0]])),  # not 1-D
])
def test_inconsistent_workloads_are_refused(broken):
    columns = dict(arrival_s=np.array([0.0, 1.0, 2.0]), prompt_tokens=np.array([5, 6, 7]),
                   output_tokens=np.array([2, 3, 4]))
    with pytest.raises(WorkloadError):
        simulator.simulate(Workload("code", **{**columns, **broken}))


def test_a_step_priced_out_of_range_stops_the_run_with_an_error():
    config = SimConfig(gpu_overrides={"bandwidth_bytes_s": 1e-20, "peak_flops": 1e-20})
    with pytest.raises(SimulationError, match="priced at"):
        simulator.simulate("fixed", config, num_requests=3)


@pytest.mark.parametrize("bandwidth", ["-5", "nan", "inf", "0", "abc"])
def test_a_kernel_csv_with_a_bad_bandwidth_is_refused(tmp_path, bandwidth):
    path = tmp_path / "kernels.csv"
    path.write_text(f"kernel,batch,context,kv_gb_per_s\npaged-v1,8,1024,{bandwidth}\n")
    with pytest.raises(ValueError, match="kv_gb_per_s"):
        simulator.simulate("fixed", SimConfig(kernel_csv=str(path)), num_requests=3)


@pytest.mark.parametrize("time_scale", [1e9])
def test_a_trace_whose_scaled_arrivals_overflow_is_refused(tmp_path, time_scale):
    path = tmp_path / "far.csv"
    path.write_text(f"{GENERIC_HEADER}\n0,1,1\n1e300,1,1\n")
    with pytest.raises(WorkloadError, match="finite|merge"):
        load_trace(path, time_scale=time_scale)


# ---- loops ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("search", [RateSearch(tolerance=1e-20), RateSearch(tolerance=math.nan),
                                    RateSearch(start=0.0), RateSearch(max_steps=10**9)])
def test_a_rate_search_that_could_not_end_is_refused(search):
    with pytest.raises(PlanError):
        run_plan([{"workload": "fixed", "num_requests": 5}], {"ttft_p90_s": 1.0}, search, parallel=False,
                 progress=False)


@pytest.mark.parametrize("text", ["1..1000000000", "1..5000", ",".join(["1"] * 5000)])
def test_huge_lists_are_refused_before_they_are_built(text):
    with pytest.raises(argparse.ArgumentTypeError, match="at most"):
        int_list(text)


# ---- the sweep store --------------------------------------------------------------------------------------------
def _trace(path, output):
    path.write_text(f"{GENERIC_HEADER}\n0,10,{output}\n0.1,10,{output}\n")


def test_rewriting_a_trace_reruns_its_sweep(tmp_path):
    trace = tmp_path / "trace.csv"
    _trace(trace, 10)
    grid = {"workload": [str(trace)], "num_requests": [2]}
    first = run_sweep(grid, tmp_path / "store.sqlite", parallel=False, progress=False)
    _trace(trace, 300)
    second = run_sweep(grid, tmp_path / "store.sqlite", parallel=False, progress=False)
    assert first.ran == second.ran == 1
    assert first.table["generated_tokens"].iloc[0] == 20 and second.table["generated_tokens"].iloc[0] == 600
    assert first.table["run_key"].iloc[0] != second.table["run_key"].iloc[0]


def test_failed_runs_are_retried_unless_asked_not_to(tmp_path):
    grid = {"workload": ["fixed"], "num_requests": [3], "model": ["qwen3-32b"], "gpu": ["l4"]}  # does not fit
    store = tmp_path / "store.sqlite"
    first = run_sweep(grid, store, parallel=False, progress=False)
    assert first.table["error"].iloc[0]
    assert run_sweep(grid, store, parallel=False, progress=False).ran == 1
    assert run_sweep(grid, store, parallel=False, progress=False, retry_failed=False).ran == 0


def test_a_store_corrupt_inside_is_refused_before_any_run(tmp_path, monkeypatch):
    store = tmp_path / "store.sqlite"
    grid = {"workload": ["fixed"], "num_requests": [3], "rate": [1.0, 2.0, 4.0, 8.0]}
    run_sweep(grid, store, parallel=False, progress=False)
    data = bytearray(store.read_bytes())
    assert len(data) > 4096 * 2
    data[4096 * 2:4096 * 2 + 64] = b"\x5a" * 64  # a page of the table, past the file header
    store.write_bytes(bytes(data))
    ran = []
    monkeypatch.setattr("simulator.experiments.sweep.run_one", lambda spec: ran.append(spec))
    with pytest.raises(StoreError, match="not a readable results store"):
        run_sweep({**grid, "rate": [16.0]}, store, parallel=False, progress=False)
    assert not ran


def test_a_store_failing_mid_sweep_loses_no_computed_run(tmp_path, monkeypatch):
    from simulator.experiments import sweep

    def broken_put(self, row):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(sweep.ResultStore, "put", broken_put)
    result = run_sweep({"workload": ["fixed"], "num_requests": [3], "rate": [1.0, 2.0]}, tmp_path / "s.sqlite",
                       parallel=False, progress=False)
    assert len(result.table) == 2 and "malformed" in result.store_error
    assert (result.table["error"] == "").all()


# ---- object boundaries ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [(10.7, 4), ("12", 4), (True, 4), (10, 4, "no"), (10, 4, 1), (10, 0), (0, 4),
                                  (10, 2.0), (None, 4)])
def test_block_manager_arguments_are_not_coerced(args):
    from lab.kv_cache.block_manager import BlockManagerConfigError, KVBlockManager

    with pytest.raises(BlockManagerConfigError):
        KVBlockManager(*args)


def test_sequences_do_not_move_between_pools_of_other_block_sizes():
    from lab.kv_cache.block_manager import KVBlockManager, PoolMismatchError

    source, target = KVBlockManager(8, 4), KVBlockManager(8, 8)
    source.create_sequence("s", [1, 2, 3, 4, 5])
    with pytest.raises(PoolMismatchError):
        source.move_sequences(["s"], target)
    assert source.get_block_table("s") and not target.sequences
    source.check_invariants()
    target.check_invariants()


def _backends():
    import torch

    return ["reference", "torch", pytest.param("cupy", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible on this machine")])]


@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=25, deadline=None)
@given(block_size=st.sampled_from([1, 3, 7, 16]), lens=st.lists(st.integers(0, 40), min_size=1, max_size=5),
       padding=st.integers(-2**31, 2**31 - 1), numpy_index=st.booleans(), seed=st.integers(0, 2**16))
def test_every_backend_honours_the_padding_row_of_the_contract(backend, block_size, lens, padding, numpy_index, seed):
    """Entries past a sequence's blocks may hold any value: the result is that of the float64 reference."""
    import torch

    import paged_kernels

    device = "cuda" if backend == "cupy" else "cpu"
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads, group, head_dim = 2, 2, 8
    width = max(1, -(-max(lens) // block_size)) + 2
    num_blocks = width * len(lens)
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=generator)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=generator)
    tables = np.full((len(lens), width), padding, dtype=np.int64)
    for row, length in enumerate(lens):
        used = -(-length // block_size)
        tables[row, :used] = np.arange(row * width, row * width + used)
    seq_lens = np.asarray(lens, dtype=np.int64)
    expected = paged_kernels.paged_attention_decode(query.double().numpy(), key_cache.double().numpy(),
                                              value_cache.double().numpy(), tables, seq_lens, backend="reference")
    index = (tables, seq_lens) if numpy_index else (torch.from_numpy(tables), torch.from_numpy(seq_lens))
    out = torch.full_like(query, float("nan")).to(device)  # poisoned
    paged_kernels.paged_attention_decode(query.to(device), key_cache.to(device), value_cache.to(device), *index,
                                   backend=backend, out=out)
    error = np.abs(out.double().cpu().numpy() - expected).max() / max(np.abs(expected).max(), 1e-12)
    assert error < 1e-5


@pytest.mark.parametrize("shape", [(4, 0, 3, 8), (4, 2, 0, 8), (4, 2, 3, 0), (0, 2, 3, 8)])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_cache_with_a_zero_dimension_is_named(shape, backend):
    import torch

    import paged_kernels

    cache = torch.zeros(shape)
    query = torch.zeros(1, 2, shape[3])
    with pytest.raises(ValueError, match="must all be >= 1"):
        paged_kernels.paged_attention_decode(query, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="must all be >= 1"):
        paged_kernels.write_kv_cache(torch.zeros(1, shape[1], shape[3]), torch.zeros(1, shape[1], shape[3]), cache,
                               cache.clone(), torch.zeros(1, dtype=torch.int64), backend=backend)


# ---- which errors are the user's --------------------------------------------------------------------------------
def test_user_errors_are_the_lab_s_and_the_kernels_not_python_s(capsys):
    import paged_kernels
    from lab.cli.args import run_command
    from lab.errors import user_errors

    with pytest.raises(paged_kernels.KernelArgumentError, match="backend must be one of"):
        paged_kernels.resolve_backend("vulkan", np.zeros(1))
    with pytest.raises(paged_kernels.KernelArgumentError, match="slot_mapping"):
        paged_kernels.write_kv_cache(np.zeros((2, 1, 4)), np.zeros((2, 1, 4)), np.zeros((1, 1, 2, 4)),
                               np.zeros((1, 1, 2, 4)), np.array([0]))
    assert not any(issubclass(ValueError, e) or issubclass(RuntimeError, e) for e in user_errors())
    assert paged_kernels.KernelArgumentError in user_errors()

    def command(raises):
        parser = argparse.ArgumentParser()
        parser.set_defaults(run=lambda args: (_ for _ in ()).throw(raises))
        return parser

    assert run_command(command(SimulationError("a priced step is not finite")), []) == 2
    assert "error: a priced step is not finite" in capsys.readouterr().err
    assert run_command(command(paged_kernels.BackendUnavailableError("backend 'cupy' is unavailable")), []) == 2
    for bug in (ValueError("a bug's error"), RuntimeError("the scheduler made no progress")):
        with pytest.raises(type(bug)):  # a bug shows as one: a traceback, not an "error:" line
            run_command(command(bug), [])
