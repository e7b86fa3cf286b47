"""Figures are built from data alone; the result store keeps, compares and reloads tables."""
import pandas as pd
import pytest

from lab.kv_cache.block_manager import KVBlockManager
from lab.kv_cache.pool_view import pool_snapshot
from lab.report.charts import (block_pool_figure, block_pool_frame, block_table_frame, engine_live_figure,
                        kernel_bandwidth_figure, kernel_time_figure, latency_histograms, paging_diagram)
from lab.errors import InputError
from lab.report.results import ResultStore, to_csv_bytes
from simulator import SimConfig, compare
from simulator.views.charts import (COMPARISON_VIEWS, comparison_figure, latency_percentiles, over_time, waste_areas,
                              waste_bars)


def test_block_pool_figure_marks_owners_shared_and_free_blocks():
    manager = KVBlockManager(10, 4)
    manager.create_sequence("a", num_prompt_tokens=6)
    manager.fork_sequence("a", "b")
    pool = pool_snapshot(manager)
    figure = block_pool_figure(pool.ref_counts, pool.owners, columns=5)
    heat = figure.data[0]
    assert heat.z.shape == (2, 5)
    assert sum(1 for v in heat.z.ravel() if v > 0) == 2 and sum(1 for v in heat.z.ravel() if v == 0) == 8  # free: drawn
    assert list(heat.text.ravel()[:2]) == ["●2", "●2"]
    frame = block_pool_frame(pool.ref_counts, pool.owners)
    assert frame["shared"].sum() == 2 and frame.loc[0, "owners"] == "a,b"
    table = block_table_frame(pool.block_tables["b"], 4, pool.seq_lens["b"])
    assert table["tokens_held"].tolist() == [4, 2]


def test_simulator_figures_have_one_trace_per_category_or_run():
    summary, runs = compare("alpaca", [SimConfig(allocator="paged", capacity_tokens=5000),
                                       SimConfig(allocator="contiguous-max", capacity_tokens=5000)],
                            num_requests=50, rate=20.0)
    assert len(waste_bars(summary).data) == 5
    assert len(waste_areas(runs["paged-B16"].timeseries, "t").data) == 5
    batch = over_time({k: r.timeseries for k, r in runs.items()}, "num_running", "b", "running sequences")
    assert len(batch.data) == 2 and batch.layout.yaxis.title.text == "running sequences"
    rate = over_time({k: r.timeseries for k, r in runs.items()}, "generated_tokens", "t", "tokens/s", per_second=True)
    assert [len(trace.x) for trace in rate.data] == [100, 100]
    assert len(latency_percentiles(summary).data) == 2 * 3  # two runs x three facets (TTFT, TPOT, e2e)
    latency = latency_percentiles(summary)  # each facet ticked over its own values (TPOT is ~1,000 x below TTFT)
    for axis, metric in (("yaxis", "ttft"), ("yaxis2", "tpot"), ("yaxis3", "e2e")):
        values = summary[[f"{metric}_p{q}_s" for q in (50, 90, 99)]].to_numpy()
        ticks = latency.layout[axis].tickvals
        assert latency.layout[axis].showticklabels and min(ticks) <= values.min() and max(ticks) >= values.max()
        bottom, top = (10 ** end for end in latency.layout[axis].range)
        assert bottom <= values.min() * (1 + 1e-9) and top >= values.max() * (1 - 1e-9)
        assert pytest.approx(bottom) in ticks and pytest.approx(top) in ticks  # a tick at each end
    series = {k: r.timeseries for k, r in runs.items()}
    names = ["waste_bars", "areas_contiguous-max"] + [v for v in COMPARISON_VIEWS.values() if v != "areas"]
    assert [len(comparison_figure(name, summary, series).data) for name in names] == [5, 5, 2, 2, 6]
    for name, message in (("areas_paged-B32", "no run labelled 'paged-B32'"), ("pie", "unknown comparison chart")):
        with pytest.raises(InputError, match=message):
            comparison_figure(name, summary, series)


