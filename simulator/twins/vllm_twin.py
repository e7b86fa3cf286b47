"""A twin of a real vLLM server: the simulator, running the vLLM V1 policy of our scheduler on a step-time profile
measured on vLLM itself (``lab.peer.profiling``), predicts what a vLLM server does with a workload, and the server
(``lab.peer.server``) is measured doing it.

The profile is calibrated on the profile's own scenarios (single prefills, decode batches, a cached prefix, idle
pauses), served by vLLM's offline engine in the peer: never on a workload that is scored. Each scored workload is
then sent to the server at its arrival times; the simulator gets the same requests at the times they were sent, the
server's pool (``vllm:cache_config_info``), block size and budgets, and its prediction is scored per metric.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from lab.errors import InputError
from lab.peer.client import PeerError, PeerSettings, VLLMPeer
from lab.profiling.profile import STALL_RATIO, Profile
from lab.models.qwen3 import checkpoint_vocab_size
from lab.peer.server import (ServerRequest, ServerRun, VLLMServer, check_server, reset_prefix_cache,
                              run_server_workload, server_cache_config)

from simulator.core.engine import SimConfig, Simulator
from lab.latency import latency_summary
from .twin import real_prompt_ids
from simulator.core.workloads import SyntheticSpec, Workload, at_mean_rate, load_trace, synthetic_workload

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
WORKLOADS = ("all-at-once", "prefix", "poisson", "gamma", "azure")
GAMMA_BURSTINESS = 0.5  # gamma shape of the bursty workload (coefficient of variation sqrt(2))
SHARED_PREFIX_TOKENS = 256  # the prefix-sharing workload's system prompt
CALIBRATION_REPEATS = 3  # of each calibration run: a two-core machine's step times vary by 10-30 % run to run
WARM_UP_REQUESTS = 8  # sent before the first scored run: the server's first steps build its kernels
# metric -> (goal, how its error is measured): relative error for latencies, points for fractions, counts
GOALS = {"ttft_p50_s": (0.05, "relative"), "tpot_p50_s": (0.05, "relative"), "e2e_p50_s": (0.05, "relative"),
         "ttft_p90_s": (0.10, "relative"), "tpot_p90_s": (0.10, "relative"), "e2e_p90_s": (0.10, "relative"),
         "kv_usage_mean_abs_points": (5.0, "points"), "prefix_hit_rate": (1.0, "points"),
         "preemptions": (0.0, "count")}


@dataclass(slots=True)
class VLLMTwinConfig:
    """The server both sides are given (its pool, block size, budgets; a checkpoint of ``model``), the profile's
    grid and rounds, and the scored workloads: ``num_requests`` each, ShareGPT-like lengths times ``length_scale``,
    arrivals at ``rate`` requests/s (all at once and prefix: at t = 0)."""

    model: str = "tiny"
    dtype: str = "float32"
    block_size: int = 32
    num_blocks: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    workloads: tuple = ("all-at-once", "prefix", "poisson")
    num_requests: int = 48
    rate: float = 20.0
    length_scale: float = 0.25
    repeats: int = 1  # real runs per workload (3: the spread)
    grid: str = "small"
    profile_repeats: int = 2
    calibration_repeats: int = CALIBRATION_REPEATS  # rounds of the server's calibration runs (``calibrate_server``)
    seed: int = 0
    poll_s: float = 0.25
    url: str | None = None  # a server already running (nothing else is contacted); None: start one
    pin_client: bool = True  # the lab's process (client, simulator) on the cores vLLM's worker leaves to its API

    def peer_settings(self, checkpoint: str) -> PeerSettings:
        return PeerSettings(checkpoint, self.dtype, self.block_size, self.num_blocks, self.max_num_seqs,
                            self.max_num_batched_tokens, self.max_model_len, enable_prefix_caching=True)


def _scaled(workload: Workload, scale: float) -> Workload:
    prompts = np.maximum(1, np.round(workload.prompt_tokens * scale)).astype(np.int64)
    outputs = np.maximum(1, np.round(workload.output_tokens * scale)).astype(np.int64)
    return replace(workload, prompt_tokens=prompts, output_tokens=outputs,
                   meta={**workload.meta, "length_scale": scale}).check()


def make_twin_workload(name: str, config: VLLMTwinConfig, seed: int) -> Workload:
    """One of ``WORKLOADS``: ShareGPT-like lengths times ``length_scale`` all at t = 0 (``all-at-once``), the same
    behind a shared system prompt (``prefix``), at a Poisson or gamma (``GAMMA_BURSTINESS``) ``rate``, or the
    Azure 2023 conversation trace's first requests, lengths scaled alike, at a mean of ``rate`` (``azure``; the
    shared traces must be present)."""
    if name == "azure":
        if not AZURE_CONV.exists():
            raise InputError(f"the azure workload reads the shared trace {AZURE_CONV}, which is not there")
        trace = at_mean_rate(load_trace(AZURE_CONV, max_rows=config.num_requests), config.rate)
        workload = _scaled(trace, config.length_scale)
    elif name in WORKLOADS:
        rate = math.inf if name in ("all-at-once", "prefix") else config.rate
        spec = SyntheticSpec("sharegpt", config.num_requests, rate, GAMMA_BURSTINESS if name == "gamma" else 1.0,
                             seed=seed)
        workload = _scaled(synthetic_workload(spec), config.length_scale)
        if name == "prefix":
            workload = replace(workload, prompt_tokens=workload.prompt_tokens + SHARED_PREFIX_TOKENS,
                               shared_prefix_tokens=SHARED_PREFIX_TOKENS)
    else:
        raise InputError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    longest = int((workload.prompt_tokens + workload.output_tokens).max())
    if longest > config.max_model_len:
        raise InputError(f"the {name} workload has a request of {longest} tokens, beyond max_model_len "
                         f"{config.max_model_len}: lower length_scale")
    return replace(workload, name=name)


def server_requests(workload: Workload, vocab_size: int, seed: int) -> list[ServerRequest]:
    """The workload's requests as the server gets them: random prompts (equal where the workload shares a prefix,
    as ``simulator.twins.twin.real_prompt_ids`` makes them), greedy, at their arrival offsets."""
    prompts = real_prompt_ids(workload, vocab_size, seed)
    return [ServerRequest(prompt, int(out), float(at))
            for prompt, out, at in zip(prompts, workload.output_tokens, workload.arrival_s)]


def sim_config(config: VLLMTwinConfig, cache: dict, profile: Profile) -> SimConfig:
    """The simulator as the server is: vLLM V1's policy, its usable blocks (one fewer than its count: block 0 is
    vLLM's null block), block size, budgets and prefix caching, steps priced by ``profile``."""
    return SimConfig(allocator="paged", block_size=cache["block_size"],
                     capacity_tokens=(cache["num_gpu_blocks"] - 1) * cache["block_size"],
                     max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, scheduling="vllm",
                     enable_prefix_caching=cache["enable_prefix_caching"], profile=profile, max_points=100_000)


