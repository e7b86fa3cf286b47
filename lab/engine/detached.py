"""Engine runs in a process of their own, for the app: the same public functions the CLI calls
(``lab.engine.live.run_runtime``, ``lab.bench.e2e.run_e2e_bench``), run in a fresh ``spawn`` process that reports back over a queue
(``run_runtime_detached``, ``lab.bench.e2e.run_e2e_bench_detached``).

Why: run inside the Streamlit server, the engine shared its process with the server's threads (websocket, protobuf,
the live redraws) and its cores with the browser. torch's intra-op threads then wait for each other at every
operator: measured on a 2-vCPU machine with one core busy elsewhere, the tiny model's runtime mix served 41-79 output
tokens/s with torch's 2 threads against 565-1,475 with 1 (docs/app.md, "The runtime page runs the engine in
another process"). A process of its own has the interpreter and its cores to itself, as ``python -m lab bench e2e``
has; its intra-op threads follow the engine's own policy (``EngineConfig.cpu_threads``), as the CLI's do."""
from __future__ import annotations

import multiprocessing
import pickle
import queue as queue_module
from typing import Callable

from lab.errors import LabError, user_errors

POLL_S = 0.05  # how often the parent looks at the queue and the child


class WorkerError(LabError):
    """The engine's process ended without a result (killed, out of memory, or it crashed)."""


def _child(function, payload, messages, stop) -> None:
    """The spawned process: ``function(payload, report)``, where ``report(message)`` sends a message to the parent
    and answers False once the parent asked to stop; then ("result", value) or ("error", exception)."""
    try:
        def report(message: tuple) -> bool:
            messages.put(message)
            return not stop.is_set()

        messages.put(("result", function(payload, report)))
    except BaseException as exc:  # every failure goes back to the page, which shows the lab's own as messages
        messages.put(("error", _portable(exc)))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling both ways (the queue unpickles in the parent, where an exception whose
    ``__init__`` takes other arguments than its message fails), else its text in a ``LabError`` (for what the app
    shows as a message: ``lab.errors.user_errors``) or a ``RuntimeError``."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        kind = LabError if isinstance(exc, user_errors()) else RuntimeError
        return kind(str(exc) if kind is LabError else f"{type(exc).__name__}: {exc}")


def run_detached(function: Callable, payload, on_message: Callable[[tuple], bool | None] | None = None):
    """``function(payload, report)`` (a module-level function: it is pickled by name) in a fresh ``spawn``
    process. Each ``report(message)`` of the child reaches ``on_message(message)`` here; when that returns False the child's next ``report`` answers False (stop).
    Returns the function's result; its exception is raised here, and ``WorkerError`` when the process dies."""
    context = multiprocessing.get_context("spawn")  # no fork of a threaded server (torch's threads, Streamlit's)
    messages, stop = context.Queue(), context.Event()
    process = context.Process(target=_child, args=(function, payload, messages, stop), daemon=True,
                              name="minipaged-engine")
    process.start()
    try:
        while True:
            try:
                message = messages.get(timeout=POLL_S)
            except queue_module.Empty:
                if process.is_alive():
                    continue
                try:  # its last message may land just after it exits
                    message = messages.get(timeout=1.0)
                except queue_module.Empty:
                    code = process.exitcode
                    why = (f"killed by signal {-code} (out of memory, or stopped from outside)" if code < 0 else
                           f"exit code {code}; its error went to the app server's log")
                    raise WorkerError(f"the engine's process ended without a result ({why})") from None
            if message[0] == "result":
                return message[1]
            if message[0] == "error":
                raise message[1]
            if on_message is not None and on_message(message) is False:
                stop.set()
    finally:
        stop.set()
        process.join(timeout=5)
        if process.is_alive():  # a page that reran (or a stopped run's process stuck in a step): not left behind
            process.kill()
            process.join()
        messages.close()
