"""What a probe of the fixed tree found where the mechanisms ended, each now refused by the mechanism it belongs to
(issue 70): an output naming an input, a link written through, a device read to its bound, grid values checked
before they are compared, a tier or a seed that would be ignored, settings an export must record."""
import os

import pandas as pd
import pytest

import simulator
import simulator.cli.main as simulator_cli
from lab.errors import InputError, LabError
from lab.files import write_text_atomically
from lab.user_files import read_bytes
from simulator.core.engine import SimConfig
from simulator.experiments.sweep import GridError, check_grid

TRACE = "arrival_time_s,prompt_tokens,output_tokens\n0,10,10\n1,12,5\n"


@pytest.mark.parametrize("output", ["--out", "--timeseries", "--checks"])
def test_an_output_never_overwrites_the_trace_it_reads(tmp_path, output, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    link = tmp_path / "link.csv"
    link.symlink_to(trace)
    for target in (trace, link):
        assert simulator_cli.main(["--workload", str(trace), "--allocators", "paged", "--no-progress", output,
                                   str(target)]) == 2
        assert "would overwrite the trace" in capsys.readouterr().err and trace.read_text() == TRACE


def test_a_sweep_never_overwrites_a_file_its_grid_reads(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    grid = tmp_path / "g.yaml"
    grid.write_text(f"workload: [{trace}]\nallocator: [paged]\n")
    assert simulator_cli.main(["sweep", "--grid", str(grid), "--out", str(trace), "--serial", "--no-progress"]) == 2
    assert "would overwrite the grid's workload file" in capsys.readouterr().err and trace.read_text() == TRACE


def test_a_write_through_a_link_reaches_the_file_it_names(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "res.csv"
    target.write_text("old")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    write_text_atomically(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_file_that_reports_no_size_is_read_to_its_bound_only():
    with pytest.raises(InputError, match="more than 1,000 bytes"):
        read_bytes("/dev/zero", InputError, max_bytes=1000)


@pytest.mark.parametrize("grid, named", [
    ({"workload": ["sharegpt"], "num_requests": [20], "replicas": [1, "two"], "router": ["random"]}, "replicas"),
    ({"workload": ["sharegpt"], "num_requests": [20], "replicas": [1, None], "router": ["random"]}, "replicas"),
    ({"workload": ["sharegpt"], "kv_offload_gib": [1], "enable_prefix_caching": [False]}, "would be ignored"),
    ({"workload": ["sharegpt"], "kv_offload_gib": [1], "allocator": ["contiguous-max"]}, "would be ignored"),
    ({"workload": ["sharegpt"], "preemption_mode": ["swap"], "allocator": ["paged", "contiguous-max"]}, "swap"),
])
def test_a_grid_is_refused_before_any_run(grid, named):
    with pytest.raises(GridError, match=named):
        check_grid(grid)


def test_a_grid_of_a_trace_checks_its_rows_and_rate(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    for bad in ({"num_requests": [0]}, {"rate": [-1]}):
        with pytest.raises(GridError):
            check_grid({"workload": [str(trace)], **bad})


def test_settings_the_api_would_ignore_are_refused(tmp_path):
    workload = simulator.make_workload("sharegpt", num_requests=5)
    with pytest.raises(InputError, match="would be ignored"):
        simulator.simulate(workload, SimConfig(kv_offload_blocks=100, enable_prefix_caching=False))
    with pytest.raises(InputError, match="kv_cache_dtype"):
        simulator.simulate(workload, SimConfig(model_overrides={"kv_dtype_bytes": 1}))
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    with pytest.raises(InputError, match="seed"):
        simulator.make_workload(str(trace), seed=5)


def test_an_export_records_every_scheduler_setting_and_the_kv_cache_dtype(tmp_path):
    out = tmp_path / "s.csv"
    assert simulator_cli.main(["--num-requests", "10", "--allocators", "paged", "--scheduling", "vllm",
                               "--long-prefill-token-threshold", "64", "--no-scheduler-reserve-full-isl",
                               "--kv-cache-dtype", "fp8", "--no-progress", "--out", str(out)]) == 0
    text = out.read_text()
    for setting in ("long_prefill_token_threshold", "scheduler_reserve_full_isl", "kv_cache_dtype"):
        assert setting in text, setting
    assert os.path.getsize(out) > 0 and len(pd.read_csv(out, comment="#")) == 1


def test_another_program_s_database_is_not_taken_as_a_store(tmp_path):
    import sqlite3

    from simulator.experiments.sweep import ResultStore, StoreError

    path = tmp_path / "app.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    with pytest.raises(StoreError, match="other tables"):
        ResultStore(path)
    with sqlite3.connect(path) as db:  # untouched: no table added, the journal mode kept
        assert [n for (n,) in db.execute("SELECT name FROM sqlite_master")] == ["users"]
        assert db.execute("PRAGMA journal_mode").fetchone()[0] != "wal"


def test_absolute_arrival_times_that_floats_cannot_tell_apart_are_refused(tmp_path):
    from simulator.core.workloads import TraceFormatError

    trace = tmp_path / "big.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n" +
                     "".join(f"{1e14 + 0.001 * i},10,10\n" for i in range(4)))
    with pytest.raises(TraceFormatError, match="merge"):
        simulator.make_workload(str(trace))
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n" +
                     "".join(f"{1.7e9 + 0.001 * i},10,10\n" for i in range(4)))  # Unix seconds keep milliseconds
    assert simulator.make_workload(str(trace)).arrival_s[1] == pytest.approx(0.001, abs=1e-6)


@pytest.mark.parametrize("text, named", [("rate: [1:30]", "base-60"), ("enable_prefix_caching: [yes]", "boolean"),
                                         ("enable_prefix_caching: [on]", "boolean")])
def test_yaml_1_1_s_surprises_are_named(text, named):
    from lab.user_files import UserFileError, loads_yaml

    with pytest.raises(UserFileError, match=named):
        loads_yaml(text, "grid.yaml")
    assert loads_yaml("x: [true, '1:30']", "grid.yaml") == {"x": [True, "1:30"]}


def test_the_kernel_csv_s_baseline_is_known_in_any_case(tmp_path):
    from simulator.core.models import read_kernel_csv

    path = tmp_path / "k.csv"
    path.write_text("kernel,batch,context,kv_gb_per_s\nSDPA-contiguous,1,512,900\npaged-torch,1,512,100\n")
    frame = read_kernel_csv(path)
    assert sorted(frame["kernel"]) == ["paged-torch", "sdpa-contiguous"]


def test_a_trace_across_a_daylight_saving_change_is_read_in_utc(tmp_path):
    from simulator.core.workloads import TraceFormatError

    trace = tmp_path / "tz.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-05 01:59:00+02:00,10,10\n"
                     "2023-11-05 01:00:00+01:00,12,5\n")
    assert list(simulator.make_workload(str(trace)).arrival_s) == [0.0, 60.0]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-05 01:59:00,10,10\n2023-11-05 02:00:00Z,12,5\n")
    with pytest.raises(TraceFormatError, match="row 3.*time zone"):
        simulator.make_workload(str(trace))


def test_a_pipe_given_as_a_trace_is_named_as_such(tmp_path):
    from simulator.core.workloads import TraceFormatError

    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    with pytest.raises(TraceFormatError, match="not a regular file"):
        simulator.make_workload(str(fifo))


def test_an_endless_answer_is_cut_at_its_size_bound(monkeypatch):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from lab.peer import waits

    class Endless(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"x" * 65536)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(waits, "MAX_ANSWER_BYTES", 1 << 20)
    try:
        with pytest.raises(waits.PeerError, match="more than 1,048,576 bytes"):
            waits.http("GET", f"http://127.0.0.1:{server.server_address[1]}/metrics", 10.0)
    finally:
        server.shutdown()


# ---- a second probe of the fixed tree -----------------------------------------------------------------------------
def test_no_output_lands_inside_the_checkpoint_a_command_reads(tmp_path, capsys):
    import lab.cli.main as lab_cli
    from lab.models.qwen3 import save_checkpoint

    checkpoint = save_checkpoint("tiny", tmp_path / "ck")
    config = (checkpoint / "config.json").read_text()
    assert lab_cli.main(["generate", "--model", str(checkpoint), "--prompt-ids", "1,2", "--max-tokens", "2",
                         "--out", str(checkpoint / "config.json")]) == 2
    assert "inside the checkpoint" in capsys.readouterr().err and (checkpoint / "config.json").read_text() == config


def test_a_device_or_pipe_is_no_output(tmp_path):
    fifo = tmp_path / "out.csv"
    os.mkfifo(fifo)
    with pytest.raises(SystemExit):
        simulator_cli.main(["--num-requests", "5", "--allocators", "paged", "--no-progress", "--out", str(fifo)])
    with pytest.raises(InputError, match="not a regular file"):
        write_text_atomically(fifo, "x")
    assert fifo.exists() and not fifo.is_file()


@pytest.mark.parametrize("argv", [
    ["--allocators", "paged,paged"], ["--max-points", "3"],
])
def test_a_repeated_or_moot_simulator_option_is_refused(argv, capsys):
    assert simulator_cli.main(["--num-requests", "5", "--no-progress", *argv]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["profile", "--model", "tiny", "--num-blocks", "50"],
    ["bench", "kernels", "--shapes", "1x32", "--batch", "1,2"],
    ["checkpoint", "--model", "tiny", "--out", ""],
])
def test_a_lab_option_that_cannot_apply_is_refused(argv, capsys):
    import lab.cli.main as lab_cli

    try:
        status = lab_cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusal
        status = exit_.code
    assert status == 2 and "error" in capsys.readouterr().err


@pytest.mark.parametrize("settings, named", [
    (dict(num_blocks=32, kv_offload_blocks=8, enable_prefix_caching=False), "kv_offload_blocks"),
    (dict(num_blocks=32, swap_space_bytes=1 << 20), "swap_space_bytes"),
    (dict(num_blocks=32, kv_memory_bytes=1 << 20), "kv_memory_bytes"),
    (dict(num_blocks=32, max_model_len=10**9), "max_position_embeddings"),
    (dict(gpu_memory_utilization=0.9), "gpu_memory_utilization"),  # a CPU engine's pool is kv_memory_bytes
    (dict(kv_memory_bytes=1), "holds no block"),
])
def test_an_engine_setting_that_cannot_apply_is_refused(settings, named):
    from lab.engine import LLMEngine

    with pytest.raises(LabError, match=named):
        LLMEngine("tiny", **settings)


def test_api_keywords_that_would_be_ignored_are_refused():
    from lab.engine import LLMEngine, SamplingParams

    workload = simulator.make_workload("fixed", num_requests=10)
    for keywords in (dict(num_requests=5), dict(seed=3), dict(rate=2.0), dict(time_scale=2.0)):
        with pytest.raises(InputError, match="would be ignored"):
            simulator.make_workload(workload, **keywords)
    with pytest.raises(InputError):
        simulator.simulate(workload, SimConfig(), snapshot_every=0)
    with pytest.raises(InputError):
        simulator.compare(workload, [SimConfig()], workers=0)
    with pytest.raises(InputError, match="prefix caching off"):
        simulator.offload_sweep(workload, SimConfig(enable_prefix_caching=False), tiers_gib=(0.0, 1.0))
    with pytest.raises(InputError, match="larger than the pool"):
        simulator.block_size_sweep({"a": workload}, SimConfig(capacity_tokens=10), block_sizes=(8, 16))
    with pytest.raises(InputError, match="at least one"):
        simulator.block_size_sweep({}, SimConfig())
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine("tiny", num_blocks=32).generate([[1, 2, 3]], SamplingParams(max_tokens=3, stop_token_ids=(10**12,)))


def test_a_grid_mixing_traces_and_presets_refuses_synthetic_axes(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    with pytest.raises(GridError, match="would be ignored for the grid's trace"):
        check_grid({"workload": ["random", str(trace)], "num_requests": [5], "n": [1, 2]})


@pytest.mark.parametrize("preset, keywords", [("sharegpt", {"input_len": 10}), ("alpaca", {"output_len": 10}),
                                              ("fixed", {"range_ratio": 0.5})])
def test_a_length_a_preset_does_not_read_is_refused(preset, keywords):
    with pytest.raises(LabError, match="would be ignored"):
        simulator.make_workload(preset, num_requests=5, **keywords)
    assert len(simulator.make_workload("random", num_requests=5, input_len=10, range_ratio=0.5)) == 5


def test_a_seed_that_draws_nothing_is_refused():
    """``fixed`` (or ``random`` without a spread) at an infinite rate, one sample each: nothing is drawn at random."""
    for preset, keywords in (("fixed", {}), ("random", {})):
        with pytest.raises(LabError, match="seed=3 would be ignored"):
            simulator.make_workload(preset, num_requests=5, seed=3, **keywords)
    for preset, keywords in (("random", {"range_ratio": 0.3}), ("fixed", {"rate": 2.0}), ("fixed", {"n": 2})):
        assert len(simulator.make_workload(preset, num_requests=5, seed=3, **keywords)) == 5
