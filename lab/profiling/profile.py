"""Profile the real engine and fit a step-time model the simulator can run on (the digital twin's clock).

``profile_engine`` runs designed workloads through ``LLMEngine`` — single prefills of several lengths with and
without a cached prefix, decode batches of several sizes x context lengths and of every size up to a ladder's top,
chunked steps that mix the two, and copy-on-write of parallel samples — each on a fresh engine whose free blocks are
scattered as a serving engine's are, and records every step's plan quantities and measured duration. After warm-up,
steps with identical quantities are repeats; their mean is one sample (a run's makespan and TPOT are sums of step
times, which follow the mean of a CPU's right-skewed step times, not their median). A non-negative least-squares
fit of ``duration = sum(coefficient x feature)`` (linear in the quantities, piecewise-linear in the decode batch size)
gives the ``Profile``'s coefficients; its error is reported on held-out samples.
"""
from __future__ import annotations

import bisect
import json
import math
import operator
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from lab import user_files
from lab.errors import LabError
from lab.files import write_text_atomically

QUANTITIES = ("constant", "prefill_seqs", "prefill_tokens", "decode_seqs", "prefill_attention_pairs",
              "decode_kv_tokens", "decode_padded_kv_tokens", "copied_blocks", "swapped_blocks", "idle_s",
              "previous_prefill_tokens", "prefill_logit_rows")
# The decode batch and the prompt chunks that sample (``prefill_logit_rows``) enter only through the piecewise-linear
# term of the step's logit rows (``design_row``): they are the rows of one LM-head GEMM; ``idle_s`` only through the
# piecewise-linear idle term.
LINEAR = tuple(name for name in QUANTITIES if name not in ("decode_seqs", "prefill_logit_rows", "idle_s"))
PREFILL_TOKENS, DECODE_SEQS = QUANTITIES.index("prefill_tokens"), QUANTITIES.index("decode_seqs")
PREVIOUS_PREFILL_TOKENS = QUANTITIES.index("previous_prefill_tokens")
PREFILL_LOGIT_ROWS, IDLE_S = QUANTITIES.index("prefill_logit_rows"), QUANTITIES.index("idle_s")
LINEAR_INDICES = tuple(QUANTITIES.index(name) for name in LINEAR)
# Per-step fixed costs of the prefill and decode paths, and of the decode right after a prefill (its activations
# evicted what the next step reads): docs/digital_twin.md, "Why the profile has these features".
STEP_FEATURES = ("prefill_step", "decode_step", "after_prefill_step")
PROFILE_VERSION = 9
STALL_RATIO = 3.0  # a step's repeat this many times its fastest was stalled (``steady_mean``)
# A step after an idle pause runs slower, more the longer the pause, up to a plateau: the idle time enters
# piecewise-linearly on these knots (docs/digital_twin.md).
IDLE_KNOTS_S = (0.002, 0.01, 0.25)
IDLE_FEATURES = tuple(f"after_idle@{knot * 1e3:g}ms" for knot in IDLE_KNOTS_S)
# The step quantities a run may take beyond the profile's grid (``Profile.beyond_measured``), and by how much before
# that is reported: the fit is linear in them, so within the grid it interpolates and beyond it extrapolates.
# ``decode_context`` (last) is the longest decoding sequence's KV length in blocks' slots (padded tokens / sequences):
# a batch's total can sit inside the grid while one sequence's context is far longer than any the grid decoded.
RANGE_QUANTITIES = ("prefill_tokens", "prefill_attention_pairs", "decode_seqs", "decode_kv_tokens", "copied_blocks",
                    "swapped_blocks", "decode_context")
EXTRAPOLATION_MARGIN = 0.1
_RANGE_INDICES = tuple(QUANTITIES.index(name) for name in RANGE_QUANTITIES[:-1])
_PADDED_KV_TOKENS = QUANTITIES.index("decode_padded_kv_tokens")


def extrapolation_warning(beyond: str) -> str:
    """The sentence a CLI or page shows for ``Profile.beyond_measured``'s (non-empty) answer."""
    return f"steps beyond what the profile measured, priced by extrapolation: {beyond}"


def range_quantities(quantities: list[float]) -> list[float]:
    """A step's ``RANGE_QUANTITIES`` from its ``QUANTITIES`` (on every profile-priced step: index look-ups only)."""
    return [*(quantities[i] for i in _RANGE_INDICES), _decode_context(quantities)]


def _decode_context(quantities: list[float]) -> float:
    seqs = quantities[DECODE_SEQS]
    return quantities[_PADDED_KV_TOKENS] / seqs if seqs else 0.0


