"""Issue 70, writes and entry points: every result file is written atomically through one helper (``lab.files``),
``generate`` returns only its own requests, Ctrl-C on a sweep writes what it ran, and every public entry point of
``simulator`` and ``lab.engine`` checks its arguments the one way (``lab.checks.entry_point``)."""
import inspect
import re
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import yaml

import lab.engine
import lab.files
import simulator
from lab.engine import LLMEngine, SamplingParams
from lab.errors import ArgumentError, LabError
from lab.files import write_atomically, write_text_atomically
from lab.profiling.profile import Profile, feature_names
from simulator.cli.main import main as simulator_main
from simulator.experiments import sweep as sweep_module
from simulator.experiments.sweep import save_table

ROOT = Path(__file__).resolve().parent.parent


# ---- atomic writes --------------------------------------------------------------------------------------------------
def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def _write_many(path: str, letter: str, times: int) -> None:
    for _ in range(times):
        write_text_atomically(path, letter * 200_000)


def test_two_threads_writing_one_path_both_succeed_and_leave_one_whole_file(tmp_path):
    path = tmp_path / "out.csv"
    errors = []

    def writer(letter):
        try:
            _write_many(str(path), letter, 20)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(letter,)) for letter in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert path.read_text() in ("a" * 200_000, "b" * 200_000)
    assert not _leftovers(tmp_path)


def test_two_processes_writing_one_path_both_succeed_and_leave_one_whole_file(tmp_path):
    path = tmp_path / "profile.json"
    code = "import sys; from lab.files import write_text_atomically as w\nfor _ in range(40): w(sys.argv[1], sys.argv[2] * 200_000)"
    processes = [subprocess.Popen([sys.executable, "-c", code, str(path), letter], cwd=ROOT) for letter in "xy"]
    assert [process.wait(timeout=120) for process in processes] == [0, 0]
    assert path.read_text() in ("x" * 200_000, "y" * 200_000)
    assert not _leftovers(tmp_path)


def _profile() -> Profile:
    return Profile("tiny", "cpu", "torch.float32", 16, "torch", dict.fromkeys(feature_names([1]), 1e-4), [1])


