"""The client of a real vLLM server (``lab.peer.server``) without one: its /metrics and KV-event frames as recorded
from vLLM 0.32's server (``tests/data/vllm_server/``), and a stand-in server (aiohttp) that is not vLLM, dies
mid-stream, stalls or answers garbage. Every failure must end the run in bounded time with a message naming it and
keep what was measured. The same client against the real server: ``tests/test_vllm_twin.py``."""
import asyncio
import base64
import json
import math
import sys
import threading
import time
from pathlib import Path

import msgspec
import pandas as pd
import pytest
import zmq
from aiohttp import web

from lab.peer import server as vllm_server
from lab.peer.client import PeerError, PeerSettings
from lab.peer.server import (KVEventListener, ServerRequest, VLLMServer, check_server, decode_frame, parse_metrics,
                             run_server_workload)

DATA = Path(__file__).parent / "data" / "vllm_server"


def recorded_frames() -> list[list[bytes]]:
    """KV-event messages vLLM's server published (two prompts sharing a prefix, then nine that evict blocks)."""
    return [[base64.b64decode(part) for part in frame] for frame in json.loads((DATA / "kv_events.json").read_text())]


def test_recorded_metrics_parse():
    values = parse_metrics((DATA / "metrics.txt").read_text())
    assert values["kv_usage"] == 0.0 and values["running"] == 0.0 and values["waiting"] == 0.0
    assert values["preemptions"] == 0.0
    assert values["prefix_queries"] > values["prefix_hits"] > 0  # the shared prefix hit
    assert values["generation_tokens"] > 0 and values["prompt_tokens"] >= values["prefix_queries"]


def test_a_metrics_text_that_does_not_parse_is_named():
    text = (DATA / "metrics.txt").read_text()
    line = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running{"))
    broken = text.replace(line, line.rsplit(" ", 1)[0] + " not-a-number", 1)
    with pytest.raises(PeerError, match="does not parse as Prometheus text"):
        parse_metrics(broken)
    with pytest.raises(PeerError, match="none of vLLM's series"):
        parse_metrics("# HELP up whether\n# TYPE up gauge\nup 1\n")


def test_recorded_kv_events_decode():
    listener = KVEventListener.bound()
    try:
        for frame in recorded_frames():
            listener.add(frame)
        events = listener.frame()
    finally:
        listener.close()
    assert listener.bad_frames == 0 and listener.missed_frames == 0
    stored = events.loc[events["kind"] == "stored", "blocks"].sum()
    removed = events.loc[events["kind"] == "removed", "blocks"].sum()
    assert (len(events[events["kind"] == "stored"]), len(events[events["kind"] == "removed"])) == (10, 32)
    cached = set()  # the recording starts mid-life: some removed blocks were stored before it
    for frame in recorded_frames():
        for event in msgspec.msgpack.decode(frame[2])[1]:
            (cached.update if event["type"] == "BlockStored" else cached.difference_update)(event["block_hashes"])
    assert events["cached_blocks"].iloc[-1] == len(cached) > 0 and stored > removed
    assert events["ts"].is_monotonic_increasing


def test_bad_and_missing_event_frames_are_counted_not_raised():
    frames = recorded_frames()
    listener = KVEventListener.bound()
    try:
        listener.add(frames[0])
        listener.add([frames[1][0], frames[1][1], b"\x93not msgpack of a batch"])
        listener.add(frames[1][:2])  # two parts
        listener.add(frames[4])  # frames 1-3 never arrived
    finally:
        listener.close()
    assert listener.bad_frames == 2 and listener.missed_frames == 3
    assert "does not decode" in listener.problems[0] and "2 parts" in listener.problems[1]
    assert len(listener.frame()) == 2  # the two good frames' events are kept
    with pytest.raises(PeerError, match="does not decode"):
        decode_frame([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": "Unknown"}]])])


def test_events_arrive_over_zmq_from_a_publisher_that_connects():
    """As vLLM's publisher does for a non-wildcard endpoint (ZmqEventPublisher._socket_setup)."""
    listener = KVEventListener.bound()
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.connect(listener.endpoint)
    try:
        frames = recorded_frames()
        deadline = time.monotonic() + 10
        sent = 0
        while time.monotonic() < deadline and len(listener.frame()) < 42:
            if sent < len(frames):  # a PUB drops what it sends before the connection is up: resend from the start
                publisher.send_multipart(frames[sent])
                sent += 1
            else:  # the first frames may have gone before the connection was up: send them all again
                time.sleep(0.2)
                if len(listener.frame()) < 42:
                    sent = 0
        events = listener.frame()
    finally:
        publisher.close(linger=0)
        context.term()
        listener.close()
    assert len(events) >= 42 and set(events["kind"]) == {"stored", "removed"}


# ---- a stand-in server -----------------------------------------------------------------------------------------

class FakeServer:
    """An aiohttp server on a free port in a thread: /v1/models, /metrics (the recorded text, or ``metrics_text``
    once ``garbage_after`` reads have been answered) and streaming /v1/completions whose ``mode`` is ``ok``,
    ``dies`` (the connection closes after 2 tokens), ``stalls`` (no token after the first) or ``html`` (not
    vLLM at all)."""

    def __init__(self, mode: str = "ok", garbage_after: int | None = None):
        self.mode, self.garbage_after, self.metrics_reads = mode, garbage_after, 0
        self.metrics = (DATA / "metrics.txt").read_text()
        self.port = vllm_server.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready, self.loop = threading.Event(), None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _serve(self):
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.read_metrics)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    async def models(self, request):
        if self.mode == "html":
            return web.Response(text="<html>hello</html>", content_type="text/html")
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def read_metrics(self, request):
        self.metrics_reads += 1
        if self.garbage_after is not None and self.metrics_reads > self.garbage_after:
            return web.Response(text="vllm:kv_cache_usage_perc{engine=\"0\"} not-a-number\n")
        return web.Response(text=self.metrics)

    async def completions(self, request):
        body = await request.json()
        response = web.StreamResponse()
        await response.prepare(request)
        for index in range(body["max_tokens"]):
            if self.mode == "dies" and index == 2:
                request.transport.close()
                return response
            if self.mode == "stalls" and index == 1:
                await asyncio.sleep(5)
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [index]}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.002)
        await response.write(b"data: [DONE]\n\n")
        return response

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake(request):
    server = FakeServer(*getattr(request, "param", ("ok",)))
    yield server
    server.close()


