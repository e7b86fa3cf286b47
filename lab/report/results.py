"""Results produced in an app session (simulations, kernel sweeps, runtime runs), kept for side-by-side comparison
and CSV export."""
from __future__ import annotations

import datetime
import enum
import functools
import math
import re
import subprocess
import time
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import pandas as pd

from lab import user_files
from lab.errors import InputError
from lab.files import write_atomically

ROOT = Path(__file__).resolve().parents[2]
RECORDED_RESULTS = ROOT / "benchmarks" / "results"


def _version() -> str:
    import tomllib

    try:
        return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


LAB_VERSION = _version()


ALL_CODE = ("lab", "simulator", "paged_kernels")


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None


@functools.cache
def lab_commit() -> str:
    """The commit this checkout runs, with ``-dirty`` when its code (``MEASURED_CODE``, the app; not recorded
    results, not this report) differs from it; "unknown" without git or a repository. Every result records it
    (``settings_of``), so a figure can be told apart from one measured on other code."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    changed = _git("diff", "--quiet", "HEAD", "--", *MEASURED_CODE, "app.py", "app_pages")
    return head.stdout.strip() + ("-dirty" if changed is not None and changed.returncode == 1 else "")


# the code each recorded figure depends on (the first pattern its file matches; else the whole lab): a change there
# since the figure's commit makes it stale
SIMULATION_CODE = ("simulator", "lab/kv_cache", "lab/sched", "lab/profiling")
CODE_OF = {"simulator.csv": SIMULATION_CODE, "compare.csv": SIMULATION_CODE, "sweep.csv": SIMULATION_CODE,
           "paper/*.csv": SIMULATION_CODE,
           "kernels_cpu.csv": ("paged_kernels", "lab/bench/kernels.py", "lab/bench/timing.py"),
           "app_flow.csv": ("app.py", "app_pages", "simulator", "lab", "benchmarks/app_flow.py")}


@functools.cache
def history_known() -> bool:
    """Whether this checkout has the history that figures' commits are compared against (git, not shallow)."""
    done = _git("rev-parse", "--is-shallow-repository")
    return done is not None and done.returncode == 0 and done.stdout.strip() == "false"


# what any other figure depends on: all the code but this report's (which formats and files figures, and measures
# nothing: a new headline row must not mark every figure stale)
MEASURED_CODE = (*ALL_CODE, ":(exclude)lab/report")


def code_of(file: str) -> tuple[str, ...]:
    """The folders and files a recorded figure's value depends on (``CODE_OF``; git pathspecs)."""
    return next((code for pattern, code in CODE_OF.items() if Path(file).match(pattern)), MEASURED_CODE)


@functools.cache
def recorded_in(path: Path) -> str | None:
    """The last commit that changed ``path``: when a figure does not record its own commit, the code it measured
    was at most that commit's (None without git or history)."""
    done = _git("log", "-1", "--format=%h", "--abbrev=12", "--", str(path))
    return done.stdout.strip() or None if done is not None and done.returncode == 0 else None


@functools.cache
def currency(commit: str | None, file: str) -> tuple[bool | None, str]:
    """Whether a figure recorded on ``commit`` still describes this checkout's code (``CODE_OF``): (True,
    "current"), (False, why) or (None, why not known). Asked once per process (the page reruns often)."""
    if not commit or commit == "unknown":
        return False, "no commit recorded"
    base = commit.removesuffix("-dirty")
    done = _git("diff", "--quiet", base, "--", *code_of(file))
    if done is None or done.returncode not in (0, 1):
        return None, "cannot compare here"
    if done.returncode == 1:
        return False, "stale: its code changed since"
    return (False, "measured on uncommitted changes") if commit.endswith("-dirty") else (True, "current")
