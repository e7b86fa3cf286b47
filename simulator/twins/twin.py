"""The digital twin: one workload through the real engine and through the simulator on the engine's profile, the
same configuration both ways; one row per metric with the real value, the simulated one and the relative error.

Arrivals: requests reach the engine at their arrival offsets from the start of the run (a request arriving during a
step joins at the next step, as in the simulator). When every request arrives at t = 0 the two schedules must be
identical step for step (``schedule_identical``). With timed arrivals which step admits a request depends on real
step times, so the step logs may drift apart; the metrics are still compared, and the first differing step is
reported; and a replay (``replay``) queues each request into the simulator after as many steps as the real run
had taken when it queued it, which reproduces the real schedule step for step, so ``replay_step_time_median``
compares each step's modelled duration with the measured one.
"""
from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import pandas as pd

from lab.errors import InputError
from lab.latency import counted_tokens, latencies_of, latency_summary
from lab.engine import EngineConfig, LLMEngine, SamplingParams, load_model
from lab.worker.model_runner import ModelRunner
from lab.profiling.profile import Profile, scatter_free_blocks, steady_state_allocator
from lab.sched.scheduler import STEP_LOG_COLUMNS

from simulator.core.runs import make_workload
from simulator.core.engine import SimConfig, Simulator
from simulator.core.workloads import SyntheticSpec, Workload, synthetic_workload

MAX_REPLAY_S = 3600.0  # the real engine replays arrivals in real time: longer is a typo in the rate

PLAN_COLUMNS = [c for c in STEP_LOG_COLUMNS if c != "duration_s"]
WARM_UP_RUNS, WARM_UP_STEPS = 2, 2  # see ``warm_up``
METRICS = ("throughput_tok_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "e2e_p50_s", "makespan_s",
           "peak_blocks_in_use", "preemptions")


@dataclass(slots=True)
class TwinConfig:
    """The model and the engine settings; the simulator is configured from the engine they build (its pool, host
    pool, caps, modes and maximum length)."""

    model: str = "tiny"
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=256))


