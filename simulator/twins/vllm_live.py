"""The vLLM twin live: one workload sent to a vLLM server in a background thread while the simulator's prediction of
it is drawn beside what was measured so far (the vLLM twin page; ``simulator.twins.vllm_twin`` is the twin itself)."""
from __future__ import annotations

import math
import threading

import numpy as np
import pandas as pd

from lab.latency import request_latencies
from lab.models.qwen3 import checkpoint_vocab_size
from lab.profiling.profile import Profile, ProfileError
from lab.report.trust import HOLDOUT_LIMIT
from lab.peer.server import (ServerRun, VLLMServer, check_server, reset_prefix_cache, run_server_workload,
                             server_cache_config)

from .vllm_twin import (ServerCalibration, VLLMTwinConfig, calibrate, calibrate_server, make_twin_workload,
                        probe_server, profile_cache_path, score, server_requests, sim_config, simulate_run)

LIVE_WINDOW_S = 0.25  # the twin's tokens/s is counted per window of this many seconds (the real one per reading)


def _holdout_error(profile: Profile) -> float:
    """``profile``'s median error on held-out steps; infinite when unknown."""
    error = profile.holdout_median_rel_error
    return math.inf if math.isnan(error) else error


class Phase:
    """Where a live run is (``LiveTwin.phase``)."""

    CALIBRATING, STARTING, RUNNING, DONE, FAILED = "calibrating", "starting the server", "running", "done", "failed"


class LiveTwin:
    """One workload sent to a vLLM server in a background thread (``start``) while the caller polls ``snapshot()``
    for what was measured so far; the twin's prediction on the workload's planned arrival times is ready before the
    first request, and is re-run on the actual send times at the end (``table``, the scores). A server the run
    started is stopped when it ends, however it ends; ``stop()`` ends the workload early and keeps what was
    measured. ``profile``: a vLLM profile to reuse (else the cached one for these settings, or, with ``remeasure``
    or none cached, measured first and cached; ``profile_source`` says which)."""

    def __init__(self, config: VLLMTwinConfig, checkpoint: str, workload: str, profile: Profile | None = None,
                 calibration: ServerCalibration | None = None, remeasure: bool = False):
        self.config, self.checkpoint, self.profile, self.calibration = config, checkpoint, profile, calibration
        self.remeasure, self.profile_source = remeasure, "given"
        self.workload = make_twin_workload(workload, config, config.seed)
        self.phase, self.error, self.prediction, self.table = Phase.CALIBRATING, "", None, None
        self.run: ServerRun | None = None
        self.cache: dict | None = None
        self.step_overhead_s = math.nan  # the calibrated step overhead shifted as probed around the run
        self.request_overhead_s = math.nan  # and the request overhead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="vllm-twin")

    def start(self) -> "LiveTwin":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED)

    def snapshot(self) -> ServerRun | None:
        """What was measured so far (None before the first request)."""
        return self.run

    def _cached_profile(self) -> Profile:
        """The profile for these settings from the cache (``profile_cache_path``), else measured now and stored. A
        cached profile whose held-out error is past ``HOLDOUT_LIMIT`` (measured while the machine was busy) is
        measured again once; the one with the lower held-out error is kept and used."""
        path = profile_cache_path(self.config)
        cached = None
        if path.exists() and not self.remeasure:
            try:
                cached = Profile.load(path)
            except ProfileError:
                pass  # a corrupt or older file: measured again below
            else:
                if _holdout_error(cached) <= HOLDOUT_LIMIT:
                    self.profile_source = f"loaded from {path}"
                    return cached
        profile = calibrate(self.config, self.checkpoint, progress=lambda _: None)
        if cached is not None:
            before = (f"the cached one was {cached.holdout_median_rel_error:.0%} off on held-out steps"
                      if math.isfinite(_holdout_error(cached)) else "the cached one had no held-out error")
            if _holdout_error(profile) >= _holdout_error(cached):
                self.profile_source = (f"loaded from {path}; measured again because {before}, and the new one was "
                                       f"{profile.holdout_median_rel_error:.0%} off, so the cached one is kept")
                return cached
            self.profile_source = f"measured now because {before}, kept in {path}"
        else:
            self.profile_source = f"measured now, kept in {path}"
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
        return profile

    def _main(self) -> None:
        server = None
        try:
            vocab = checkpoint_vocab_size(self.checkpoint)
            if self.config.url is not None:
                check_server(self.config.url)  # a URL with no vLLM behind it fails now, not after the calibration
            if self.profile is None:
                self.profile = self._cached_profile()
            self.phase = Phase.STARTING
            if self.config.url is None:
                server = VLLMServer(self.config.peer_settings(self.checkpoint))
                url = server.url
            else:
                url = self.config.url
            model = check_server(url)
            self.cache = server_cache_config(url)
            simulation = sim_config(self.config, self.cache, self.profile)
            if self.calibration is None:
                self.calibration = calibrate_server(url, model, simulation, vocab, self.config.seed + 7,
                                                    self.config.calibration_repeats)
            priced = self.calibration.applied(simulation, self.profile)
            shift = probe_server(url, model, priced, self.calibration, vocab, self.config.seed + 500)
            now = self.calibration.shifted(*shift)  # the overheads as probed before the run
            simulation = now.applied(simulation, self.profile)
            self.step_overhead_s, self.request_overhead_s = now.step_overhead_s, now.request_overhead_s
            planned = ServerRun(pd.DataFrame({"sent_s": self.workload.arrival_s}), pd.DataFrame(),
                                pd.DataFrame(), 0.0, 0.0)
            self.prediction = simulate_run(self.workload, planned, simulation, now)
            reset_prefix_cache(url)
            self.phase = Phase.RUNNING

            def seen(run: ServerRun) -> None:
                self.run = run

            requests = server_requests(self.workload, vocab, self.config.seed + 1)
            self.run = run_server_workload(url, requests, model, events=server.events if server else None,
                                           stop=self._stop, poll_s=self.config.poll_s, progress=seen)
            if self.run.requests["sent_s"].notna().any():
                if not self.run.stopped:  # and after it: the prediction of the run is priced with both
                    after = probe_server(url, model, priced, self.calibration, vocab, self.config.seed + 501)
                    now = self.calibration.shifted(*np.mean([shift, after], axis=0))  # as run_vllm_twin does
                    simulation = now.applied(simulation, self.profile)
                self.step_overhead_s, self.request_overhead_s = now.step_overhead_s, now.request_overhead_s
                self.prediction = simulate_run(self.workload, self.run, simulation, now)
                self.table = score(self.workload, self.run, simulation, now, self.prediction)
            self.phase = Phase.DONE
        except Exception as exc:  # shown on the page; the thread must not die silently
            self.error, self.phase = f"{type(exc).__name__}: {exc}", Phase.FAILED
        finally:
            if server is not None:
                server.close()


