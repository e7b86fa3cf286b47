"""Where a step's time goes, in our engine and in vLLM's CPU build, on the same step shapes (``python -m lab bench vllm
--profile``): prefills of one prompt and decode steps of a batch at a context, timed whole (median wall time) and
split by op kind with ``torch.profiler`` scopes around each engine's own ops. vLLM's side runs in the peer's process
(``lab/peer/driver.py``, which wraps vLLM's modules in scopes of the same names); the host path is what is left of
the step: building its tensors, bookkeeping, Python."""
from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import paged_kernels
from lab.engine import LLMEngine
from lab.models.qwen3 import save_checkpoint
from lab.peer.client import PeerSettings, VLLMPeer
from lab.engine.sampler import SamplingParams

# The op kinds of the table, in its order (the peer driver names its scopes alike); "host and other" is the rest.
KINDS = ("gemm", "attention", "norms, rotary, cache write", "activation", "sampling", "scheduler")
REST = "host and other"
# (kind, tokens): a prefill of one prompt of that many tokens; (kind, batch, context): a decode step of a batch
SHAPES = (("prefill", 32), ("prefill", 256), ("prefill", 2048), ("decode", 1, 128), ("decode", 16, 128),
          ("decode", 64, 128), ("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024))


@dataclass(slots=True)
class Shape:
    """One step shape: a prefill of ``tokens`` prompt tokens, or a decode step of ``batch`` sequences at
    ``context`` tokens."""

    kind: str
    tokens: int = 0
    batch: int = 0
    context: int = 0

    @classmethod
    def of(cls, spec: tuple) -> "Shape":
        return cls("prefill", tokens=spec[1]) if spec[0] == "prefill" else cls("decode", batch=spec[1], context=spec[2])

    def label(self) -> str:
        return f"prefill {self.tokens}" if self.kind == "prefill" else f"decode {self.batch} x {self.context}"

    def max_tokens(self, budget: int, steps: int) -> int:
        """A decode shape's output length: every request still decoding when the last prompt is prefilled (a budget
        of ``budget`` tokens a step), then ``steps`` warm, ``steps`` timed and ``steps`` profiled steps."""
        return -(-self.batch * self.context // budget) + 3 * steps + 8

    def prompts(self, salt: int) -> list[list[int]]:
        """Distinct prompts (ids below 1,000: every preset's vocabulary holds them), so nothing hits a cache."""
        count, length = (1, self.tokens) if self.kind == "prefill" else (self.batch, self.context)
        return [[(7 * j + 13 * i + salt) % 1000 for j in range(length)] for i in range(count)]


def scope_totals(prof, steps: int) -> dict[str, float]:
    """Milliseconds per step inside each kind's scopes (their CPU time, children included)."""
    totals = {kind: 0.0 for kind in KINDS}
    for event in prof.key_averages():
        if event.key in totals:
            totals[event.key] += event.cpu_time_total / 1e3 / steps
    return totals


def _scoped(kind: str, function):
    def wrapper(*args, **kwargs):
        with record_function(kind):
            return function(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def _our_scopes(engine: LLMEngine):
    """Scopes around our engine's ops while profiling (the functions and methods it calls, wrapped and restored)."""
    runner = engine.runner
    patches = [(runner, "linear", "gemm"), (runner, "_attention", "attention"), (paged_kernels, "rms_norm", "norms, rotary, cache write"),
               (paged_kernels, "qk_norm_rope_write", "norms, rotary, cache write"),
               (paged_kernels, "silu_and_mul", "activation"), (engine.sampler, "sample", "sampling"),
               (engine.scheduler, "schedule", "scheduler")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, kind in patches:
            setattr(owner, name, _scoped(kind, getattr(owner, name)))
        yield
    finally:
        for owner, name, original in saved:
            if owner is paged_kernels:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute goes; the class's method shows again


def profile_our_steps(engine: LLMEngine, shape: Shape, steps: int) -> dict:
    """``shape`` on our engine: the median wall time of ``steps`` steps, then ms per step by kind from as many
    profiled ones."""
    def step() -> float:
        started = time.perf_counter()
        engine.step()
        return time.perf_counter() - started

    walls, salt = [], 0
    if shape.kind == "prefill":
        def one_prefill(profiled=None):
            nonlocal salt
            salt += 1
            engine.add_request(shape.prompts(salt)[0], SamplingParams(max_tokens=1, ignore_eos=True))
            elapsed = step()
            while engine.has_unfinished():
                engine.step()
            return elapsed
        one_prefill()  # warm
        walls = [one_prefill() for _ in range(steps)]
        with _our_scopes(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                one_prefill()
            profiled = (time.perf_counter() - started) / steps * 1e3
    else:
        for prompt in shape.prompts(0):
            engine.add_request(prompt, SamplingParams(max_tokens=shape.max_tokens(
                engine.scheduler.config.max_num_batched_tokens, steps), ignore_eos=True))
        for _ in range(1000):  # bounded, as the peer's wait is
            if engine.last_plan is not None and engine.last_plan.num_decode_seqs == shape.batch \
                    and not engine.last_plan.num_prefill_tokens:
                break
            engine.step()
        else:
            raise RuntimeError(f"{shape.label()}: the batch was not all decoding after 1,000 steps")
        for _ in range(steps):  # warm, as vLLM's side is
            engine.step()
        walls = [step() for _ in range(steps)]
        with _our_scopes(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            profiled = (time.perf_counter() - started) / steps * 1e3
        while engine.has_unfinished():
            engine.step()
    return {"step_ms": statistics.median(walls) * 1e3, "profiled_ms": profiled, **scope_totals(prof, steps)}


def with_rest(row: dict) -> dict:
    """``row``'s kinds scaled from the profiled steps (the profiler slows a step down) to the step's wall time, and
    ``REST``: the wall time less the kinds'."""
    scale = row["step_ms"] / row["profiled_ms"] if row["profiled_ms"] else 0.0
    kinds = {kind: row[kind] * scale for kind in KINDS}
    return {"step_ms": row["step_ms"], **kinds, REST: max(0.0, row["step_ms"] - sum(kinds.values()))}


def run_step_profile(model: str = "tiny", dtype: str = "float32", steps: int = 5, shapes=SHAPES,
                     block_size: int = 32, progress=None) -> pd.DataFrame:
    """Both engines on each shape, same checkpoint, dtype, block size, budget (2,048 tokens, so the largest prefill
    is one step) and pool: one row per (shape, system) with ``step_ms`` and ms per step by kind, then a
    ``ours / vllm`` row of the step times per shape."""
    shapes = [Shape.of(spec) for spec in shapes]
    budget = max(2048, max(s.tokens for s in shapes))
    largest = max(max(s.tokens, s.batch * (s.context + s.max_tokens(budget, steps))) for s in shapes)
    num_blocks = 2 * -(-largest // block_size) + 64
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = save_checkpoint(model, Path(folder) / model, getattr(torch, dtype))
        settings = PeerSettings(str(checkpoint), dtype, block_size, num_blocks,
                                max_num_seqs=max(64, *(s.batch for s in shapes)), max_num_batched_tokens=budget,
                                max_model_len=budget + max(s.max_tokens(budget, steps) for s in shapes))
        engine = LLMEngine(str(checkpoint), block_size=block_size, num_blocks=num_blocks - 1,
                           max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=budget, scheduling="vllm",
                           enable_prefix_caching=False, dtype=getattr(torch, dtype))
        rows = []
        with VLLMPeer(settings) as peer:
            theirs = peer.profile([{"kind": s.kind, "prompts": s.prompts(0), "max_tokens": s.max_tokens(budget, steps)}
                                   for s in shapes], steps)
            for shape, their in zip(shapes, theirs["rows"]):
                ours = profile_our_steps(engine, shape, steps)
                for system, row, threads in (("ours", ours, torch.get_num_threads()),
                                             ("vllm", their, theirs["threads"])):
                    rows.append({"shape": shape.label(), "system": system, "threads": threads, **with_rest(row)})
                rows.append({"shape": shape.label(), "system": "ours / vllm", "threads": None,
                             "step_ms": ours["step_ms"] / their["step_ms"]})
                if progress:
                    progress(len(rows) // 3, len(shapes))
    table = pd.DataFrame(rows)
    table["model"], table["dtype"], table["block_size"] = model, dtype, block_size
    return table
