"""Every page of the app under Streamlit's AppTest: defaults run cleanly, widgets change results, downloads are
readable CSV with the documented columns, bad input shows an error element (never a traceback)."""
import io
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

import pandas as pd
import pytest
from streamlit.runtime.media_file_manager import MediaFileManager
from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["overview", "memory_simulator", "block_pool", "kernel_lab", "runtime", "twin", "paper", "sweeps",
         "benchmarks"]


class Downloads(dict):
    """Bytes of every file the app offers for download, by file id (a deferred download's bytes are made when first
    read, as a click would); ``names``: their file names."""

    def __init__(self):
        super().__init__()
        self.names, self.deferred = {}, {}

    def __missing__(self, file_id):
        self[file_id] = self.deferred.pop(file_id)()
        return self[file_id]


def file_id_of(button) -> str:
    """The file id behind a download button: its URL's stem, or its deferred file's id."""
    return button.proto.deferred_file_id or PurePosixPath(button.proto.url).stem


@pytest.fixture
def downloads(monkeypatch):
    files = Downloads()
    original = MemoryMediaFileStorage.load_and_get_id
    original_deferred = MediaFileManager.add_deferred

    def record(self, path_or_data, mimetype, kind, filename=None):
        file_id = original(self, path_or_data, mimetype, kind, filename)
        files[file_id], files.names[file_id] = path_or_data, filename
        return file_id

    def record_deferred(self, data_callable, mimetype, coordinates, file_name=None, **kwargs):
        file_id = original_deferred(self, data_callable, mimetype, coordinates, file_name, **kwargs)
        files.pop(file_id, None)
        files.deferred[file_id], files.names[file_id] = data_callable, file_name
        return file_id

    monkeypatch.setattr(MemoryMediaFileStorage, "load_and_get_id", record)
    monkeypatch.setattr(MediaFileManager, "add_deferred", record_deferred)
    return files


def test_worker_processes_that_import_app_py_do_not_start_the_app():
    # multiprocessing's workers import the main script again as __mp_main__ (the simulator's pool, forkserver)
    code = ("import runpy, sys; runpy.run_path('app.py', run_name='__mp_main__'); "
            "print('streamlit' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_rerun_never_runs_beside_the_script_it_interrupts():
    """Streamlit's fast reruns start a second script thread while the first still runs to its next yield point; both
    touch the session's state, and a slider's read of it raised "dictionary changed size during iteration" in the
    server log (a CI run). The app runs one script thread per session."""
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["runner"]["fastReruns"] is False


def test_no_pages_folder_beside_app_py():
    # Streamlit runs a fresh server's first page from a pages/ folder beside the main script (its first multipage
    # API) before app.py's st.navigation: the page ran twice on the first load
    assert not (ROOT / "pages").exists()
    assert (ROOT / "app_pages" / "memory_simulator.py").exists()


def open_page(page: str) -> AppTest:
    app = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    app.run()
    if page != "overview":
        app.switch_page(f"app_pages/{page}.py")
        app.run()
    return app


def clean(app: AppTest) -> None:
    assert not app.exception, [e.value for e in app.exception]
    assert not app.error, [e.value for e in app.error]
    assert_readable_tables(app)


def assert_readable_tables(app: AppTest) -> None:
    """Every table on the page heads its columns for a person (its column config's label, else the column's name):
    no ``snake_case`` name of an export."""
    for table in app.dataframe:
        config = json.loads(table.proto.columns or "{}")
        headers = [config.get(str(column), {}).get("label") or str(column) for column in table.value.columns]
        assert not [h for h in headers if "_" in h], headers


def download_table(app: AppTest, files: dict, key: str) -> pd.DataFrame:
    button = next(b for b in app.download_button if b.proto.id.endswith(key))
    return pd.read_csv(io.BytesIO(files[file_id_of(button)]))


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs_with_defaults_and_its_exports_say_what_produced_them(page, downloads):
    app = open_page(page)
    clean(app)
    for button in app.download_button:
        file_id = file_id_of(button)
        table = pd.read_csv(io.BytesIO(downloads[file_id]))
        assert "lab_version" in table, (page, button.proto.id)
        assert re.search(r"_\d{8}-\d{6}\.csv$", downloads.names[file_id]), downloads.names[file_id]  # a timestamp
        EXPORTS[f"{page}: {downloads.names[file_id]}"] = table


EXPORTS: dict[str, pd.DataFrame] = {}  # every export of every page at its defaults (filled by the test above)
UNIT_SUFFIXES = {"_frac": (0.0, 1.0), "_pct": (0.0, 100.0), "_s": (0.0, None), "_ms": (0.0, None),
                 "_tokens": (0.0, None), "_tok_s": (0.0, None)}


def test_a_column_name_means_one_thing_in_every_export():
    """A column shared by exports is numeric in all or in none, and a unit suffix holds its promise everywhere:
    ``_frac`` in [0, 1], ``_pct`` in [0, 100], times, token counts and rates not negative."""
    if len(EXPORTS) < len(PAGES):
        pytest.skip("runs after test_every_page_runs_with_defaults_and_its_exports_say_what_produced_them")
    kinds: dict[str, dict[str, bool]] = {}
    for name, table in EXPORTS.items():
        for column in table.columns:
            values = table[column].dropna()
            numeric = pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)
            if not values.empty:
                kinds.setdefault(column, {})[name] = numeric
            for suffix, (low, high) in UNIT_SUFFIXES.items():
                if column.endswith(suffix) and numeric:
                    finite = values[values.abs() != float("inf")]
                    assert (finite >= low).all() and (high is None or (finite <= high).all()), (name, column)
    mixed = {column: by for column, by in kinds.items() if len(set(by.values())) > 1}
    assert not mixed, mixed


