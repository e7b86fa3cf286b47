"""Runs of one workload side by side in worker processes (``compare(..., workers=N)``): a simulation is one
Python thread's work, so a comparison of several configurations uses the machine's other cores this way."""
from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import threading
import time
from typing import Callable

from .cluster import run_simulation
from .engine import SimConfig, SimResult
from .workloads import Workload

POLL_S = 0.05  # how often the caller's wait wakes to collect finished runs
# the caller hears of progress when a run finishes, else at most this often (a Streamlit page stops a run from its
# callback; each call there sends the browser a message: at every POLL_S they took ~18 % of the machine's CPU while
# the page waited on a comparison, measured by py-spy on the server)
PROGRESS_EVERY_S = 0.5
_pool: concurrent.futures.ProcessPoolExecutor | None = None
_pool_workers = 0
_lock = threading.Lock()


def pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """The process pool of ``workers`` processes, started once (forkserver: no fork of a threaded server) and
    kept, so a later comparison pays no start-up."""
    global _pool, _pool_workers
    with _lock:
        if _pool is None or _pool_workers != workers:
            if _pool is not None:
                _pool.shutdown(wait=False, cancel_futures=True)
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["simulator"])
            _pool, _pool_workers = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context), workers
            atexit.register(_pool.shutdown, wait=False, cancel_futures=True)  # before the interpreter tears down
        return _pool


def _run(workload: Workload, config: SimConfig) -> SimResult:
    return run_simulation(workload, config, snapshot_pool=False)


def run_in_processes(workload: Workload, configs: list[SimConfig], workers: int,
                     progress: Callable[[float], bool | None] | None = None,
                     on_result: Callable[[int, SimResult], None] | None = None) -> list[SimResult | None]:
    """Each config's result, in order, computed in ``workers`` processes. ``progress(fraction done)`` is called
    when a run finishes and at least every ``PROGRESS_EVERY_S`` while runs go on; when it returns False (or raises,
    as a page that reruns does) the runs not started are cancelled and those not finished come back as None.
    ``on_result(index, result)`` hears of each run as it finishes, so a stop loses none that did."""
    futures = [pool(workers).submit(_run, workload, config) for config in configs]
    done: set = set()
    told = time.monotonic()
    try:
        while len(done) < len(futures):
            finished, _ = concurrent.futures.wait(set(futures) - done, timeout=POLL_S,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            done |= finished
            if on_result is not None:
                for future in finished:
                    on_result(futures.index(future), future.result())
            if progress is None or not (finished or time.monotonic() - told >= PROGRESS_EVERY_S):
                continue
            told = time.monotonic()
            if progress(len(done) / len(futures)) is False:
                break
    finally:
        for future in futures:
            future.cancel()
    return [future.result() if future in done else None for future in futures]