# which command writes each recorded CSV (the first pattern a file's path relative to the folder matches)
RECORDED_BY = {"block_manager.csv": "python -m lab bench block-manager", "e2e_cpu.csv": "python -m lab bench e2e",
               "kernels_cpu.csv": "python -m lab bench kernels", "twin_cpu*.csv": "python -m simulator twin-bench",
               "twin_offload*_cpu.csv": "python -m simulator twin --kv-offload-blocks (docs/offload.md)",
               "simulator.csv": "python -m simulator.bench", "sweep.csv": "python -m simulator.bench --sweep",
               "compare.csv": "python -m simulator.bench --compare",
               "paper/*.csv": "python -m simulator paper", "launches.csv": "python -m lab bench launches",
               "gpu/*.csv": "scripts/gpu_check.sh (on a GPU)", "vllm_cpu.csv": "python -m lab bench vllm",
               "vllm_cpu_bf16.csv": "python -m lab bench vllm --dtype bfloat16",
               "vllm_profile_cpu.csv": "python -m lab bench vllm --profile",
               "app_flow.csv": "python -m benchmarks.app_flow", "app_parity.csv": "python -m benchmarks.app_parity",
               "vllm_twin_cpu.csv": "python -m simulator twin --peer vllm --repeats 5 --workloads all",
               "kv_precision_cpu.csv": "python -m lab bench kv-precision",
               "kv_precision_bf16_cpu.csv": "python -m lab bench kv-precision --model tiny --dtype bfloat16 "
                                            "--out benchmarks/results/kv_precision_bf16_cpu.csv",
               "vllm_fp8_cpu.csv": "python -m lab bench vllm --kv-cache-dtype fp8_e4m3",
               "vllm_fp8_agreement_cpu.csv": "python -m lab bench vllm --model tiny --kv-cache-dtype fp8_e4m3 "
                                             "--num-requests 1000 --first-token-only",
               "vllm_fp8_agreement_bf16_cpu.csv": "python -m lab bench vllm --model tiny --dtype bfloat16 "
                                                  "--kv-cache-dtype fp8_e4m3 --num-requests 1000 --first-token-only "
                                                  "--out benchmarks/results/vllm_fp8_agreement_bf16_cpu.csv",
               "vllm_fp8_e5m2_agreement_cpu.csv": "python -m lab bench vllm --model tiny --kv-cache-dtype fp8_e5m2 "
                                                  "--num-requests 1000 --first-token-only "
                                                  "--out benchmarks/results/vllm_fp8_e5m2_agreement_cpu.csv",
               "vllm_fp8_greedy_cpu.csv": "python -m lab bench vllm --kv-cache-dtype fp8_e4m3 --model tiny "
                                          "--num-requests 64 --repeats 1 "
                                          "--out benchmarks/results/vllm_fp8_greedy_cpu.csv",
               "vllm_family_float32_cpu.csv": "python -m lab bench vllm --model tiny --workload random",
               "vllm_family_bfloat16_cpu.csv": "python -m lab bench vllm --model tiny --workload random --dtype "
                                               "bfloat16",
               "contention_cpu.csv": "python -m lab bench contention",
               "kv_precision_gains.csv": "python -m simulator.bench --precision",
               "vllm_contention_cpu.csv": "python -m lab bench vllm --model tiny --num-requests 32 --background-load"}


@dataclass(slots=True)
class StoredResult:
    """A named table of one kind (``simulation``, ``kernels``, ``runtime``, ``uploaded``) and the settings that
    produced it (``settings_of``)."""

    name: str
    kind: str
    table: pd.DataFrame
    settings: dict = field(default_factory=dict)
    created_s: float = field(default_factory=time.time)


class ResultStore:
    """Ordered results by unique name."""

    def __init__(self):
        self.results: dict[str, StoredResult] = {}

    def add(self, kind: str, name: str, table: pd.DataFrame, settings: dict | None = None) -> StoredResult:
        """Store a copy of ``table`` with its ``settings``; a taken name gets a numeric suffix."""
        unique, index = name, 2
        while unique in self.results:
            unique, index = f"{name} ({index})", index + 1
        result = StoredResult(unique, kind, table.copy(), dict(settings or {}))
        self.results[unique] = result
        return result

    def names(self) -> list[str]:
        return list(self.results)

    def listing(self) -> pd.DataFrame:
        """One row per stored result: name, kind, rows, columns."""
        return pd.DataFrame([{"name": r.name, "kind": r.kind, "rows": len(r.table), "columns": len(r.table.columns)}
                             for r in self.results.values()], columns=["name", "kind", "rows", "columns"])

    def side_by_side(self, names: list[str], settings: bool = False) -> pd.DataFrame:
        """The chosen tables stacked, tagged by a ``result`` column (columns missing in one table are empty); with
        ``settings``, each table carries its own settings as columns (an export that says what produced each row)."""
        missing = [n for n in names if n not in self.results]
        if missing:
            raise InputError(f"no stored result named {', '.join(missing)}")
        frames = [(with_settings(self.results[n].table, self.results[n].settings) if settings
                   else self.results[n].table).assign(result=n) for n in names]
        table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        return table[["result", *[c for c in table.columns if c != "result"]]] if frames else table

    def load_csv(self, data: bytes, name: str) -> StoredResult:
        """Read an exported CSV back; raises ``ValueError`` naming the file when it is not a readable table."""
        table = _read_csv_table(data, name)
        if table.empty:
            raise InputError(f"{name}: the CSV has no rows")
        return self.add("uploaded", name, table)