def test_memory_simulator_reacts_and_exports(downloads):
    app = open_page("memory_simulator")
    clean(app)
    summary = download_table(app, downloads, "dl_summary")
    assert {"label", "allocator", "token_states_frac", "reserved_frac", "internal_fragmentation_frac", "external_fragmentation_frac",
            "free_frac", "mean_batch_size", "throughput_tok_s"} <= set(summary.columns)
    assert summary["num_requests_completed"].iloc[0] == 1000
    series = download_table(app, downloads, "dl_timeseries")
    assert {"elapsed_s", "num_running", "blocks_in_use", "token_states", "reserved", "internal_fragmentation",
            "external_fragmentation", "free", "run"} <= set(series.columns)
    checks = download_table(app, downloads, "dl_checks")  # every run's closed-form checks, shown beside it
    assert set(checks["label"]) == set(summary["label"]) and checks["holds"].all()
    assert any(e.label.startswith(f"Checks against closed forms: {len(checks)} of {len(checks)} hold")
               for e in app.expander)
    app.number_input[0].set_value(300).run()
    clean(app)
    assert download_table(app, downloads, "dl_summary")["num_requests_completed"].iloc[0] == 300
    app.number_input(key="sim_max_num_seqs").set_value(8).run()  # every allocator's batch capped at 8
    clean(app)
    assert download_table(app, downloads, "dl_summary")["peak_batch_size"].max() == 8
    app.toggle(key="sim_prefix_caching").set_value(False).run()
    clean(app)
    assert download_table(app, downloads, "dl_summary")["prefix_cache_hit_rate"].isna().all()


def test_the_block_size_sweep_s_export_states_the_requests_it_ran(downloads):
    """The sweep runs the first requests of two workloads: its CSV says so, not the comparison's 1,000."""
    app = open_page("memory_simulator")
    clean(app)
    app.button(key="run_block_sweep").click().run()
    clean(app)
    sweep = download_table(app, downloads, "dl_block_sweep")
    assert (sweep["num_requests"] == 300).all() and len(set(sweep["workload"])) == 2
    assert set(sweep["workloads"].iloc[0].split()) == set(sweep["workload"])


def test_a_sweep_cut_short_by_another_action_shows_what_finished(downloads):
    """A rerun ends the run in progress (Streamlit), so a click elsewhere on the page while a sweep runs cuts it
    short. The rows it finished are shown with a note saying so, not dropped without a word; after a change of
    settings they are stale, and the note says to run it again."""
    app = open_page("memory_simulator")
    clean(app)
    app.button(key="run_block_sweep").click().run()
    full = download_table(app, downloads, "dl_block_sweep")
    finished = full.drop(columns=[c for c in full.columns if c not in
                                  ("workload", "block_size", "internal_fragmentation_pct", "throughput_tok_s",
                                   "mean_batch_size")]).head(5).to_dict("records")
    # what an interrupted sweep leaves: its rows so far, for the run it swept (the page's own helpers keep them)
    app.session_state["sim_block_rows"], app.session_state["sim_block_for"] = finished, app.session_state["sim_key"]
    app.session_state["sim_block_sweep"] = None
    app.run()  # the rerun of another action (not a chart view: figures built here are kept for other tests)
    clean(app)
    assert any(i.value.startswith("Cut short by another action on the page: 5 of 18 runs finished") for i in app.info)
    assert len(download_table(app, downloads, "dl_block_sweep")) == 5
    app.run()  # the note is said once
    assert not any("Cut short" in i.value for i in app.info)
    app.session_state["sim_block_rows"], app.session_state["sim_block_for"] = finished, app.session_state["sim_key"]
    app.number_input[0].set_value(300).run()  # other settings: the rows belong to another run
    clean(app)
    assert any("cut short by a change of settings" in i.value for i in app.info)
    assert not any(b.proto.id.endswith("dl_block_sweep") for b in app.download_button)