# ``fit`` re-solves this many times with each row's relative error taken against its fitted duration
REWEIGHTINGS, MIN_FITTED_S = 3, 1e-6


MAX_COEFFICIENT = 1e3  # seconds per unit of a step feature: more is a corrupt file, and would overflow the clock


class ProfileError(LabError):
    """A profile file is malformed, or does not match the model or block size it is used with."""


def plan_quantities(out, block_size: int, idle_s: float = 0.0, previous_prefill_tokens: int = 0) -> list[float]:
    """What the step-time model reads from one step's plan (``lab.sched.scheduler.SchedulerOutput``), in ``QUANTITIES``
    order. ``decode_padded_kv_tokens`` is the decode batch padded to its longest sequence's blocks: what a backend
    that gathers a rectangular batch (the torch one) reads, while ``decode_kv_tokens`` is what a per-sequence kernel
    reads. ``idle_s``: the seconds the executor sat idle (had nothing to run) before this step, 0 back to back;
    ``previous_prefill_tokens``: the tokens the step before this one prefilled; ``prefill_logit_rows``: the prompt
    chunks that complete their prompt, whose last position goes through the LM head (a group's forks share one)."""
    swapped = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
    padded = out.num_decode_seqs * -(-out.decode_max_kv_len // block_size) * block_size
    chunks = out.prefill_chunks
    return [1.0, float(len(chunks)), float(out.num_prefill_tokens), float(out.num_decode_seqs),
            float(out.prefill_attention_pairs), float(out.decode_kv_tokens), float(padded),
            float(len(out.blocks_to_copy)), float(swapped), float(idle_s), float(previous_prefill_tokens),
            float(sum(1 for chunk in chunks if chunk.samples) if chunks else 0)]


def steady_mean(times: list[float]) -> tuple[float, int]:
    """The mean of one step shape's measured durations leaving out the stalled ones, and how many were left out: a
    repeat more than ``STALL_RATIO`` times the fastest was held up by something outside the step (a descheduled
    process, a pause). Noise on a CPU makes a step slower, never three times faster; one 192-token prefill after an
    idle pause timed at 240 ms among repeats of 4-5 ms made the mean 123 ms, and the fit priced every step after a
    pause up to 60 ms longer (the after-idle term, which that shape alone measured with one other)."""
    bound = STALL_RATIO * min(times)
    kept = [t for t in times if t <= bound]
    return statistics.fmean(kept), len(times) - len(kept)


def grouped_samples(groups: dict[tuple, list[float]], sources: dict[tuple, list[str]]) -> list[dict]:
    """The fit's samples: per step shape (``QUANTITIES``), its ``steady_mean`` duration, its repeats (those left out
    as stalled counted apart) and the scenarios that measured it, the first one naming it."""
    samples = []
    for key, times in groups.items():
        duration, stalled = steady_mean(times)
        samples.append({"quantities": list(key), "duration_s": duration, "repeats": len(times) - stalled,
                        "stalled": stalled, "scenario": sources[key][0], "scenarios": sources[key]})
    return samples


def feature_names(knots: list[int]) -> tuple[str, ...]:
    """The model's features: the linear quantities, ``STEP_FEATURES``, one ``after_idle@<ms>`` per pause of
    ``IDLE_KNOTS_S``, then one ``logit_rows@k`` per knot of the logit-rows term."""
    return LINEAR + STEP_FEATURES + IDLE_FEATURES + tuple(f"logit_rows@{k}" for k in knots)


def hat_weights(value: float, knots, flat_beyond: bool = False) -> list[float]:
    """``value`` spread over hat functions on ``knots`` (increasing, > 0): linear through the origin below the first
    knot, shared by the two knots around it between them, and beyond the last knot linear through the origin on it
    (or 1 on it, ``flat_beyond``). All zeros for a value <= 0."""
    weights = [0.0] * len(knots)
    if value <= 0:
        return weights
    if value <= knots[0] or value >= knots[-1]:
        end = 0 if value <= knots[0] else -1
        weights[end] = 1.0 if end == -1 and flat_beyond else value / knots[end]
        return weights
    upper = bisect.bisect_right(knots, value)
    low, high = knots[upper - 1], knots[upper]
    weights[upper - 1], weights[upper] = (high - value) / (high - low), (value - low) / (high - low)
    return weights


def design_row(quantities: list[float], knots: list[int]) -> list[float]:
    """One row of the fit's design matrix. The step's logit rows (decode sequences plus prompt chunks that sample)
    enter piecewise-linearly (hat functions on the knots, linear through the origin below the first and beyond the
    last): per-row work (the LM head, sampling) does not cost the same per row at every count on real hardware (a
    CPU's BLAS changes kernels with the row count; a GPU fills its tiles), so a straight line misses by 40 % at some
    counts. A prompt's last row goes through the same LM-head GEMM as a decode row: on the 0.6B shapes (MKL, AMD
    EPYC) two prompts of 32 tokens took 134 ms to prefill and one of 64 took 100 (the LM head's 1 -> 2 rows), while
    a model with a linear per-prompt cost and the decode batch alone in the hats missed mixed chunked steps by up to
    +32 % and -18 % (7 decodes + 1 completing prompt is 8 rows, cheaper than 7 on that BLAS). The idle time before
    the step enters the same way, on ``IDLE_KNOTS_S``, flat beyond the last."""
    linear = [quantities[index] for index in LINEAR_INDICES]
    linear += [1.0 if quantities[PREFILL_TOKENS] > 0 else 0.0,  # STEP_FEATURES
               1.0 if quantities[DECODE_SEQS] > 0 else 0.0,
               1.0 if quantities[PREVIOUS_PREFILL_TOKENS] > 0 else 0.0]
    idle = hat_weights(quantities[IDLE_S], IDLE_KNOTS_S, flat_beyond=True)
    return linear + idle + hat_weights(quantities[DECODE_SEQS] + quantities[PREFILL_LOGIT_ROWS], knots)


@dataclass(slots=True)
class Profile:
    """A fitted step-time model with where it was measured. ``samples`` are ``{"quantities": [...] (QUANTITIES
    order), "duration_s": mean, "repeats": n, "holdout": bool}``; ``coefficients`` are keyed by
    ``feature_names(decode_knots)``; ``add_request_s``: the mean time ``LLMEngine.add_request`` took a request."""

    model: str
    device: str
    dtype: str
    block_size: int
    backend: str
    coefficients: dict[str, float]
    decode_knots: list[int] = field(default_factory=lambda: [1])
    samples: list[dict] = field(default_factory=list)
    holdout_median_rel_error: float = math.nan
    holdout_max_rel_error: float = math.nan
    version: int = PROFILE_VERSION
    # seconds of the engine's ``add_request`` per request: between steps, it delays the next one (34 us on the tiny
    # model on a CPU: 128 requests at t = 0 put the first step 4.3 ms late, 0.7 % of the saturated twin's makespan;
    # 1.2 % of a light load's TTFT). 0 in profiles written before it was measured.
    add_request_s: float = 0.0

    def step_time(self, out, idle_s: float = 0.0, previous_prefill_tokens: int = 0) -> float:
        """Predicted seconds of the step planned in ``out`` (``idle_s``, ``previous_prefill_tokens``: see
        ``plan_quantities``)."""
        return self.predictor()(out, idle_s, previous_prefill_tokens)

    def predictor(self, highest: list[float] | None = None) -> Callable[..., float]:
        """``step_time`` with the coefficients laid out once (the simulator calls it every step). With ``highest``
        (``RANGE_QUANTITIES`` order, zeros to start), each priced step raises its entries to the step's: what
        ``beyond_measured`` compares with the profile's range."""
        time_of, block_size = self.quantities_predictor(), self.block_size

        def step_time(out, idle_s: float = 0.0, previous_prefill_tokens: int = 0) -> float:
            quantities = plan_quantities(out, block_size, idle_s, previous_prefill_tokens)
            if highest is not None:
                highest[:] = map(max, highest, range_quantities(quantities))
            return time_of(quantities)
        return step_time

    def beyond_measured(self, highest: list[float]) -> str:
        """The ``RANGE_QUANTITIES`` (``highest``, as ``predictor`` keeps them) that went more than
        ``EXTRAPOLATION_MARGIN`` beyond every step the profile measured, e.g. ``decode_context up to 20,480 (measured
        up to 4,096)``: step prices there are extrapolated from the fit (a long context's attention can cost more per
        token once it leaves the CPU's caches). "" when every step was inside the measured range."""
        measured = self.measured_range()
        return "; ".join(f"{name} up to {top:,.0f} (measured up to {limit:,.0f})"
                         for name, top, limit in zip(RANGE_QUANTITIES, highest, measured)
                         if top > limit * (1 + EXTRAPOLATION_MARGIN))

    def measured_range(self) -> list[float]:
        """The largest of each ``RANGE_QUANTITIES`` over the profile's samples (zeros without samples)."""
        rows = [sample["quantities"] for sample in self.samples]
        if not rows:
            return [0.0] * len(RANGE_QUANTITIES)
        top = list(map(max, *rows)) if len(rows) > 1 else list(rows[0])  # column maxima, in C (once a simulation)
        return [top[index] for index in _RANGE_INDICES] + [max(map(_decode_context, rows))]

    def quantities_predictor(self) -> Callable[[list[float]], float]:
        """The fitted seconds of a step given its quantities (``QUANTITIES`` order, as samples hold them)."""
        knots = list(self.decode_knots)
        vector = [self.coefficients[name] for name in feature_names(knots)]

        def time_of(quantities: list[float]) -> float:
            return sum(map(operator.mul, vector, design_row(quantities, knots)))
        return time_of

    def scenario_errors(self) -> pd.DataFrame:
        """Per scenario: its samples, the median measured and fitted step time, and the signed relative error of
        the fitted median (where the fit misses, and whether short and long scenarios ran alike). A step shape that
        several scenarios produced (a decode scenario's first step is a multi-prompt prefill) counts in each."""
        step_time, rows = self.quantities_predictor(), {}
        for sample in self.samples:
            pair = (sample["duration_s"], step_time(sample["quantities"]))
            for name in sample.get("scenarios") or [sample.get("scenario", "?")]:
                rows.setdefault(name, []).append(pair)
        table = pd.DataFrame([{"scenario": name, "samples": len(pairs),
                               "measured_s": statistics.median(m for m, _ in pairs),
                               "fitted_s": statistics.median(f for _, f in pairs)} for name, pairs in rows.items()])
        table["rel_error"] = table["fitted_s"] / table["measured_s"] - 1
        return table

    def check_matches(self, model: str | None = None, block_size: int | None = None, device: str | None = None,
                      dtype: str | None = None, backend: str | None = None) -> None:
        """Raise ``ProfileError`` when the profile was measured for another model or block size, or (given) on
        another kind of device (``cpu``, ``cuda``), dtype (``torch.bfloat16``) or attention backend."""
        if model is not None and str(model) != self.model:
            raise ProfileError(f"the profile was measured on model {self.model!r}, not {str(model)!r}")
        if block_size is not None and block_size != self.block_size:
            raise ProfileError(f"the profile was measured with block_size {self.block_size}, not {block_size}")
        measured = (self.device.split(":")[0], self.dtype, self.backend)
        for name, here, there in zip(("device", "dtype", "attention backend"), (device, dtype, backend), measured):
            if here is not None and here != there:
                raise ProfileError(f"the profile was measured with {name} {there}, but this engine runs {here}: "
                                   f"its step times do not price this engine (profile it here)")

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path``, creating its folders (``--out`` checked that they can be)."""
        write_text_atomically(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read and check a profile file (through ``lab.user_files``); ``ProfileError`` names what is wrong."""
        return cls.from_bytes(user_files.read_bytes(path, ProfileError, user_files.MAX_SETTINGS_BYTES), str(path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> "Profile":
        """A profile from a file's bytes (an upload), read strictly by ``lab.user_files``; ``ProfileError`` names
        ``name`` and what is wrong."""
        text = user_files.decode(data, name, ProfileError, user_files.MAX_SETTINGS_BYTES)
        return cls.from_dict(user_files.loads_json(text, name, ProfileError), name)

    @classmethod
    def from_dict(cls, data, name: str = "profile") -> "Profile":
        if not isinstance(data, dict):
            raise ProfileError(f"{name}: expected a JSON object")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{name}: profile version {data.get('version')!r}, this lab reads {PROFILE_VERSION}")
        for key, kind in (("model", str), ("device", str), ("dtype", str), ("backend", str), ("block_size", int),
                          ("coefficients", dict), ("decode_knots", list), ("samples", list)):
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise ProfileError(f"{name}: field {key!r} must be a {kind.__name__}, got {data.get(key)!r:.60}")
        knots = data["decode_knots"]
        if not knots or not all(type(k) is int and k >= 1 for k in knots) or knots != sorted(set(knots)):
            raise ProfileError(f"{name}: decode_knots must be increasing integers >= 1, got {knots!r:.60}")
        coefficients, names = data["coefficients"], feature_names(knots)
        if set(coefficients) != set(names) or not all(_is_number(v) and 0 <= v <= MAX_COEFFICIENT
                                                      for v in coefficients.values()):
            raise ProfileError(f"{name}: coefficients must be numbers in [0, {MAX_COEFFICIENT:g}] (seconds per unit) "
                               f"for exactly {', '.join(names)}")
        if not any(coefficients.values()):
            raise ProfileError(f"{name}: every coefficient is 0, which prices every step at 0 s (a clock that never "
                               f"advances); measure one with `python -m lab profile`")
        if data["block_size"] < 1:
            raise ProfileError(f"{name}: block_size must be >= 1")
        if not _is_number(data.get("add_request_s", 0.0)) or data.get("add_request_s", 0.0) < 0:
            raise ProfileError(f"{name}: add_request_s must be a finite number >= 0, got {data['add_request_s']!r:.60}")
        for index, sample in enumerate(data["samples"]):
            if not _is_sample(sample):
                raise ProfileError(f"{name}: sample {index} must hold {len(QUANTITIES)} numeric quantities "
                                   f"({', '.join(QUANTITIES)}) and a duration_s > 0, got {sample!r:.80}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_sample(sample) -> bool:
    if not isinstance(sample, dict) or not _is_number(sample.get("duration_s")) or sample["duration_s"] <= 0:
        return False
    quantities = sample.get("quantities")
    return isinstance(quantities, list) and len(quantities) == len(QUANTITIES) and all(map(_is_number, quantities))


def fit(samples: list[dict], knots: list[int], holdout_fraction: float = 0.2,
        seed: int = 0) -> tuple[dict[str, float], float, float]:
    """Non-negative least squares of ``duration = sum(coefficient x feature)`` on relative error, each scenario's
    samples (``sample["scenario"]``; without it a sample is its own) weighing as much as another scenario's. Relative,
    not absolute: a serving run is mostly short decode steps, and an absolute-error fit, led by the long prefills,
    overestimates them by 10-20 % on a CPU, which the twin's TPOT shows. Each row's error is relative to its fitted
    duration, not its measured one (first solved against the measurement, then reweighted ``REWEIGHTINGS`` times):
    dividing by the measurement discounts exactly the slow repeats, and that fit came out 3-5 % below the mean step
    time. Returns the coefficients fitted on every sample and the median and max relative error on a held-out
    fraction (fitted without it)."""
    from scipy.optimize import nnls

    features = np.array([design_row(s["quantities"], knots) for s in samples], dtype=np.float64)
    durations = np.array([s["duration_s"] for s in samples], dtype=np.float64)
    rng = np.random.default_rng(seed)
    holdout = rng.random(len(samples)) < holdout_fraction
    if holdout.all() or not holdout.any():
        holdout = np.zeros(len(samples), dtype=bool)
        holdout[rng.integers(len(samples))] = True
    for sample, held in zip(samples, holdout):
        sample["holdout"] = bool(held)

    # every scenario weighs the same in total (a decode scenario yields a sample per step, a prefill one a single
    # sample: counted per sample, the fit served decode steps and left prefills 20-30 % low)
    scenarios = [s.get("scenario", index) for index, s in enumerate(samples)]
    counts = Counter(scenarios)
    balance = np.array([1.0 / math.sqrt(counts[name]) for name in scenarios])

    def solve(rows):
        scale = features[rows].max(axis=0)
        scale[scale == 0] = 1.0
        weights = balance[rows] / durations[rows]
        for _ in range(REWEIGHTINGS + 1):
            solution, _ = nnls(features[rows] / scale * weights[:, None], durations[rows] * weights)
            weights = balance[rows] / np.maximum(features[rows] @ (solution / scale), MIN_FITTED_S)
        return solution / scale

    trained = solve(~holdout)
    errors = np.abs(features[holdout] @ trained - durations[holdout]) / durations[holdout]
    coefficients = solve(np.ones(len(samples), dtype=bool))
    return dict(zip(feature_names(knots), map(float, coefficients))), float(np.median(errors)), float(errors.max())


# ---- measuring the engine -----------------------------------------------------------------------------------------
# glibc's mallopt parameters (malloc.h) and the values steady_state_allocator sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES, MMAP_ABOVE_BYTES = 256 << 20, 32 << 20


def steady_state_allocator() -> bool:
    """Make freed host memory stay in this process for reuse (glibc ``mallopt``: blocks up to 32 MiB from the heap,
    the heap trimmed only above 256 MiB free), as a long-running engine's allocator is once warm. Profiling builds
    a fresh engine per scenario, and by default glibc hands the large activations of each back to the system:
    measured on the tiny model, a profile round took ~130,000 page faults inside its timed steps (thousands per
    step of the 32- and 64-sequence scenarios, a fifth of their time), a long-lived engine's light run about none.
    Returns False where the C library has no ``mallopt`` (not glibc): nothing changed."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_ABOVE_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


GRIDS = ("full", "small", "quick")
# The decode batch sizes each grid measures on their own: the knots of the piecewise-linear logit-rows term
# (``small`` has every knot ``full`` has; why these: docs/digital_twin.md).
DECODE_KNOTS = (1, 2, 4, 8, 16, 32, 64)
DECODE_BATCHES = {"full": DECODE_KNOTS, "small": DECODE_KNOTS, "quick": (4,)}
# A batch's cost is not monotone in its size on a CPU (the BLAS picks its kernel by the row count), so a "ladder"
# scenario (requests of 2, 3, ..., ``LADDER`` + 1 output tokens) decodes every batch size from ``LADDER`` down to 1,
# one step each, and each of those sizes is a knot too.
DECODE_LADDER = {"full": 32, "small": 16, "quick": 0}


def decode_knots(grid: str) -> list[int]:
    """The knots of the logit-rows term a profile on ``grid`` fits: its decode batches and every ladder size."""
    return sorted(set(DECODE_BATCHES[grid]) | set(range(1, DECODE_LADDER[grid] + 1)))


def _scenarios(block_size: int, grid: str) -> list[tuple[str, dict, list[tuple[int, int, int]]]]:
    """(name, engine settings, requests as (prompt length, output tokens, samples n)). ``full``: the designed grid;
    ``small``: fewer and shorter contexts, for models whose prefills take seconds on a CPU; ``quick``: a handful
    (tests)."""
    if grid == "quick":
        return [("decode 4x32", {}, [(32, 4, 1)] * 4), ("decode 3x32 + 1x100", {}, [(32, 4, 1)] * 3 + [(100, 4, 1)]),
                ("prefill 64", {}, [(64, 1, 1)]),
                ("chunked", {"scheduling": "chunked", "max_num_batched_tokens": 48}, [(40, 4, 1)] * 2 + [(100, 2, 1)]),
                ("forks", {}, [(block_size + 1, 3, 2)]),
                ("swap", {"preemption_mode": "swap", "pool_fraction": 0.5}, [(24, 12, 1)] * 4)]
    small = grid == "small"
    batches, contexts = DECODE_BATCHES[grid], (32, 192) if small else (32, 128, 384)
    decode = [(f"decode {batch}x{context}", {}, [(context, 6, 1)] * batch) for batch in batches for context in contexts]
    # one long sequence among short ones: separates the padded batch from the tokens actually read
    mixed = ((32, 256),) if small else ((32, 384), (128, 512))
    decode += [(f"decode {batch - 1}x{short} + 1x{long}", {}, [(short, 6, 1)] * (batch - 1) + [(long, 6, 1)])
               for batch in ((8, 64) if small else (4, 16, 64)) for short, long in mixed]
    if not small:  # long contexts: a sequence's attention reads beyond the CPU's caches
        decode += [(f"decode {batch}x{context}", {}, [(context, 6, 1)] * batch)
                   for batch, context in ((1, 2048), (4, 2048), (1, 8192))]
    ladder = DECODE_LADDER[grid]
    decode.append((f"decode ladder {ladder}..1", {}, [(32, outputs, 1) for outputs in range(2, ladder + 2)]))
    lengths = (16, 64, 192, 384, 1024) if small else (16, 48, 128, 256, 512, 1024, 2048, 4096)
    prefill = [(f"prefill {length}", {}, [(length, 1, 1)]) for length in lengths]
    prefill += [(f"prefill {count} x {length}", {}, [(length, 1, 1)] * count)
                for count in ((8,) if small else (8, 32)) for length in ((64,) if small else (32, 128))]
    cached = [(f"prefill {length} after a cached prefix", {"cached_prefix": 128 if small else 256},
               [(length, 1, 1)]) for length in (32, 128)]
    chunked = [(f"chunked {batch} decodes + prompt", {"scheduling": "chunked", "max_num_batched_tokens": 96},
                [(64, 8, 1)] * batch + [(400 if not small else 200, 2, 1)]) for batch in ((8,) if small else (4, 16))]
    forks = [("parallel samples (copy-on-write)", {}, [(block_size * 3 + 1, 5, 4)] * 2)]
    # half the pool the requests need: sequences are swapped out to the host pool and back in as others finish
    swaps = [(f"swap preemption, {count} x 64 + 48", {"preemption_mode": "swap", "pool_fraction": 0.5},
              [(64, 48, 1)] * count) for count in (4, 16)]
    # a prompt arriving at an idle engine (the light-load case): its prefill after each pause of the idle term
    idle = [(f"prefill {length} after {pause * 1e3:g} ms idle", {"idle_s": pause}, [(length, 1, 1)])
            for pause in IDLE_KNOTS_S for length in (64, 192)]
    return decode + prefill + cached + chunked + forks + swaps + idle


def _longest_sequence(scenario: tuple[str, dict, list[tuple[int, int, int]]]) -> int:
    """The most tokens one sequence of a scenario holds: its cached prefix, its prompt and its outputs."""
    _, settings, requests = scenario
    return settings.get("cached_prefix", 0) + max(length + outputs for length, outputs, _ in requests)


class Profiler:
    """Profiling in rounds: each ``run_round`` runs every scenario once on a fresh engine (the first round is
    unmeasured warm-up); ``result`` fits the samples gathered so far. A caller that measures something else too can
    interleave its runs with the rounds, so a shared machine's slow spells fall on the profile and its runs alike."""

    def __init__(self, model="tiny", device: str | None = None, block_size: int = 16, backend: str = "auto",
                 seed: int = 0, grid: str = "full"):
        import torch

        from lab.engine.llm_engine import EngineConfig, load_model

        if grid not in GRIDS:
            raise ProfileError(f"grid must be one of {', '.join(GRIDS)}, got {grid!r}")
        steady_state_allocator()
        self.scenarios, self.grid, self.seed, self.model_name = _scenarios(block_size, grid), grid, seed, str(model)
        self.probe = EngineConfig(block_size=block_size, device=device, attention_backend=backend, seed=seed,
                                  num_blocks=1)
        self.probe.check()
        self.hf_model = load_model(model, self.probe)[0] if isinstance(model, str) else model
        # a model with a shorter context than the grid's longest prompts profiles the scenarios it can run
        max_len = getattr(self.hf_model.config, "max_position_embeddings", None) or math.inf
        self.scenarios = [scenario for scenario in self.scenarios if _longest_sequence(scenario) <= max_len]
        self.generators = [torch.Generator().manual_seed(seed + index) for index in range(len(self.scenarios))]
        self.groups: dict[tuple, list[float]] = {}
        self.sources: dict[tuple, list[str]] = {}  # quantities -> the scenarios that produced them, first first
        self.add_request_times: list[float] = []  # seconds per request, per measured scenario
        self.rounds_run, self.engine = 0, None

    @property
    def num_scenarios(self) -> int:
        return len(self.scenarios)

    def run_round(self, progress: Callable[[int], None] | None = None) -> None:
        """Every scenario once; ``progress(i)`` after the ``i``-th. The first round is not recorded. Measured rounds
        run the scenarios in a fresh seeded order: a step runs slower for a while after the machine sat idle (the
        first scenario after the idle ones measured 3.7 ms a decode step on this CPU, 2.1 ms when run last), so a
        fixed order would pin that on the same scenarios every round."""
        order = list(range(len(self.scenarios)))
        if self.rounds_run:
            random.Random(self.seed * 1000 + self.rounds_run).shuffle(order)
        for done, index in enumerate(order, 1):
            name, settings, requests = self.scenarios[index]
            record = self._recorder(name) if self.rounds_run else None
            admissions = self.add_request_times if self.rounds_run else None
            self.engine = _run_scenario(self.hf_model, self.probe, settings, requests, self.generators[index], record,
                                        admissions)
            if progress is not None:
                progress(done)
        self.rounds_run += 1

    def _recorder(self, scenario: str) -> Callable[[tuple, float], None]:
        def record(quantities: tuple, duration_s: float) -> None:
            self.groups.setdefault(quantities, []).append(duration_s)
            names = self.sources.setdefault(quantities, [])
            if scenario not in names:
                names.append(scenario)
        return record

    def result(self) -> Profile:
        """Fit the measured rounds (at least one after the warm-up) into a ``Profile``."""
        if self.rounds_run < 2:
            raise ProfileError("a profile needs a measured round after the warm-up round")
        samples = grouped_samples(self.groups, self.sources)
        knots = decode_knots(self.grid)
        coefficients, median_error, max_error = fit(samples, knots, seed=self.seed)
        engine = self.engine
        return Profile(self.model_name, str(engine.device), str(engine.runner.dtype), self.probe.block_size,
                       engine.runner.attention_backend, coefficients, knots, samples, median_error, max_error,
                       add_request_s=statistics.fmean(self.add_request_times))


def profile_engine(model="tiny", device: str | None = None, block_size: int = 16, backend: str = "auto",
                   repeats: int = 3, seed: int = 0, grid: str = "full",
                   progress: Callable[[int, int], None] | None = None,
                   on_round: Callable[[Callable[[], Profile], int, int], object] | None = None) -> Profile:
    """Measure the engine on the designed scenarios and fit the step-time model. The model is loaded once; each
    round runs every scenario on a fresh engine, round 0 unmeasured (warm-up), so a slow spell of a shared machine
    lands on all scenarios alike instead of skewing a few (the fit would then bend around it). ``on_round(fit,
    measured, repeats)`` hears of each measured round as it ends: ``fit()`` makes the profile of the rounds so far
    (what a page's Stop keeps)."""
    profiler = Profiler(model, device, block_size, backend, seed, grid)
    total = (repeats + 1) * profiler.num_scenarios
    for round_ in range(repeats + 1):
        done = round_ * profiler.num_scenarios
        profiler.run_round(None if progress is None else lambda index: progress(done + index, total))
        if on_round is not None and round_ >= 1:
            on_round(profiler.result, round_, repeats)
    return profiler.result()


def scatter_free_blocks(manager, rng: random.Random) -> None:
    """Leave the free blocks of ``manager`` (a ``KVBlockManager``) queued in a random order, as a serving engine's are
    once requests have come and gone: a fresh pool hands out consecutive blocks, whose K/V a decode step gathers
    faster. Measured on the tiny model (AMD EPYC, torch backend), a 32-sequence decode step ran 3-4 % slower on an
    engine that had served a saturated run, or on a fresh one with its free queue shuffled, than on a fresh one; a
    profile of fresh pools priced the saturated twin's steps 3-4 % low."""
    seq_ids = [("scatter", index) for index in range(manager.num_free_blocks)]
    for seq_id in seq_ids:
        manager.create_sequence(seq_id, num_prompt_tokens=manager.block_size)
    rng.shuffle(seq_ids)
    for seq_id in seq_ids:
        manager.release_sequence(seq_id)


def _run_scenario(hf_model, base, settings: dict, requests, generator,
                  record: Callable[[tuple, float], None] | None, add_request_times: list[float] | None = None):
    """One scenario on a fresh engine sized to hold it; ``record(quantities, duration_s)`` for each step (``None``:
    a warm-up run); the mean ``add_request`` time of its requests is appended to ``add_request_times``."""
    import dataclasses

    import torch

    from lab.engine.llm_engine import LLMEngine, SamplingParams

    cached_prefix, pool_fraction = settings.get("cached_prefix", 0), settings.get("pool_fraction", 1.0)
    idle_s = settings.get("idle_s", 0.0)
    block_size = base.block_size
    needed = sum(n * -(-(cached_prefix + length + outputs) // block_size) for length, outputs, n in requests)
    num_blocks = needed + 2 * cached_prefix // block_size + 8
    if pool_fraction < 1:  # a pool too small for all at once (swap scenarios); the host pool holds the rest
        longest = max(-(-(length + outputs) // block_size) for length, outputs, _ in requests)
        num_blocks = max(int(needed * pool_fraction), 2 * longest + 2)
    config = dataclasses.replace(base, max_num_seqs=64, num_blocks=num_blocks,
                                 num_cpu_blocks=needed + 8 if pool_fraction < 1 else 0,
                                 **{k: v for k, v in settings.items()
                                    if k not in ("cached_prefix", "pool_fraction", "idle_s")})
    engine = LLMEngine(hf_model, config)
    scatter_free_blocks(engine.block_manager, random.Random(int(torch.randint(0, 2**31, (1,), generator=generator))))
    vocab = hf_model.config.vocab_size
    prefix = torch.randint(0, vocab, (cached_prefix,), generator=generator).tolist()
    if cached_prefix:
        engine.generate([prefix + [1]], SamplingParams(max_tokens=1, ignore_eos=True))
    prompts = [prefix + torch.randint(0, vocab, (length,), generator=generator).tolist() for length, _, _ in requests]
    params = [SamplingParams(max_tokens=outputs, n=n, ignore_eos=True, temperature=0.8 if n > 1 else 0.0,
                             seed=base.seed) for _, outputs, n in requests]
    started = time.perf_counter()
    for prompt, sampling in zip(prompts, params):
        engine.add_request(prompt, sampling)
    if add_request_times is not None:
        add_request_times.append((time.perf_counter() - started) / len(prompts))
    if idle_s:
        time.sleep(idle_s)
    while engine.has_unfinished():
        idle = idle_s if engine.num_steps == 0 else 0.0
        previous = engine.last_plan.num_prefill_tokens if engine.last_plan is not None else 0
        started = time.perf_counter()
        engine.step()
        # the whole call, its closing bookkeeping too: a serving loop's clock advances by that
        duration_s = time.perf_counter() - started
        if record is not None:
            record(tuple(plan_quantities(engine.last_plan, block_size, idle, previous)), duration_s)
    return engine