def test_a_profile_save_that_fails_midway_keeps_the_old_profile(tmp_path, monkeypatch):
    """A full disk mid-write used to replace a good profile with truncated JSON (it was written in place)."""
    path = tmp_path / "profile.json"
    _profile().save(path)
    good = path.read_text()

    def full_disk(handle):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lab.files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        _profile().save(path)
    assert path.read_text() == good and Profile.load(path).coefficients == _profile().coefficients
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_table_write_that_fails_midway_keeps_the_old_table_and_no_temporary(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"sweep{suffix}"
    save_table(pd.DataFrame({"run_key": ["a"], "error": [""]}), path)
    before = path.read_bytes()

    def half_then_fail(self, target, *args, **kwargs):
        Path(target).write_bytes(b"run_key,err")
        raise KeyboardInterrupt

    monkeypatch.setattr(pd.DataFrame, "to_csv" if suffix == ".csv" else "to_parquet", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        save_table(pd.DataFrame({"run_key": ["b"], "error": [""]}), path)
    assert path.read_bytes() == before
    assert not _leftovers(tmp_path)


def test_a_new_file_gets_the_usual_permissions_and_an_old_one_keeps_its_own(tmp_path):
    fresh = tmp_path / "new.csv"
    write_text_atomically(fresh, "x")
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~lab.files._UMASK  # not mkstemp's 0600
    fresh.chmod(0o640)
    write_atomically(fresh, lambda temporary: temporary.write_text("y"))
    assert fresh.stat().st_mode & 0o777 == 0o640 and fresh.read_text() == "y"


WRITES = re.compile(r"\.partial\b|\.write_text\(|\.write_bytes\(|open\([^)]*[\"']w|\.to_(csv|parquet)\((?!index=)[^)]")


def test_every_result_writer_goes_through_the_atomic_helper():
    """A writer of a result file in lab/ or simulator/ writes through ``lab.files``: these are the only direct writes
    left, each of a scratch file in a temporary folder or of no file at all."""
    direct = {f"{path.relative_to(ROOT)}: {line.strip()}"
              for path in [*(ROOT / "lab").rglob("*.py"), *(ROOT / "simulator").rglob("*.py")]
              if path.name != "files.py"
              for line in path.read_text().splitlines() if WRITES.search(line) and "temporary" not in line}
    assert direct == {
        'lab/bench/e2e.py: Path("/proc/self/clear_refs").write_text("5")',  # drops the page cache's counters
        'simulator/bench.py: frame.to_csv(path, index=False)',  # a trace in a TemporaryDirectory, to time loading
        'simulator/bench.py: with open(path, "w") as handle:',  # the same, as JSONL
        'simulator/core/workloads.py: path.write_bytes(data)',  # an upload in a TemporaryDirectory, to load it
        'simulator/experiments/isolated.py: (folder / "request.pickle").write_bytes(pickle.dumps((job, kwargs)))',
    }, "write result files with lab.files.write_atomically"


# ---- generate beside add_request ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny", num_blocks=48, block_size=4)


def _drain(engine) -> list:
    outputs = []
    for _ in range(50):
        outputs += engine.step()
        if not engine.has_unfinished():
            break
    return outputs + engine.step()


@pytest.mark.parametrize("a_tokens,b_tokens", [(8, 2), (1, 6)])  # A still running / already done when B is
def test_generate_returns_its_own_requests_and_step_returns_the_others(engine, a_tokens, b_tokens):
    """``add_request(A)`` then ``generate([B])``: generate returned [B] but consumed A, which no step() ever
    returned."""
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=a_tokens, ignore_eos=True))
    (b,) = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=b_tokens, ignore_eos=True))
    assert b.request_id != a and len(b.token_ids) == b_tokens
    later = _drain(engine)
    assert [output.request_id for output in later] == [a] and len(later[0].token_ids) == a_tokens
    assert engine.step() == [] and not engine.has_unfinished()


# ---- Ctrl-C on a sweep ----------------------------------------------------------------------------------------------
def test_ctrl_c_on_a_sweep_writes_the_runs_done_and_a_rerun_does_the_rest(tmp_path, monkeypatch, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"workload": ["fixed"], "num_requests": [3], "rate": [1.0, 2.0, 4.0, 8.0, 16.0]}))
    out = tmp_path / "sweep.csv"
    argv = ["sweep", "--grid", str(grid), "--out", str(out), "--serial", "--no-progress"]
    real, calls = sweep_module.run_one, []

    def interrupted_at_the_third(spec):
        calls.append(spec)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(spec)

    monkeypatch.setattr(sweep_module, "run_one", interrupted_at_the_third)
    assert simulator_main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "interrupted" in line]
    assert "after 2 of 5 runs" in line and str(out) in line and "3 missing" in line
    assert len(pd.read_csv(out)) == 2
    monkeypatch.setattr(sweep_module, "run_one", real)
    assert simulator_main(argv) == 0
    assert "(3 run now, 2 from" in capsys.readouterr().err
    assert len(pd.read_csv(out)) == 5


def test_run_sweep_passes_an_interrupt_on_unless_asked_to_keep(tmp_path, monkeypatch):
    def interrupt(spec):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_module, "run_one", interrupt)
    grid = {"workload": ["fixed"], "num_requests": [3], "rate": [1.0, 2.0]}
    with pytest.raises(KeyboardInterrupt):
        sweep_module.run_sweep(grid, tmp_path / "s.sqlite", parallel=False, progress=False)
    kept = sweep_module.run_sweep(grid, tmp_path / "s.sqlite", parallel=False, progress=False, keep_on_interrupt=True)
    assert (kept.ran, kept.interrupted, len(kept.table)) == (0, 2, 0)