def _requests_frame(workload: Workload, run: ServerRun) -> pd.DataFrame:
    frame = run.requests.rename(columns={"sent_s": "arrival_s"})
    frame["output_tokens"] = workload.output_tokens
    return frame


@dataclass(slots=True)
class ServerCalibration:
    """What the server adds to its engine's steps, measured on calibration requests (never a scored workload):
    ``step_overhead_s``, seconds the server's steps take beyond the offline profile's (the engine core hands each
    step to its worker process and its outputs to the API process, on two cores shared with that process and the
    load generator; flat in the batch size, where a ratio was not; it drifts while a server runs, see
    ``probe_step_overhead``), and ``prefill_token_overhead_s`` more per token a step prefills (the server's worker
    runs its GEMMs on the one core vLLM leaves it, the profile's engine on both); ``request_overhead_s``, the
    seconds between a request's send and its first token that no engine step accounts for (HTTP, the API process,
    the hand-over to the engine and back), and ``request_interval_s``, the API process's time per request, shared
    among the requests it holds (``engine_arrivals``). ``table``: the calibration runs."""

    step_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    request_interval_s: float = 0.0
    table: pd.DataFrame = field(default_factory=pd.DataFrame)
    interval_at_bound: bool = False  # the request interval's search ended at its largest value (INTERVALS_S)
    prefill_token_at_bound: bool = False  # and the prefill token's (PREFILL_TOKEN_OVERHEADS_S)
    request_overhead_per_token_s: float = 0.0  # the request overhead's more per prompt token (the prompt's way in)
    prefill_token_overhead_s: float = 0.0  # what each prefilled token costs the server's steps beyond the profile

    def request_overheads(self, prompt_tokens: np.ndarray) -> np.ndarray:
        """Each request's overhead: ``request_overhead_s`` and its prompt's share."""
        return self.request_overhead_s + self.request_overhead_per_token_s * prompt_tokens

    @property
    def bound_note(self) -> str:
        """What to say after the calibration when a search ended at its bound ("" otherwise)."""
        ended = [name for name, at_bound in (("the request interval", self.interval_at_bound),
                                             ("a prefilled token's cost", self.prefill_token_at_bound)) if at_bound]
        return f" ({' and '.join(ended)} at the largest value searched: the fit may want more)" if ended else ""

    def priced(self, profile: Profile) -> Profile:
        """``profile`` with every step ``step_overhead_s`` longer (its constant term) and each prefilled token
        ``prefill_token_overhead_s``."""
        coefficients = dict(profile.coefficients)
        coefficients["constant"] = coefficients.get("constant", 0.0) + self.step_overhead_s
        coefficients["prefill_tokens"] = coefficients.get("prefill_tokens", 0.0) + self.prefill_token_overhead_s
        return replace(profile, coefficients=coefficients)

    def applied(self, simulation: SimConfig, profile: Profile) -> SimConfig:
        """``simulation`` with its steps priced by ``profile`` plus the step overhead (``priced``)."""
        return replace(simulation, profile=self.priced(profile))

    def shifted(self, seconds: float, request_seconds: float = 0.0) -> "ServerCalibration":
        """The step overhead ``seconds`` longer (``probe_step_overhead``) and the request overhead
        ``request_seconds`` (``probe_request_overhead``), neither below none: the server's steps do not run faster
        than its engine's alone, nor does a request reach its first token sooner than its steps allow."""
        return replace(self, step_overhead_s=max(0.0, self.step_overhead_s + seconds),
                       request_overhead_s=max(0.0, self.request_overhead_s + request_seconds))


