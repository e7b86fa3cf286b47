"""Sweeps on Ray: every combination of a grid of ``SimConfig`` fields and workload parameters, one simulation per
Ray task, each finished run written at once to a results store (SQLite) keyed by a hash of its full spec.

``ray.init()`` without an address starts a local Ray on this machine; ``address`` (or ``RAY_ADDRESS``) joins an
existing cluster. A rerun skips what the store holds; a task whose worker dies is retried by Ray (``max_retries``)
and its row is stored once; a run that raises is stored with its error and the sweep goes on.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import sqlite3
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pandas as pd

from lab import user_files
from lab.checks import check_int, check_real
from lab.errors import InputError, LabError
from lab.files import file_digest, write_atomically
from simulator.core.checks import closed_form_checks
from simulator.core.cluster import run_simulation
from simulator.core.engine import FILE_FIELDS, Profile, SimConfig, check_config, offload_blocks
from simulator.core.models import check_tensor_parallel, get_gpu, get_model, read_kernel_csv
from simulator.core.workloads import (SYNTHETIC_PRESETS, at_mean_rate, SyntheticSpec, Workload, check_synthetic_spec, load_trace,
                        synthetic_workload, MIN_RATE)

WORKLOAD_FIELDS = ("workload", "num_requests", "rate", "burstiness", "n", "beam_width", "shared_prefix_tokens",
                   "seed")
MAX_GRID_RUNS = 100_000  # every run is checked before any starts: a grid past this is a typo, not a sweep
SYNTHETIC_ONLY = ("burstiness", "n", "beam_width", "shared_prefix_tokens", "seed")  # a trace ignores these
ALIASES = {"trace": "workload"}  # a grid may say ``trace: [path, ...]``
SIM_FIELDS = tuple(f.name for f in dataclasses.fields(SimConfig) if f.name not in ("model_overrides",
                                                                                    "gpu_overrides", "record_steps"))
SIM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SimConfig)}
WORKLOAD_DEFAULTS = {"workload": "sharegpt", "num_requests": 1000, "rate": math.inf, "burstiness": 1.0, "n": 1,
                     "beam_width": 1, "shared_prefix_tokens": 0, "seed": 0}
# A spec may size the offload tier in GiB of host memory (what a person buys) instead of kv_offload_blocks: each run
# converts it with its own model's bytes per block (a paged allocator; a contiguous one has no prefix cache).
OFFLOAD_GIB = "kv_offload_gib"
SPEC_VERSION = 3  # part of every run's key: bump when a change makes stored results stale (3: checks_failed)
MAX_RETRIES = 3


class StoreError(LabError):
    """A sweep store file is not a readable results store."""


class GridError(LabError):
    """A sweep grid names an unknown field, an empty or non-list value, or a value of the wrong type."""


@dataclass(slots=True)
class SweepResult:
    """``table``: one row per point of the grid (config columns, then summary columns, then ``error``; points that
    share a run, see ``spec_key``, share its ``run_key``); ``ran``: how many runs this invocation computed (the others
    came from the store or are shared); ``ray_init_s``: Ray's start-up time."""

    table: pd.DataFrame
    ran: int
    ray_init_s: float = 0.0
    store_error: str = ""  # the store failed part-way: the table holds this invocation's runs from memory
    interrupted: int = 0  # Ctrl-C ended the sweep (``run_sweep(..., keep_on_interrupt=True)``): the runs it had to do


# ---- the grid ----------------------------------------------------------------------------------------------------
def load_grid(path: str | Path) -> dict[str, list]:
    """A grid from YAML (or JSON), read strictly by ``lab.user_files`` (no repeated key, alias or deep nesting): a
    mapping from field name to a non-empty list of values."""
    return check_grid(user_files.read_yaml(path, GridError), str(path))


