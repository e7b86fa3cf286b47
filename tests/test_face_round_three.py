"""Issue 67, "the face, round three": settings that survive a change of page and travel in the URL, the Memory
simulator's per-request export, latency CDFs, goodput and overload verdict, headline cards found by name in their
export, one rejection warning per cause, a Stop that keeps finished runs, Sweeps that sweep each allocator over the
settings it reads, and warnings where a spread or a held-out error makes a number untrustworthy."""
import json
import math

import pandas as pd
import pytest

import simulator
from lab.report import trust, url_settings
from simulator.views import report
from tests.test_app import clean, download_table, downloads, open_page  # noqa: F401 (a fixture)


# ---- the URL codec -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, options", [(5.0, None), (1000, None), (True, None),
                                            ("sharegpt", ["sharegpt", "alpaca"]), ([16, 128], [1, 16, 128]),
                                            (["paged"], ["paged", "contiguous-max"])])
def test_a_setting_reads_back_as_it_was_written(value, options):
    assert url_settings.decode(url_settings.encode(value), value, options) == value


@pytest.mark.parametrize("text, default, options, low, high", [
    ("abc", 5.0, None, 0.0, 200.0), ("500", 5.0, None, 0.0, 200.0), ("nan", 5.0, None, None, None),
    ("inf", 5.0, None, None, None), ("yes", True, None, None, None), ("opt-999b", "opt-13b", ["opt-13b"], None, None),
    ("[16,16]", [16], [16, 32], None, None), ("[3]", [16], [16, 32], None, None), ("{}", [16], [16], None, None),
    ("2.5", 3, None, None, None)])
def test_a_hand_edited_or_stale_url_value_falls_back_to_the_default(text, default, options, low, high):
    assert url_settings.decode(text, default, options, low, high) is url_settings.MISSING


def test_a_setting_from_the_url_opens_the_page_with_it_and_its_export_says_so(downloads):
    """A shared link (its query parameters) sets the page's widgets on a fresh session; the run and its export are
    of those settings, and the URL keeps only what differs from the defaults."""
    from streamlit.testing.v1 import AppTest

    from tests.test_app import ROOT

    app = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    app.query_params.update(sim_rate="2.5", sim_requests="300", sim_block_sizes="[16,128]", sim_model="nonsense")
    app.run()
    app.switch_page("app_pages/memory_simulator.py")
    app.query_params.update(sim_rate="2.5", sim_requests="300", sim_block_sizes="[16,128]", sim_model="nonsense")
    app.run()
    clean(app)
    assert app.number_input(key="sim_rate").value == 2.5 and app.number_input(key="sim_requests").value == 300
    assert app.selectbox(key="sim_model").value == "opt-13b"  # an unknown model falls back to the default
    summary = download_table(app, downloads, "dl_summary")
    assert summary["arrival_rate_req_s"].eq(2.5).all() and set(summary["label"]) >= {"paged-B16", "paged-B128"}
    assert app.query_params.get("sim_rate") == "2.5" and "sim_model" not in app.query_params


def test_settings_survive_leaving_the_page_and_coming_back():
    app = open_page("memory_simulator")
    app.number_input(key="sim_rate").set_value(3.0).run()
    app.multiselect(key="sim_allocators").set_value(["paged", "contiguous-oracle"]).run()
    clean(app)
    app.switch_page("app_pages/kernel_lab.py")
    app.run()
    assert "sim_rate" not in app.query_params  # another page's URL carries its own settings
    app.switch_page("app_pages/memory_simulator.py")
    app.run()
    clean(app)
    assert app.number_input(key="sim_rate").value == 3.0
    assert app.multiselect(key="sim_allocators").value == ["paged", "contiguous-oracle"]
    assert app.query_params.get("sim_rate") == "3.0"