def shared_frontend(sent: np.ndarray, work_s: float) -> np.ndarray:
    """When requests sent at ``sent`` (sorted) leave a frontend that shares its time equally among the requests it
    holds, each needing ``work_s`` of it (processor sharing: an asyncio server interleaves the handlers of requests
    that arrive together, so a burst leaves together, one request alone after ``work_s``)."""
    done = np.array(sent, dtype=np.float64)
    if work_s <= 0 or len(done) == 0:
        return done
    now = served = 0.0  # the clock and the service each request in the frontend has had since it opened
    held: list[tuple[int, float]] = []  # (index, the service at which it leaves), in order of arrival
    head = arrived = 0
    while arrived < len(done) or head < len(held):
        count = len(held) - head
        leaves_at = now + (held[head][1] - served) * count if count else math.inf
        if arrived < len(done) and sent[arrived] < leaves_at:
            if count:
                served += (sent[arrived] - now) / count
            now = float(sent[arrived])
            held.append((arrived, served + work_s))
            arrived += 1
        else:
            index, served = held[head]
            now, done[index] = leaves_at, leaves_at
            head += 1
    return done


def engine_arrivals(sent: np.ndarray, overhead_s: float | np.ndarray = 0.0, interval_s: float = 0.0) -> np.ndarray:
    """When requests sent at ``sent`` (sorted) reach the engine: through a frontend that shares its time among them,
    ``interval_s`` each (``shared_frontend``), then ``overhead_s`` (one for all, or one per request) later, none
    before one sent before it. A frontend that took them one after another (each ``interval_s`` after the last) put
    the first tokens of 16 prompts sent together on a staircase, one prefill step each; the server's come in groups,
    one per step of as many prompts as the token budget holds (docs/vllm_twin.md)."""
    return np.maximum.accumulate(shared_frontend(sent, interval_s) + overhead_s)  # none overtakes one sent before it


def simulate_run(workload: Workload, run: ServerRun, config: SimConfig, calibration: ServerCalibration | None = None):
    """The simulator on the workload's requests at the times the run sent them, reaching the engine as
    ``calibration`` says (the requests it never sent dropped); its result's ``requests`` and summary latencies count
    from the send."""
    calibration = calibration or ServerCalibration()
    sent = run.requests["sent_s"].to_numpy()
    keep = ~np.isnan(sent)
    sent = np.maximum.accumulate(sent[keep])  # sends of one instant may leave microseconds out of order
    index = np.flatnonzero(keep)
    overheads = calibration.request_overheads(workload.prompt_tokens[index])
    subset = replace(workload, arrival_s=engine_arrivals(sent, overheads, calibration.request_interval_s),
                     prompt_tokens=workload.prompt_tokens[index], output_tokens=workload.output_tokens[index],
                     prompt_block_ids=None if workload.prompt_block_ids is None
                     else [workload.prompt_block_ids[i] for i in index]).check()
    result = Simulator(subset, config).run()
    result.requests["arrival_s"] = sent
    result.summary.update(latency_summary(result.requests))
    return result


def _usage_error(run: ServerRun, timeseries: pd.DataFrame, usable_blocks: int) -> tuple[float, float, float]:
    """KV usage, real and simulated, averaged over the run's /metrics readings, and their mean absolute difference
    (points): at each reading, the simulator's usage after its last step that ended by then."""
    readings = run.metrics.dropna(subset=["kv_usage"])
    readings = readings[readings["t_s"] <= run.requests["finish_s"].max()]
    if readings.empty or timeseries.empty:
        return math.nan, math.nan, math.nan
    ends = timeseries["elapsed_s"].to_numpy()
    usage = timeseries["blocks_in_use"].to_numpy() / usable_blocks
    at = np.searchsorted(ends, readings["t_s"].to_numpy(), side="right") - 1
    simulated = np.where(at >= 0, usage[np.maximum(at, 0)], 0.0)
    real = readings["kv_usage"].to_numpy()
    return float(real.mean() * 100), float(simulated.mean() * 100), float(np.abs(real - simulated).mean() * 100)