def test_memory_simulator_draws_the_chart_chosen_and_builds_each_once():
    """Two charts at a time (where the memory goes, and the view chosen), each built when first shown and kept with
    the run: a return to a view shows the same figure without building it again."""
    import json
    from unittest import mock

    from simulator.views import charts

    def titles(app):  # where the memory goes and the view chosen (the latency CDFs further down are always drawn)
        return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in app.get("plotly_chart")][:2]

    app = open_page("memory_simulator")
    clean(app)
    assert titles(app) == ["Where the KV memory goes (time-weighted mean)", "paged-B16: KV breakdown over time"]
    with mock.patch.object(charts, "comparison_figure", wraps=charts.comparison_figure) as build:
        for view, title in (("Running sequences over time", "Batch size"), ("Latency percentiles", None),
                            ("KV breakdown over time", "paged-B16: KV breakdown over time")):
            app.segmented_control(key="sim_chart_view").set_value(view).run()
            clean(app)
            assert len(titles(app)) == 2 and (title is None or titles(app)[1] == title)
        app.segmented_control(key="sim_areas_run").set_value("contiguous-max").run()
        clean(app)
        assert titles(app)[1] == "contiguous-max: KV breakdown over time"
        app.segmented_control(key="sim_chart_view").set_value("Running sequences over time").run()
        clean(app)
    assert [c.args[0] for c in build.call_args_list] == ["batch_over_time", "latency_percentiles",
                                                         "areas_contiguous-max"]


def test_memory_simulator_shows_settings_it_already_ran_at_once():
    """Going back to settings the server has run shows that result without running again (the same settings give
    the same result); other settings run."""
    from unittest import mock

    import simulator

    app = open_page("memory_simulator")
    clean(app)
    first = app.session_state["sim_summary"]
    with mock.patch.object(simulator, "compare", wraps=simulator.compare) as compare:
        app.number_input[0].set_value(200).run()
        clean(app)
        assert compare.call_count == 1 and app.session_state["sim_summary"]["num_requests"].iloc[0] == 200
        app.number_input[0].set_value(1000).run()
        clean(app)
        assert compare.call_count == 1  # the defaults again: nothing ran
    again = app.session_state["sim_summary"]
    pd.testing.assert_frame_equal(again, first)
    assert again is not first  # a copy: the page may add to it


def test_memory_simulator_figure2_setup_greys_out_what_it_fixes(downloads):
    app = open_page("memory_simulator")
    app.toggle[0].set_value(True).run()  # "vLLM paper Figure 2 setup"
    clean(app)
    fixed = [app.number_input(key=k) for k in ("sim_max_num_seqs", "sim_budget")] + [app.toggle(key="sim_prefix_caching")]
    assert all(widget.disabled for widget in fixed) and app.number_input(key="sim_capacity").disabled
    summary = download_table(app, downloads, "dl_summary")
    assert summary["paper_token_states_frac"].notna().any()


def test_memory_simulator_greys_out_what_a_trace_brings_itself():
    synthetic_only = ("Arrival rate", "Burstiness", "Parallel samples", "Beam width", "Shared system-prompt")

    def sliders(app):  # the arrival rate is typed (a number input), the others are sliders
        return [s for s in [*app.slider, *app.number_input] if s.label.startswith(synthetic_only)]

    app = open_page("memory_simulator")
    assert len(sliders(app)) == len(synthetic_only) and not any(s.disabled for s in sliders(app))
    app.radio[0].set_value("upload a trace").run()  # its arrivals and lengths come from the file
    assert not app.exception and all(s.disabled for s in sliders(app))
    assert not app.error and any("Upload a trace in the sidebar" in i.value for i in app.info)  # not an error yet


def test_memory_simulator_bad_upload_shows_error():
    app = open_page("memory_simulator")
    app.radio[0].set_value("upload a trace").run()
    app.file_uploader[0].upload("broken.csv", b"arrival_time_s,prompt_tokens,output_tokens\n0,abc,5\n", "text/csv")
    app.run()
    assert not app.exception
    assert any("broken.csv" in e.value and "row 2" in e.value for e in app.error)


def test_memory_simulator_impossible_pool_shows_error():
    app = open_page("memory_simulator")
    app.number_input(key="sim_capacity").set_value(1).run()  # a KV capacity of one token: no block fits
    assert not app.exception and any("holds no block" in e.value for e in app.error)


def test_memory_simulator_warns_about_rejected_requests():
    app = open_page("memory_simulator")
    app.number_input(key="sim_capacity").set_value(64).run()  # 64 token slots: most ShareGPT requests can never fit
    assert not app.exception and not app.error
    assert any("larger than the whole KV pool" in w.value for w in app.warning)
    assert not any("nan" in w.value for w in app.warning)  # contiguous runs are named without a block size


def test_kernel_lab_block_size_changes_results(downloads):
    app = open_page("kernel_lab")
    clean(app)
    assert download_table(app, downloads, "dl_kernels")["block_size"].iloc[0] == 16
    app.select_slider[0].set_value(7)
    app.button(key="run").click().run()
    clean(app)
    table = download_table(app, downloads, "dl_kernels")
    assert (table["block_size"] == 7).all() and {"kernel", "batch", "context", "median_ms", "vs_sdpa"} <= set(table)
    assert (app.dataframe[0].value["Max relative error vs the float64 reference"] < 1e-4).all()