def recorded_results(folder: Path = RECORDED_RESULTS) -> pd.DataFrame:
    """The benchmark CSVs committed under ``folder`` (the README quotes them): ``file`` (relative path), ``rows``,
    ``command`` (what writes it; empty when unknown). Empty when the folder is missing; ``rows`` is None for a file
    that is not a readable table."""
    rows = []
    for path in sorted(folder.rglob("*.csv")) if folder.is_dir() else []:
        relative = path.relative_to(folder)
        command = next((c for pattern, c in RECORDED_BY.items() if relative.match(pattern)), "")
        rows.append({"file": relative.as_posix(), "rows": _count_rows(path), "command": command})
    return pd.DataFrame(rows, columns=["file", "rows", "command"])


def _read_csv_table(source: bytes | Path, name: str) -> pd.DataFrame:
    """A CSV (its bytes, or a path) read strictly by ``lab.user_files`` and typed by ``pandas``; ``InputError``
    naming ``name`` (and the line) when it is not a well-formed table."""
    data = user_files.read_bytes(source, InputError) if isinstance(source, Path) else source
    return user_files.csv_table(user_files.decode(data, name, InputError), name, InputError)


def _count_rows(path: Path) -> int | None:
    try:
        return len(_read_csv_table(path, path.name))
    except ValueError:
        return None  # listed all the same: read_recorded names the problem


def read_recorded(file: str, folder: Path = RECORDED_RESULTS) -> pd.DataFrame:
    """One recorded CSV by its ``file`` name from ``recorded_results``; ``ValueError`` naming it when it is not one
    of them or not a readable table."""
    path = (folder / file).resolve()
    if path.suffix != ".csv" or folder.resolve() not in path.parents or not path.is_file():
        raise InputError(f"{file}: not a recorded result under {folder}")
    return _read_csv_table(path, file)


def csv_target(path: str, settings: dict | None = None, kind: str = "results") -> Path:
    """The file ``save_csv`` writes for ``path``: itself, or in a folder (with ``settings``) a name made from them."""
    target = Path(path)
    if settings is not None and (target.is_dir() or path.endswith(("/", "\\"))):
        target = target / export_name(kind, settings)
    return target


def save_csv(table: pd.DataFrame, path: str | None, settings: dict | None = None, kind: str = "results") -> None:
    """Write ``table`` to ``path`` (folders created) and say so; nothing when ``path`` is empty. With ``settings``
    the file carries them as leading columns, and a folder ``path`` (an existing folder, or one ending in ``/``)
    gets a file named from them and the time (``export_name``)."""
    if not path:
        return
    target = csv_target(path, settings, kind)
    if settings is not None:
        if "lab_commit" not in settings:  # every recorded result names the code it ran on
            settings = {**settings, "lab_version": LAB_VERSION, "lab_commit": lab_commit()}
        table = with_settings(table, settings)
    write_atomically(target, lambda temporary: table.to_csv(temporary, index=False))
    print(f"wrote {target}")


def print_and_save(table: pd.DataFrame, out: str | None, columns: list[str] | None = None,
                   settings: dict | None = None, kind: str = "results") -> None:
    """Print ``table`` (or its ``columns``) for a terminal, then ``save_csv`` the whole table (with its
    ``settings``) to ``out``."""
    shown = table[columns] if columns else table
    with pd.option_context("display.width", 220, "display.max_columns", 40, "display.float_format", "{:.4g}".format):
        print(shown.to_string(index=False))
    save_csv(table, out, settings, kind)