def score(workload: Workload, run: ServerRun, config: SimConfig,
          calibration: ServerCalibration | None = None, result=None) -> pd.DataFrame:
    """One row per metric of ``GOALS``: the server's value, the simulator's, the error (relative, points or a
    count, per ``GOALS``), the goal and whether it is met. ``result``: ``simulate_run``'s, when already made."""
    if result is None:
        result = simulate_run(workload, run, config, calibration)
    real = latency_summary(_requests_frame(workload, run))
    simulated = result.summary
    rows = []
    for name in ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s", "ttft_p90_s", "tpot_p90_s", "e2e_p90_s"):
        rows.append((name, real[name], simulated[name], abs(simulated[name] - real[name]) / real[name]))
    usable = int(config.capacity_tokens // config.block_size)
    real_usage, simulated_usage, difference = _usage_error(run, result.timeseries, usable)
    rows.append(("kv_usage_mean_abs_points", real_usage, simulated_usage, difference))
    queries, hits = run.counter("prefix_queries"), run.counter("prefix_hits")
    real_rate = 100 * hits / queries if queries else math.nan
    hit_blocks = simulated.get("prefix_cache_hit_blocks", math.nan)
    simulated_rate = 100 * hit_blocks * config.block_size / float(workload.prompt_tokens.sum())
    rows.append(("prefix_hit_rate", real_rate, simulated_rate, abs(simulated_rate - real_rate)))
    real_preemptions = run.counter("preemptions")
    rows.append(("preemptions", real_preemptions, float(simulated["preemptions"]),
                 abs(simulated["preemptions"] - real_preemptions)))
    table = pd.DataFrame(rows, columns=["metric", "real", "simulated", "error"])
    table["goal"] = [GOALS[name][0] for name in table["metric"]]
    table["unit"] = [GOALS[name][1] for name in table["metric"]]
    table["met"] = table["error"] <= table["goal"]
    return table


def _noise_floor(real: np.ndarray, unit: str) -> float:
    """The error a perfect twin would score on these repeats: one that predicts the server's own median every
    time, its error against each run (relative, or points and counts as they are) and the median of those, as
    ``summary`` takes the twin's. With one run, nan."""
    if len(real) < 2:
        return math.nan
    centre = float(np.median(real))
    errors = np.abs(centre - real) / real if unit == "relative" else np.abs(centre - real)
    return float(np.median(errors))


@dataclass(slots=True)
class VLLMTwinResult:
    """Per workload and run: the score table, the server's run and the simulator's result."""

    table: pd.DataFrame  # workload, run, metric, real, simulated, error, goal, unit, met, run_step_overhead_s
    runs: dict = field(default_factory=dict)  # (workload, run) -> ServerRun
    simulated: dict = field(default_factory=dict)  # (workload, run) -> SimResult
    profile: Profile | None = None
    server_start_s: float = math.nan
    calibration: ServerCalibration | None = None

    def summary(self) -> pd.DataFrame:
        """Per workload and metric: the median error over the runs, its range, the goal and whether the median
        meets it."""
        grouped = self.table.groupby(["workload", "metric"], sort=False)
        out = grouped.agg(real=("real", "median"), simulated=("simulated", "median"), error=("error", "median"),
                          error_min=("error", "min"), error_max=("error", "max"), goal=("goal", "first"),
                          unit=("unit", "first"), runs=("run", "count"),
                          run_step_overhead_s=("run_step_overhead_s", "median"),
                          real_min=("real", "min"), real_max=("real", "max"), real_mean=("real", "mean"),
                          real_std=("real", "std")).reset_index()
        out["met"] = out["error"] <= out["goal"]
        out["noise_floor_error"] = [_noise_floor(group["real"].to_numpy(), group["unit"].iloc[0])
                                    for _, group in grouped]
        # the server's own spread over the repeats, and whether the twin's median lies inside it
        out["real_cv"] = (out.pop("real_std") / out.pop("real_mean")).where(out["runs"] > 1)
        out["inside_spread"] = (out["simulated"] >= out["real_min"]) & (out["simulated"] <= out["real_max"])
        return out

    def extrapolation(self) -> dict[str, str]:
        """Per workload, where the simulator priced steps beyond what the profile measured
        (``Profile.beyond_measured``: its prediction leans on the fit there), from the first run that did; the
        workloads priced within the profile's range are left out."""
        beyond = {}
        for (workload, _), simulated in self.simulated.items():
            note = simulated.summary.get("profile_extrapolation", "")
            if note and workload not in beyond:
                beyond[workload] = note
        return beyond


def profile_cache_path(config: VLLMTwinConfig) -> Path:
    """Where the page keeps the profile of vLLM's engine for these settings (beside the peer environment): measured
    once on a quiet machine it is reused, instead of re-measured while the browser and the app share the cores."""
    import hashlib

    from lab.peer.client import VLLM_VERSION, peer_venv
    from lab.peer.profiling import usable_pool_tokens, vllm_scenarios

    # the scenarios measured and the rule that made their samples are in the name: a profile of other scenarios, or
    # one kept before stalled repeats were left out (one such kept profile priced a step after a 250 ms pause 11 ms
    # long: ``steady_mean``), is measured again, not reused
    scenarios = vllm_scenarios(config.block_size, config.grid, config.max_model_len,
                               usable_pool_tokens(config.num_blocks, config.block_size))
    digest = hashlib.sha256(repr((scenarios, STALL_RATIO)).encode()).hexdigest()[:8]
    name = (f"{Path(config.model).name}-{config.dtype}-B{config.block_size}-{config.num_blocks}blocks-"
            f"{config.max_num_seqs}seqs-{config.max_num_batched_tokens}tokens-{config.grid}-{digest}-"
            f"vllm{VLLM_VERSION}.json")
    return peer_venv().parent / "vllm-profiles" / name


def calibrate(config: VLLMTwinConfig, checkpoint: str, progress: Callable[[str], None] = print) -> Profile:
    """The step-time profile of vLLM's engine on the checkpoint (``lab.peer.profiling.profile_vllm``), measured in
    the peer's offline engine with the server's pool and budgets."""
    from lab.peer.profiling import profile_vllm

    progress(f"calibrating on vLLM's engine ({config.grid} grid, {config.profile_repeats} rounds)")
    with VLLMPeer(config.peer_settings(checkpoint)) as peer:
        return profile_vllm(peer, config.model, checkpoint_vocab_size(checkpoint), config.grid, config.profile_repeats,
                            config.seed)


CALIBRATION_BATCHES = (1, 4, 8, 16, 32)  # sent together: their TPOT gives the step overhead, their TTFT the interval
CALIBRATION_PROMPTS = (32, 128, 384)  # single prompts on an idle server: the request overhead
INTERVALS_S = tuple(np.arange(0.0, 0.004001, 0.000125))  # the API process's time per request: the values tried
PREFILL_TOKEN_OVERHEADS_S = tuple(np.arange(0.0, 32.01e-6, 2e-6))  # a prefilled token's cost beyond the profile: tried
TTFT_QUARTILES = (0.25, 0.5, 0.75)
PROBE = (4, 96, 48)  # the step-overhead probe: requests sent together, prompt and output tokens each (not scored)
# the request-overhead probe: single prompts sent one at a time, each alone on the server (count, tokens each, gap in s)
REQUEST_PROBE = (3, 32, 0.05)


def _fixed(count: int, prompt: int, output: int, gap_s: float = 0.0) -> Workload:
    """``count`` requests of ``prompt`` tokens and ``output`` tokens each, sent ``gap_s`` apart (0: together)."""
    return Workload("calibration", gap_s * np.arange(count), np.full(count, prompt, dtype=np.int64),
                    np.full(count, output, dtype=np.int64)).check()


def _served(url: str, model: str, workload: Workload, vocab: int, seed: int, what: str) -> ServerRun:
    """``workload`` served (random prompts from ``seed``); a run with problems raises, naming ``what``."""
    run = run_server_workload(url, server_requests(workload, vocab, seed), model, poll_s=60.0)
    if run.problems:
        raise PeerError(f"{what} failed: {'; '.join(run.problems[:3])}")
    return run


def _first_tokens(workload: Workload, run: ServerRun, simulation: SimConfig,
                  calibration: ServerCalibration) -> tuple[np.ndarray, np.ndarray]:
    """``run`` of ``workload`` simulated with ``calibration``: per request, the server's TTFT and the simulator's."""
    result = simulate_run(workload, run, simulation, calibration)
    return ((run.requests["first_token_s"] - run.requests["sent_s"]).to_numpy(),
            (result.requests["first_token_s"] - result.requests["arrival_s"]).to_numpy())


def _ttft_misfit(batches, simulation: SimConfig, calibration: ServerCalibration) -> float:
    """How far the simulated TTFTs of the calibration batches (``(workload, run)``, more than one request) are from
    the server's: squared relative errors of their quartiles. Quartiles, not the median alone: a batch's first
    tokens come in groups, one per prefill step, and the median of one batch says little about where the groups lie."""
    misfit = 0.0
    for workload, run in batches:
        real, simulated = _first_tokens(workload, run, simulation, calibration)
        misfit += float(np.sum((np.nanquantile(simulated, TTFT_QUARTILES)
                                / np.nanquantile(real, TTFT_QUARTILES) - 1) ** 2))
    return misfit


def _with_interval(calibration: ServerCalibration, interval: float) -> ServerCalibration:
    """``calibration`` (its request overhead fitted on prompts sent alone, with no frontend) with a frontend of
    ``interval`` per request: a prompt alone in the frontend spends ``interval`` there, so the overhead keeps what the
    lone prompts measured beyond it (never below none)."""
    return replace(calibration, request_interval_s=interval,
                   request_overhead_s=max(0.0, calibration.request_overhead_s - interval))


def _coarse_to_fine(count: int, score: Callable[[int], float], stride: int):
    """The index of ``range(count)`` with the least ``score`` (each scored once at most), searched on every
    ``stride``-th index, then on the indices around the best of those. Returns (index, its score)."""
    scores: dict[int, float] = {}

    def scored(index: int) -> float:
        if index not in scores:
            scores[index] = score(index)
        return scores[index]
    best = min(range(0, count, stride), key=scored)
    best = min(range(max(0, best - stride + 1), min(count, best + stride)), key=scored)
    return best, scores[best]


def _best_interval(batches, simulation: SimConfig, calibration: ServerCalibration) -> tuple[float, float]:
    """The request interval of ``INTERVALS_S`` with the least ``_ttft_misfit`` (``_with_interval``), searched coarse
    to fine. Returns (interval, misfit)."""
    index, misfit = _coarse_to_fine(len(INTERVALS_S), lambda i: _ttft_misfit(
        batches, simulation, _with_interval(calibration, INTERVALS_S[i])), stride=4)
    return float(INTERVALS_S[index]), misfit


def _fit_at(per_token: float, simulation: SimConfig, batches, singles) -> tuple[float, ServerCalibration, list[tuple]]:
    """The calibration with each prefilled token ``per_token`` beyond the profile, fitted on the calibration runs:
    the step overhead (decode batches' TPOT), the request overhead line (single prompts) and the request interval
    (``_best_interval``). Returns the batches' TTFT misfit, the calibration and its table's rows (kind, size,
    server's seconds, simulator's)."""
    base = ServerCalibration(prefill_token_overhead_s=per_token)
    unpriced = base.applied(simulation, simulation.profile)
    rows = [("decode tpot", len(workload), real["tpot_p50_s"],
             simulate_run(workload, run, unpriced).summary["tpot_p50_s"]) for workload, run, real in batches]
    # never below none (as ``shifted``): a server measured faster than its profile had a profile measured slow
    stepped = replace(base, step_overhead_s=max(0.0, float(np.median([real - sim for *_, real, sim in rows]))))
    priced = stepped.applied(simulation, simulation.profile)
    single = _single_ttfts(singles, priced)
    overhead, slope = _overhead_line([(length, real - sim) for length, real, sim in single])
    calibration = replace(stepped, request_overhead_s=overhead, request_overhead_per_token_s=slope)
    together = [(workload, run) for workload, run, _ in batches if len(workload) > 1]
    interval, misfit = _best_interval(together, priced, calibration)
    rows += [("single ttft", *row) for row in single]
    return misfit, _with_interval(calibration, interval), rows


def _single_ttfts(singles, simulation: SimConfig) -> list[tuple[int, float, float]]:
    """Per single prompt (``(workload, run)``): its length, its TTFT and the simulator's (``simulation``, no
    frontend)."""
    rows = []
    for workload, run in singles:
        real, simulated = _first_tokens(workload, run, simulation, ServerCalibration())
        rows.append((int(workload.prompt_tokens[0]), float(real[0]), float(simulated[0])))
    return rows


def calibrate_server(url: str, model: str, simulation: SimConfig, vocab: int, seed: int = 0,
                     repeats: int = CALIBRATION_REPEATS) -> ServerCalibration:
    """Measure ``ServerCalibration`` on the server, each run ``repeats`` times: decode batches of
    ``CALIBRATION_BATCHES`` requests sent together (96-token prompts, 64 tokens each; the median of the server's TPOT
    p50 less the simulator's is the step overhead), single prompts of ``CALIBRATION_PROMPTS`` tokens sent one at a
    time (the median of the server's TTFT less the simulator's, a line in the prompt's length, is the request
    overhead). What a prefilled token costs the server beyond the profile (``PREFILL_TOKEN_OVERHEADS_S``) and the
    frontend's time per request (``INTERVALS_S``) are searched together, everything else fitted again for each
    (``_fit_at``): the pair whose simulated TTFT quartiles of the batches are closest to the server's
    (``_ttft_misfit``)."""
    if type(repeats) is not int or repeats < 1:
        raise InputError(f"calibration_repeats must be an integer >= 1; got {repeats!r}")
    batches = []
    for repeat in range(repeats):
        for batch in CALIBRATION_BATCHES:
            workload = _fixed(batch, 96, 64)
            run = _served(url, model, workload, vocab, seed + 10 * repeat + batch, "a calibration batch")
            batches.append((workload, run, latency_summary(_requests_frame(workload, run))))
    singles = [(workload, _served(url, model, workload, vocab, seed + 100 * repeat + length, "a calibration prompt"))
               for repeat in range(repeats) for length in CALIBRATION_PROMPTS for workload in [_fixed(1, length, 2)]]
    fits: dict[int, tuple] = {}

    def misfit(index: int) -> float:
        fits[index] = _fit_at(PREFILL_TOKEN_OVERHEADS_S[index], simulation, batches, singles)
        return fits[index][0]
    index, _ = _coarse_to_fine(len(PREFILL_TOKEN_OVERHEADS_S), misfit, stride=2)
    _, calibration, rows = fits[index]
    calibration.interval_at_bound = calibration.request_interval_s == INTERVALS_S[-1]
    calibration.prefill_token_at_bound = calibration.prefill_token_overhead_s == PREFILL_TOKEN_OVERHEADS_S[-1]
    priced = calibration.applied(simulation, simulation.profile)
    for workload, run, real in batches:
        simulated = simulate_run(workload, run, priced, calibration)
        rows.append(("batch ttft", len(workload), real["ttft_p50_s"], simulated.summary["ttft_p50_s"]))
    calibration.table = pd.DataFrame(rows, columns=["kind", "size", "real_s", "simulated_s"])
    return calibration


def _overhead_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``extra = a + b * prompt_tokens`` through the single prompts' TTFT left unaccounted for, both
    never below zero: a line through the medians per prompt length (least squares), so that one slow repeat does
    not tilt it. Measured on the tiny checkpoint, the server's TTFT exceeded its engine's steps by about 3 ms for
    a 32-token prompt and 7 ms for a 384-token one (the prompt's way in: HTTP, the API process, the hand-over)."""
    lengths = sorted({length for length, _ in points})
    medians = [float(np.median([extra for length, extra in points if length == at])) for at in lengths]
    if len(lengths) < 2:
        return max(0.0, medians[0]), 0.0
    slope, intercept = np.polyfit(lengths, medians, 1)
    if slope <= 0:
        return max(0.0, float(np.median(medians))), 0.0
    if intercept < 0:  # through the origin (a server faster than priced at every length: no overhead at all)
        return 0.0, max(0.0, float(np.dot(lengths, medians) / np.dot(lengths, lengths)))
    return float(intercept), float(slope)


def probe_step_overhead(url: str, model: str, simulation: SimConfig, vocab: int, seed: int) -> float:
    """How much longer the server's steps are now than ``simulation`` (priced as calibrated) says: its TPOT p50 on
    ``PROBE`` less the simulator's, in seconds a step. What the server adds to its engine's steps (the engine core's
    hand-overs, the API process) drifts on this VM while a server runs, by more than the twin's goals; the engine's
    own compute, the profile's terms, drifts far less. So a run is priced with the overhead probed around it
    (docs/vllm_twin.md)."""
    workload = _fixed(*PROBE)
    run = _served(url, model, workload, vocab, seed, "the step-overhead probe")
    real = latency_summary(_requests_frame(workload, run))["tpot_p50_s"]
    simulated = simulate_run(workload, run, simulation).summary["tpot_p50_s"]
    if not (math.isfinite(real) and math.isfinite(simulated)):
        raise PeerError(f"the step-overhead probe measured a TPOT of {real!r} s against {simulated!r} s simulated")
    return real - simulated


def probe_request_overhead(url: str, model: str, simulation: SimConfig, calibration: ServerCalibration,
                           vocab: int, seed: int) -> float:
    """How much longer a lone request's way to its first token is now than ``calibration`` says: the median, over
    ``REQUEST_PROBE``'s single prompts sent one at a time to the idle server, of its TTFT less the simulator's. The
    request overhead calibrated on a fresh server drifts like the step overhead (a calibration of 4.4 ms predicted
    light-load TTFT p50s 15-21 % high on every workload of the same server), so a run is priced with it probed
    around the run too."""
    count, prompt, gap_s = REQUEST_PROBE
    workload = _fixed(count, prompt, 2, gap_s)
    run = _served(url, model, workload, vocab, seed, "the request-overhead probe")
    real, simulated = _first_tokens(workload, run, simulation, calibration)
    extras = real - simulated
    if not np.isfinite(extras).all():
        raise PeerError(f"the request-overhead probe measured {extras.tolist()!r} s beyond the simulator's TTFT")
    return float(np.median(extras))


def probe_server(url: str, model: str, simulation: SimConfig, calibration: ServerCalibration, vocab: int,
                 seed: int) -> tuple[float, float]:
    """``probe_step_overhead`` and ``probe_request_overhead`` now: what ``ServerCalibration.shifted`` takes."""
    return (probe_step_overhead(url, model, simulation, vocab, seed),
            probe_request_overhead(url, model, simulation, calibration, vocab, seed + 50))


def run_vllm_twin(config: VLLMTwinConfig, checkpoint: str, profile: Profile | None = None,
                  progress: Callable[[str], None] = print, stop: threading.Event | None = None) -> VLLMTwinResult:
    """Calibrate (unless ``profile`` is given), start the server (or use ``config.url``), warm it up, then run
    each workload ``config.repeats`` times against it and score the simulator's prediction of each run, priced with
    the step and request overheads probed before and after it (``probe_server``)."""
    if config.url is not None:
        check_server(config.url)  # a URL with no vLLM behind it fails now, not after the calibration
    profile = profile or calibrate(config, checkpoint, progress)
    profile.check_matches(block_size=config.block_size)
    result = VLLMTwinResult(pd.DataFrame(), profile=profile)
    vocab = checkpoint_vocab_size(checkpoint)
    server = pinned = None
    try:
        if config.url is None:
            progress("starting vLLM's server")
            server = VLLMServer(config.peer_settings(checkpoint))
            url, result.server_start_s = server.url, server.start_s
        else:
            url = config.url
        model = check_server(url)
        cache = server_cache_config(url)
        if cache["block_size"] != profile.block_size:
            raise PeerError(f"the server at {url} uses blocks of {cache['block_size']} tokens, the profile "
                            f"{profile.block_size}")
        simulation = sim_config(config, cache, profile)
        # pinned from here on: the calibration runs under the conditions of the scored runs
        pinned = _pin_client(server) if config.pin_client and server is not None else None
        warm = make_twin_workload("all-at-once", replace(config, num_requests=WARM_UP_REQUESTS), config.seed + 999)
        run_server_workload(url, server_requests(warm, vocab, config.seed + 999), model)
        progress("calibrating on the server (decode batches, single prompts)")
        calibration = result.calibration = calibrate_server(url, model, simulation, vocab, config.seed + 7,
                                                                    config.calibration_repeats)
        progress(f"server steps +{calibration.step_overhead_s * 1e3:.2f} ms over the engine's, "
                 f"+{calibration.prefill_token_overhead_s * 1e6:.1f} us a prefilled token; request overhead "
                 f"{calibration.request_overhead_s * 1e3:.1f} ms + "
                 f"{calibration.request_overhead_per_token_s * 1e6:.1f} us a prompt token + "
                 f"{calibration.request_interval_s * 1e3:.2f} ms per request in the API process"
                 f"{calibration.bound_note}")
        priced = calibration.applied(simulation, profile)
        shifts = [probe_server(url, model, priced, calibration, vocab, config.seed + 500)]
        tables = []
        workloads = {name: make_twin_workload(name, config, config.seed) for name in config.workloads}
        # repeats interleaved (each round runs every workload), so a slow spell of the machine touches all
        for repeat, name in ((r, n) for r in range(config.repeats) for n in config.workloads):
            workload = workloads[name]
            if stop is not None and stop.is_set():
                break
            reset_prefix_cache(url)
            progress(f"{name}, run {repeat + 1} of {config.repeats}: {len(workload)} requests")
            # fresh prompts per run: a server whose cache cannot be reset still starts each run cold
            run = run_server_workload(url, server_requests(workload, vocab, config.seed + 1 + repeat), model,
                                      events=server.events if server else None, poll_s=config.poll_s,
                                      stop=stop)
            if run.problems:
                progress(f"{name}: {'; '.join(run.problems[:3])}")
            result.runs[(name, repeat)] = run
            shifts.append(probe_server(url, model, priced, calibration, vocab, config.seed + 500 + len(shifts)))
            now = calibration.shifted(*np.mean(shifts[-2:], axis=0))  # probed before and after the run
            priced_run = now.applied(simulation, profile)
            predicted = result.simulated[(name, repeat)] = simulate_run(workload, run, priced_run, now)
            table = score(workload, run, priced_run, now, predicted)
            tables.append(table.assign(workload=name, run=repeat, run_step_overhead_s=now.step_overhead_s,
                                       run_request_overhead_s=now.request_overhead_s))
        result.table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
        return result
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)
        if server is not None:
            server.close()


def _pin_client(server: VLLMServer) -> set[int] | None:
    """Move this process (the client and the simulator) onto the cores vLLM's worker threads are not bound to (the
    API process's), so that neither shares the worker's core; returns the affinity to restore (None: nothing done,
    as when vLLM bound no thread or left no core)."""
    before = os.sched_getaffinity(0)
    rest = before - server.pinned
    if not server.pinned or not rest:
        return None
    os.sched_setaffinity(0, rest)
    return before


def settings_of(config: VLLMTwinConfig) -> dict:
    return {f"twin_{key}": value for key, value in asdict(config).items()}