def test_kernel_lab_draws_a_noisy_baseline_with_a_warning(monkeypatch):
    """A baseline still noisy when timed again (a busy machine) is drawn with a warning that says why, not refused
    with an error and no chart."""
    from lab.bench import kernels

    monkeypatch.setattr(kernels, "baseline_problem", lambda table: "the SDPA baseline at batch 1 took 0.573 ms at "
                        "context 256 but 0.267 ms at context 1024: a noisy or unwarmed run")
    app = open_page("kernel_lab")
    clean(app)
    assert any("0.573 ms at context 256" in w.value and "timed twice" in w.value for w in app.warning), \
        [w.value for w in app.warning]
    assert len(app.get("plotly_chart")) >= 2


def test_runtime_page_runs_and_reports_errors(downloads):
    app = open_page("runtime")
    clean(app)
    requests = download_table(app, downloads, "dl_requests")
    assert len(requests) == 16 and {"ttft_s", "tpot_s", "e2e_s"} <= set(requests)
    app.slider[0].set_value(4)
    app.button(key="run").click().run()
    clean(app)
    assert len(download_table(app, downloads, "dl_requests")) == 4
    app.radio(key="compare_workload").set_value("this page's request mix")
    app.button(key="compare").click().run()
    clean(app)
    comparison = download_table(app, downloads, "dl_compare")
    assert list(comparison["system"]) == ["paged-engine", "hf-continuous", "hf-static"]
    assert comparison["same_tokens_as_engine"].all() and comparison["num_requests"].eq(4).all()
    app.number_input(key="runtime_num_blocks").set_value(2)  # a KV pool smaller than one request
    app.button(key="run").click().run()
    assert not app.exception and any("KV pool" in e.value for e in app.error)
    app.text_input[0].set_value("/nonexistent/qwen3")
    app.button(key="run").click().run()
    assert not app.exception and any("neither a preset" in e.value for e in app.error)


def test_the_runtime_page_opens_again_with_its_first_run_and_run_serves_anew(monkeypatch):
    """The default mix is served once per server: the page opened again (a reload, another tab) shows that run and
    says when it ran; Run serves the mix again."""
    from lab.engine import live
    from lab.errors import InputError

    first = open_page("runtime")
    clean(first)

    def refuse(config, on_step=None):
        raise InputError("served again")

    monkeypatch.setattr(live, "run_runtime_detached", refuse)
    again = open_page("runtime")
    clean(again)
    assert any("the run this page opened with on this server" in c.value.lower() for c in again.caption)
    assert again.session_state["runtime_run"].summary == first.session_state["runtime_run"].summary
    again.button(key="run").click().run()
    assert [e.value.split()[:2] for e in again.error] == [["served", "again"]]


def test_block_pool_frames_and_controls():
    app = open_page("block_pool")
    clean(app)
    frames = app.session_state["pool_frames"]
    assert len(frames) > 1 and app.metric[1].label == "free blocks"
    app.slider(key="num_blocks").set_value(64)
    app.button(key="run").click().run()
    clean(app)
    assert len(app.session_state["pool_frames"][-1][1].ref_counts) == 64
    app.radio[0].set_value("runtime engine")
    app.button(key="run").click().run()
    clean(app)


@pytest.mark.parametrize("source", ["simulator (paged)", "runtime engine"])
def test_block_pool_shows_the_host_pool_when_swapping(source):
    app = open_page("block_pool")
    app.radio[0].set_value(source)
    app.slider(key="num_blocks").set_value(16)  # small: forces swapping
    app.slider[1].set_value(40)  # requests
    app.radio[1].set_value("swap")
    app.button(key="run").click().run()
    clean(app)
    frames = app.session_state["pool_frames"]
    assert all(pool.host_pool is not None for _, pool in frames)
    assert any(len(pool.host_pool.ref_counts) > pool.host_pool.num_free_blocks for _, pool in frames)
    assert any("Host pool" in caption.value for caption in app.caption)


@pytest.mark.parametrize("source", ["simulator (paged)", "runtime engine"])
def test_block_pool_draws_the_offload_tier(source):
    app = open_page("block_pool")
    app.radio[0].set_value(source)
    app.slider(key="num_blocks").set_value(32)  # small: cached prefix blocks get evicted to the tier
    app.slider(key="offload_blocks").set_value(64)
    app.button(key="run").click().run()
    clean(app)
    frames = app.session_state["pool_frames"]
    assert all(pool.offload is not None and len(pool.offload.lru_rank) == 64 for _, pool in frames)
    last = frames[-1][1].offload
    assert last.stats.stored_blocks > 0 and last.num_used_slots == min(64, last.stats.stored_blocks)
    assert any("Host offload tier" in caption.value for caption in app.caption)
    assert app.session_state["pool_settings"]["kv_offload_blocks"] == 64