def test_an_uploaded_trace_stays_for_the_session_and_the_page_says_it_is_not_in_the_link():
    app = open_page("memory_simulator")
    app.radio(key="sim_source").set_value("upload a trace").run()
    app.file_uploader(key="sim_trace").upload("mine.csv", b"arrival_time_s,prompt_tokens,output_tokens\n0,100,20\n"
                                              b"1,200,30\n", "text/csv")
    app.run()
    clean(app)
    app.switch_page("app_pages/sweeps.py")
    app.run()
    app.switch_page("app_pages/memory_simulator.py")
    app.run()
    clean(app)
    assert app.radio(key="sim_source").value == "upload a trace"
    assert any("mine.csv" in c.value and "not the file" in c.value for c in app.caption)
    assert "2 requests" in next(c.value for c in app.caption if c.value.startswith("Workload:"))


# ---- the Memory simulator ------------------------------------------------------------------------------------------
def test_per_request_export_goodput_and_cdfs(downloads):
    app = open_page("memory_simulator")
    clean(app)
    requests = download_table(app, downloads, "dl_requests")
    assert {"run", "request", "arrival_s", "queue_s", "ttft_s", "tpot_s", "itl_s", "e2e_s", "prompt_tokens",
            "output_tokens", "preemptions", "rejected", "model", "gpu", "arrival_rate_req_s"} <= set(requests)
    summary = download_table(app, downloads, "dl_summary")
    paged = requests[requests["run"] == "paged-B16"]
    assert len(paged) == 1000 and paged["preemptions"].sum() == summary.set_index("label").loc["paged-B16",
                                                                                                "preemptions"]
    assert paged["ttft_s"].median() == pytest.approx(summary.set_index("label").loc["paged-B16", "ttft_p50_s"])
    assert (paged["queue_s"] <= paged["ttft_s"] + 1e-9).all() and (paged["queue_s"] >= -1e-9).all()
    goodput = download_table(app, downloads, "dl_goodput")
    assert goodput["ttft_slo_s"].eq(2.0).all() and goodput["tpot_slo_s"].eq(0.1).all()
    met = ((paged["ttft_s"] <= 2.0) & (paged["tpot_s"] <= 0.1)).mean()
    assert goodput.set_index("run").loc["paged-B16", "met_both_frac"] == pytest.approx(met)
    app.number_input(key="sim_ttft_slo").set_value(1000.0).run()  # an SLO changes goodput, not the run
    clean(app)
    looser = download_table(app, downloads, "dl_goodput").set_index("run")
    assert looser.loc["paged-B16", "met_both_frac"] > met and looser["ttft_slo_s"].eq(1000.0).all()
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in app.get("plotly_chart")]
    assert any(t.startswith("TTFT (s): share of finished") for t in titles)
    assert any(t.startswith("End-to-end latency (s): share") for t in titles)


def test_the_overload_verdict_names_its_numbers_and_goes_when_the_load_does():
    app = open_page("memory_simulator")
    verdict = [w.value for w in app.warning if w.value.startswith("Overloaded")]
    assert len(verdict) == 1 and "paged-B16" in verdict[0] and "requests/s" in verdict[0]
    app.number_input(key="sim_rate").set_value(0.5).run()
    clean(app)
    assert not any(w.value.startswith("Overloaded") for w in app.warning)


def test_the_overload_table_says_who_keeps_up():
    workload = simulator.make_workload("sharegpt", num_requests=400, rate=5.0)
    summary, runs = simulator.compare(workload, simulator.make_configs(["paged", "contiguous-max"], [16],
                                                                       model="opt-13b", gpu="a100-40gb"))
    table = report.overload(report.request_table(runs), summary).set_index("run")
    assert table.loc["contiguous-max", "overloaded"]
    assert table.loc["contiguous-max", "late_queue_s"] > 10 * max(table.loc["contiguous-max", "early_queue_s"], 0.1)
    assert table.loc["paged-B16", "served_req_s"] > table.loc["contiguous-max", "served_req_s"]
    all_at_once = simulator.make_workload("sharegpt", num_requests=50)
    summary, runs = simulator.compare(all_at_once, simulator.make_configs(["paged"], [16]))
    batch = report.overload(report.request_table(runs), summary)
    assert batch.empty and report.overload_sentence(batch) is None  # a batch has no rate to outrun


