"""``python -m simulator.bench`` at a tiny size: every row it reports, the in-run ratio, and its argument checks."""
import pandas as pd
import pytest

from lab.bench.timing import median_seconds
from simulator.bench import main


def test_the_bench_reports_replay_speeds_their_ratio_memory_and_trace_loads(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    rows = "\n".join(f"{i * 0.05},{20 + i % 7},{5 + i % 5}" for i in range(60))
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n" + rows + "\n")
    mooncake = tmp_path / "mooncake.jsonl"  # three conversations, each turn extending the one before
    mooncake.write_text("".join(f'{{"timestamp": {i * 100}, "input_length": {500 + 512 * (i // 3)}, "output_length": 4, '
                                f'"hash_ids": {[j * 10 + i % 3 for j in range(i // 3 + 1)]}}}\n' for i in range(30)))
    out = tmp_path / "bench.csv"
    assert main(["--trace", str(trace), "--repeats", "3", "--large", "300", "--csv-rows", "200",
                 "--mooncake-trace", str(mooncake), "--mooncake-requests", "24", "--out", str(out)]) == 0
    table = pd.read_csv(out).set_index("case")
    paged, oracle = table.loc["azure-conv replay, paged"], table.loc["azure-conv replay, contiguous-oracle"]
    assert paged["completed"] == oracle["completed"] == 60 and paged["value"] > 0 and oracle["value"] > 0
    assert table.loc["paged / contiguous-oracle speed", "unit"] == "ratio (median of 3 alternating pairs)"
    assert table.loc["300 requests: peak traced memory", "value"] > 0
    assert table.loc["300 sharegpt requests, paged", "completed"] == 300
    assert {"load 200-row generic CSV", "load 200-row Mooncake JSONL"} <= set(table.index)
    cached, uncached = (table.loc[f"mooncake-conv 24 requests, paged, prefix caching {state}"] for state in ("on", "off"))
    assert cached["completed"] == uncached["completed"] == 24
    assert 0.5 < table.loc["mooncake-conv prefix-cache hit rate", "value"] < 1  # later turns hit earlier ones
    assert table.loc["prefix caching on / off speed", "value"] > 0


def test_a_missing_trace_is_skipped_with_a_line_and_bad_sizes_are_refused(tmp_path, capsys):
    out = tmp_path / "bench.csv"
    assert main(["--trace", str(tmp_path / "none.csv"), "--mooncake-trace", str(tmp_path / "none.jsonl"),
                 "--large", "50", "--csv-rows", "10", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipping the trace replay" in printed and "skipping the prefix-caching replay" in printed
    assert not pd.read_csv(out)["case"].str.startswith("azure-conv").any()
    for flag in ("--repeats", "--large", "--csv-rows", "--num-cpus", "--mooncake-requests"):
        with pytest.raises(SystemExit):
            main([flag, "0"])


def test_median_seconds_warms_up_then_takes_the_median():
    calls = []
    seconds = median_seconds(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and 0 <= seconds < 0.1


def test_the_sweep_bench_grid_is_200_distinct_runs():
    from simulator.bench import SWEEP_GRID
    from simulator.experiments.sweep import expand, spec_key

    assert len({spec_key(spec) for spec in expand(SWEEP_GRID)}) == len(expand(SWEEP_GRID)) == 200
