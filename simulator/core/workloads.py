"""Workloads for the simulator: synthetic presets and loaders for real traces (Azure LLM 2023, Mooncake, generic CSV).

A ``Workload`` is columnar (NumPy arrays, one entry per request) so that a million-row trace stays cheap.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from lab import user_files
from lab.checks import check_choice, check_int, check_real, entry_point
from lab.errors import InputError, LabError
from lab.user_files import shown

MOONCAKE_BLOCK_TOKENS = 512
_INT64_SAFE_BLOCK_ID = (1 << 62) // MOONCAKE_BLOCK_TOKENS  # larger ids take Python ints (no wrap-round)
MAX_TRACE_TOKENS = 2**31 - 1  # a length in a trace must fit int32
SYNTHETIC_PRESETS = ("sharegpt", "alpaca", "random", "fixed")
YEAR_S = 365.25 * 24 * 3600
MAX_ARRIVAL_S = 2.0**32  # ~136 years: float64 seconds keep microseconds below 2**33
ARRIVAL_RESOLUTION_S = 1e-6  # a trace's absolute arrival times must keep microseconds (float64 keeps them to ~2^33 s)
MIN_RATE = 1e-6  # requests/s: one request in 11.6 days; below it arrival times leave float range
MIN_BURSTINESS = 1e-3  # gamma shape; below it the gaps underflow to 0 and overflow to inf


class WorkloadError(LabError):
    """A workload's requests are inconsistent or out of range (see ``Workload.check``)."""


class TraceFormatError(WorkloadError):
    """A trace file is malformed; the message names the file, the row and the column."""