@dataclass(slots=True)
class RealRun:
    """The engine's side of a twin run: its metrics, step log, wall time, the step count at which each request was
    queued, the engine (what the simulator is configured from), and ``{step (counted from 0): seconds}`` for the steps
    that started after the engine sat idle (had nothing to run, waiting for an arrival)."""

    metrics: dict
    steps: pd.DataFrame
    wall_s: float
    admitted_after: list[int]
    engine: LLMEngine
    idle_steps: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class TwinResult:
    table: pd.DataFrame  # metric, real, simulated, rel_error (and noise_floor with repeats)
    real_steps: pd.DataFrame
    simulated_steps: pd.DataFrame
    first_difference: str  # "" when the schedules are identical
    real_wall_s: float
    simulated_wall_s: float
    real_requests: pd.DataFrame | None = None  # per request: ttft_s, tpot_s, e2e_s (for CDFs)
    simulated_requests: pd.DataFrame | None = None
    workload: Workload | None = None
    replayed_steps: pd.DataFrame | None = None  # the simulator replaying the real admissions (None: no match)
    extrapolation: str = ""  # the step quantities beyond the profile's measured range (Profile.beyond_measured)

    def steps_table(self) -> pd.DataFrame:
        """The real run's step log, ``duration_s`` renamed ``real_duration_s``, with ``simulated_duration_s``
        beside it: the modelled time of the same step in the replay (NaN where the replay's schedule differed)."""
        table = self.real_steps.rename(columns={"duration_s": "real_duration_s"})
        matched = self.replayed_steps is not None
        table["simulated_duration_s"] = self.replayed_steps["duration_s"].to_numpy() if matched else math.nan
        return table

    def pricing_through_run(self, parts: int = 5) -> pd.DataFrame:
        """The real run's steps cut into ``parts`` consecutive stretches (``part`` 1, 2, …), each with its measured
        and modelled seconds (the replay's prices) and ``measured_over_modelled``. A ratio that climbs through the
        run shows steps slowing under sustained load (a GPU or CPU clocking down), which a profile of short scenarios
        does not see (on the first H200 run, decode steps rose from 52 to 72 ms after a second of stepping). Empty
        when the replay's schedule differed, so no step has a price."""
        table = self.steps_table()
        columns = ["part", "first_step", "last_step", "steps", "measured_s", "modelled_s", "measured_over_modelled"]
        if self.replayed_steps is None or table.empty:
            return pd.DataFrame(columns=columns)
        grouped = table.groupby(np.arange(len(table)) * min(parts, len(table)) // len(table))
        out = pd.DataFrame({"first_step": grouped["step"].min(), "last_step": grouped["step"].max(),
                            "steps": grouped.size(), "measured_s": grouped["real_duration_s"].sum(),
                            "modelled_s": grouped["simulated_duration_s"].sum()})
        out["measured_over_modelled"] = out["measured_s"] / out["modelled_s"]
        out.index += 1  # the first stretch is part 1
        return out.rename_axis("part").reset_index()[columns]


def twin_workload(source: str, num_requests: int, rate: float | None = None, input_len: int = 96,
                  output_len: int = 32, time_scale: float = 1.0, seed: int = 0) -> Workload:
    """A preset drawn at ``rate`` requests/s (None: all at t = 0; ``random`` and ``fixed`` take ``input_len`` and
    ``output_len``, ``random`` ±50 %), or a trace file's first ``num_requests`` rows at their own arrival times
    multiplied by ``time_scale``, or rescaled to a mean of ``rate`` requests/s (``simulator.core.workloads.at_mean_rate``;
    a time scale beside a rate, or other than 1 with a preset, is an error)."""
    lengths = dict(input_len=input_len, output_len=output_len) if source in ("random", "fixed") else {}
    if source == "random":
        lengths["range_ratio"] = 0.5
    if source == "fixed" and rate is None:
        seed = 0  # nothing is drawn: the seed seeds the engine's sampling only
    return make_workload(source, num_requests=num_requests, seed=seed, time_scale=time_scale,
                         rate=math.inf if rate is None else rate, **lengths)


def sim_config(engine: LLMEngine, profile: Profile) -> SimConfig:
    """The simulator configured as ``engine`` is, its clock from ``profile``."""
    settings, manager = engine.config, engine.block_manager
    return SimConfig(allocator="paged", block_size=manager.block_size,
                     capacity_tokens=manager.num_physical_blocks * manager.block_size,
                     max_model_len=engine.max_model_len, max_num_seqs=settings.max_num_seqs,
                     max_num_batched_tokens=settings.max_num_batched_tokens, scheduling=settings.scheduling,
                     preemption_mode=settings.preemption_mode,
                     num_cpu_blocks=engine.policy.num_swap_blocks,
                     enable_prefix_caching=settings.enable_prefix_caching, profile=profile, record_steps=True,
                     kv_offload_blocks=settings.kv_offload_blocks)


def request_latencies(requests: pd.DataFrame) -> pd.DataFrame:
    """``ttft_s``, ``tpot_s``, ``e2e_s`` per finished request from arrival / first token / finish times and the
    counted output tokens (``lab.latency``: the longest sample's)."""
    return latencies_of(requests)[["ttft_s", "tpot_s", "e2e_s"]]


def run_real(workload: Workload, config: TwinConfig, hf_model=None) -> RealRun:
    """The workload through the engine (greedy, ``ignore_eos``, output lengths from the workload): its metrics,
    its step log and its wall time. The engine starts as a serving engine that has run a while, the state the profile
    measured: throw-away engines run the workload's first steps before it (``warm_up``), so the timed run pays
    neither the process's one-off start-up costs nor first-touch memory; freed memory stays in the process
    (``steady_state_allocator``); and its free blocks are queued in a random order (``scatter_free_blocks``: a fresh
    pool hands out consecutive blocks, and the tiny model's light run decoded 2 % faster on one than the profile's
    scattered pools had, its TPOT simulated +5.5 against +3.3 % scattered, four runs each, alternating).
    ``hf_model``: the already loaded model (else ``config.model`` is loaded)."""
    if workload.arrival_s[-1] > MAX_REPLAY_S:
        raise InputError(f"the workload's last request arrives at {workload.arrival_s[-1]:.4g} s; a real-time replay "
                         f"is limited to {MAX_REPLAY_S:g} s (raise the rate or shorten the trace)")
    steady_state_allocator()  # as the profile measured it
    model = load_model(config.model, config.engine)[0] if hf_model is None else hf_model
    prompts = real_prompt_ids(workload, model.config.vocab_size, config.engine.seed)
    params = [SamplingParams(max_tokens=int(out), ignore_eos=True) for out in workload.output_tokens]
    engine = LLMEngine(model, config.engine)
    for prompt, sampling in zip(prompts, params):  # every request checked before the clock starts
        engine.scheduler.check_request(len(prompt), sampling.max_tokens, sampling.n)
    scatter_free_blocks(engine.block_manager, random.Random(config.engine.seed))  # a serving engine's pool, as profiled
    # the timed engine's pool as resolved (one sized from free GPU memory would come out smaller the second time), cut
    # to what the warm-up can use: beside a pool sized from a GPU's free memory, a second as large would not fit
    warm_blocks = min(engine.block_manager.num_physical_blocks, warm_up_blocks(prompts, params, config.engine))
    warm_up(model, replace(config.engine, num_blocks=warm_blocks), prompts, params)
    started = time.perf_counter()
    arrivals, next_request, peak_blocks = workload.arrival_s, 0, 0
    admitted_after = []  # per request: how many engine steps had run when it was queued (for the replay)
    idle_steps, last_step_end, was_idle = {}, started, False
    while next_request < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - started
        while next_request < len(prompts) and arrivals[next_request] <= now:
            engine.add_request(prompts[next_request], params[next_request], started + arrivals[next_request])
            admitted_after.append(engine.num_steps)
            next_request += 1
        if engine.has_unfinished():
            if was_idle:
                idle_steps[engine.num_steps] = time.perf_counter() - last_step_end
            engine.step()
            last_step_end, was_idle = time.perf_counter(), False
            peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
        else:
            was_idle = True
            time.sleep(max(0.0, arrivals[next_request] - now))
    wall = time.perf_counter() - started
    return RealRun(_real_metrics(engine, started, peak_blocks), engine.step_log(), wall, admitted_after, engine,
                   idle_steps)


def real_prompt_ids(workload: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The real run's prompts: random token ids, except where the workload shares prefixes (a shared system prompt,
    a Mooncake trace's ``hash_ids``): there one random token per distinct id of the workload's own
    (``Workload.prompt_token_ids``, as the simulator's prefix cache sees them), so that equal blocks stay equal and
    the engine's prefix cache hits where the simulator's does. (Random prompts there left the engine prefilling the
    512 shared tokens of each Mooncake conversation the simulator found cached: the schedules parted at the second
    step.)"""
    generator = np.random.default_rng(seed)
    if not workload.has_shared_prefixes:
        return [generator.integers(0, vocab_size, int(length)).tolist() for length in workload.prompt_tokens]
    ids = [workload.prompt_token_ids(index) for index in range(len(workload))]
    distinct, inverse = np.unique(np.concatenate(ids), return_inverse=True)
    tokens = generator.integers(0, vocab_size, len(distinct))[inverse]
    return [prompt.tolist() for prompt in np.split(tokens, np.cumsum([len(prompt) for prompt in ids])[:-1])]


def warm_up_blocks(prompts: list[list[int]], params: list[SamplingParams], engine: EngineConfig) -> int:
    """The blocks ``warm_up``'s engines can use: its requests' prompts and steps, and enough for the largest request
    to be accepted at all (the engine refuses one that could never fit its pool)."""
    queued = list(itertools.islice(zip(prompts, params), engine.max_num_seqs))
    blocks = lambda tokens: -(-tokens // engine.block_size)  # noqa: E731
    steps = sum(p.n * blocks(len(prompt) + WARM_UP_STEPS + 1) for prompt, p in queued)
    return max(1, steps, *(p.n * blocks(len(prompt) + p.max_tokens) for prompt, p in queued))


def warm_up(hf_model, engine: EngineConfig, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Run the start of a workload, as many of its requests queued at once as a step can admit, for
    ``WARM_UP_STEPS`` steps on each of ``WARM_UP_RUNS`` throw-away engines. Its first step is then the largest this
    process has run (a prefill of the whole token budget), so the timed run's steps find their activations' memory
    already mapped, as a long-running engine's do and the profile's (after its warm-up round) did. A fixed warm-up
    of 8 x 64 tokens left the timed run's first prefill to fault in its memory: on the tiny model a 39-prompt
    prefill took 8,000 page faults and 48 ms instead of 39, and a 48-request twin's TTFT p50 came out 10-16 % low
    in four runs. One throw-away engine left 30-2,000 faults, two about 30."""
    for _ in range(WARM_UP_RUNS):
        warm = LLMEngine(hf_model, engine)
        for prompt, sampling in itertools.islice(zip(prompts, params), engine.max_num_seqs):
            warm.add_request(prompt, sampling)
        for _ in range(WARM_UP_STEPS):
            if warm.has_unfinished():
                warm.step()


def _real_metrics(engine: LLMEngine, started: float, peak_blocks: int) -> dict:
    outputs = engine.finished
    requests = pd.DataFrame({"arrival_s": [o.arrival_s - started for o in outputs],
                             "first_token_s": [o.first_token_s - started for o in outputs],
                             "finish_s": [o.finish_s - started for o in outputs],
                             "output_tokens": counted_tokens([[len(s) for s in o.outputs] for o in outputs])})
    makespan = float(requests["finish_s"].max())
    generated = sum(len(s) for o in outputs for s in o.outputs)
    return {"throughput_tok_s": generated / makespan, **latency_summary(requests), "makespan_s": makespan,
            "peak_blocks_in_use": peak_blocks, "preemptions": engine.num_preemptions,
            "requests": request_latencies(requests)}


def run_simulated(workload: Workload, config: SimConfig, repeats: int = 5) -> tuple[dict, pd.DataFrame, float]:
    """The simulator's metrics, step log and wall time: the median of ``repeats`` runs (the runs are identical;
    the first one pays one-off costs such as lazy imports)."""
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = Simulator(workload, config).run()
        walls.append(time.perf_counter() - started)
    wall = float(np.median(walls))
    summary = result.summary
    steps = result.steps
    metrics = {name: summary[name] for name in METRICS if name in summary}
    metrics.update(makespan_s=summary["simulated_time_s"], peak_blocks_in_use=int(steps["blocks_in_use"].max()),
                   throughput_tok_s=summary["generated_tokens"] / summary["simulated_time_s"],
                   requests=request_latencies(result.requests), extrapolation=summary["profile_extrapolation"])
    return metrics, steps, wall


def replay(workload: Workload, config: SimConfig, admitted_after: list[int],
           idle_steps: dict[int, float] | None = None) -> pd.DataFrame:
    """The simulator driven step by step with each request queued after as many steps as the real run had taken
    when it queued it (and the steps that the real engine began after idling, ``{step: seconds idle}``, priced as
    such): the same schedule as the real run whatever the arrival times, so each step's modelled duration can be
    compared with the measured one. Returns the simulated step log."""
    sim = Simulator(workload, config, requests=[])
    scheduler, request, idle = sim.scheduler, 0, idle_steps or {}
    while request < len(workload) or scheduler.has_unfinished():
        while request < len(workload) and admitted_after[request] <= scheduler.num_steps:
            sim.queue_now(request)
            request += 1
        if scheduler.has_unfinished():
            sim.iterate(idle.get(scheduler.num_steps, 0.0))
    return sim.scheduler.step_log_frame()


def first_difference(real: pd.DataFrame, simulated: pd.DataFrame) -> str:
    """'' when the step logs agree in every column but ``duration_s``, else the first differing step."""
    if len(real) != len(simulated):
        shorter = min(len(real), len(simulated))
        if (real[PLAN_COLUMNS].iloc[:shorter].to_numpy() == simulated[PLAN_COLUMNS].iloc[:shorter].to_numpy()).all():
            return f"the real run took {len(real)} steps, the simulated one {len(simulated)}"
    length = min(len(real), len(simulated))
    mismatch = (real[PLAN_COLUMNS].iloc[:length].to_numpy() != simulated[PLAN_COLUMNS].iloc[:length].to_numpy())
    rows = np.flatnonzero(mismatch.any(axis=1))
    if not len(rows):
        return ""
    row = int(rows[0])
    return (f"step {row + 1}: real {real[PLAN_COLUMNS].iloc[row].to_dict()} vs simulated "
            f"{simulated[PLAN_COLUMNS].iloc[row].to_dict()}")


def run_twin(workload: Workload, config: TwinConfig, profile: Profile, repeats: int = 1,
             on_run: Callable[[RealRun, int, int], object] | None = None) -> TwinResult:
    """Run the workload through the engine ``repeats`` times and through the simulator. ``real`` is the median of
    the runs' values and ``noise_floor`` the largest relative distance of a run from it; the step logs, the replay
    and the CDFs use the first run. ``on_run(run, done, repeats)`` hears of each real run as it ends (a page's
    progress; the runs a Stop keeps, which ``compare`` takes as they are)."""
    profile.check_matches(model=config.model, block_size=config.engine.block_size)
    hf_model = load_model(config.model, config.engine)[0]
    parameter = next(hf_model.parameters())
    profile.check_matches(device=parameter.device.type, dtype=str(parameter.dtype),
                          backend=ModelRunner.resolve_attention_backend(hf_model, config.engine.attention_backend))
    runs = []
    for _ in range(repeats):
        runs.append(run_real(workload, config, hf_model))
        if on_run is not None:
            on_run(runs[-1], len(runs), repeats)
    return compare(workload, runs, profile)


def compare(workload: Workload, real_runs: list[RealRun], profile: Profile) -> TwinResult:
    """The simulator configured as the real runs' engine, on ``profile``, against the real runs (see
    ``run_twin``)."""
    repeats, first = len(real_runs), real_runs[0]
    real, real_steps, real_wall = first.metrics, first.steps, first.wall_s
    simulation = sim_config(first.engine, profile)
    simulated, simulated_steps, simulated_wall = run_simulated(workload, simulation)
    rows = []
    for name in METRICS:
        measured = [float(run.metrics[name]) for run in real_runs]
        real_value, simulated_value = float(np.median(measured)), float(simulated[name])
        row = {"metric": name, "real": real_value, "simulated": simulated_value,
               "rel_error": _relative(simulated_value, real_value)}
        if repeats > 1:
            row["noise_floor"] = max(_relative(value, real_value) for value in measured)
        rows.append(row)
    difference = first_difference(real_steps, simulated_steps)
    rows.append({"metric": "schedule_identical", "real": 1.0, "simulated": float(difference == ""),
                 "rel_error": 0.0 if difference == "" else 1.0})
    replayed = replay(workload, simulation, first.admitted_after, first.idle_steps)
    replay_difference = first_difference(real_steps, replayed)
    rows.append({"metric": "replay_schedule_identical", "real": 1.0, "simulated": float(replay_difference == ""),
                 "rel_error": 0.0 if replay_difference == "" else 1.0})
    if replay_difference == "":
        errors = (replayed["duration_s"] - real_steps["duration_s"]).abs() / real_steps["duration_s"]
        rows.append({"metric": "replay_step_time_median", "real": float(real_steps["duration_s"].median()),
                     "simulated": float(replayed["duration_s"].median()), "rel_error": float(errors.median())})
    rows.append({"metric": "wall_time_s", "real": real_wall, "simulated": simulated_wall,
                 "rel_error": math.nan})
    return TwinResult(pd.DataFrame(rows), real_steps, simulated_steps, difference, real_wall, simulated_wall,
                      real["requests"], simulated["requests"], workload,
                      replayed if replay_difference == "" else None, simulated["extrapolation"])


def _relative(value: float, reference: float) -> float:
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - reference) / abs(reference)


@dataclass(slots=True)
class BenchModel:
    """How the fidelity benchmark runs one model on a CPU: its profile grid, its workload, its pool, and how many
    profile rounds and real runs per load it takes turns with."""

    grid: str
    num_requests: int
    input_len: int
    output_len: int
    num_blocks: int
    repeats: int
    light_requests: int = 0  # the light load's requests (0: num_requests)
    light_fraction: float = 0.35  # the light load's arrival rate, as a fraction of the saturated request throughput
    chunked_budget: int = 128  # the chunked load's tokens a step (max_num_batched_tokens), below the longer prompts


# Repeats and request counts per model: docs/digital_twin.md ("Why the bench's loads").
BENCH_MODELS = {
    "tiny": BenchModel("full", 128, 96, 32, 256, repeats=5),
    "qwen3-0.6b-random-4l": BenchModel("small", 16, 96, 24, 64, repeats=3, light_requests=32, light_fraction=0.2),
}


@dataclass(slots=True)
class TwinCase:
    """One workload on one engine configuration for ``calibrated_twins``. ``workload`` may be a callable that
    builds it from the real runs so far (``{case name: [RealRun]}``): a light load sized from a saturated run."""

    workload: Workload | Callable[[dict], Workload]
    engine: EngineConfig


def calibrated_twins(model: str, cases: dict[str, TwinCase], grid: str = "full", repeats: int = 3,
                     progress: Callable[[str], None] | None = None) -> tuple[Profile, dict[str, TwinResult]]:
    """Profile ``model`` and run every case through the engine ``repeats`` times, taking turns: a warm-up round,
    then per repeat one measured profile round (``lab.profiling.profile.Profiler``) and one real run of each case, in order.
    A shared machine's slow spells, which last seconds to minutes, then fall on the calibration and on the runs it
    predicts alike. Returns the profile and each case compared with the simulator on it (``compare``). The cases
    share one block size and device (the profile's)."""
    from lab.profiling.profile import Profiler

    engines = [case.engine for case in cases.values()]
    if len({(engine.block_size, engine.device) for engine in engines}) != 1:
        raise InputError("calibrated_twins: every case needs the same block_size and device (one profile)")
    say = progress or (lambda message: None)
    say(f"{model}: warming up the profiler ({grid} grid)")
    profiler = Profiler(model, engines[0].device, engines[0].block_size, grid=grid)
    profiler.run_round()
    workloads, runs = {}, {name: [] for name in cases}
    for repeat in range(repeats):
        say(f"{model}: profile round {repeat + 1} of {repeats}")
        profiler.run_round()
        for name, case in cases.items():
            if name not in workloads:
                workloads[name] = case.workload(runs) if callable(case.workload) else case.workload
            say(f"{model}: real run {repeat + 1} of {repeats}, {name}")
            runs[name].append(run_real(workloads[name], TwinConfig(model, case.engine), profiler.hf_model))
    profile = profiler.result()
    return profile, {name: compare(workloads[name], runs[name], profile) for name in cases}


def bench_twin(models=("tiny", "qwen3-0.6b-random-4l"), repeats: int | None = None, block_size: int = 16,
               device: str | None = None, light_fraction: float | None = None,
               progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """The fidelity benchmark: per model, profile the engine and run the twin saturated (every request at t = 0),
    at a light load (Poisson arrivals at ``light_fraction`` of the saturated run's request throughput, so it is
    light on any machine; ``None``: the model's ``BenchModel.light_fraction``) and saturated under chunked prefill
    (``BenchModel.chunked_budget`` tokens a step, so long prompts are spread over steps beside the decodes), the
    profile's rounds and the real runs taking turns (``calibrated_twins``). One row per (model, load, metric) with
    the error, the real run-to-run noise floor, and how much faster than real time the simulator ran."""
    unknown = [m for m in models if m not in BENCH_MODELS]
    if unknown:
        raise InputError(f"no benchmark settings for {', '.join(unknown)}; known: {', '.join(BENCH_MODELS)}")
    rows = []
    for model in models:
        setup = BENCH_MODELS[model]

        def workload(rate: float, num_requests: int = setup.num_requests) -> Workload:
            return synthetic_workload(SyntheticSpec(preset="random", num_requests=num_requests,
                                                    input_len=setup.input_len, output_len=setup.output_len,
                                                    range_ratio=0.5, rate=rate, seed=1))

        def light(runs: dict) -> Workload:
            fraction = setup.light_fraction if light_fraction is None else light_fraction
            return workload(fraction * setup.num_requests / runs["saturated"][0].metrics["makespan_s"],
                            setup.light_requests or setup.num_requests)

        engine = EngineConfig(block_size=block_size, num_blocks=setup.num_blocks, device=device)
        chunked = replace(engine, scheduling="chunked", max_num_batched_tokens=setup.chunked_budget)
        at_once = workload(math.inf)  # the saturated and the chunked load: one workload, two schedulers
        profile, results = calibrated_twins(model, {"saturated": TwinCase(at_once, engine),
                                                    "light": TwinCase(light, engine),
                                                    "chunked": TwinCase(at_once, chunked)}, setup.grid,
                                            repeats or setup.repeats, progress)
        rows.append({"model": model, "load": "profile", "metric": "holdout_median_rel_error", "real": math.nan,
                     "simulated": math.nan, "rel_error": profile.holdout_median_rel_error})
        for load, result in results.items():
            rows.append({"model": model, "load": load, "metric": "arrival_rate_req_s",
                         "real": result.workload.summary()["rate_req_s"], "simulated": math.nan, "rel_error": math.nan})
            rows.append({"model": model, "load": load, "metric": "num_requests", "real": float(len(result.workload)),
                         "simulated": math.nan, "rel_error": math.nan})
            rows += [{"model": model, "load": load, **row} for row in result.table.to_dict("records")]
            rows.append({"model": model, "load": load, "metric": "speedup_vs_real_time", "real": result.real_wall_s,
                         "simulated": result.simulated_wall_s,
                         "rel_error": result.real_wall_s / result.simulated_wall_s})
    return pd.DataFrame(rows)