def test_every_headline_card_is_in_its_export_by_the_same_name(downloads):
    app = open_page("memory_simulator")
    clean(app)
    figures = download_table(app, downloads, "dl_headline").set_index("Figure")
    assert len(app.metric) == 4
    for card in app.metric:
        figure, run = card.label.split(" · ")
        row = figures.loc[figure]
        assert row["Paged run"] == run
        shown = float(card.value.split()[0].replace(",", ""))
        assert shown == pytest.approx(row["Paged"], rel=0.01), (card.label, card.value, row["Paged"])
    summary = download_table(app, downloads, "dl_summary").set_index("label")
    # the card's holding share is the summary's allocated_holding_frac (share of allocated KV), named apart from
    # token_states_frac (share of the whole pool)
    assert 100 * summary.loc["paged-B16", "allocated_holding_frac"] == pytest.approx(
        figures.loc["Allocated KV holding tokens (%)", "Paged"])


def test_one_rejection_warning_names_every_allocator_it_applies_to():
    """A trace whose requests no allocator can hold: one warning naming the six, not six warnings."""
    app = open_page("memory_simulator")
    app.radio(key="sim_source").set_value("upload a trace").run()
    app.file_uploader(key="sim_trace").upload("too_long.csv", b"arrival_time_s,prompt_tokens,output_tokens\n"
                                              b"0,5000,10\n1,6000,10\n", "text/csv")
    app.run()
    rejections = [w.value for w in app.warning if "were rejected" in w.value]
    assert len(rejections) == 1 and all(name in rejections[0] for name in simulator.ALLOCATORS), rejections
    app.radio(key="sim_source").set_value("synthetic").run()
    app.number_input(key="sim_capacity").set_value(64).run()  # different counts: one warning per count
    rejections = [w.value for w in app.warning if "were rejected" in w.value]
    assert 1 < len(rejections) < len(simulator.ALLOCATORS)
    assert any("contiguous-oracle, contiguous-grow, contiguous-pow2-total, paged-B16:" in w for w in rejections)


def test_a_stopped_comparison_keeps_the_runs_that_finished():
    workload = simulator.make_workload("sharegpt", num_requests=200, rate=5.0)
    configs = simulator.make_configs(["contiguous-max", "contiguous-oracle", "paged"], [16])
    kept = simulator.RunCache(8)
    calls = []

    def stop_after_the_first(fraction):
        calls.append(fraction)
        return fraction < 1 / 3

    simulator.compare(workload, configs, progress=stop_after_the_first, reuse=kept)
    finished = simulator.finished_configs(workload, configs, kept)
    assert finished == configs[:1] and len(kept) == 1
    again, _ = simulator.compare(workload, finished, reuse=kept)
    assert again["label"].tolist() == ["contiguous-max"]


# ---- Sweeps --------------------------------------------------------------------------------------------------------
def test_each_allocator_is_swept_over_the_settings_it_reads_only(tmp_path):
    from simulator.experiments.sweep import allocator_grids, run_sweep

    grid = {"workload": ["sharegpt"], "num_requests": [30], "allocator": ["paged", "contiguous-oracle",
                                                                          "contiguous-max"],
            "block_size": [8, 16], "rate": [5.0], "address_space": ["first-fit", "buddy"],
            "enable_prefix_caching": [True, False]}
    paged, contiguous = allocator_grids(grid)
    assert paged["allocator"] == ["paged"] and "address_space" not in paged and paged["block_size"] == [8, 16]
    assert contiguous["allocator"] == ["contiguous-oracle", "contiguous-max"]
    assert "block_size" not in contiguous and "enable_prefix_caching" not in contiguous
    table = run_sweep(allocator_grids(grid), tmp_path / "store.sqlite", parallel=False, progress=False).table
    assert len(table) == 2 * 2 + 2 * 2  # paged: block sizes x prefix caching; contiguous: allocators x address space
    assert table[table["allocator"] != "paged"][["block_size", "enable_prefix_caching"]].isna().all().all()
    assert table[table["allocator"] == "paged"]["address_space"].isna().all()