def test_block_pool_draws_one_host_pool_for_swapping_and_the_tier():
    app = open_page("block_pool")
    app.slider(key="num_blocks").set_value(32)
    app.slider(key="offload_blocks").set_value(64)
    app.radio[1].set_value("swap")
    app.button(key="run").click().run()
    clean(app)
    frames = [pool for _, pool in app.session_state["pool_frames"]]
    assert all(pool.offload.shares_host_pool and len(pool.offload.lru_rank) == len(pool.host_pool.ref_counts)
               for pool in frames)
    assert any(any(pool.host_pool.owners) for pool in frames), "some frame should hold a swapped-out sequence"
    assert any("one budget" in caption.value for caption in app.caption)


def test_benchmarks_page_lists_results_and_rejects_bad_csv(downloads):
    app = open_page("memory_simulator")
    app.switch_page("app_pages/benchmarks.py")
    app.run()
    clean(app)
    listing = app.session_state["results"].listing()
    assert {"simulation", "checks"} <= set(listing["kind"])  # the closed-form checks go there too
    app.file_uploader[0].upload("bad.csv", b"\x00\x01\x02", "text/csv")
    app.run()
    assert not app.exception
    app.file_uploader[0].upload("good.csv", b"a,b\n1,2\n", "text/csv")
    app.run()
    assert "good.csv" in app.session_state["results"].names()
    comparison = download_table(app, downloads, "dl_comparison")
    assert "result" in comparison.columns


def test_runtime_page_runs_chunked_prefill_with_swap_preemption(downloads):
    app = open_page("runtime")
    app.slider[0].set_value(12)
    app.number_input(key="runtime_num_blocks").set_value(24)  # a small pool: preemption by swapping
    app.radio(key="runtime_scheduling").set_value("chunked")
    app.number_input(key="runtime_budget").set_value(32)
    app.number_input(key="runtime_max_num_seqs").set_value(3)  # the pool alone would let 4 run
    app.radio(key="runtime_preemption").set_value("swap")
    app.button(key="run").click().run()
    clean(app)
    run = app.session_state["runtime_run"]
    assert run.summary["swap_outs"] > 0 and len(run.requests) == 12
    steps = run.steps
    assert steps["num_prefill_tokens"].max() <= 32 and steps["cpu_blocks_in_use"].max() > 0
    assert steps["num_running"].max() == 3


BAD_UPLOADS = [("empty.csv", b""), ("binary.csv", b"\x00\xff\xfe\x01"), ("huge.csv",
               b"arrival_time_s,prompt_tokens,output_tokens\n0,99999999999,5\n"),
               ("broken.jsonl", b'{"timestamp": 0}\n'), ("nan.csv", b"arrival_time_s,prompt_tokens,output_tokens\nnan,4,5\n")]


@pytest.mark.parametrize("name,data", BAD_UPLOADS, ids=[n for n, _ in BAD_UPLOADS])
def test_memory_simulator_bad_uploads_show_an_error_naming_the_file(name, data):
    app = open_page("memory_simulator")
    app.radio[0].set_value("upload a trace").run()
    app.file_uploader[0].upload(name, data, "text/csv")
    app.run()
    assert not app.exception and any(name in e.value for e in app.error), [e.value for e in app.error]


@pytest.mark.parametrize("files", [{"config.json": b"[1, 2]"}, {"config.json": b"{not json"},
                                   {"config.json": b"{}", "model.safetensors": b"garbage"}],
                         ids=["config-not-an-object", "config-not-json", "corrupt-weights"])
def test_runtime_page_bad_checkpoint_shows_an_error(tmp_path, files):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    app = open_page("runtime")
    app.text_input[0].set_value(str(tmp_path))
    app.button(key="run").click().run()
    assert not app.exception and any(str(tmp_path) in e.value for e in app.error), [e.value for e in app.error]


@pytest.mark.parametrize("source", ["simulator (paged)", "runtime engine"])
def test_block_pool_extreme_settings_run_or_explain(source):
    """The smallest pool with the largest shared prefix and samples: requests that can never fit are reported, the
    rest run; no traceback."""
    app = open_page("block_pool")
    app.radio[0].set_value(source)
    app.slider(key="num_blocks").set_value(16)
    app.select_slider[0].set_value(1)  # block size 1: 16 token slots in all
    app.slider[3].set_value(256)  # shared prefix longer than the pool
    app.button(key="run").click().run()
    assert not app.exception
    assert app.error or app.warning, "a pool too small for every request must say so"


def test_kernel_lab_extremes_run_cleanly():
    app = open_page("kernel_lab")
    app.select_slider[0].set_value(1)
    app.slider[0].set_value(1)
    app.button(key="run").click().run()
    clean(app)