def test_rates_over_time_are_window_means_that_keep_the_total():
    # 1,000 cycles of a decode row (50 tokens in 0.01 s) and a prefill-like row (no tokens, 0.02 s): row by row the
    # rate swings between 5,000 and 0 tokens/s; over a window of ten cycles it is 50 / 0.03 = 1,667 tokens/s
    elapsed = pd.Series([0.03 * (i // 2) + (0.01 if i % 2 == 0 else 0.03) for i in range(2000)])
    totals = pd.Series([50.0 * (i // 2 + 1) for i in range(2000)])
    rate = over_time({"run": pd.DataFrame({"elapsed_s": elapsed, "tokens": totals})}, "tokens", "t", "tokens/s",
                     per_second=True).data[0]
    assert len(rate.x) == 100 and sum(rate.y) * elapsed.max() / 100 == pytest.approx(totals.iloc[-1])
    assert all(abs(value - 50 / 0.03) < 0.11 * 50 / 0.03 for value in rate.y)  # a window may cut a cycle


def test_runtime_and_kernel_figures():
    steps = pd.DataFrame({"elapsed_s": [0.1, 0.2], "num_running": [1, 2], "num_waiting": [3, 1],
                          "blocks_in_use": [4, 6]})
    assert len(engine_live_figure(steps).data) == 3
    histograms = latency_histograms({"vllm:time_to_first_token_seconds": [0.1, 0.2],
                                     "vllm:inter_token_latency_seconds": [0.01, 0.02]})
    assert len(histograms.data) == 2 and [note.text for note in histograms.layout.annotations] == [
        "Time to first token (TTFT)", "Inter-token latency (ITL)"]
    kernels = pd.DataFrame({"kernel": ["sdpa-contiguous", "torch"], "batch": [1, 1], "context": [64, 64],
                            "median_ms": [1.0, 1.1], "kv_gb_per_s": [5.0, 4.5]})
    assert len(kernel_time_figure(kernels).data) == 2 and len(kernel_bandwidth_figure(kernels).data) == 2
    diagram = paging_diagram()
    assert len(diagram.layout.shapes) == 13
    physical = [shape.fillcolor for shape in diagram.layout.shapes if shape.y0 == 0.5]
    logical = {shape.fillcolor for shape in diagram.layout.shapes if shape.y0 == 3.0}
    # a physical block takes its one owner's colour; the shared one (7) and the free ones differ from both
    assert physical[1] == physical[4] != physical[3] and {physical[1], physical[3]} == logical
    assert physical[7] not in logical and physical[0] == physical[2] not in logical


def test_result_store_round_trip():
    store = ResultStore()
    first = store.add("simulation", "run", pd.DataFrame({"x": [1, 2]}))
    second = store.add("kernels", "run", pd.DataFrame({"y": [3]}))
    assert (first.name, second.name) == ("run", "run (2)")
    both = store.side_by_side(["run", "run (2)"])
    assert list(both.columns) == ["result", "x", "y"] and len(both) == 3
    loaded = store.load_csv(to_csv_bytes(both), "export.csv")
    assert loaded.table.shape == both.shape and store.listing()["kind"].tolist()[-1] == "uploaded"
    with pytest.raises(ValueError, match="bad.csv"):
        store.load_csv(b"", "bad.csv")
    with pytest.raises(ValueError, match="no stored result"):
        store.side_by_side(["nope"])


def test_the_twin_s_tokens_per_second_are_counted_in_time_windows():
    from simulator.views.charts import twin_steps, windowed_rate

    # steps ending at 0.5, 1, 1.5 and 4 s: a window holds the steps that end in it, empty windows count 0
    rate = windowed_rate(pd.Series([0.5, 1.0, 1.5, 4.0]), pd.Series([1, 2, 3, 4]), 1.0)
    assert rate["elapsed_s"].tolist() == [0.0, 1.0, 2.0, 3.0] and rate["value"].tolist() == [3.0, 3.0, 0.0, 4.0]
    assert windowed_rate(pd.Series([0.3]), pd.Series([6]), 0.5)["value"].tolist() == [12.0]
    real = pd.DataFrame({"duration_s": [0.02] * 100, "num_decode_seqs": [0] + [8] * 99})  # 8 tokens / 20 ms
    simulated = real.assign(duration_s=0.01)  # twice as fast
    figure = twin_steps(real, simulated, "num_decode_seqs", "Decode tokens/s", per_second=True, windows=20)
    by_run = {trace.name: trace for trace in figure.data}
    assert figure.layout.yaxis.title.text == "Decode tokens/s"  # what is plotted, not the step-log column's name
    assert len(by_run["real"].x) == 20 and len(by_run["simulated"].x) == 10  # windows of 0.1 s over 2 s and 1 s
    assert by_run["real"].y[5] == pytest.approx(400.0) and by_run["simulated"].y[5] == pytest.approx(800.0)
    # the total over the windows is every token, once
    assert sum(by_run["real"].y) * 0.1 == pytest.approx(8 * 99)


def test_recorded_results_are_listed_with_their_command_and_read_safely(tmp_path):
    from lab.report.results import RECORDED_RESULTS, read_recorded, recorded_results

    (tmp_path / "paper").mkdir()
    (tmp_path / "paper" / "figure2.csv").write_text("system,frac\nvLLM,0.96\nOrca,0.2\n")
    (tmp_path / "mystery.csv").write_text("a\n1\n")
    (tmp_path / "broken.csv").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "notes.txt").write_text("not a table")
    listing = recorded_results(tmp_path).set_index("file")
    assert list(listing.index) == ["broken.csv", "mystery.csv", "paper/figure2.csv"]
    assert listing.loc["paper/figure2.csv", "rows"] == 2 and listing.loc["paper/figure2.csv", "command"] == \
        "python -m simulator paper"
    assert listing.loc["mystery.csv", "command"] == "" and pd.isna(listing.loc["broken.csv", "rows"])
    assert read_recorded("paper/figure2.csv", tmp_path)["frac"].tolist() == [0.96, 0.2]
    for bad, message in (("broken.csv", "broken.csv: the file is UTF-16"), ("notes.txt", "not a recorded result"),
                         ("../outside.csv", "not a recorded result"), ("none.csv", "not a recorded result")):
        with pytest.raises(ValueError, match=message):
            read_recorded(bad, tmp_path)
    assert recorded_results(tmp_path / "missing").empty
    repo = recorded_results(RECORDED_RESULTS).set_index("file")  # the README's figures, each with its command
    assert repo.loc["simulator.csv", "command"] == "python -m simulator.bench" and (repo["command"] != "").all()


def test_the_block_size_chart_puts_each_figure_in_its_own_panel():
    import pandas as pd

    from simulator.views.charts import block_size_lines

    table = pd.DataFrame({"workload": ["a"] * 3 + ["b"] * 3, "block_size": [1, 16, 256] * 2,
                          "internal_fragmentation_pct": range(6), "throughput_tok_s": range(10, 16),
                          "mean_batch_size": range(20, 26)})
    figure = block_size_lines(table)
    assert [trace.xaxis for trace in figure.data] == ["x", "x2", "x3"] * 2
    assert [trace.showlegend for trace in figure.data] == [True, False, False] * 2


def test_settings_flatten_configs_and_name_the_export():
    import datetime

    from lab.engine import EngineConfig
    from lab.engine.live import RuntimeRunConfig
    from lab.report.results import LAB_VERSION, export_name, settings_of, split_settings, with_settings

    config = RuntimeRunConfig(model="tiny", num_requests=4, prompt_len_range=(8, 32), max_tokens_range=(2, 9),
                              engine=EngineConfig(block_size=7, seed=3))
    settings = settings_of(config, {"workload": "random"}, extra=None)
    # nested dataclass fields in place; a name taken twice (seed) prefixed by its field; tuples as words
    assert settings["block_size"] == 7 and settings["seed"] == 0 and settings["engine_seed"] == 3
    assert settings["prompt_len_range"] == "8 32" and settings["lab_version"] == LAB_VERSION
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in settings.values())
    when = datetime.datetime(2026, 12, 2, 20, 15)
    assert export_name("runtime", settings, when) == "runtime_random_4req_tiny_B7_20261202-201500.csv"
    assert export_name("x", {"workload": "a/b c", "arrival_rate_req_s": float("inf")}, when) == \
        "x_a-b-c_allatonce_20261202-201500.csv"
    table = pd.DataFrame({"block_size": [16, 32], "tokens": [1, 2]})
    exported = with_settings(table, settings)
    assert list(exported.columns[:3]) == ["model", "num_requests", "prompt_len_range"]
    assert exported["setting_block_size"].tolist() == [7, 7] and exported["block_size"].tolist() == [16, 32]
    back, values = split_settings(exported, list(settings))
    pd.testing.assert_frame_equal(back, table)
    assert values["block_size"] == 7 and values["model"] == "tiny"


def test_stored_results_keep_their_settings_for_export():
    store = ResultStore()
    store.add("simulation", "a", pd.DataFrame({"x": [1]}), {"workload": "sharegpt"})
    store.add("simulation", "b", pd.DataFrame({"x": [2]}), {"workload": "alpaca"})
    assert "workload" not in store.side_by_side(["a", "b"])
    assert store.side_by_side(["a", "b"], settings=True)["workload"].tolist() == ["sharegpt", "alpaca"]


def test_the_headline_chart_writes_each_figure_clear_of_the_goal_line():
    """Labels start right of their bar and of the goal line (a line through a number made it unreadable); a figure
    infinitely past its goal (a zero where lower is better) is drawn capped, within the axis."""
    from lab.report.charts import HEADLINE_RATIO_SHOWN, headline_figure

    table = pd.DataFrame({"benchmark": ["below", "just above", "far above", "zero cost"],
                          "latest": [0.5, 1.05, 3.0, 0.0], "unit": ["×", "×", "×", "%"], "goal": ["≥ 1"] * 3 + ["≤ 5"],
                          "met": [False, True, True, True], "latest_over_goal": [0.5, 1.05, 3.0, float("inf")]})
    figure = headline_figure(table)
    bars, labels = figure.data
    assert list(bars.x) == [0.5, 1.05, 3.0, HEADLINE_RATIO_SHOWN]
    assert all(x > max(bar, 1.0) for x, bar in zip(labels.x, bars.x)) and labels.textposition == "middle right"
    assert list(labels.text) == list(bars.customdata) and "0 % (goal ≤ 5)" in labels.text
    low, high = figure.layout.xaxis.range
    assert low == 0 and max(labels.x) * 1.5 < high < 20


def test_column_names_read_as_words_with_their_units():
    """A display label for every name an export writes: its own where it has one, else its words and the unit its
    suffix names; exports keep the names (``human_columns`` renames a copy)."""
    from lab.report.results import human_columns, human_label

    assert human_label("ttft_p50_s") == "TTFT p50 (s)" and human_label("logical_block") == "Logical block"
    assert [human_label(n) for n in ("median_ms", "kv_gb_per_s", "peak_tok_s", "free_frac", "num_free_blocks")] == \
        ["Median (ms)", "Kv (GB/s)", "Peak (tokens/s)", "Free (fraction)", "Num free blocks"]
    assert human_label(3) == 3 and human_label("s") == "S"
    table = pd.DataFrame({"ttft_s": [0.1], "max_rel_err": [1e-7]})
    shown = human_columns(table, {"max_rel_err": "Max relative error vs float64"})
    assert list(shown.columns) == ["Time to first token (s)", "Max relative error vs float64"]
    assert list(table.columns) == ["ttft_s", "max_rel_err"]