def test_the_sweep_heatmap_colour_starts_at_zero_and_a_sweep_says_whether_memory_binds():
    from simulator.views import charts

    table = pd.DataFrame({"rate": [1.0, 1.0, 5.0, 5.0], "block_size": [8, 16, 8, 16],
                          "throughput_tok_s": [2006.0, 2037.0, 2010.0, 2058.0]})
    figure = charts.sweep_heatmap(table, "block_size", "rate", "throughput_tok_s")
    assert figure.layout.coloraxis.cmin == 0 and "from zero" in figure.layout.title.text
    idle = pd.DataFrame({"allocator": ["paged", "contiguous-oracle"], "throughput_tok_s": [2006.0, 2058.0],
                         "peak_allocated_frac": [0.4, 0.7], "preemptions": [0, 0]})
    assert report.memory_bound_sentence(idle).startswith("**Not memory-bound**")
    bound = idle.assign(peak_allocated_frac=[1.0, 0.98], throughput_tok_s=[770.0, 534.0])
    assert "Memory-bound in 2 of 2 runs" in report.memory_bound_sentence(bound) and "1.44×" in \
        report.memory_bound_sentence(bound)


# ---- trust -------------------------------------------------------------------------------------------------------
def test_a_wide_spread_or_a_large_held_out_error_is_named():
    timings = pd.DataFrame({"kernel": ["torch", "sdpa-contiguous"], "batch": [8, 8], "context": [1024, 1024],
                            "median_ms": [0.16, 0.2], "max_ms": [12.0, 0.25]})
    problems = trust.spread_problems(timings, "median_ms", "max_ms", ["kernel", "batch", "context"])
    assert len(problems) == 1 and problems[0].startswith("torch, batch 8, context 1024: slowest call 75×")
    assert trust.holdout_problem(0.77)[0].startswith("the profile is 77% off")
    assert trust.holdout_problem(0.05) == [] and trust.holdout_problem(math.nan)
    assert trust.table_problems(timings.drop(columns="max_ms"))  # a median alone: its spread unknown


def test_the_kernel_lab_warns_about_a_wide_spread_and_marks_stale_timings(monkeypatch):
    from lab.bench import kernels

    real = kernels.run_kernel_bench

    def disturbed(config, progress=None, on_rows=None, refuse_noisy=True):
        table = real(config, progress, on_rows, refuse_noisy)
        return table.assign(max_ms=table["median_ms"] * ([75.0] + [1.0] * (len(table) - 1)))

    monkeypatch.setattr(kernels, "run_kernel_bench", disturbed)
    app = open_page("kernel_lab")
    clean(app)
    assert any("slowest call 75× the median" in w.value for w in app.warning)
    app.select_slider(key="kernel_block_size").set_value(32).run()
    assert any("settings changed — press Run" in w.value for w in app.warning)


def test_a_stopped_calibration_can_keep_the_measured_rounds():
    """``profile_engine(on_round=)`` hands over a fit of the rounds measured so far after each: what the Digital
    twin's Stop keeps."""
    from lab.profiling.profile import Profile, profile_engine

    heard = []
    whole = profile_engine("tiny", block_size=16, repeats=2, grid="quick",
                           on_round=lambda fit, measured, planned: heard.append((fit(), measured, planned)))
    assert [(measured, planned) for _, measured, planned in heard] == [(1, 2), (2, 2)]
    first, _, _ = heard[0]
    def timed(profile):  # each step shape's timings, those kept and those left out as stalled (``steady_mean``)
        return sum(sample["repeats"] + sample["stalled"] for sample in profile.samples)
    assert isinstance(first, Profile) and timed(whole) == 2 * timed(first)
