"""The vLLM paper's figures run at a reduced size and return their documented columns and verdicts."""
import pandas as pd
import pytest

from simulator.views.charts import paper_figure

from simulator.experiments.paper import (FIGURES, SAVED_RUN, TinyScale, figure2, figure12, figure13, figure15, figure16, figure18,
                             figure19, load_figures, normalized_latency, run_figures)

COLUMNS = {"2": {"system", "token_states_frac", "paper_token_states_frac"},
           "12": {"model", "workload", "system", "max_rate_req_s", "knee_s_per_token"},
           "15": {"workload", "n", "saving", "paper_saving"},
           "16": {"prefix_tokens", "system", "max_rate_req_s"},
           "13": {"workload", "system", "mean_batch_size", "paper_mean_batch_size"},
           "18": {"workload", "block_size", "normalized_latency_s_per_token", "real_throughput_tok_s",
                  "simulated_throughput_tok_s"},
           "19": {"block_size", "preemption_mode", "normalized_latency_s_per_token", "blocks_swapped",
                  "real_makespan_s", "simulated_makespan_s", "measured_swap_over_recompute"}}


@pytest.mark.parametrize("figure", FIGURES)
def test_each_figure_runs_small_and_has_its_columns(figure):
    functions = {"2": figure2, "12": figure12, "13": figure13, "15": figure15, "16": figure16, "18": figure18,
                 "19": figure19}
    small = {"tiny": TinyScale((4, 16), "quick", 12)} if figure in ("18", "19") else {}
    table, summary = functions[figure](60 if figure in ("12", "16") else 120, **small)
    assert COLUMNS[figure] <= set(table.columns) and len(table) > 0
    assert summary and all(row["verdict"] in ("reproduced", "partly", "not") for row in summary)
    chart = paper_figure(figure, table)
    assert len(chart.data) >= 2  # the lab beside the paper, or the tiny engine beside the model
    assert not [note.text for note in chart.layout.annotations if "=" in note.text]  # panels: "opt-13b", not "model=…"


def test_the_summary_and_csvs_are_written(tmp_path):
    summary = run_figures(["2", "13"], tmp_path, 100)
    assert list(summary.columns) == ["figure", "quantity", "paper", "lab", "verdict"]
    assert (tmp_path / "figure2.csv").exists() and (tmp_path / "figure13.csv").exists()
    written = pd.read_csv(tmp_path / "summary.csv")
    assert list(written.columns) == ["figures", "num_requests", "tiny_engine", "lab_version", "lab_commit",
                                     *summary.columns]
    assert written["num_requests"].eq(100).all() and written["figures"].eq("2 13").all()  # says what produced it
    with pytest.raises(ValueError, match="not available"):
        run_figures(["14"], tmp_path)
    loaded_summary, tables, settings = load_figures(tmp_path)
    pd.testing.assert_frame_equal(loaded_summary, summary.astype({"figure": str}))
    assert settings["num_requests"] == 100 and not settings["tiny_engine"]
    assert list(tables) == ["2", "13"]  # in the paper's order, not the files' names' order
    assert load_figures(tmp_path / "nothing here") is None


def test_the_committed_full_run_loads():
    summary, tables, _ = load_figures(SAVED_RUN)
    assert set(summary["verdict"]) <= {"reproduced", "partly", "not"} and set(tables) == set(FIGURES)


def test_normalized_latency_is_mean_latency_per_output_token():
    requests = pd.DataFrame({"arrival_s": [0.0, 1.0], "first_token_s": [0.5, 1.5], "finish_s": [2.0, 5.0],
                             "output_tokens": [4, 8]})
    assert normalized_latency(requests) == pytest.approx((0.5 + 0.5) / 2)
