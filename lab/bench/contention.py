"""Serving speed with one core busy elsewhere, as where users run the lab (beside a browser, a Streamlit server, an
IDE): ``BackgroundLoad`` keeps a busy process on one core; ``run_contention_bench`` runs the paged engine under each
thread policy and HF continuous batching on the ``lab bench e2e`` workload, quiet and loaded in alternation, and
reports each system's slowdown and the paged / HF ratio both ways."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import pandas as pd

from lab.bench.e2e import run_hf_continuous, run_paged_engine
from lab.engine import EngineConfig, LLMEngine
from lab.engine.live import random_requests
from lab.errors import InputError
from lab.peer.client import _die_with_parent
from lab.worker.threads import allowed_cores

BUSY_LOOP = "while True:\n    pass\n"
QUIET, LOADED = "quiet", "one core busy"  # a run's load column


def _pin_and_die_with_parent(core: int):
    def setup() -> None:
        os.sched_setaffinity(0, {core})
        _die_with_parent()
    return setup


class BackgroundLoad:
    """A busy process pinned to one core (by default the last this process may use) while the block runs; it dies
    with this process."""

    def __init__(self, core: int | None = None):
        cores = sorted(allowed_cores())
        self.core = cores[-1] if core is None else core
        if self.core not in cores:
            raise InputError(f"background load core {self.core} is not one this process may use ({cores})")
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "BackgroundLoad":
        self.process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=_pin_and_die_with_parent(self.core),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.2)  # running before the measurement starts
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass(slots=True)
class ContentionConfig:
    """The ``lab bench e2e`` workload (smaller by default: every system runs it quiet and loaded, ``repeats`` times)."""

    model: str = "tiny"
    num_requests: int = 32
    prompt_range: tuple[int, int] = (16, 512)
    output_range: tuple[int, int] = (16, 128)
    block_size: int = 16
    repeats: int = 3
    seed: int = 0
    threads: tuple = (None, 1, 0)  # the paged engine's EngineConfig.cpu_threads (0: every core it may use)


def _policy_name(threads: int | None) -> str:
    if threads is None:
        return "paged engine (threads measured)"
    return f"paged engine ({threads} thread{'s' if threads > 1 else ''})"


def run_contention_bench(config: ContentionConfig, progress=None) -> pd.DataFrame:
    """One row per (system, load, repeat), then per system the medians quiet and loaded, the slowdown (loaded /
    quiet wall time) and each paged row's ratio to HF continuous batching quiet and loaded. Loads and systems
    alternate in order from one repeat to the next, so a slow spell of the machine touches all."""
    if len(allowed_cores()) < 2:
        raise InputError("the contention bench needs two cores or more: one is kept busy")
    engine = LLMEngine(config.model, EngineConfig(block_size=config.block_size, max_num_seqs=config.num_requests,
                                                  max_num_batched_tokens=4096))
    prompts, outputs = random_requests(config.num_requests, config.prompt_range, config.output_range,
                                       engine.hf_model.config.vocab_size, config.seed)
    threads = [len(allowed_cores()) if t == 0 else t for t in config.threads]
    threads = {_policy_name(t): t for t in threads}
    runners = {name: (lambda p, o, t=t: run_paged_engine(engine, p, o, cpu_threads=t)) for name, t in threads.items()}
    runners["hf-continuous"] = lambda p, o: run_hf_continuous(engine.hf_model, p, o)
    for runner in runners.values():
        runner(prompts[:2], [4, 4])  # warm-up
    rows, total = [], 2 * len(runners) * config.repeats
    for repeat in range(config.repeats):
        loads = (False, True) if repeat % 2 == 0 else (True, False)
        for loaded in loads:
            names = list(runners) if repeat % 2 == 0 else list(runners)[::-1]
            for name in names:
                if loaded:
                    with BackgroundLoad():
                        result = runners[name](prompts, outputs)
                else:
                    result = runners[name](prompts, outputs)
                rows.append({"system": name, "load": LOADED if loaded else QUIET, "repeat": repeat,
                             "wall_s": result["wall_s"], "output_tok_s": result["output_tokens"] / result["wall_s"]})
                if progress:
                    progress(len(rows), total)
    return summarize(pd.DataFrame(rows), config)


def summarize(runs: pd.DataFrame, config: ContentionConfig) -> pd.DataFrame:
    """Per system: median tok/s quiet and loaded (with the spread), slowdown, and the ratio to HF continuous."""
    out = []
    for system, part in runs.groupby("system", sort=False):
        quiet, loaded = (part[part["load"] == load]["output_tok_s"] for load in (QUIET, LOADED))
        out.append({"system": system, "quiet_tok_s": statistics.median(quiet),
                    "quiet_min_max": f"{quiet.min():,.0f}-{quiet.max():,.0f}",
                    "loaded_tok_s": statistics.median(loaded),
                    "loaded_min_max": f"{loaded.min():,.0f}-{loaded.max():,.0f}",
                    "slowdown": statistics.median(quiet) / statistics.median(loaded)})
    table = pd.DataFrame(out)
    hf = table.set_index("system").loc["hf-continuous"]
    table["vs_hf_quiet"] = table["quiet_tok_s"] / hf["quiet_tok_s"]
    table["vs_hf_loaded"] = table["loaded_tok_s"] / hf["loaded_tok_s"]
    table["ratio_change"] = table["vs_hf_loaded"] / table["vs_hf_quiet"] - 1
    table["model"], table["num_requests"], table["repeats"] = config.model, config.num_requests, config.repeats
    return table