def check_grid(grid, name: str = "grid") -> dict[str, list]:
    """Raise ``GridError`` for anything but a mapping of known fields to non-empty lists of valid values; every
    combination is checked before any runs."""
    if not isinstance(grid, dict) or not grid:
        raise GridError(f"{name}: expected a mapping of field -> list of values, got {grid!r:.80}")
    if all(name in grid for name in ("trace", "workload")):
        raise GridError(f"{name}: give either 'trace' or 'workload', not both")
    grid = {ALIASES.get(field, field): values for field, values in grid.items()}
    for field, values in grid.items():
        if field not in WORKLOAD_FIELDS and field not in SIM_FIELDS and field != OFFLOAD_GIB:
            raise GridError(f"{name}: unknown field {field!r}; SimConfig fields: {', '.join(SIM_FIELDS)}; workload "
                            f"fields: {', '.join(WORKLOAD_FIELDS)}; {OFFLOAD_GIB} (the offload tier in GiB)")
        if not isinstance(values, list) or not values:
            raise GridError(f"{name}: field {field!r} must be a non-empty list, got {values!r:.80}")
    runs = math.prod(len(values) for values in grid.values())
    if runs > MAX_GRID_RUNS:
        sizes = " x ".join(f"{len(values)} {field}" for field, values in grid.items())
        raise GridError(f"{name}: {sizes} make {runs:,} runs; a grid may hold at most {MAX_GRID_RUNS:,}")
    workloads = [str(w) for w in grid.get("workload", [WORKLOAD_DEFAULTS["workload"]])]
    traces = [w for w in workloads if w not in SYNTHETIC_PRESETS]
    if traces:  # a trace's arrivals and lengths are its own: an axis of synthetic settings would label copies of it
        ignored = [f for f in SYNTHETIC_ONLY if f in grid]
        if ignored:
            raise GridError(f"{name}: {', '.join(ignored)} would be ignored for the grid's trace "
                            f"{user_files.shown(traces[0])}, which keeps its own lengths and one sample per request "
                            f"(its rate can be set); sweep traces in a grid of their own")
    for spec in expand(grid):
        try:
            check_spec(spec)
        except ValueError as exc:
            raise GridError(f"{name}: {exc}") from None
    if max(grid.get("replicas", [1])) == 1 and "router" in grid:  # the values are checked integers by now
        raise GridError(f"{name}: router would be ignored: it shares requests among replicas (more than 1)")
    _read_files(grid, name)
    return grid


def _read_files(grid: dict[str, list], name: str) -> None:
    """Read each file the grid names for its runs' settings (a kernel CSV, a profile) once, now: a missing or
    malformed one would otherwise fail every run that uses it, after the others ran."""
    readers = {"kernel_csv": read_kernel_csv, "profile": Profile.load}
    for field, read in readers.items():
        paths = [value for value in grid.get(field, []) if isinstance(value, (str, Path))]
        for path in dict.fromkeys(map(str, paths)):
            try:
                read(path)
            except LabError as exc:
                raise GridError(f"{name}: {field} {user_files.shown(path)}: {exc}") from None


