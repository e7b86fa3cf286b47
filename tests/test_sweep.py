"""Sweeps on a local Ray of 2 CPUs: equal to serial runs, resumable, robust to a killed worker and failing runs;
bad grids are rejected before any work."""
import os
import signal
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from simulator.experiments.sweep import GridError, ResultStore, check_grid, expand, run_sweep, runs_failing_checks, spec_key

ray = pytest.importorskip("ray")

GRID = {"allocator": ["paged", "contiguous-oracle"], "block_size": [8, 16], "rate": [5.0, 40.0],
        "num_requests": [120], "capacity_tokens": [6000]}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    yield
    ray.shutdown()


def test_a_sweep_equals_the_same_runs_done_serially(tmp_path, local_ray):
    parallel = run_sweep(GRID, tmp_path / "ray.sqlite", progress=False)
    serial = run_sweep(GRID, tmp_path / "serial.sqlite", parallel=False, progress=False)
    # 8 grid points, 6 runs: contiguous-oracle ignores the block size, so its two block sizes share one run per rate
    assert parallel.ran == serial.ran == 6 and len(parallel.table) == len(expand(GRID)) == 8
    pd.testing.assert_frame_equal(parallel.table, serial.table, check_exact=True)  # bit-equal summaries
    oracle = parallel.table[parallel.table["allocator"] == "contiguous-oracle"]
    assert sorted(oracle["block_size"]) == [8, 8, 16, 16] and oracle["run_key"].nunique() == 2
    by_rate = oracle.drop(columns="block_size").groupby("rate")
    assert (by_rate.nunique(dropna=False) == 1).all().all()  # the shared run's row, once per grid point
    assert (parallel.table["error"] == "").all() and list(parallel.table.columns[1:6]) == list(GRID)
    assert (parallel.table["checks_failed"] == 0).all()  # every run's closed-form checks hold
    again = run_sweep(GRID, tmp_path / "ray.sqlite", progress=False)
    assert again.ran == 0 and again.ray_init_s == 0.0
    pd.testing.assert_frame_equal(again.table, parallel.table, check_exact=True)


def test_only_the_fields_a_run_reads_make_its_key():
    spec = expand(check_grid({"allocator": ["contiguous-max"], "block_size": [8]}))[0]
    assert spec_key(spec) == spec_key({**spec, "block_size": 32})  # a contiguous region has no blocks
    assert spec_key({**spec, "allocator": "paged"}) != spec_key({**spec, "allocator": "paged", "block_size": 32})
    profiled = {**spec, "profile": "p.json"}  # a profile is checked against the block size: it stays in the key
    assert spec_key(profiled) != spec_key({**profiled, "block_size": 32})


def test_runs_breaking_a_closed_form_check_are_named():
    table = pd.DataFrame({"run_key": ["a", "b", "c"], "checks_failed": [0, 2, None], "error": ["", "", "boom"]})
    assert list(runs_failing_checks(table)["run_key"]) == ["b"]
    assert runs_failing_checks(table.drop(columns="checks_failed")).empty  # a table saved before the column


def _ray_worker_running(task: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if f"ray::{task}" in command:
                return int(entry.name)
    return None


def test_killing_a_worker_mid_sweep_still_gives_every_row_once(tmp_path, local_ray):
    grid = {**GRID, "num_requests": [400], "seed": [1, 2]}
    outcome = {}
    store = tmp_path / "store.sqlite"
    thread = threading.Thread(target=lambda: outcome.setdefault("result", run_sweep(grid, store, progress=False)))
    thread.start()
    killed, deadline = None, time.time() + 120
    while killed is None and time.time() < deadline and thread.is_alive():
        killed = _ray_worker_running("run_one")
        time.sleep(0.05)
    assert killed is not None, "no Ray worker was seen running a simulation"
    os.kill(killed, signal.SIGKILL)
    thread.join(timeout=300)
    table = outcome["result"].table
    assert len(table) == len(expand(grid)) == 16 and table["run_key"].nunique() == 12  # 4 shared oracle runs
    assert (table["error"] == "").all()
    assert len(ResultStore(store).keys()) == 12


def test_a_trace_grid_scales_its_arrivals_to_each_rate(tmp_path, traces_dir):
    trace = str(traces_dir / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv")
    grid = {"trace": [trace], "num_requests": [200], "rate": [2.0, 8.0], "max_model_len": [16384]}
    table = run_sweep(grid, tmp_path / "t.sqlite", parallel=False, progress=False).table
    assert list(table["workload"]) == [trace, trace] and (table["num_requests_completed"] == 200).all()
    slow, fast = table["simulated_time_s"]
    assert slow > 2 * fast and slow > 99  # 199 gaps at 2 req/s take ~100 s, at 8 req/s ~25 s (plus serving)


def test_a_failing_run_is_recorded_and_the_rest_finish(tmp_path, local_ray):
    grid = {"allocator": ["paged"], "block_size": [16, 64], "capacity_tokens": [48], "num_requests": [20],
            "max_model_len": [40]}
    table = run_sweep(grid, tmp_path / "s.sqlite", progress=False).table
    failed = table[table["error"] != ""]
    assert list(failed["block_size"]) == [64] and "holds no block" in failed["error"].iloc[0]
    assert table.loc[table["block_size"] == 16, "num_requests_completed"].iloc[0] > 0


@pytest.mark.parametrize("grid,message", [
    ({"blocksize": [16]}, "unknown field 'blocksize'"),
    ({"block_size": []}, "non-empty list"),
    ({"block_size": 16}, "non-empty list"),
    ({"block_size": ["x"]}, "block_size='x'"),
    ({"rate": [-1.0]}, "rate=-1.0"),
    ({"workload": ["/no/such/trace.csv"]}, "neither a preset"),
    ([1, 2], "mapping"),
])
def test_bad_grids_fail_before_any_work(tmp_path, grid, message):
    with pytest.raises(GridError, match=message):
        run_sweep(grid, tmp_path / "store.sqlite", progress=False)
    assert not (tmp_path / "store.sqlite").exists()


def test_the_cli_runs_a_grid_file_and_reports_bad_ones(tmp_path, capsys, local_ray):
    from simulator.cli.main import main

    (tmp_path / "grid.yaml").write_text("allocator: [paged]\nrate: [10.0]\nnum_requests: [50]\n")
    assert main(["sweep", "--grid", str(tmp_path / "grid.yaml"), "--out", str(tmp_path / "r.parquet"),
                 "--no-progress"]) == 0
    assert len(pd.read_parquet(tmp_path / "r.parquet")) == 1
    (tmp_path / "bad.yaml").write_text("allocator: [paged]\nrate: oops\n")
    assert main(["sweep", "--grid", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "r.csv")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "'rate' must be a non-empty list" in err and "Traceback" not in err
    assert ResultStore(tmp_path / "r.store.sqlite").has(spec_key(expand(check_grid({"allocator": ["paged"], "rate": [10.0],
                                                                             "num_requests": [50]}))[0]))