@entry_point
@dataclass(slots=True)
class Workload:
    """Requests sorted by arrival. ``prompt_block_ids`` (Mooncake) gives per-512-token prompt block ids, so equal
    ids mean a shared prompt prefix; ``shared_prefix_tokens`` is a system prompt common to every request; each
    request samples ``n`` outputs (``output_tokens`` holds the first sample's length, ``sample_output_tokens`` all),
    or with ``beam_width`` > 1 runs a beam search of that width."""

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    n: int = 1
    shared_prefix_tokens: int = 0
    prompt_block_ids: list[list[int]] | None = None
    sample_output_tokens: np.ndarray | None = None  # [num_requests, n]
    source: str = "synthetic"
    meta: dict = field(default_factory=dict)
    beam_width: int = 1  # > 1: beam search, every beam as long as output_tokens (simulator.core.beams)

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def check(self) -> "Workload":
        """Raise ``WorkloadError`` naming the first inconsistency (a workload built in code reaches the simulator
        only through this): equal lengths, finite non-negative sorted arrivals, whole positive lengths; returns
        itself."""
        owner, count = f"Workload {self.name!r}", len(self.prompt_tokens)
        check_int(owner, "n", self.n, 1, 1024, error=WorkloadError)
        check_int(owner, "beam_width", self.beam_width, 1, 256, error=WorkloadError)
        check_int(owner, "shared_prefix_tokens", self.shared_prefix_tokens, 0, MAX_TRACE_TOKENS, error=WorkloadError)
        columns = {"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                   "output_tokens": self.output_tokens}
        for name, values in columns.items():
            if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype.kind not in "iuf":
                raise WorkloadError(f"{owner}: {name} must be a 1-D numeric NumPy array")
            if len(values) != count:
                raise WorkloadError(f"{owner}: {name} has {len(values)} entries, prompt_tokens {count}")
        if count == 0:
            raise WorkloadError(f"{owner}: no requests")
        arrivals = self.arrival_s
        bad = ~np.isfinite(arrivals) | (arrivals < 0)
        if bad.any():
            row = int(np.argmax(bad))
            raise WorkloadError(f"{owner}: arrival_s[{row}]={arrivals[row]!r} is not a finite time >= 0 (a rate or "
                                f"time scale too small or too large overflows)")
        if arrivals.max() > MAX_ARRIVAL_S:
            row = int(np.argmax(arrivals > MAX_ARRIVAL_S))
            raise WorkloadError(f"{owner}: arrival_s[{row}]={arrivals[row]:.4g} s is {arrivals[row] / YEAR_S:,.0f} "
                                f"years after the first request; arrivals must lie within {MAX_ARRIVAL_S / YEAR_S:.0f} "
                                f"years of it (past that the simulator's clock, float seconds, loses microseconds)")
        if count > 1 and (np.diff(arrivals) < 0).any():
            row = int(np.argmax(np.diff(arrivals) < 0)) + 1
            raise WorkloadError(f"{owner}: arrival_s[{row}] is earlier than arrival_s[{row - 1}] (not sorted)")
        for name in ("prompt_tokens", "output_tokens"):
            values = columns[name]
            bad = ~np.isfinite(values) | (values < 1) | (values > MAX_TRACE_TOKENS) | (values != np.floor(values))
            if bad.any():
                row = int(np.argmax(bad))
                raise WorkloadError(f"{owner}: {name}[{row}]={values[row]!r} is not a whole number of tokens in "
                                    f"[1, {MAX_TRACE_TOKENS}]")
        if self.prompt_block_ids is not None and len(self.prompt_block_ids) != count:
            raise WorkloadError(f"{owner}: prompt_block_ids has {len(self.prompt_block_ids)} entries, not {count}")
        samples = self.sample_output_tokens
        if samples is not None:
            if not isinstance(samples, np.ndarray) or samples.shape != (count, self.n) or (samples < 1).any():
                raise WorkloadError(f"{owner}: sample_output_tokens must be a [{count}, {self.n}] array of lengths "
                                    f">= 1")
        return self

    @property
    def has_shared_prefixes(self) -> bool:
        return self.shared_prefix_tokens > 0 or self.prompt_block_ids is not None

    def prompt_token_ids(self, index: int) -> list[int] | None:
        """Synthetic token ids that reproduce the workload's prefix sharing, or None when nothing is shared."""
        length = int(self.prompt_tokens[index])
        if self.prompt_block_ids is not None:
            ids, block = self.prompt_block_ids[index], MOONCAKE_BLOCK_TOKENS
            if all(abs(int(i)) < _INT64_SAFE_BLOCK_ID for i in ids):  # one array op per prompt (they run to 100k)
                positions = np.arange(length, dtype=np.int64)
                return (np.asarray(ids, dtype=np.int64)[positions // block] * block + positions % block).tolist()
            return [int(ids[position // block]) * block + position % block for position in range(length)]
        if self.shared_prefix_tokens:
            shared = min(self.shared_prefix_tokens, length)
            unique_base = -(index + 1) * (1 << 24)  # negative ids never collide with the shared prefix
            return list(range(shared)) + list(range(unique_base, unique_base + length - shared))
        return None

    def subset(self, indices) -> "Workload":
        """The requests at ``indices`` (in that order, arrival times kept) as a workload of their own."""
        indices = np.asarray(indices, dtype=np.int64)
        blocks = [self.prompt_block_ids[i] for i in indices] if self.prompt_block_ids is not None else None
        samples = self.sample_output_tokens[indices] if self.sample_output_tokens is not None else None
        return Workload(self.name, self.arrival_s[indices], self.prompt_tokens[indices], self.output_tokens[indices],
                        self.n, self.shared_prefix_tokens, blocks, samples, self.source, dict(self.meta),
                        self.beam_width)

    def fingerprint(self) -> str:
        """A digest of everything a run reads of the workload (two workloads with the same one serve alike)."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((self.name, self.n, self.shared_prefix_tokens, self.beam_width, self.source,
                            sorted(self.meta.items(), key=str), self.prompt_block_ids)).encode())
        for column in (self.arrival_s, self.prompt_tokens, self.output_tokens, self.sample_output_tokens):
            if column is not None:
                digest.update(repr((column.dtype.str, column.shape)).encode())
                digest.update(np.ascontiguousarray(column).tobytes())
        return digest.hexdigest()

    def outputs_of(self, index: int) -> list[int]:
        """Output lengths of every sample (or beam) of request ``index``."""
        if self.beam_width > 1:
            return [int(self.output_tokens[index])] * self.beam_width
        if self.sample_output_tokens is None:
            return [int(self.output_tokens[index])] * self.n
        return [int(x) for x in self.sample_output_tokens[index]]

    def summary(self) -> dict:
        """Count, mean lengths, duration and rate."""
        duration = float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0
        return {"workload": self.name, "num_requests": len(self), "n": self.n, "beam_width": self.beam_width,
                "prompt_mean": float(self.prompt_tokens.mean()) if len(self) else 0.0,
                "output_mean": float(self.output_tokens.mean()) if len(self) else 0.0,
                "duration_s": duration, "rate_req_s": (len(self) - 1) / duration if duration > 0 else math.inf}


@entry_point
@dataclass(slots=True)
class SyntheticSpec:
    """Parameters of a synthetic workload (see ``synthetic_workload``)."""

    preset: str = "sharegpt"
    num_requests: int = 1000
    rate: float = math.inf  # requests/s; inf = all arrive at t=0
    burstiness: float = 1.0  # gamma shape; 1 = Poisson, < 1 burstier
    n: int = 1
    beam_width: int = 1  # beam search of this width (not with n > 1)
    shared_prefix_tokens: int = 0
    input_len: int = 1024  # random / fixed
    output_len: int = 128  # random / fixed
    range_ratio: float = 0.0  # random: uniform in [L(1-r), L(1+r)]
    max_model_len: int | None = None
    seed: int = 0


SYNTHETIC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SyntheticSpec)}
LENGTH_FIELDS = {"input_len": ("random", "fixed"), "output_len": ("random", "fixed"), "range_ratio": ("random",)}


@entry_point
def synthetic_workload(spec: SyntheticSpec) -> Workload:
    """Draw a synthetic workload: ``sharegpt`` (mean prompt/output ~161/338, heavy-tailed, prompt <= 1024,
    prompt + output <= 2048), ``alpaca`` (~19/58), ``random`` (vLLM bench style) or ``fixed``."""
    check_synthetic_spec(spec)
    rng = np.random.default_rng(spec.seed)
    count = spec.num_requests
    if spec.preset == "sharegpt":
        prompts, outputs = _lognormal(rng, 167, 1.0, count, 4, 1024), _lognormal(rng, 356, 1.0, count, 4, 2048)
        outputs = np.minimum(outputs, 2048 - prompts)
    elif spec.preset == "alpaca":
        prompts, outputs = _lognormal(rng, 19, 0.6, count, 2, 512), _lognormal(rng, 58, 0.8, count, 2, 1024)
    elif spec.preset == "random":
        prompts = _uniform_around(rng, spec.input_len, spec.range_ratio, count)
        outputs = _uniform_around(rng, spec.output_len, spec.range_ratio, count)
    else:
        prompts, outputs = np.full(count, spec.input_len), np.full(count, spec.output_len)
    prompts = prompts + spec.shared_prefix_tokens
    if spec.max_model_len:
        prompts = np.minimum(prompts, spec.max_model_len - 1)
        outputs = np.minimum(outputs, spec.max_model_len - prompts)
    samples = None
    if spec.n > 1:
        samples = np.concatenate([outputs[:, None], _resample_outputs(rng, spec, outputs, prompts)], axis=1)
    return Workload(spec.preset, arrival_times(rng, count, spec.rate, spec.burstiness), prompts.astype(np.int64),
                    outputs.astype(np.int64), n=spec.n, shared_prefix_tokens=spec.shared_prefix_tokens,
                    sample_output_tokens=samples, meta={"spec": spec}, beam_width=spec.beam_width).check()


def arrival_times(rng: np.random.Generator, count: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times: all at 0 when ``rate`` is infinite, else gamma gaps (shape ``burstiness``) of mean 1/rate."""
    if math.isinf(rate):
        return np.zeros(count)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def check_synthetic_spec(spec: SyntheticSpec) -> None:
    owner, big = "SyntheticSpec", 10**7
    check_choice(owner, "preset", spec.preset, SYNTHETIC_PRESETS)
    for name, low, high in (("num_requests", 1, big), ("n", 1, 1024), ("beam_width", 1, 256),
                            ("shared_prefix_tokens", 0, big),
                            ("input_len", 1, big), ("output_len", 1, big), ("seed", 0, 2**63 - 1)):
        check_int(owner, name, getattr(spec, name), low, high)
    check_int(owner, "max_model_len", spec.max_model_len, 2, 2**31, optional=True)
    check_real(owner, "rate", spec.rate, MIN_RATE, allow_inf=True, error=WorkloadError)
    check_real(owner, "burstiness", spec.burstiness, MIN_BURSTINESS, 1e6, error=WorkloadError)
    if spec.burstiness != 1.0 and math.isinf(spec.rate):
        raise WorkloadError(f"{owner}: burstiness={spec.burstiness:g} would be ignored: it shapes the gaps between "
                            f"arrivals, and an infinite rate has every request arrive at once (give a rate)")
    check_real(owner, "range_ratio", spec.range_ratio, 0.0, 0.999)
    ignored = [name for name, presets in LENGTH_FIELDS.items()
               if spec.preset not in presets and getattr(spec, name) != SYNTHETIC_DEFAULTS[name]]
    if ignored:
        raise WorkloadError(f"{owner}: {', '.join(ignored)} would be ignored: the {spec.preset} preset does not read "
                            f"{'it' if len(ignored) == 1 else 'them'} (they shape the "
                            f"{' and '.join(sorted(set().union(*(LENGTH_FIELDS[n] for n in ignored))))} presets' lengths)")
    draws = spec.preset in ("sharegpt", "alpaca") or spec.preset == "random" and spec.range_ratio > 0 \
        or not math.isinf(spec.rate) or spec.n > 1
    if spec.seed != 0 and not draws:
        raise WorkloadError(f"{owner}: seed={spec.seed} would be ignored: this {spec.preset} workload draws nothing at "
                            f"random (fixed lengths, every request at t = 0, one sample each)")
    if spec.n > 1 and spec.beam_width > 1:
        raise InputError(f"SyntheticSpec: n={spec.n} and beam_width={spec.beam_width}: a request samples or beam-"
                         f"searches, not both")
    if spec.max_model_len is not None and spec.max_model_len <= spec.shared_prefix_tokens + 1:
        raise InputError(f"max_model_len={spec.max_model_len} leaves no room after the shared prefix")


def _lognormal(rng, mean: float, sigma: float, count: int, low: int, high: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, count)), low, high).astype(np.int64)


def _uniform_around(rng, length: int, ratio: float, count: int) -> np.ndarray:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, count)


def _resample_outputs(rng, spec: SyntheticSpec, outputs: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """Independent output lengths for samples 2..n of each request, from the same distribution."""
    fixed = spec.preset == "fixed" or spec.preset == "random" and spec.range_ratio == 0  # the same lengths again
    extra = synthetic_workload(SyntheticSpec(**{**_spec_dict(spec), "n": 1, "seed": 0 if fixed else spec.seed + 7919,
                                                "num_requests": len(outputs) * (spec.n - 1),
                                                "shared_prefix_tokens": 0})).output_tokens
    limit = (spec.max_model_len or 1 << 62) - prompts
    return np.minimum(extra.reshape(len(outputs), spec.n - 1), limit[:, None])


def _spec_dict(spec: SyntheticSpec) -> dict:
    return {name: getattr(spec, name) for name in SyntheticSpec.__dataclass_fields__}


# ---- traces ---------------------------------------------------------------------------------------------------------
@entry_point
def load_trace(path: str | Path, time_scale: float = 1.0, max_rows: int | None = None, fmt: str | None = None) -> Workload:
    """Load a trace file: Azure LLM CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``), Mooncake JSONL
    (``timestamp`` ms, ``input_length``, ``output_length``, and ``hash_ids`` in every row or none: without them no
    prompt shares a prefix) or generic CSV
    (``arrival_time_s,prompt_tokens,output_tokens``). Arrival offsets are multiplied by ``time_scale``."""
    path = Path(path)
    if path.is_dir():  # a FileNotFoundError as a missing file is: callers catch one type
        raise FileNotFoundError(f"{path} is a folder, not a trace file (CSV or JSONL)")
    if path.exists() and not path.is_file():
        raise TraceFormatError(f"{path}: not a regular file (a pipe or a device: a trace is read more than once); "
                               f"save it to a file first")
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    check_real("load_trace", "time_scale", time_scale, 0.0, 1e9, low_open=True)
    check_int("load_trace", "max_rows", max_rows, 1, optional=True)
    fmt = fmt or detect_format(path)
    loaders = {"azure": _load_azure, "mooncake": _load_mooncake, "generic": _load_generic}
    if fmt not in loaders:
        raise InputError(f"trace format must be one of {', '.join(loaders)}; got {fmt!r}")
    workload = loaders[fmt](path, max_rows)
    largest = float(np.abs(workload.arrival_s).max())
    if math.isfinite(largest) and np.spacing(largest) > ARRIVAL_RESOLUTION_S:
        raise TraceFormatError(f"{path}: arrival times as large as {largest:.6g} s are stored to "
                               f"{np.spacing(largest):.2g} s only (floating point), so nearby arrivals would merge; "
                               f"give the times as offsets from an origin closer to them")
    with np.errstate(over="ignore"):  # an overflow to inf is named by check()
        workload.arrival_s = (workload.arrival_s - workload.arrival_s[0]) * time_scale
    return workload.check()


@entry_point
def at_mean_rate(workload: Workload, rate: float) -> Workload:
    """``workload`` with its arrival offsets scaled so that requests arrive ``rate`` per second on average (a trace
    replayed at another load, its burstiness kept); ``inf``, or no two distinct arrival times, leaves it as it is."""
    check_real("at_mean_rate", "rate", rate, MIN_RATE, allow_inf=True, error=WorkloadError)
    if math.isinf(rate):
        return workload
    if len(workload) < 2 or workload.arrival_s[-1] <= workload.arrival_s[0]:
        raise WorkloadError(f"a rate of {rate:g} requests/s would be ignored: {workload.name!r} has "
                            f"{'one request' if len(workload) < 2 else 'every arrival at one time'}, so there is no "
                            f"mean rate to rescale (give it arrivals, or no rate)")
    natural = (len(workload) - 1) / float(workload.arrival_s[-1] - workload.arrival_s[0])
    offsets = workload.arrival_s - workload.arrival_s[0]
    return dataclasses.replace(workload, arrival_s=workload.arrival_s[0] + offsets * (natural / rate)).check()


@entry_point
def load_trace_bytes(data: bytes, name: str, time_scale: float = 1.0, max_rows: int | None = None) -> Workload:
    """Load an uploaded trace (its bytes and file name); errors name the file as uploaded."""
    import tempfile

    suffix = Path(name).suffix or ".csv"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"upload{suffix}"
        path.write_bytes(data)
        try:
            workload = load_trace(path, time_scale=time_scale, max_rows=max_rows)
        except TraceFormatError as exc:
            raise TraceFormatError(str(exc).replace(str(path), name)) from None
    workload.name, workload.source = Path(name).stem, name
    return workload


def detect_format(path: Path) -> str:
    """``mooncake`` for JSON lines, else ``azure`` or ``generic`` by the CSV header."""
    with open(path, "rb") as handle:
        head = handle.readline(4096)
    _check_start(path, head)
    if head.lstrip().startswith(b"{"):
        return "mooncake"
    return "azure" if b"ContextTokens" in head else "generic"


def _check_start(path: Path, head: bytes) -> None:
    """Name an empty file or a blank first line instead of misreading it (its encoding is ``user_files``')."""
    if not head:
        raise TraceFormatError(f"{path}: the file is empty")
    if not head.strip() and not head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise TraceFormatError(f"{path}: line 1 is blank; the header (CSV) or the first record (JSONL) must be on "
                               f"line 1")


def _read_text(path: Path) -> str:
    """The trace's text, read by the one reader of user files (strict UTF-8, bounded size)."""
    text = user_files.read_text(path, TraceFormatError)
    _check_start(path, text.split("\n", 1)[0].encode())
    return text


def _read_csv(path: Path, columns: list[str], max_rows: int | None) -> pd.DataFrame:
    """The CSV's rows as strings, read strictly by ``lab.user_files.csv_frame`` (distinct column names holding
    ``columns``, every row as many fields as the header), indexed by file line."""
    return user_files.csv_frame(_read_text(path), str(path), TraceFormatError, tuple(columns), max_rows)[columns]


def _numeric_column(path: Path, frame: pd.DataFrame, column: str, positive: bool, first_row: int = 2) -> np.ndarray:
    """Column as float64; the error names the first bad row (file line numbers: header is line 1)."""
    values = pd.to_numeric(frame[column].str.strip(), errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        row = int(np.argmax(bad))
        raise TraceFormatError(f"{path}: row {row + first_row}, column {column}: "
                               f"{shown(frame[column].iloc[row])} is not a finite number")
    bad = values <= 0 if positive else values < 0
    if bad.any():
        row = int(np.argmax(bad))
        need = "> 0" if positive else ">= 0"
        raise TraceFormatError(f"{path}: row {row + first_row}, column {column}: {values[row]:g} must be {need}")
    return values


def _integer_lengths(path: Path, values: np.ndarray, column: str, first_row: int = 2) -> np.ndarray:
    bad = values != np.floor(values)
    if bad.any():
        row = int(np.argmax(bad))
        raise TraceFormatError(f"{path}: row {row + first_row}, column {column}: {values[row]:g} is not a whole number")
    bad = values > MAX_TRACE_TOKENS
    if bad.any():
        row = int(np.argmax(bad))
        raise TraceFormatError(f"{path}: row {row + first_row}, column {column}: {values[row]:g} tokens is more than "
                               f"{MAX_TRACE_TOKENS} (int32)")
    return values.astype(np.int64)


def _check_sorted(path: Path, times: np.ndarray, column: str, first_row: int = 2) -> None:
    bad = np.diff(times) < 0
    if bad.any():
        row = int(np.argmax(bad)) + 1
        raise TraceFormatError(f"{path}: row {row + first_row}, column {column}: arrival times are not sorted "
                               f"(earlier than the row before)")


# The Azure LLM inference traces' TIMESTAMP: a date and a time of day, e.g. 2023-11-16 18:15:46.6805900.
AZURE_TIMESTAMP = r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:?\d{2})?"


def _load_azure(path: Path, max_rows: int | None) -> Workload:
    frame = _read_csv(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], max_rows)
    malformed = ~frame["TIMESTAMP"].str.strip().str.fullmatch(AZURE_TIMESTAMP)
    if malformed.any():
        row = int(np.argmax(malformed.to_numpy()))
        raise TraceFormatError(f"{path}: row {row + 2}, column TIMESTAMP: {shown(frame['TIMESTAMP'].iloc[row])} is "
                               f"not a date and time like 2023-11-16 18:15:46.6805900")
    text = frame["TIMESTAMP"].str.strip()
    zoned = text.str.contains(r"(?:Z|[+-]\d\d:?\d\d)$", regex=True)
    if zoned.any() and not zoned.all():
        row = int(np.argmax((zoned != zoned.iloc[0]).to_numpy()))
        raise TraceFormatError(f"{path}: row {row + 2}, column TIMESTAMP: {shown(text.iloc[row])} "
                               f"{'gives' if zoned.iloc[row] else 'lacks'} a time zone where row 2 "
                               f"{'does not' if zoned.iloc[row] else 'does'}: give every row one, or none")
    try:  # times with zones (a trace across a daylight-saving change) are compared in UTC
        stamps = pd.to_datetime(text, errors="coerce", format="ISO8601", utc=bool(zoned.all()))
    except ValueError as exc:
        raise TraceFormatError(f"{path}: column TIMESTAMP: {exc}") from None
    if stamps.isna().any():
        row = int(np.argmax(stamps.isna().to_numpy()))
        raise TraceFormatError(f"{path}: row {row + 2}, column TIMESTAMP: {shown(frame['TIMESTAMP'].iloc[row])} "
                               f"is not a valid date and time")
    _check_span(path, frame, stamps)
    times = (stamps - stamps.iloc[0]).dt.total_seconds().to_numpy()
    _check_sorted(path, times, "TIMESTAMP")
    prompts = _integer_lengths(path, _numeric_column(path, frame, "ContextTokens", True), "ContextTokens")
    outputs = _integer_lengths(path, _numeric_column(path, frame, "GeneratedTokens", True), "GeneratedTokens")
    return Workload(path.stem, times, prompts, outputs, source=str(path))


def _check_span(path: Path, frame: pd.DataFrame, stamps: pd.Series) -> None:
    """Refuse a timestamp centuries from the first before subtracting them (past ~292 years the nanosecond
    difference overflows int64); ``Workload.check`` holds arrivals to the exact bound (``MAX_ARRIVAL_S``)."""
    years = stamps.dt.year.to_numpy()
    far = np.abs(years - years[0]) > MAX_ARRIVAL_S / YEAR_S + 1
    if far.any():
        row = int(np.argmax(far))
        raise TraceFormatError(f"{path}: row {row + 2}, column TIMESTAMP: {shown(frame['TIMESTAMP'].iloc[row])} is "
                               f"{abs(int(years[row]) - int(years[0]))} years from the first request "
                               f"({shown(frame['TIMESTAMP'].iloc[0])}); arrivals must lie within "
                               f"{MAX_ARRIVAL_S / YEAR_S:.0f} years of it")


def _load_generic(path: Path, max_rows: int | None) -> Workload:
    frame = _read_csv(path, ["arrival_time_s", "prompt_tokens", "output_tokens"], max_rows)
    times = _numeric_column(path, frame, "arrival_time_s", positive=False)
    _check_sorted(path, times, "arrival_time_s")
    prompts = _integer_lengths(path, _numeric_column(path, frame, "prompt_tokens", True), "prompt_tokens")
    outputs = _integer_lengths(path, _numeric_column(path, frame, "output_tokens", True), "output_tokens")
    return Workload(path.stem, times, prompts, outputs, source=str(path))


def _load_mooncake(path: Path, max_rows: int | None) -> Workload:
    times, prompts, outputs, block_ids, first_line = [], [], [], [], 0
    for line_no, line in user_files.lines(_read_text(path)):
        if max_rows is not None and len(times) >= max_rows:
            break
        if not line.strip():
            continue
        record = _mooncake_record(path, line_no, line)
        if block_ids and (block_ids[0] is None) != (record[3] is None):
            raise TraceFormatError(f"{path}: row {line_no}, column hash_ids: "
                                   f"{'missing' if record[3] is None else 'given'} here but not in row "
                                   f"{first_line} (give every row its hash_ids, or none)")
        first_line = first_line or line_no
        times.append(record[0])
        prompts.append(record[1])
        outputs.append(record[2])
        block_ids.append(record[3])
    if not times:
        raise TraceFormatError(f"{path}: the file is empty")
    arrival = np.asarray(times, dtype=np.float64) / 1000.0
    _check_sorted(path, arrival, "timestamp", first_row=1)
    return Workload(path.stem, arrival, np.asarray(prompts, np.int64), np.asarray(outputs, np.int64),
                    prompt_block_ids=None if block_ids[0] is None else _dense_ids(block_ids), source=str(path))


def _dense_ids(block_ids: list[list[int]]) -> list[list[int]]:
    """Each distinct hash id as its rank of first appearance (0, 1, ...): equal ids stay equal, distinct ones stay
    distinct, and token ids built from them stay small (int64 hash ids times the block size would overflow)."""
    rank: dict[int, int] = {}
    return [[rank.setdefault(h, len(rank)) for h in ids] for ids in block_ids]


def _mooncake_record(path: Path, line_no: int, line: str):
    record = user_files.loads_json(line, str(path), TraceFormatError, line=line_no)
    if not isinstance(record, dict):
        raise TraceFormatError(f"{path}: row {line_no}: expected a JSON object")
    values = []
    for column, positive in (("timestamp", False), ("input_length", True), ("output_length", True)):
        value = record.get(column)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TraceFormatError(f"{path}: row {line_no}, column {column}: {shown(value)} is not a finite number")
        if value < 0 or (positive and value == 0) or (column != "timestamp" and value != int(value)):
            raise TraceFormatError(f"{path}: row {line_no}, column {column}: {shown(value)} must be a "
                                   f"{'positive whole number' if positive else 'number >= 0'}")
        if column != "timestamp" and value > MAX_TRACE_TOKENS:
            raise TraceFormatError(f"{path}: row {line_no}, column {column}: {value!r} tokens is more than "
                                   f"{MAX_TRACE_TOKENS} (int32)")
        values.append(value)
    if "hash_ids" not in record:  # no prefix information: nothing shared
        return values[0], int(values[1]), int(values[2]), None
    hash_ids = record["hash_ids"]
    expected = math.ceil(values[1] / MOONCAKE_BLOCK_TOKENS)
    if not isinstance(hash_ids, list) or len(hash_ids) != expected or \
            not all(type(h) is int and -2**63 <= h < 2**63 for h in hash_ids):
        raise TraceFormatError(f"{path}: row {line_no}, column hash_ids: expected {expected} int64 block ids for "
                               f"input_length {int(values[1])}")
    return values[0], int(values[1]), int(values[2]), hash_ids