# ---- settings: what produced a result ---------------------------------------------------------------------------
def settings_of(*configs, **extra) -> dict:
    """The settings that produced a result as one flat dict of scalars: each config's fields (a dataclass, or a dict
    such as ``vars(args)``; nested dataclasses flattened in place, their fields prefixed only where a name is taken),
    then ``extra``, then the lab's version."""
    settings: dict = {}
    for config in configs:
        _flatten(config, "", settings)
    _flatten(extra, "", settings)
    settings["lab_version"] = LAB_VERSION
    settings["lab_commit"] = lab_commit()
    return settings


def _flatten(config, prefix: str, settings: dict) -> None:
    items = [(f.name, getattr(config, f.name)) for f in fields(config)] if is_dataclass(config) else config.items()
    for name, value in items:
        key = name if name not in settings else f"{prefix}{name}"
        if is_dataclass(value):
            _flatten(value, f"{name}_", settings)
        elif isinstance(value, dict):
            settings.update({f"{key}_{k}": _scalar(v) for k, v in value.items()})
        else:
            settings[key] = _scalar(value)


def _scalar(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, (list, tuple, set, frozenset)):
        return " ".join(str(_scalar(v)) for v in value)
    return str(value)


def with_settings(table: pd.DataFrame, settings: dict) -> pd.DataFrame:
    """``table`` with the settings as leading columns (a setting named like one of its columns as
    ``setting_<name>``), so an exported CSV says what produced it."""
    extra = {f"setting_{k}" if k in table.columns else k: v for k, v in settings.items()}
    return pd.concat([pd.DataFrame({k: [v] * len(table) for k, v in extra.items()}, index=table.index), table], axis=1)


def split_settings(table: pd.DataFrame, names) -> tuple[pd.DataFrame, dict]:
    """The reverse of ``with_settings`` for the settings called ``names``: the table without their columns, and
    their values (from the first row)."""
    columns = {name: f"setting_{name}" if f"setting_{name}" in table else name for name in names}
    present = {name: column for name, column in columns.items() if column in table}
    values = {name: table[column].iloc[0] if len(table) else None for name, column in present.items()}
    return table.drop(columns=list(present.values())), values


def export_name(kind: str, settings: dict, when: datetime.datetime | None = None) -> str:
    """A file name that tells exports apart: the kind, the settings that name a run (workload, its size and rate,
    model, GPU or device, block size or the paged block sizes compared) where present, and a timestamp, e.g.
    ``summary_sharegpt_1000req_5rps_opt-13b_a100-40gb_20261202-201500.csv``."""
    when = when or datetime.datetime.now()
    parts = [kind]
    for key, form in _NAME_PARTS:
        if settings.get(key) is not None:
            parts.append(form(settings[key]))
    parts.append(when.strftime("%Y%m%d-%H%M%S"))
    return "_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", str(p)).strip("-") for p in parts) + ".csv"


_NAME_PARTS = (("workload", str), ("num_requests", "{}req".format),
               ("arrival_rate_req_s", lambda rate: "allatonce" if rate == math.inf else f"{rate:g}rps"),
               ("model", str), ("gpu", str), ("device", str), ("block_size", "B{}".format),
               ("paged_block_sizes", "B{}".format))


def to_csv_bytes(table: pd.DataFrame) -> bytes:
    """CSV bytes for a download button."""
    return table.to_csv(index=False).encode()


# ---- headline figures ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Headline:
    """One headline figure: how to read its latest value from a recorded CSV and the goal it is held to."""

    name: str
    file: str  # under benchmarks/results/
    read: object  # table -> float
    unit: str
    goal: float | None  # None: no goal, a figure to watch
    higher_is_better: bool = True

    def met(self, value: float) -> bool | None:
        if self.goal is None or value != value:
            return None
        return value >= self.goal if self.higher_is_better else value <= self.goal