def requests(count: int = 6, tokens: int = 8, gap_s: float = 0.01) -> list[ServerRequest]:
    return [ServerRequest([1, 2, 3], tokens, index * gap_s) for index in range(count)]


def test_a_clean_run_records_every_request_and_the_metrics(fake):
    run = run_server_workload(fake.url, requests(), poll_s=0.02)
    assert run.complete and not run.problems
    assert (run.requests["output_tokens"] == 8).all()
    assert (run.requests["first_token_s"] >= run.requests["sent_s"]).all()
    assert (run.requests["finish_s"] >= run.requests["first_token_s"]).all()
    assert len(run.metrics) >= 2 and run.metrics["t_s"].iloc[0] == 0.0  # a reading before the first request


@pytest.mark.parametrize("fake", [("html",)], indirect=True)
def test_a_url_that_is_not_vllm_is_named(fake):
    with pytest.raises(PeerError, match="is not a vLLM server"):
        check_server(fake.url)
    with pytest.raises(PeerError, match="no server answers"):
        check_server(f"http://127.0.0.1:{vllm_server.free_port()}")


@pytest.mark.parametrize("fake", [("dies",)], indirect=True)
def test_a_server_that_drops_streams_fails_those_requests_and_keeps_the_rest(fake):
    run = run_server_workload(fake.url, requests(), poll_s=0.05)
    assert not run.complete
    assert (run.requests["output_tokens"] == 2).all()  # what came before the drop is kept
    assert run.requests["first_token_s"].notna().all() and run.requests["finish_s"].isna().all()
    assert run.requests["error"].str.len().gt(0).all()
    assert any("failed after 2 tokens" in problem for problem in run.problems)


@pytest.mark.parametrize("fake", [("stalls",)], indirect=True)
def test_a_stalled_server_is_called_stalled_within_the_read_timeout(fake):
    started = time.perf_counter()
    run = run_server_workload(fake.url, requests(count=3), poll_s=0.05, read_timeout_s=0.5)
    assert time.perf_counter() - started < 10
    assert run.requests["error"].str.startswith("stalled").all()
    assert (run.requests["output_tokens"] == 1).all()


@pytest.mark.parametrize("fake", [("ok", 2)], indirect=True)
def test_metrics_that_stop_parsing_mid_run_are_reported_and_the_run_goes_on(fake):
    run = run_server_workload(fake.url, requests(count=4, tokens=40), poll_s=0.02)
    assert run.requests["finish_s"].notna().all()
    assert any("does not parse" in problem for problem in run.problems)
    assert len(run.metrics) >= 1  # the readings before the garbage stay