def expand(grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid, as full run specs (workload defaults filled in)."""
    fields = list(grid)
    return [{**WORKLOAD_DEFAULTS, **dict(zip(fields, values))} for values in itertools.product(*grid.values())]


def check_spec(spec: dict) -> None:
    """Raise ``ValueError`` when the spec's config or workload parameters are invalid (without running it)."""
    config = sim_config(spec)
    check_config(config)
    get_gpu(config.gpu)  # names known (whether the model fits is the run's business)
    check_tensor_parallel(get_model(config.model), config.tp)  # a split vLLM refuses
    workload = spec["workload"]
    if not isinstance(workload, str):
        raise InputError(f"workload={workload!r}: expected a preset ({', '.join(SYNTHETIC_PRESETS)}) or a trace path")
    if workload in SYNTHETIC_PRESETS:
        check_synthetic_spec(_synthetic_spec(spec))
    elif not Path(workload).is_file():
        raise InputError(f"workload {workload!r} is neither a preset ({', '.join(SYNTHETIC_PRESETS)}) nor a file")
    else:  # a trace: its rows and rate, as the run will read them
        check_int("spec", "num_requests", spec.get("num_requests"), 1, 1 << 31, optional=True)
        check_real("spec", "rate", spec.get("rate", math.inf), MIN_RATE, allow_inf=True)
    if spec.get(OFFLOAD_GIB) and (config.allocator != "paged" or not config.enable_prefix_caching):
        raise InputError(f"{OFFLOAD_GIB}={spec[OFFLOAD_GIB]!r} would be ignored: the offload tier keeps the paged "
                         f"prefix cache's blocks (allocator paged with prefix caching on)")


def spec_key(spec: dict) -> str:
    """The run's identity: a hash of its full spec, less a contiguous allocator's ``block_size`` (it places whole
    regions and ignores it; with a profile the block size is checked, so it stays): grid points that differ only
    there share one run."""
    fields = dict(spec)
    if fields.get("allocator", SIM_DEFAULTS["allocator"]) != "paged" and fields.get("profile") is None:
        fields.pop("block_size", None)
    if fields.get("allocator", SIM_DEFAULTS["allocator"]) != "paged":
        fields.pop(OFFLOAD_GIB, None)
    for name in ("workload", *FILE_FIELDS):  # a file's content, not its path: a rewritten file reruns
        value = fields.get(name)
        if isinstance(value, (str, Path)) and str(value) not in SYNTHETIC_PRESETS and Path(value).is_file():
            fields[f"{name}_sha256"] = file_digest(Path(value))
    text = json.dumps({"version": SPEC_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def default_store_path() -> Path:
    """The user's own sweep store: ``$XDG_CACHE_HOME/minipaged/sweeps.sqlite`` (``~/.cache`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "minipaged" / "sweeps.sqlite"


def sim_config(spec: dict) -> SimConfig:
    config = SimConfig(**{k: v for k, v in spec.items() if k in SIM_FIELDS})
    gib = spec.get(OFFLOAD_GIB)
    if gib is not None and config.allocator == "paged":
        if spec.get("kv_offload_blocks"):
            raise InputError(f"give the offload tier as {OFFLOAD_GIB} or kv_offload_blocks, not both")
        if isinstance(gib, bool) or not isinstance(gib, (int, float)):
            raise InputError(f"{OFFLOAD_GIB}={gib!r}: expected a number of GiB (0: no tier, inf: unbounded)")
        config = dataclasses.replace(config, kv_offload_blocks=offload_blocks(config, float(gib)) if gib else 0)
    return config


def _synthetic_spec(spec: dict) -> SyntheticSpec:
    return SyntheticSpec(preset=spec["workload"], num_requests=spec["num_requests"], rate=spec["rate"],
                         burstiness=spec["burstiness"], n=spec["n"], beam_width=spec["beam_width"],
                         shared_prefix_tokens=spec["shared_prefix_tokens"], seed=spec["seed"],
                         max_model_len=spec.get("max_model_len", SIM_DEFAULTS["max_model_len"]))


@lru_cache(maxsize=8)
def _trace(path: str, max_rows: int, digest: str) -> Workload:
    """``digest`` (the file's) keys the cache on the content: a rewritten file is read again."""
    return load_trace(path, max_rows=max_rows)


def build_workload(spec: dict) -> Workload:
    """A preset's synthetic workload, or a trace (its first ``num_requests`` rows; with a finite ``rate`` its
    arrivals scaled to that mean rate)."""
    if spec["workload"] in SYNTHETIC_PRESETS:
        return synthetic_workload(_synthetic_spec(spec))
    path = spec["workload"]
    return at_mean_rate(_trace(path, spec["num_requests"], file_digest(Path(path))), spec["rate"])


# ---- one run ----------------------------------------------------------------------------------------------------
def run_one(spec: dict) -> dict:
    """Simulate one spec; the row is the spec, the summary, ``checks_failed`` (how many of its closed-form checks do
    not hold, ``simulator.core.checks``: 0 unless the simulator has a bug) and ``error`` (empty, or what the run
    raised)."""
    row = {"run_key": spec_key(spec), **{k: v for k, v in spec.items()}}
    try:
        workload = build_workload(spec)
        result = run_simulation(workload, sim_config(spec))
        checks = closed_form_checks(workload, {"run": result})
    except Exception as exc:  # noqa: BLE001 - a sweep records a failing run and goes on
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    summary = {k: v for k, v in result.summary.items() if k not in row and k != "wall_time_s"}
    return {**row, **summary, "checks_failed": int((~checks["holds"]).sum()), "error": ""}


# ---- the store --------------------------------------------------------------------------------------------------
class ResultStore:
    """Finished runs in a SQLite file, one row per run key (the row as JSON); each ``put`` is its own transaction,
    so a run is either stored whole or not at all."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None)
            foreign = [name for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                       if name != "runs"]
            if foreign:  # another program's database: adding a table and WAL mode to it would change it for good
                self.db.close()
                raise StoreError(f"{self.path} is a database of other tables ({', '.join(foreign[:3])}), not a sweep "
                                 f"store; give --store a file of its own")
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS runs (run_key TEXT PRIMARY KEY, row TEXT NOT NULL)")
            # the whole file, before any work: a store damaged inside would fail only after the runs
            problems = [text for (text,) in self.db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems[:3]))
            for key, text in self.db.execute("SELECT run_key, row FROM runs"):
                _stored_row(key, text)
        except (sqlite3.DatabaseError, ValueError) as exc:
            raise StoreError(f"{self.path}: not a readable results store ({exc}); delete it or choose another "
                             f"--store") from None

    def close(self) -> None:
        """Write the log back into the file and close it."""
        self.db.close()

    def has(self, key: str) -> bool:
        return self.db.execute("SELECT 1 FROM runs WHERE run_key = ?", (key,)).fetchone() is not None

    def keys(self, failed: bool = True) -> set[str]:
        """Stored run keys; without the runs that failed when ``failed`` is False."""
        if failed:
            return {key for (key,) in self.db.execute("SELECT run_key FROM runs")}
        return {key for key, text in self.db.execute("SELECT run_key, row FROM runs")
                if not _stored_row(key, text)["error"]}

    def put(self, row: dict) -> None:
        text = json.dumps({k: _plain(v) for k, v in row.items()})
        self.db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?)", (row["run_key"], text))

    def table(self, keys: list[str], specs: list[dict], blank: tuple[str, ...] = ()) -> pd.DataFrame:
        """One row per (``keys[i]``, ``specs[i]``) whose run is stored, in that order: the stored row with the spec's
        own values (runs shared by several grid points appear once per point); the ``blank`` fields a spec does not
        set are empty (a contiguous run's block size: it has none, whatever point first stored the run)."""
        rows = dict(self.db.execute("SELECT run_key, row FROM runs"))
        return pd.DataFrame([{**_stored_row(key, rows[key]), **dict.fromkeys(blank), **spec}
                             for key, spec in zip(keys, specs) if key in rows])


def _stored_row(key, text) -> dict:
    """A stored run's row, read by ``lab.user_files`` (the store is a file the user can hand over) and checked to be
    a run: a JSON object whose ``error`` is a string (empty when the run succeeded)."""
    name = f"run {user_files.shown(key)}"
    if not isinstance(text, str):
        raise StoreError(f"{name}: the row is {type(text).__name__}, not JSON text")
    row = user_files.loads_json(text, name, StoreError)
    if not isinstance(row, dict) or not isinstance(row.get("error"), str):
        raise StoreError(f"{name}: {user_files.shown(text)} is not a run's row (a JSON object with an 'error' string)")
    return row


def _plain(value):
    """A JSON-ready value: NumPy scalars as Python ones (floats keep every bit; inf and NaN included)."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


# ---- the sweep --------------------------------------------------------------------------------------------------
RAY_CONNECT_TIMEOUT_S = 5.0  # a cluster that does not answer by then is named, not retried for minutes


def check_reachable(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Raise ``InputError`` unless ``address`` (``host:port``, ``ray://host:port``; ``auto``/``local`` are Ray's own
    look-ups and pass) accepts a TCP connection within ``timeout_s``: Ray itself retries an unreachable head for
    minutes before it gives up."""
    import socket

    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"Ray address {address!r}: expected host:port (or ray://host:port)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise InputError(f"Ray address {address!r} does not answer ({exc.strerror or exc}) within {timeout_s:g} s; "
                         f"start the cluster, fix the address, or leave it out for a local Ray") from None


def start_ray(address: str | None = None, num_cpus: int | None = None) -> float:
    """Start (or join) Ray; returns the seconds it took. No address and no ``RAY_ADDRESS``: a local Ray."""
    import ray

    if ray.is_initialized():
        return 0.0
    started = time.perf_counter()
    address = address or os.environ.get("RAY_ADDRESS")
    root = str(Path(__file__).resolve().parents[2])
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}}
    if address:
        check_reachable(address)
        ray.init(address=address, runtime_env={"working_dir": root, "excludes": ["benchmarks", "tests", ".git"]},
                 log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env=env)
    workers = int(ray.cluster_resources().get("CPU", 1))
    ray.get([ray.remote(_warm_up).remote() for _ in range(workers)])  # start the workers, import the simulator
    return time.perf_counter() - started


def _warm_up() -> int:
    from simulator.core import engine  # noqa: F401

    return os.getpid()


def allocator_grids(grid: dict[str, list]) -> list[dict[str, list]]:
    """``grid`` split by kind of allocator (paged, contiguous), each kind's grid without the settings it does not read
    (``simulator.core.presets.ALLOCATOR_SETTINGS``: a contiguous allocator has no block size, prefix cache or
    offload tier; paged blocks no address space): those are swept only for the kind that reads them, so a
    contiguous run is not repeated, or listed, once per block size. A grid of one kind comes back whole, less the
    other kind's settings."""
    from simulator.core.presets import ALLOCATOR_SETTINGS

    allocators = grid.get("allocator", [SIM_DEFAULTS["allocator"]])
    kinds: dict[str, list] = {}
    for allocator in allocators:
        kinds.setdefault("paged" if allocator == "paged" else "contiguous", []).append(allocator)
    grids = []
    for kind, names in kinds.items():
        own = {field: values for field, values in grid.items()
               if field not in ALLOCATOR_SETTINGS or ALLOCATOR_SETTINGS[field][1] == kind}
        if kind != "paged":
            own.pop(OFFLOAD_GIB, None)
        grids.append({**own, "allocator": names})
    return grids


def run_sweep(grid: dict[str, list] | list[dict[str, list]], store: str | Path, parallel: bool = True,
              address: str | None = None,
              num_cpus: int | None = None, progress: bool = True,
              should_stop: Callable[[int, int], bool] | None = None, retry_failed: bool = True,
              keep_on_interrupt: bool = False) -> SweepResult:
    """Run every combination of ``grid`` not already in ``store`` (a run that failed is tried again unless
    ``retry_failed`` is False); returns the whole grid's table. ``should_stop`` (called with done, total after each
    run) ends the sweep early when it returns True (pending tasks are cancelled; what finished is stored). The store
    is checked before any run; should it fail later, the runs of this invocation are still returned (from memory)
    and ``store_error`` says what happened. A ``KeyboardInterrupt`` stops the runs (what finished is stored); with
    ``keep_on_interrupt`` the sweep then returns the table of the runs done so far, ``ran`` those of this invocation
    and ``interrupted`` how many it had to do (the same sweep again runs exactly the missing ones), else the
    interrupt goes on to the caller. ``grid`` may be a list of grids (as ``allocator_grids`` makes), run as one sweep: a
    field that only some of them set is empty in the others' rows."""
    grids = [check_grid(one) for one in ([grid] if isinstance(grid, dict) else grid)]
    specs = [spec for one in grids for spec in expand(one)]
    fields = list(dict.fromkeys(field for one in grids for field in one))
    blank = tuple(field for field in fields if not all(field in one for one in grids))
    results = ResultStore(store)
    keys = [spec_key(spec) for spec in specs]
    stored = results.keys(failed=not retry_failed)
    todo = [(key, spec) for key, spec in dict(zip(keys, specs)).items() if key not in stored]
    bar = progress_bar(len(todo), progress)
    fresh: dict[str, dict] = {}
    store_error = []

    def keep(key: str, row: dict) -> None:
        """Each run is stored as it finishes (a sweep stopped part-way keeps them) and kept in memory."""
        fresh[key] = row
        if not store_error:
            try:
                results.put(row)
            except sqlite3.Error as exc:
                store_error.append(f"{results.path}: {exc}")

    ray_init_s, interrupted = 0.0, False
    try:
        if parallel and todo:
            ray_init_s = start_ray(address, num_cpus)
            _run_on_ray(todo, keep, bar, should_stop)
        else:
            for done, (key, spec) in enumerate(todo, 1):
                keep(key, run_one(spec))
                bar.update(1)
                if should_stop is not None and should_stop(done, len(todo)):
                    break
    except KeyboardInterrupt:
        if not keep_on_interrupt:
            raise
        interrupted = True  # the runs done so far are stored; the table below is theirs
    bar.close()
    if not store_error:
        try:
            table = results.table(keys, specs, blank)
            results.close()
        except sqlite3.Error as exc:
            store_error.append(f"{results.path}: {exc}")
    if store_error:
        table = pd.DataFrame([{**fresh[key], **dict.fromkeys(blank), **spec} for key, spec in zip(keys, specs)
                              if key in fresh])
    return SweepResult(tidy(table, fields), len(fresh) if interrupted else len(todo), ray_init_s,
                       "".join(store_error), len(todo) if interrupted else 0)


def _run_on_ray(todo: list[tuple[str, dict]], keep: Callable[[str, dict], None], bar, should_stop) -> None:
    import ray

    remote = ray.remote(max_retries=MAX_RETRIES)(run_one)
    pending = {remote.remote(spec): (key, spec) for key, spec in todo}
    try:
        _collect(pending, keep, bar, should_stop)
    except KeyboardInterrupt:
        for ref in pending:  # the runs not finished stop with this process's sweep
            ray.cancel(ref, force=True)
        raise


def _collect(pending: dict, keep: Callable[[str, dict], None], bar, should_stop) -> None:
    """Keep each of the ``pending`` Ray tasks' rows as it finishes (removing it from ``pending``), until none is
    left or ``should_stop`` says so (the rest are then cancelled)."""
    import ray

    done = 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.2)  # whatever finished
        for ref in ready:
            key, spec = pending.pop(ref)
            try:
                row = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the worker died more than MAX_RETRIES times
                row = {"run_key": key, **spec, "error": f"{type(exc).__name__}: {exc}"}
            keep(key, row)
            done += 1
            bar.update(1)
        if should_stop is not None and should_stop(done, done + len(pending)):
            for ref in pending:
                ray.cancel(ref, force=True)
            return


def tidy(table: pd.DataFrame, grid_fields: list[str]) -> pd.DataFrame:
    """The config columns (the grid's first, then the rest of the spec), then the summary columns, then ``error``."""
    if table.empty:
        return table
    spec_columns = [c for c in grid_fields if c in table] + [c for c in WORKLOAD_FIELDS
                                                             if c in table and c not in grid_fields]
    rest = [c for c in table.columns if c not in spec_columns and c not in ("run_key", "error")]
    return table[["run_key", *spec_columns, *rest, "error"]]


def failed_runs(table: pd.DataFrame) -> pd.DataFrame:
    """The rows whose run raised (``error`` set; a CSV read back has NaN for none)."""
    if "error" not in table:
        return table.iloc[:0]
    errors = table["error"]
    return table[errors.notna() & (errors.astype(str) != "")]


def runs_failing_checks(table: pd.DataFrame) -> pd.DataFrame:
    """The rows whose run broke a closed-form check (``checks_failed`` > 0: a simulator bug to report)."""
    if "checks_failed" not in table:
        return table.iloc[:0]
    return table[table["checks_failed"].fillna(0) > 0]


def read_table(data: bytes, name: str) -> pd.DataFrame:
    """A saved sweep or plan table (Parquet or CSV bytes); ``ValueError`` naming the file otherwise."""
    import io

    try:
        if not name.endswith(".parquet"):  # text: the one reader of user files
            table = user_files.csv_table(user_files.decode(data, name, InputError), name, InputError)
        else:
            table = pd.read_parquet(io.BytesIO(data))
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - pandas and pyarrow raise many types for a bad file
        raise InputError(f"{name}: not a readable {'Parquet' if name.endswith('.parquet') else 'CSV'} table "
                         f"({type(exc).__name__}: {exc})") from None
    if "max_rate_req_s" not in table and "run_key" not in table:
        raise InputError(f"{name}: neither a sweep table (run_key column) nor a plan (max_rate_req_s column)")
    return table


def save_table(table: pd.DataFrame, path: str | Path) -> None:
    """Parquet for ``.parquet``, else CSV."""
    path = Path(path)
    if path.suffix == ".parquet":
        write_atomically(path, lambda temporary: table.to_parquet(temporary, index=False))
    else:
        write_atomically(path, lambda temporary: table.to_csv(temporary, index=False))


def progress_bar(total: int, show: bool):
    """A tqdm bar on stderr (with ETA) for ``total`` runs; disabled when ``show`` is False."""
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc="sweep", unit="run", file=sys.stderr, disable=not show)