def _row_value(column: str, **where):
    def read(table: pd.DataFrame) -> float:
        rows = table
        for key, value in where.items():
            rows = rows[rows[key] == value]
        return float(rows[column].iloc[0]) if len(rows) else float("nan")
    return read


def _contention_bound(table: pd.DataFrame) -> float:
    """The least slowdown a thread policy could show in a contention run: the engine's quiet speed on every core
    over its loaded speed on one thread (with a core taken, one thread is what runs at full speed), both from the
    same run. The better the engine's steps scale across cores, the higher it is."""
    fixed = table[table["system"].str.fullmatch(r"paged engine \(\d+ threads?\)")]
    if fixed.empty:
        return float("nan")
    counts = fixed["system"].str.extract(r"\((\d+) thread", expand=False).astype(int)
    every, one = fixed[counts == counts.max()], fixed[counts == 1]
    if one.empty or counts.max() == 1:
        return float("nan")
    return float(every["quiet_tok_s"].iloc[0] / one["loaded_tok_s"].iloc[0])


P50S = ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s")


def _vllm_twin_worst_p50(table: pd.DataFrame) -> float:
    """The largest median p50 error (TTFT, TPOT, E2E) of the vLLM twin over every workload scored, %."""
    rows = table[table["metric"].isin(P50S)]
    return float(rows["error"].max() * 100) if len(rows) else float("nan")


def _vllm_server_spread(table: pd.DataFrame) -> float:
    """The real server's own spread beside the twin: the largest coefficient of variation of a p50 (TTFT, TPOT,
    E2E) over the repeats of one workload, %."""
    if "real_cv" not in table:
        return float("nan")
    rows = table[table["metric"].isin(P50S)]
    return float(rows["real_cv"].max() * 100) if len(rows) else float("nan")


def _twin_within(table: pd.DataFrame) -> float:
    p50 = table[table["metric"].isin(["throughput_tok_s", "ttft_p50_s", "tpot_p50_s"])
                & ~table["load"].isin(["profile"])]
    return float((p50["rel_error"].abs() <= 0.10).mean() * 100) if len(p50) else float("nan")