def test_stop_ends_the_run_and_keeps_what_was_measured(fake):
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    started = time.perf_counter()
    run = run_server_workload(fake.url, requests(count=20, tokens=8, gap_s=0.1), stop=stop, poll_s=0.05)
    timer.cancel()
    assert time.perf_counter() - started < 3 and run.stopped and not run.complete
    sent = run.requests["sent_s"].notna()
    assert 0 < sent.sum() < 20
    assert (run.requests.loc[~sent, "error"] == "not sent: stopped").all()
    assert run.requests.loc[sent, "finish_s"].notna().sum() >= 1


def test_a_server_that_never_gets_ready_or_exits_is_stopped_and_named(monkeypatch):
    """A spawned server that fails to start is named with its log, and its process group is gone."""
    monkeypatch.setattr(vllm_server, "missing_reason", lambda: None)
    spawned = []
    real_popen = vllm_server.subprocess.Popen

    def popen(command, **kwargs):
        process = real_popen(command, **kwargs)
        spawned.append(process)
        return process

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    monkeypatch.setattr(vllm_server, "server_command", lambda *args: [sys.executable, "-c", "import time; "
                                                                      "print('loading', flush=True); time.sleep(60)"])
    with pytest.raises(PeerError, match=r"did not answer /health within 1 s(.|\n)*loading"):
        VLLMServer(PeerSettings("unused"), start_timeout_s=1)
    assert spawned[-1].poll() is not None  # stopped
    monkeypatch.setattr(vllm_server, "server_command", lambda *args: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(PeerError, match="exited with code 3 while starting"):
        VLLMServer(PeerSettings("unused"), start_timeout_s=30)


def test_stream_times_count_from_the_send(fake):
    run = run_server_workload(fake.url, [ServerRequest([1], 4, 0.2)], poll_s=0.05)
    assert run.requests["sent_s"].iloc[0] >= 0.2 and not math.isnan(run.requests["finish_s"].iloc[0])


def flat_profile():
    """A vLLM profile whose every step takes 2 ms (blocks of 32)."""
    from lab.profiling.profile import Profile, feature_names

    coefficients = dict.fromkeys(feature_names([1]), 0.0) | {"constant": 0.002}
    return Profile("tiny", "cpu", "float32", 32, "vllm", coefficients, [1])


def test_the_live_twin_runs_against_a_server_and_draws_both_sides(fake, tmp_path):
    """``simulator.twins.vllm_live.LiveTwin`` on a URL (the stand-in server, which reports vLLM's recorded pool), a given
    profile and calibration: the prediction is ready, the run is measured, scored, and every live series has both
    sides."""
    from simulator.twins.vllm_live import LiveTwin, Phase, live_series
    from simulator.twins.vllm_twin import ServerCalibration, VLLMTwinConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000}))
    profile = flat_profile()
    config = VLLMTwinConfig(url=fake.url, num_requests=6, length_scale=0.05, poll_s=0.02)
    twin = LiveTwin(config, str(tmp_path), "all-at-once", profile, ServerCalibration(0.0005, 0.001, 0.0)).start()
    twin.join(60)
    assert twin.phase == Phase.DONE, twin.error
    assert twin.cache == {"block_size": 32, "num_gpu_blocks": 96, "enable_prefix_caching": True}
    assert twin.snapshot().complete and twin.table is not None and len(twin.table) == 9
    series = live_series(twin)
    for name in ("kv_usage", "queues", "tokens_per_s", "latency"):
        assert set(series[name]["source"]) == {"vLLM server", "twin (simulator)"}, name
    assert len(series["latency"]) == 2 * len(twin.workload)
    assert twin.step_overhead_s >= 0  # the calibrated overhead, shifted as probed before and after the run
    assert twin.request_overhead_s >= 0 and math.isfinite(twin.request_overhead_s)  # and the request overhead
    # a profile that measured nothing: every step is priced beyond it, which the page says beside the scores
    assert "(measured up to 0)" in twin.prediction.summary["profile_extrapolation"]
    # the page draws the finished run, and warns that this profile's error on held-out steps is unknown (a profile
    # cached from a busy machine, 262 % off, was drawn without a word)
    from streamlit.testing.v1 import AppTest

    page = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app_pages" / "vllm_twin.py"),
                             default_timeout=60)
    page.session_state["vllm_twin"] = twin
    page.run()
    assert not page.exception, [e.value for e in page.exception]
    warnings = " ".join(w.value for w in page.warning)
    assert "The profile of vLLM's engine has no held-out error" in warnings
    assert "Measure vLLM's engine again" in warnings


