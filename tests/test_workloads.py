"""Trace loaders: the real traces in ../shared/traces, and every malformed-input case."""
import json
import math

import numpy as np
import pytest

from simulator import SimConfig, Simulator, TraceFormatError, load_trace, simulate


def test_azure_trace_loads_and_replays(traces_dir):
    path = traces_dir / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    full = load_trace(path)
    assert len(full) == 19366 and full.arrival_s[0] == 0 and np.all(np.diff(full.arrival_s) >= 0)
    assert abs(full.prompt_tokens.mean() - 1154.7) < 1 and abs(full.output_tokens.mean() - 211.1) < 1
    part = load_trace(path, max_rows=400, time_scale=0.1)
    assert len(part) == 400 and part.arrival_s[-1] == pytest.approx(full.arrival_s[399] * 0.1)
    result = Simulator(part, SimConfig(allocator="paged", max_model_len=16384)).run()
    assert result.summary["num_requests_completed"] + result.summary["num_requests_rejected"] == 400


def test_mooncake_trace_shares_prefixes(traces_dir):
    path = traces_dir / "mooncake_fast25" / "conversation_trace.jsonl"
    workload = load_trace(path, max_rows=300)
    assert workload.prompt_block_ids is not None and len(workload) == 300
    ids = workload.prompt_token_ids(0)
    assert len(ids) == workload.prompt_tokens[0]
    config = SimConfig(allocator="paged", max_model_len=131072, gpu="h200", model="qwen3-8b", block_size=512)
    result = Simulator(workload, config).run()
    assert result.summary["num_requests_completed"] == 300
    config.capacity_tokens = 10**8  # nothing is ever evicted
    # Upper bound: the share of 512-token prompt blocks whose whole prefix of ids appeared before.
    seen, hits, total = set(), 0, 0
    for ids in workload.prompt_block_ids:
        total += len(ids) - 1  # the last prompt block is always recomputed
        matched = 0
        while matched < len(ids) - 1 and tuple(ids[:matched + 1]) in seen:
            matched += 1
        hits += matched
        seen.update(tuple(ids[:j + 1]) for j in range(len(ids)))
    assert hits / total > 0.05
    assert Simulator(workload, config).run().summary["prefix_cache_hit_blocks"] == hits
    assert 0 < result.summary["prefix_cache_hit_blocks"] <= hits


def test_code_trace_and_synthetic_mooncake_load(traces_dir):
    assert len(load_trace(traces_dir / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv")) == 8819
    assert len(load_trace(traces_dir / "mooncake_fast25" / "synthetic_trace.jsonl")) == 3993


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


GENERIC_HEADER = "arrival_time_s,prompt_tokens,output_tokens\n"


@pytest.mark.parametrize("body,row,column,words", [
    ("0,10,5\n1,abc,5\n", 3, "prompt_tokens", "not a finite number"),
    ("0,10,5\n1,10,-3\n", 3, "output_tokens", "must be > 0"),
    ("0,10,5\n1,0,3\n", 3, "prompt_tokens", "must be > 0"),
    ("0,10,5\n1,nan,3\n", 3, "prompt_tokens", "not a finite number"),
    ("0,10,5\n1,,3\n", 3, "prompt_tokens", "not a finite number"),
    ("0,10,5\n2,10,5\n1,10,5\n", 4, "arrival_time_s", "not sorted"),
    ("0,10.5,5\n", 2, "prompt_tokens", "whole number"),
])
def test_generic_csv_errors_name_file_row_and_column(tmp_path, body, row, column, words):
    path = write(tmp_path, "t.csv", GENERIC_HEADER + body)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    message = str(info.value)
    assert str(path) in message and f"row {row}" in message and column in message and words in message


def test_empty_missing_columns_and_unknown(tmp_path):
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(write(tmp_path, "e.csv", ""))
    with pytest.raises(TraceFormatError, match="no rows"):
        load_trace(write(tmp_path, "h.csv", GENERIC_HEADER))
    with pytest.raises(TraceFormatError, match="missing column.*output_tokens"):
        load_trace(write(tmp_path, "m.csv", "arrival_time_s,prompt_tokens\n0,1\n"))
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.csv")
    with pytest.raises(ValueError, match="time_scale"):
        load_trace(write(tmp_path, "ok.csv", GENERIC_HEADER + "0,1,1\n"), time_scale=0)


def test_azure_errors(tmp_path):
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    good = "2023-11-16 18:15:46.6805900,374,44\n"
    with pytest.raises(TraceFormatError, match=r"row 3, column TIMESTAMP"):
        load_trace(write(tmp_path, "a.csv", header + good + "yesterday,3,4\n"))
    with pytest.raises(TraceFormatError, match=r"row 3, column TIMESTAMP: .*not sorted"):
        load_trace(write(tmp_path, "b.csv", header + good + "2023-11-16 18:15:40.0000000,3,4\n"))
    with pytest.raises(TraceFormatError, match=r"row 2, column GeneratedTokens"):
        load_trace(write(tmp_path, "c.csv", header + "2023-11-16 18:15:46.6805900,374,x\n"))
    workload = load_trace(write(tmp_path, "d.csv", header + good + "2023-11-16 18:15:47.1805900,3,4\n"))
    assert workload.arrival_s[1] == pytest.approx(0.5)
    with pytest.raises(TraceFormatError, match=r"e.csv: row 3, column TIMESTAMP: .*time zone"):  # not pandas' bare error
        load_trace(write(tmp_path, "e.csv", header + good + "2023-11-16 18:15:47+02:00,3,4\n"))


def test_mooncake_lines_without_hash_ids_share_nothing(tmp_path):
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 5}, {"timestamp": 40, "input_length": 600,
                                                                        "output_length": 3}]
    workload = load_trace(write(tmp_path, "plain.jsonl", "\n".join(map(json.dumps, rows)) + "\n"))
    assert workload.prompt_block_ids is None and not workload.has_shared_prefixes
    assert list(workload.prompt_tokens) == [600, 600] and workload.arrival_s[1] == pytest.approx(0.04)
    result = simulate(workload, SimConfig(allocator="paged", capacity_tokens=4096))
    assert result.summary["num_requests_completed"] == 2 and result.summary["prefix_cache_hit_blocks"] == 0