def test_benchmarks_page_shows_recorded_results_and_adds_them_to_the_session(downloads):
    from lab.report.results import LAB_VERSION, RECORDED_RESULTS, lab_commit, split_settings

    app = open_page("benchmarks")
    clean(app)
    app.selectbox(key="recorded_file").set_value("simulator.csv").run()
    clean(app)
    shown = download_table(app, downloads, "dl_recorded")
    table, settings = split_settings(shown, ["source", "lab_version", "lab_commit"])
    assert settings["source"] == "simulator.csv" and settings["lab_version"] == LAB_VERSION  # where it came from
    assert settings["lab_commit"] == lab_commit()
    assert table.equals(pd.read_csv(RECORDED_RESULTS / "simulator.csv"))
    app.button(key="add_recorded").click().run()
    clean(app)
    assert app.session_state["results"].names() == ["recorded: simulator.csv"]


@pytest.mark.parametrize("data", [b"", b"\x00\x01\x02", b"a,b\n1\n2,3,4,5\n"], ids=["empty", "binary", "ragged"])
def test_benchmarks_page_bad_csv_shows_an_error(data):
    app = open_page("benchmarks")
    app.file_uploader[0].upload("bad.csv", data, "text/csv")
    app.run()
    assert not app.exception and any("bad.csv" in e.value for e in app.error), [e.value for e in app.error]


def test_sweeps_page_runs_a_sweep_and_a_plan_and_loads_files(downloads):
    from simulator.experiments.sweep import failed_runs

    app = open_page("sweeps")
    clean(app)
    app.toggle(key="on_ray").set_value(False)
    app.number_input[0].set_value(60)
    app.button(key="run_sweep").click().run()
    clean(app)
    table = download_table(app, downloads, "dl_sweep")
    # paged at 3 block sizes x 3 rates, contiguous-oracle (which has no blocks) once per rate
    assert len(table) == 3 * 3 + 3
    contiguous = table[table["allocator"] != "paged"]
    assert len(contiguous) == 3 and contiguous["block_size"].isna().all()
    assert failed_runs(table).empty and {"throughput_tok_s", "block_size", "rate"} <= set(table)
    # the defaults are memory-bound at 5 and 20 requests/s, and paging shows it there (at 1 request/s the pool
    # never fills and the two serve alike)
    best = table.groupby(["rate", "allocator"])["throughput_tok_s"].max().unstack()
    assert (best.loc[[5.0, 20.0], "paged"] > 1.1 * best.loc[[5.0, 20.0], "contiguous-oracle"]).all(), best
    assert any("Memory-bound in" in i.value for i in app.info)
    charts = [json.loads(c.proto.spec) for c in app.get("plotly_chart")]
    heatmap = next(c for c in charts if c["data"][0]["type"] == "heatmap")
    assert heatmap["layout"]["coloraxis"]["cmin"] == 0 and "from zero" in heatmap["layout"]["title"]["text"]
    assert not app.warning  # the results are the sidebar's
    app.sidebar.multiselect(key="sweep_rates").set_value([1.0, 5.0]).run()
    assert any("settings changed — press Run" in w.value for w in app.warning)  # stale until Run
    app.sidebar.radio(key="sweep_mode").set_value("capacity plan").run()
    app.button(key="run_sweep").click().run()
    clean(app)
    plan = download_table(app, downloads, "dl_sweep")
    plan_button = next(b for b in app.download_button if b.proto.id.endswith("dl_sweep"))
    assert downloads.names[file_id_of(plan_button)].startswith("plan_")
    assert {"max_rate_req_s", "cost_per_hour", "chosen", "kv_offload_gib", "host_cost_per_hour"} <= set(plan)
    assert plan["chosen"].sum() <= 1 and plan["host_price_per_gib_hour"].eq(0.004).all()
    app.sidebar.text_input[0].set_value("ttft_p91=2")
    app.button(key="run_sweep").click().run()
    assert not app.exception and any("ttft_p91" in e.value for e in app.error)
    app.sidebar.radio(key="sweep_mode").set_value("load a results file").run()
    app.sidebar.file_uploader[0].upload("plan.csv", plan.to_csv(index=False).encode(), "text/csv")
    app.run()
    clean(app)
    app.sidebar.file_uploader[0].upload("junk.csv", b"a,b\n1,2\n", "text/csv")
    app.run()
    assert not app.exception and any("junk.csv" in e.value for e in app.error)