# ---- entry points ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workload():
    return simulator.make_workload("fixed", num_requests=3)


CASES = [
    (lambda w: simulator.simulate(w, "paged"), "config"),
    (lambda w: simulator.compare(w, [simulator.SimConfig()], workers="2"), "workers"),
    (lambda w: simulator.compare(w, [simulator.SimConfig()], progress="yes"), "progress"),
    (lambda w: simulator.compare(w, [simulator.SimConfig()], reuse=[]), "reuse"),
    (lambda w: simulator.block_size_sweep("x", simulator.SimConfig()), "workloads"),
    (lambda w: simulator.block_size_sweep({"a": "x"}, simulator.SimConfig()), "workloads"),
    (lambda w: simulator.load_trace_bytes("a,b\n1,2\n", "t.csv"), "data"),
    (lambda w: simulator.SimConfig(foo=1), "foo"),
    (lambda w: SamplingParams(best_of=2), "best_of"),
    (lambda w: simulator.make_workload("sharegpt", foo=1), "foo"),
    (lambda w: simulator.simulate("sharegpt", foo=1), "foo"),
    (lambda w: simulator.make_configs(["paged"], [16], allocator="x"), "allocator"),  # make_configs sets it itself
    (lambda w: LLMEngine(on_step=5), "on_step"),
    (lambda w: LLMEngine("tiny", blocksize=16), "blocksize"),
    (lambda w: simulator.make_workload("sharegpt", num_requests=True), "num_requests"),
    (lambda w: simulator.run_simulation(w, simulator.SimConfig(), snapshot_every=2.5), "snapshot_every"),
    (lambda w: simulator.Simulator(w, None), "config"),
]


@pytest.mark.parametrize("call,argument", CASES)
def test_an_entry_point_names_the_argument_it_does_not_take(workload, call, argument):
    with pytest.raises(ArgumentError, match=rf"\({argument}=.*(expected|unknown argument '{argument}'; accepted: )"):
        call(workload)


def test_an_unknown_keyword_lists_the_accepted_ones_and_positional_extras_are_named():
    with pytest.raises(ArgumentError, match="accepted: .*max_tokens.*top_p"):
        SamplingParams(best_of=2)
    with pytest.raises(ArgumentError, match=r"simulate\(\): too many positional arguments"):
        simulator.simulate("fixed", None, None, 50, 3)
    with pytest.raises(ArgumentError, match="missing a required argument: 'workload'"):
        simulator.make_workload()


def test_valid_calls_pass_the_checks(workload):
    assert simulator.make_workload("fixed", num_requests=3, rate=2.0, seed=1).n == 1
    table, _ = simulator.compare(workload, (simulator.SimConfig(),), progress=lambda f: None, workers=1,
                                 reuse=simulator.RunCache(4))
    assert len(table) == 1
    assert len(simulator.block_size_sweep({"w": workload}, simulator.SimConfig(), block_sizes=[8, 16])) == 2


OUTPUT_RECORDS = {"SimResult", "Snapshot", "RequestOutput", "StepStats", "BeamSearchOutput", "TraceFormatError"}


@pytest.mark.parametrize("package", [simulator, lab.engine])
def test_every_public_callable_is_an_entry_point(package):
    """The checks are one mechanism applied everywhere: whatever ``simulator`` or ``lab.engine`` exports that a user
    calls is decorated (the records the lab builds and returns are not inputs)."""
    callables = {name: getattr(package, name) for name in package.__all__ if callable(getattr(package, name))}
    unchecked = [name for name, obj in callables.items() if name not in OUTPUT_RECORDS
                 and not getattr(obj, "__entry_point__", False)]
    assert not unchecked
    assert "workload" in inspect.signature(simulator.simulate).parameters  # the signature people read is kept
    assert "max_tokens" in inspect.signature(SamplingParams).parameters


def test_argument_errors_are_lab_errors():
    assert issubclass(ArgumentError, LabError)
