"""Every wait on a peer (an HTTP request to a server, a streamed answer, the peer process's next line) goes through a
``Deadline``: an overall limit on the whole wait, not a per-read timeout that a server dripping one header line a
second resets forever. An expired deadline is a ``PeerError`` naming the peer (its URL or process) and the limit."""
from __future__ import annotations

import asyncio
import math
import queue
import time
from dataclasses import dataclass

import aiohttp

from lab.checks import check_real
from lab.errors import LabError


class PeerError(LabError):
    """The vLLM peer (its process or its server) is missing, failed to start, answered with an error or did not
    answer in time (``Deadline``)."""


class Deadline:
    """``seconds`` from now for ``what`` (the peer and the question: ``GET http://host/metrics``)."""

    def __init__(self, seconds: float, what: str):
        check_real("Deadline", "seconds", seconds, 0.0, math.inf, low_open=True, error=PeerError)
        self.seconds, self.what = seconds, what
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; the deadline's ``PeerError`` when none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.error()
        return left

    def error(self) -> PeerError:
        """The error an expired deadline raises."""
        return PeerError(f"{self.what}: no complete answer within the deadline of {self.seconds:g} s")

    async def within(self, awaitable):
        """``awaitable``'s result, or the deadline's error once it expires (the awaitable cancelled)."""
        try:
            return await asyncio.wait_for(awaitable, self.left())
        except asyncio.TimeoutError:
            if time.monotonic() < self.end:  # the awaitable's own timeout (a stalled read), not the deadline
                raise
            raise self.error() from None

    def get(self, answers: queue.Queue):
        """The next item of ``answers`` (a peer process's lines), or the deadline's error."""
        try:
            return answers.get(timeout=self.left())
        except queue.Empty:
            raise self.error() from None


MAX_ANSWER_BYTES = 64 << 20  # a server's answer to one request (vLLM's /metrics is kilobytes)


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer read whole: its status and body."""

    status: int
    text: str


def http(method: str, url: str, deadline_s: float, json: dict | None = None) -> Answer:
    """``method url`` answered whole (headers and body) within ``deadline_s`` seconds, else a ``PeerError`` naming
    the URL and the deadline; a server that cannot be reached is one naming the URL and why."""
    deadline = Deadline(deadline_s, f"{method} {url}")

    async def ask() -> Answer:
        async with aiohttp.ClientSession() as session, session.request(method, url, json=json) as answer:
            body = bytearray()
            async for chunk in answer.content.iter_chunked(1 << 16):  # a bound on size, as the deadline is on time
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise PeerError(f"{method} {url}: the answer holds more than {MAX_ANSWER_BYTES:,} bytes (at "
                                    f"most {MAX_ANSWER_BYTES:,} are read): not the server expected")
            return Answer(answer.status, bytes(body).decode(answer.charset or "utf-8", errors="replace"))

    try:
        return asyncio.run(deadline.within(ask()))
    except aiohttp.ClientError as exc:
        reason = "connection refused: nothing listens there" if "refused" in str(exc).lower() else \
            f"{type(exc).__name__}: {exc}"
        raise PeerError(f"no server answers at {url} ({reason})") from None