def test_twin_page_calibrates_runs_and_rejects_bad_profiles(downloads):
    app = open_page("twin")
    clean(app)
    app.sidebar.file_uploader[0].upload("bad.json", b"{not json", "application/json")
    app.run()
    assert not app.exception and any("bad.json" in e.value or "JSON" in e.value for e in app.error)
    app = open_page("twin")  # a fresh session
    app.radio(key="profile_grid").set_value("quick")
    app.button(key="calibrate").click().run()
    clean(app)
    fit = app.dataframe[0].value  # the profile's fit, scenario by scenario
    assert {"Scenario", "Measured (s)", "Fitted (s)", "Relative error"} <= set(fit.columns) and len(fit) >= 5
    app.sidebar.number_input[0].set_value(12)  # requests
    app.number_input(key="twin_max_num_seqs").set_value(5)
    app.button(key="run_twin").click().run()
    clean(app)
    table = download_table(app, downloads, "dl_twin").set_index("metric")
    assert table.loc["schedule_identical", "simulated"] == 1.0 and len(app.get("plotly_chart")) == 4
    assert app.session_state["twin_result"].real_steps["num_running"].max() == 5
    steps = download_table(app, downloads, "dl_twin_steps")
    assert (steps["real_duration_s"] > 0).all() and (steps["simulated_duration_s"] > 0).all()
    assert not any("settings changed" in w.value for w in app.warning)
    app.number_input(key="twin_max_num_seqs").set_value(6).run()  # the comparison shown is of max_num_seqs 5
    assert any("settings changed — press Run" in w.value for w in app.warning)
    app.selectbox(key="twin_workload").set_value("upload a trace").run()
    app.button(key="run_twin").click().run()
    assert not app.exception and any("upload a trace file first" in e.value for e in app.error)
    app.file_uploader(key="twin_trace").upload(
        "t.csv", b"arrival_time_s,prompt_tokens,output_tokens\n0,20,4\n0.01,30,5\n0.02,10,6\n", "text/csv")
    app.button(key="run_twin").click().run()
    clean(app)
    assert len(app.session_state["twin_result"].real_requests) == 3  # the trace's three requests
    assert any("3 requests arriving over 0.0 s" in caption.value for caption in app.caption)
    app.file_uploader(key="twin_trace").upload("junk.csv", b"a,b\n1,2\n", "text/csv")
    app.run()
    assert not app.exception and any("junk.csv" in e.value for e in app.error)  # named before any run
    app.selectbox(key="twin_workload").set_value("random").run()
    app.sidebar.text_input[0].set_value("qwen3-0.6b")  # the profile was measured on "tiny"
    app.button(key="run_twin").click().run()
    assert not app.exception and any("measured on model 'tiny'" in e.value for e in app.error)


def test_paper_page_runs_figures_and_exports(downloads):
    app = open_page("paper")
    clean(app)
    app.sidebar.multiselect[0].set_value(["2", "19"])
    app.sidebar.number_input[0].set_value(100)
    app.button(key="run_paper").click().run()
    clean(app)
    summary = download_table(app, downloads, "dl_paper")
    assert list(summary.columns) == ["figures", "num_requests", "tiny_engine", "lab_version", "lab_commit", "figure",
                                     "quantity", "paper", "lab", "verdict"]
    assert summary[["figures", "num_requests"]].iloc[0].tolist() == ["2 19", 100]
    assert set(summary["figure"].astype(str)) == {"2", "19"} and app.get("plotly_chart")
    assert not any("settings changed" in w.value for w in app.warning)
    app.sidebar.multiselect(key="paper_figures").set_value(["2"]).run()  # the figures shown are of other settings
    assert any("settings changed — press Run" in w.value for w in app.warning)


def test_the_overview_links_every_page_of_the_navigation():
    """One list of pages (``app_pages._ui.PAGES``) makes the navigation and the Overview's list: none left out."""
    from app_pages._ui import PAGES as ENTRIES

    app = open_page("overview")
    clean(app)
    assert {link.proto.page for link in app.get("page_link")} == {Path(entry.path).stem for entry in ENTRIES[1:]}


def test_benchmarks_page_opens_on_the_headline_figures_against_their_goals():
    from lab.report.results import HEADLINES

    app = open_page("benchmarks")
    clean(app)
    assert any(h.value.startswith("Headline figures:") for h in app.subheader)
    table = app.dataframe[0].value
    assert len(table) == len(HEADLINES) and table["latest"].notna().all()  # read from benchmarks/results/
    assert set(table["goal"]) >= {"≥ 2", "≤ 1.2"} and table["command"].str.len().gt(0).all()


def test_runtime_page_explains_when_static_batching_wins():
    from lab.report.charts import static_batching_note

    table = pd.DataFrame({"system": ["paged-engine", "hf-continuous", "hf-static"], "output_tok_s": [1360, 800, 2294]})
    assert "small load" in static_batching_note(table)
    assert static_batching_note(table.assign(output_tok_s=[3000, 800, 2000])) == ""


def test_runtime_page_shows_one_engine_chart_after_a_run():
    """The live view and the finished run share one slot: no chart or tile of the live view stays behind."""
    import json

    app = open_page("runtime")
    clean(app)
    app.button(key="run").click().run()
    clean(app)
    titles = [json.loads(c.proto.spec)["layout"].get("title", {}).get("text") for c in app.get("plotly_chart")]
    assert titles.count("Engine state over time") == 1
    assert [m.label for m in app.metric].count("Preemptions") == 1


def test_a_twin_that_priced_beyond_its_profile_says_so_in_a_sentence():
    """Both twin pages warn alike (``app_pages._ui.extrapolation_note``): the sentence, then what to do."""
    def page():
        from app_pages._ui import extrapolation_note

        extrapolation_note("decode_context up to 1,024 (measured up to 256)", "Read the errors with that in mind.")

    app = AppTest.from_function(page)
    app.run()
    assert not app.exception
    assert [w.value for w in app.warning] == ["Steps beyond what the profile measured, priced by extrapolation: "
                                              "decode_context up to 1,024 (measured up to 256). Read the errors with "
                                              "that in mind."]