HEADLINES = [
    Headline("Paged engine vs HF continuous batching, output tokens/s (CPU, tiny Qwen3, 64 requests)", "e2e_cpu.csv",
             _row_value("speedup_vs_hf_continuous", system="paged-engine"), "×", 2.0),
    Headline("Scheduler's share of the engine's step time (CPU)", "e2e_cpu.csv",
             lambda t: 100 * _row_value("scheduler_share", system="paged-engine")(t), "%", 5.0, False),
    Headline("Paged decode kernel time vs SDPA, batch 32 × 1,024 tokens (CPU, torch backend)", "kernels_cpu.csv",
             _row_value("vs_sdpa", kernel="torch", batch=32, context=1024), "×", 1.2, False),
    Headline("Simulator speed, paged vs contiguous-oracle, Azure conversation trace", "simulator.csv",
             _row_value("value", case="paged / contiguous-oracle speed"), "×", 0.8),
    Headline("Simulator speed, Azure conversation trace (19,366 requests)", "simulator.csv",
             _row_value("value", case="azure-conv replay, paged"), "requests/s", 20_000),
    Headline("Sweep of 200 simulations: local Ray on 2 CPUs vs serial", "sweep.csv",
             _row_value("value", case="Ray / serial sweep speed"), "×", 1.5),
    Headline("Digital twin: p50s simulated within 10 % of the real engine (CPU)", "twin_cpu.csv", _twin_within, "%",
             100.0),
    Headline("vLLM paper Fig. 2: paged KV holding tokens (paper: 96.3 %)", "paper/figure2.csv",
             lambda t: 100 * _row_value("token_states_frac", allocator="paged")(t), "% of KV", 90.0),
    Headline("Kernel launches per decoder layer in a graph-replayed decode step (Qwen3-0.6B shapes)", "launches.csv",
             _row_value("per_layer", step="decode"), "launches", 12, False),
    Headline("Our engine vs vLLM's CPU build, output tokens/s (tiny Qwen3, fp32, same checkpoint and pool)",
             "vllm_cpu.csv", _row_value("output_tok_s", system="ours / vllm", model="tiny"), "×", 1.0),
    Headline("Our engine vs vLLM's CPU build, output tokens/s (Qwen3-0.6B shapes, 4 layers, fp32)", "vllm_cpu.csv",
             _row_value("output_tok_s", system="ours / vllm", model="qwen3-0.6b-random-4l"), "×", 1.0),
    Headline("Our engine vs vLLM's CPU build, output tokens/s (tiny Qwen3, bf16)",
             "vllm_cpu_bf16.csv", _row_value("output_tok_s", system="ours / vllm", model="tiny"), "×", 1.0),
    Headline("Our engine vs vLLM's CPU build, output tokens/s (Qwen3-0.6B shapes, 4 layers, bf16)",
             "vllm_cpu_bf16.csv", _row_value("output_tok_s", system="ours / vllm", model="qwen3-0.6b-random-4l"),
             "×", 1.0),
    Headline("Ours vs vLLM, worst of a random family of 8 (tiny, fp32)",
             "vllm_family_float32_cpu.csv", _row_value("ratio", workload="family worst"), "×", 0.9),
    Headline("Ours vs vLLM, worst of a random family of 8 (tiny, bf16)",
             "vllm_family_bfloat16_cpu.csv", _row_value("ratio", workload="family worst"), "×", 0.9),
    Headline("Paged engine's slowdown, one core busy elsewhere (tiny Qwen3, threads measured)",
             "contention_cpu.csv", _row_value("slowdown", system="paged engine (threads measured)"), "×", 1.5, False),
    Headline("Beside it, its bound: every core quiet over one thread with a core busy (same run)",
             "contention_cpu.csv", _contention_bound, "×", None, False),
    Headline("FP8 KV (e4m3) at the Memory simulator's defaults: running sequences vs the best contiguous run",
             "kv_precision_gains.csv", _row_value("mean_batch_size_x", step="fp8"), "×", None),
    Headline("Paging and FP8 KV together at the Memory simulator's defaults: running sequences vs contiguous",
             "kv_precision_gains.csv", _row_value("mean_batch_size_x", step="together"), "×", None),
    Headline("FP8 KV (e4m3): top-1 agreement with an fp32 cache, near ties excluded (0.6B shapes)",
             "kv_precision_cpu.csv", lambda t: 100 * _row_value("top1_agreement_clear", kv_cache_dtype="fp8_e4m3",
                                                                scales="1.0", model="qwen3-0.6b-random")(t),
             "%", 95.0),
    Headline("FP8 first token = vLLM's (CPU, no ties)",
             "vllm_fp8_agreement_cpu.csv", lambda t: 100 * _row_value("first_token_agreement_clear",
                                                                      system="ours / vllm", model="tiny")(t),
             "%", 95.0),
    Headline("Our engine vs vLLM's CPU build, both with FP8 KV (e4m3), output tokens/s (tiny Qwen3)",
             "vllm_fp8_cpu.csv", _row_value("output_tok_s", system="ours / vllm", model="tiny"), "×", 1.0),
    Headline("vLLM twin: worst p50 error vs a vLLM server (TTFT/TPOT/E2E, 5 workloads, CPU)",
             "vllm_twin_cpu.csv", _vllm_twin_worst_p50, "%", 5.0, False),
    Headline("Beside it, the vLLM server's own spread: largest p50 coefficient of variation (5 repeats)",
             "vllm_twin_cpu.csv", _vllm_server_spread, "%", None, False),
    Headline("Memory simulator in Chromium: an arrival-rate change until the page is current (defaults, 2 cores)",
             "app_flow.csv", _row_value("median_s", code="this checkout", change="arrival rate (+0.01 requests/s)"),
             "s", 1.0, False),
    Headline("Memory simulator's default comparison, 6 configurations (simulator.compare, serially)", "compare.csv",
             _row_value("value", case="default comparison (6 configs), serial, quiet steps at once"), "s", 0.3, False),
    Headline("Paged engine vs HF continuous batching on an H200 (Qwen3-0.6B shapes)", "gpu/e2e_gpu.csv",
             _row_value("speedup_vs_hf_continuous", system="paged-engine"), "×", 5.0),
]