def test_the_vllm_twin_says_which_workloads_it_priced_beyond_the_profile():
    """Per workload, the first run whose steps went beyond the profile's measured range (what the CLI warns of)."""
    from types import SimpleNamespace

    from simulator.twins.vllm_twin import VLLMTwinResult

    beyond = "decode_kv_tokens up to 6,144 (measured up to 3,396)"
    runs = {("all-at-once", 0): "", ("prefix", 0): "", ("prefix", 1): beyond, ("prefix", 2): "other"}
    result = VLLMTwinResult(pd.DataFrame(), simulated={key: SimpleNamespace(summary={"profile_extrapolation": note})
                                                       for key, note in runs.items()})
    assert result.extrapolation() == {"prefix": beyond}
    assert VLLMTwinResult(pd.DataFrame()).extrapolation() == {}


def test_a_probed_step_overhead_shifts_the_calibration_and_never_below_none():
    from simulator.twins.vllm_twin import ServerCalibration

    calibration = ServerCalibration(0.002, 0.003, 0.001)
    assert calibration.shifted(0.0015).step_overhead_s == pytest.approx(0.0035)
    assert calibration.shifted(-0.005).step_overhead_s == 0.0  # the server's steps are never shorter than the engine's
    shifted = calibration.shifted(0.001)
    assert (shifted.request_overhead_s, shifted.request_interval_s) == (0.003, 0.001)
    assert calibration.shifted(0.0, 0.0015).request_overhead_s == pytest.approx(0.0045)  # probed around a run
    assert calibration.shifted(0.0, -0.01).request_overhead_s == 0.0  # never below none
    assert calibration.shifted(0.0, 0.0015).step_overhead_s == 0.002
    profile = flat_profile()
    assert shifted.priced(profile).coefficients["constant"] == pytest.approx(0.002 + 0.003)
    from simulator.core.engine import SimConfig

    simulation = shifted.applied(SimConfig(block_size=32, max_num_seqs=7), profile)
    assert simulation.max_num_seqs == 7 and simulation.profile.coefficients == shifted.priced(profile).coefficients


@pytest.mark.parametrize("cached_error, new_error, measured, kept", [
    (0.05, 0.02, 0, 0.05),  # a good cached profile is used as it is
    (2.62, 0.04, 1, 0.04),  # one measured while the machine was busy is measured again, and replaced
    (2.62, 3.10, 1, 2.62),  # ... unless the new one is worse: the better of the two is kept
    (math.nan, 0.04, 1, 0.04),  # one with no held-out error says nothing of its predictions
])
def test_a_cached_vllm_profile_far_off_on_held_out_steps_is_measured_again(tmp_path, monkeypatch, cached_error,
                                                                              new_error, measured, kept):
    from lab.profiling.profile import Profile
    from simulator.twins import vllm_live
    from simulator.twins.vllm_twin import VLLMTwinConfig

    path = tmp_path / "profiles" / "vllm.json"
    path.parent.mkdir()
    cached = flat_profile()
    cached.holdout_median_rel_error = cached_error
    cached.save(path)
    calls = []

    def calibrate(config, checkpoint, progress):
        calls.append(checkpoint)
        fresh = flat_profile()
        fresh.holdout_median_rel_error = new_error
        return fresh

    monkeypatch.setattr(vllm_live, "profile_cache_path", lambda config: path)
    monkeypatch.setattr(vllm_live, "calibrate", calibrate)
    twin = vllm_live.LiveTwin(VLLMTwinConfig(num_requests=3), str(tmp_path), "poisson")
    used = twin._cached_profile()
    assert len(calls) == measured
    assert used.holdout_median_rel_error == pytest.approx(kept)
    assert Profile.load(path).holdout_median_rel_error == pytest.approx(kept)  # the cache keeps the one used
    source = twin.profile_source  # the page says where the profile came from, and why it was measured again
    assert ("measured again" in source or "measured now" in source) == bool(measured) and str(path) in source


@pytest.mark.parametrize("fake", [("html",)], indirect=True)
def test_a_live_twin_on_a_url_that_is_not_vllm_fails_with_the_reason(fake, tmp_path):
    from simulator.twins.vllm_live import LiveTwin, Phase
    from simulator.twins.vllm_twin import VLLMTwinConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 1000}))
    profile = flat_profile()
    twin = LiveTwin(VLLMTwinConfig(url=fake.url, num_requests=3), str(tmp_path), "poisson", profile).start()
    twin.join(30)
    assert twin.phase == Phase.FAILED and "is not a vLLM server" in twin.error and twin.snapshot() is None
    # without a profile it fails as fast: the URL is checked before vLLM's engine would be measured
    twin = LiveTwin(VLLMTwinConfig(url=fake.url, num_requests=3), str(tmp_path), "poisson").start()
    twin.join(30)
    assert twin.phase == Phase.FAILED and "is not a vLLM server" in twin.error