def test_the_runtime_page_s_comparison_is_the_cli_s_bench():
    """Issue 67: the page's Compare once put the paged engine at 0.45 x HF continuous batching while `python -m lab
    bench e2e` gave 6.7 x. Both now run ``run_e2e_bench`` in a process of its own: on the same small workload the page
    and the CLI serve the same requests and output tokens with every system's tokens the paged engine's. How close
    their speed ratios come is a timing, measured by ``python -m benchmarks.app_parity``, not here."""
    from benchmarks.app_parity import cli_compare, page_compare, set_compare_workload, speedup

    app = open_page("runtime")
    set_compare_workload(app, 2)
    page, cli = page_compare(app), cli_compare(2)
    clean(app)
    for table in (page, cli):
        assert set(table.index) == {"paged-engine", "hf-continuous"} and table["same_tokens_as_engine"].all()
        assert (table["num_requests"] == 2).all() and speedup(table) > 0
    assert page["output_tokens"].to_dict() == cli["output_tokens"].to_dict()


def test_the_runtime_page_s_live_run_is_the_script_s_run():
    """Issue 67: the page's live run served ~27-30 output tokens/s where the same engine from the command line
    served ~720. The page runs ``run_runtime`` with the settings a script would give it: the same engine settings
    and, for the same requests, the same output tokens (its speed against the script's is
    ``python -m benchmarks.app_parity``'s to measure)."""
    from benchmarks.app_parity import script_run

    app = open_page("runtime")
    app.slider[0].set_value(4)  # requests
    app.slider[2].set_value((8, 16))  # max new tokens
    app.button(key="run").click().run()
    clean(app)
    settings = app.session_state["runtime_settings"]
    assert (settings["model"], settings["num_requests"], settings["scheduling"], settings["max_num_batched_tokens"],
            settings["max_num_seqs"], settings["num_blocks"], settings["block_size"]) == \
        ("tiny", 4, "vllm", 4096, 32, 256, 16)
    run = app.session_state["runtime_run"]
    assert run.summary["output_tok_s"] > 0
    script = script_run(4, 8, 16)
    assert script["requests_finished"] == run.summary["requests_finished"] == 4
    for key in ("output_tokens", "steps", "preemptions", "peak_kv_blocks"):
        assert script[key] == run.summary[key], key


def test_the_block_pool_page_marks_events_and_highlights_a_sequence():
    """Issue 67: stepping to a frame where sequences forked or hit the prefix cache since the frame before, the pool
    picture marks those blocks; highlighting a sequence names it in the legend and shows its block table."""
    app = open_page("block_pool")
    clean(app)
    frames = app.session_state["pool_frames"]
    from lab.kv_cache.pool_view import pool_events

    index = next(i for i in range(1, len(frames)) if pool_events(frames[i - 1][1], frames[i][1]))
    app.slider(key="pool_index").set_value(index).run()
    clean(app)
    events = pool_events(frames[index - 1][1], frames[index][1])
    assert app.metric[4].label == "events since the last frame" and app.metric[4].value == str(len(events))
    pool_chart = next(c for c in app.get("plotly_chart") if "blocks of 16 tokens" in c.proto.spec)
    names = [trace.get("name") for trace in json.loads(pool_chart.proto.spec)["data"]]
    kinds = {event.kind for event in events}
    assert all(any(str(name).startswith(f"{kind} (") for name in names) for kind in kinds), (kinds, names)
    seq = next(iter(frames[index][1].block_tables))
    app.selectbox(key="pool_highlight").set_value(seq).run()
    clean(app)
    pool_chart = next(c for c in app.get("plotly_chart") if "blocks of 16 tokens" in c.proto.spec)
    assert f"sequence {seq} (highlighted)" in [t.get("name") for t in json.loads(pool_chart.proto.spec)["data"]]
    assert len(app.dataframe) >= 1  # its block table


def test_the_processes_an_app_server_started_are_told_apart_by_its_mark():
    """``benchmarks.app_flow.started_by``: a process that carries one app server's mark in its environment (what
    every process under that server inherits, even once orphaned) is found for it, and not for another server."""
    import os
    import subprocess
    import sys
    import time

    from benchmarks.app_flow import APP_SERVER_ENV, started_by

    command = "import time; time.sleep(30)  # minipaged-mark-probe"
    child = subprocess.Popen([sys.executable, "-c", command], env={**os.environ, APP_SERVER_ENV: "65001"})
    try:
        deadline = time.monotonic() + 30  # until the child has exec'd: before, /proc shows the parent's command
        while not started_by("http://127.0.0.1:65001", "minipaged-mark-probe") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started_by("http://127.0.0.1:65001", "minipaged-mark-probe") == [child.pid]
        assert started_by("http://127.0.0.1:65002", "minipaged-mark-probe") == []
    finally:
        child.kill()
        child.wait()