# Column and metric names as a person reads them, with their units: what the app's tables and charts show (exports
# keep the names). One label per name, wherever it appears; a name without one is shown in words (``human_label``).
COLUMN_LABELS = {
    # requests and their latencies (a run's requests; summaries of runs)
    "request_id": "Request", "prompt_tokens": "Prompt tokens", "output_tokens": "Output tokens",
    "ttft_s": "Time to first token (s)", "tpot_s": "Time per output token (s)", "e2e_s": "End-to-end latency (s)",
    "ttft_p50_s": "TTFT p50 (s)", "ttft_p90_s": "TTFT p90 (s)", "tpot_p50_s": "TPOT p50 (s)",
    "tpot_p90_s": "TPOT p90 (s)", "e2e_p50_s": "End-to-end p50 (s)", "e2e_p90_s": "End-to-end p90 (s)",
    "ttft_median_s": "TTFT median (s)", "tpot_median_s": "TPOT median (s)",
    "throughput_tok_s": "Throughput (output tokens/s)", "output_tok_s": "Throughput (output tokens/s)",
    "makespan_s": "Makespan (s)", "wall_s": "Wall time (s)", "wall_time_s": "Wall time (s)",
    "preemptions": "Preemptions", "peak_blocks_in_use": "Peak KV blocks in use", "steps": "Steps",
    "num_requests": "Requests", "rate": "Arrival rate (requests/s)",
    # serving systems compared (python -m lab bench e2e)
    "system": "System", "scheduler_share": "Scheduler's share of step time", "peak_memory_mib": "Peak memory (MiB)",
    "same_tokens_as_engine": "Same tokens as the paged engine", "repeats": "Runs (median taken)",
    "speedup_vs_hf_continuous": "Speed-up vs HF continuous batching (×)",
    # a twin against its engine
    "metric": "Metric", "real": "Real engine", "simulated": "Simulated",
    "rel_error": "Relative error", "noise_floor": "Noise floor (the runs' largest distance from their median)",
    "schedule_identical": "Same schedule as the engine (1 = yes)",
    "replay_schedule_identical": "Replay: same schedule as the engine (1 = yes)",
    "replay_step_time_median": "Replay: median step time (s)",
    "kv_usage_mean_abs_points": "KV cache usage, mean over the run (%)",
    "prefix_hit_rate": "Prefix-cache hit rate (%)",
    "part": "Part of the run", "first_step": "First step", "last_step": "Last step",
    "measured_s": "Measured (s)", "modelled_s": "Modelled (s)", "fitted_s": "Fitted (s)",
    "measured_over_modelled": "Measured / modelled", "scenario": "Scenario", "samples": "Samples",
    # block tables and kernels
    "logical_block": "Logical block", "physical_block": "Physical block",
    "first_token": "First token (position in the sequence)", "tokens_held": "Tokens held",
    "backend": "Backend", "dtype": "Data type", "block_size": "Block size (tokens)",
    # configurations and benchmark runs
    "allocator": "Allocator", "model": "Model", "gpu": "GPU", "replicas": "Replicas", "workload": "Workload",
    "cpus": "CPUs", "vs_baseline": "Against the baseline (×)", "vs_sdpa": "Against SDPA (×)",
}


# a name's unit by its suffix, for names without a label (the lab's exports keep to these suffixes)
UNIT_SUFFIXES = (("_tok_s", "tokens/s"), ("_gb_per_s", "GB/s"), ("_ms", "ms"), ("_s", "s"), ("_mib", "MiB"),
                 ("_bytes", "bytes"), ("_pct", "%"), ("_frac", "fraction"))


def human_label(name):
    """``name`` as a person reads it: its ``COLUMN_LABELS`` label, else its words with the unit its suffix names
    (``median_ms``: ``Median (ms)``, ``num_free_blocks``: ``Num free blocks``). Anything but a string as it is."""
    if not isinstance(name, str):
        return name
    if name in COLUMN_LABELS:
        return COLUMN_LABELS[name]
    for suffix, unit in UNIT_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return f"{_words(name[:-len(suffix)])} ({unit})"
    return _words(name)


def _words(name: str) -> str:
    words = name.replace("_", " ")
    return words[:1].upper() + words[1:]