def test_mooncake_errors(tmp_path):
    ok = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]})
    cases = [
        ("{not json", "line 2: not valid JSON"),
        (json.dumps({"timestamp": 5, "input_length": -1, "output_length": 5, "hash_ids": []}), "row 2, column input_length"),
        (json.dumps({"timestamp": 5, "input_length": 10, "output_length": 5, "hash_ids": [1, 2]}), "row 2, column hash_ids"),
        (json.dumps({"timestamp": 5, "output_length": 5, "hash_ids": [1]}), "row 2, column input_length"),
        (json.dumps({"timestamp": float("nan"), "input_length": 1, "output_length": 5, "hash_ids": [1]}), "column timestamp"),
        (json.dumps({"timestamp": 5, "input_length": 10, "output_length": 5}),
         "row 2, column hash_ids: missing here but not in row 1"),
    ]
    for index, (line, words) in enumerate(cases):
        path = write(tmp_path, f"m{index}.jsonl", ok + "\n" + line + "\n")
        with pytest.raises(TraceFormatError, match=words.replace("(", r"\(")):
            load_trace(path)
    given = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 5})
    with pytest.raises(TraceFormatError, match="row 3, column hash_ids: given here but not in row 1"):
        load_trace(write(tmp_path, "g.jsonl", given + "\n\n" + ok.replace("0", "9", 1) + "\n"))
    unsorted = json.dumps({"timestamp": -5 + 0, "input_length": 1, "output_length": 5, "hash_ids": [1]})
    with pytest.raises(TraceFormatError, match="not sorted"):
        load_trace(write(tmp_path, "u.jsonl", json.dumps({"timestamp": 10, "input_length": 1, "output_length": 1,
                                                            "hash_ids": [3]}) + "\n" + unsorted.replace("-5", "4")))


def test_a_trace_replayed_at_another_mean_rate_keeps_its_shape(tmp_path):
    from simulator.cli.main import _workload, build_parser
    from simulator.core.workloads import at_mean_rate

    rng = np.random.default_rng()
    arrivals = np.sort(rng.uniform(0, 100, 50))
    path = tmp_path / "t.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n" +
                    "".join(f"{t},{rng.integers(1, 500)},{rng.integers(1, 200)}\n" for t in arrivals))
    trace = load_trace(path)
    rate = float(rng.uniform(0.5, 50))
    scaled = at_mean_rate(trace, rate)
    assert (len(scaled) - 1) / scaled.arrival_s[-1] == pytest.approx(rate)  # requests per second, on average
    gaps, scaled_gaps = np.diff(trace.arrival_s), np.diff(scaled.arrival_s)
    np.testing.assert_allclose(scaled_gaps / scaled_gaps.sum(), gaps / gaps.sum())  # bursts where they were
    assert (scaled.prompt_tokens == trace.prompt_tokens).all() and (trace.arrival_s == load_trace(path).arrival_s).all()
    assert at_mean_rate(trace, math.inf) is trace
    with pytest.raises(ValueError, match="would be ignored"):  # one arrival, or all at one time: nothing to scale
        at_mean_rate(trace.subset([3]), 2.0)
    with pytest.raises(ValueError, match="rate"):
        at_mean_rate(trace, 0.0)
    cli = _workload(build_parser().parse_args(["--workload", str(path), "--rate", str(rate)]))
    np.testing.assert_allclose(cli.arrival_s, scaled.arrival_s)  # python -m simulator --rate with a trace


def test_make_workload_refuses_what_its_source_would_ignore(tmp_path):
    from simulator import make_workload

    path = tmp_path / "t.csv"
    path.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n2,12,6\n4,14,7\n")
    assert list(make_workload(str(path), rate=2.0).arrival_s) == [0.0, 0.5, 1.0]  # a trace at a mean of 2 per s
    with pytest.raises(ValueError, match="n, shared_prefix_tokens: for a synthetic preset"):
        make_workload(str(path), n=2, shared_prefix_tokens=16)
    with pytest.raises(ValueError, match="a rate or a time scale, not both"):
        make_workload(str(path), rate=2.0, time_scale=3.0)
    with pytest.raises(ValueError, match="a time scale applies to a trace"):
        make_workload("sharegpt", num_requests=5, time_scale=3.0)