def live_series(twin: LiveTwin) -> dict[str, pd.DataFrame]:
    """The live page's series, one frame each, real and predicted on the same time axis (seconds from the run's
    start): ``kv_usage`` (%), ``queues`` (running and waiting requests), ``tokens_per_s`` (generated tokens per
    second between readings; the twin's per step window of 0.25 s) and ``latency`` (per request: TTFT and ITL, ms).
    Empty frames before there is anything to draw."""
    run, prediction = twin.snapshot(), twin.prediction
    frames = {}
    usable = (twin.cache["num_gpu_blocks"] - 1) if twin.cache else 1
    real_metrics = run.metrics if run is not None else pd.DataFrame(columns=["t_s"])
    rows = []
    if len(real_metrics):
        rows.append(pd.DataFrame({"t_s": real_metrics["t_s"], "kv_usage_pct": real_metrics["kv_usage"] * 100,
                                  "running": real_metrics["running"], "waiting": real_metrics["waiting"],
                                  "source": "vLLM server"}))
    if prediction is not None and len(prediction.timeseries):
        series = prediction.timeseries
        rows.append(pd.DataFrame({"t_s": series["elapsed_s"], "kv_usage_pct": series["blocks_in_use"] / usable * 100,
                                  "running": series["num_running"], "waiting": series["num_waiting"],
                                  "source": "twin (simulator)"}))
    joined = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(
        columns=["t_s", "kv_usage_pct", "running", "waiting", "source"])
    frames["kv_usage"] = joined[["t_s", "kv_usage_pct", "source"]]
    frames["queues"] = joined.melt(id_vars=["t_s", "source"], value_vars=["running", "waiting"], var_name="queue",
                                   value_name="requests")
    throughput = []
    if len(real_metrics) >= 2:
        tokens = real_metrics["generation_tokens"].diff() / real_metrics["t_s"].diff()
        throughput.append(pd.DataFrame({"t_s": real_metrics["t_s"], "tokens_per_s": tokens,
                                        "source": "vLLM server"}).dropna())
    if prediction is not None and len(prediction.timeseries):
        series = prediction.timeseries
        bins = np.floor(series["elapsed_s"] / LIVE_WINDOW_S) * LIVE_WINDOW_S
        generated = series["generated_tokens"].groupby(bins).max().diff().fillna(0) / LIVE_WINDOW_S
        throughput.append(pd.DataFrame({"t_s": generated.index + LIVE_WINDOW_S, "tokens_per_s": generated.values,
                                        "source": "twin (simulator)"}))
    frames["tokens_per_s"] = pd.concat(throughput, ignore_index=True) if throughput else pd.DataFrame(
        columns=["t_s", "tokens_per_s", "source"])
    latency = []
    if run is not None:
        done = run.requests[run.requests["finish_s"].notna()]
        latency.append(_latency_rows(done.index, done.rename(columns={"sent_s": "arrival_s"}), "vLLM server"))
    if prediction is not None:
        latency.append(_latency_rows(np.arange(len(prediction.requests)), prediction.requests, "twin (simulator)"))
    frames["latency"] = pd.concat(latency, ignore_index=True) if latency else pd.DataFrame(
        columns=["request", "ttft_ms", "itl_ms", "source"])
    return frames


def _latency_rows(index, requests: pd.DataFrame, source: str) -> pd.DataFrame:
    """The latency frame's rows of ``requests`` (``lab.latency``'s TTFT and ITL, ms); unfinished ones NaN."""
    table = request_latencies(requests["arrival_s"], requests["first_token_s"], requests["finish_s"],
                              requests["output_tokens"])
    return pd.DataFrame({"request": index, "ttft_ms": table["ttft_s"].to_numpy() * 1e3,
                         "itl_ms": table["itl_s"].to_numpy() * 1e3, "source": source})