def human_columns(table: pd.DataFrame, labels: dict | None = None) -> pd.DataFrame:
    """``table`` with its columns named for a person: ``labels`` first (a name that means something more particular
    in this table, or a layer's own labels), then ``human_label``. For display: exports keep the names."""
    labels = labels or {}
    return table.rename(columns=lambda name: labels.get(name) or human_label(name))


def human_number(value: float) -> str:
    """A number as a person reads it, 3 significant digits, thousands separated: ``4.23``, ``0.921``, ``26,916``;
    ``—`` for NaN, ``∞`` for infinity."""
    if value != value:
        return "—"
    if abs(value) == float("inf"):
        return "∞" if value > 0 else "−∞"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def headline_results(folder: Path = RECORDED_RESULTS) -> pd.DataFrame:
    """The latest value of every headline figure from the recorded CSVs, beside its goal: ``benchmark``,
    ``latest``, ``unit``, ``goal`` (text), ``met`` (True, False, or None when there is no goal or no value),
    ``latest_over_goal`` (the figure as a multiple of its goal, inverted where lower is better: >= 1 means met),
    ``file``, the ``command`` that reruns it, the commit it was measured on (``measured_on``: the figure's own, or
    for one recorded before figures carried it the last commit of its file, ``commit_of``) and whether that code is
    still this checkout's (``current``; ``currency`` says why not: ``currency()``)."""
    rows = []
    for headline in HEADLINES:
        path = folder / headline.file
        commit = None
        try:
            table = _read_csv_table(path, headline.file) if path.is_file() else None
            value = headline.read(table) if table is not None else float("nan")
            if table is not None and "lab_commit" in table and len(table):
                commit = str(table["lab_commit"].iloc[-1])
        except (KeyError, IndexError, ValueError):
            value = float("nan")
        filed = commit is None and value == value
        if filed:  # recorded before figures carried their commit: the commit that recorded the file bounds it
            commit = recorded_in(path)
        current, why = currency(commit, headline.file) if value == value else (None, "not measured")
        goal = "" if headline.goal is None else \
            f"{'≥' if headline.higher_is_better else '≤'} {human_number(headline.goal)}"
        ratio = float("nan") if headline.goal is None or value != value else \
            (value / headline.goal if headline.higher_is_better else headline.goal / value if value else float("inf"))
        command = next((c for pattern, c in RECORDED_BY.items() if Path(headline.file).match(pattern)), "")
        rows.append({"benchmark": headline.name, "latest": value, "unit": headline.unit, "goal": goal,
                     "met": headline.met(value), "latest_over_goal": ratio, "file": headline.file,
                     "command": command, "measured_on": commit or "", "commit_of": "file" if filed else "figure",
                     "current": current, "currency": why, "code": ", ".join(code_of(headline.file))})
    return pd.DataFrame(rows)


def headline_markdown(folder: Path = RECORDED_RESULTS, currency: bool = True) -> str:
    """``headline_results`` as the README's Markdown table; with ``currency``, a column saying on which commit each
    figure was measured (``*``: its file's commit, the figure names none) and whether the code it measures changed
    since (✓; ⚠ stale, dirty: measured on uncommitted code, none: no commit), as of now: a later change makes it
    stale."""
    lines = ["| figure | latest | goal | command |" + (" measured on |" if currency else ""),
             "|---|---|---|---|" + ("---|" if currency else "")]
    for row in headline_results(folder).itertuples():
        mark = "" if row.met is None else " ✓" if row.met else " ✗"
        value = "not measured" if row.latest != row.latest else f"**{human_number(row.latest)} {row.unit}**{mark}"
        line = f"| {row.benchmark} | {value} | {row.goal} {row.unit if row.goal else ''} | `{row.command}` |"
        if currency:
            short = {"current": "✓", "no commit recorded": "⚠ none", "measured on uncommitted changes": "⚠ dirty",
                     "stale: its code changed since": "⚠ stale"}.get(row.currency, f"⚠ {row.currency}")
            where = f"`{row.measured_on[:7]}`{'*' if row.commit_of == 'file' else ''} " if row.measured_on else ""
            line += f" {where}{short} |"
        lines.append(line)
    return "\n".join(lines)
