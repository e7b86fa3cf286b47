"""Our engine against vLLM's CPU build on the same checkpoint, workload, KV pool, block size and budgets, runs
alternating in one invocation: output tokens/s, TTFT and TPOT p50/p90, steps, preemptions and peak memory, medians
over the repeats, and the ratio ours / vLLM. vLLM runs in its own environment (``lab.peer``)."""
from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from lab.bench.contention import LOADED, QUIET, BackgroundLoad
from lab.bench.e2e import status_bytes
from lab.engine import LLMEngine, SamplingParams
from lab.engine.live import random_requests
from lab.latency import counted_tokens, request_latencies
from lab.models.qwen3 import PRESETS, save_checkpoint
from lab.peer.client import PeerSettings, VLLMPeer, serve

METRICS = ("output_tok_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "steps", "preemptions",
           "peak_memory_bytes")


FIXED_REPEATS = 5  # runs of each engine, fixed workload: vLLM's own TTFT p50 moved 30-44 ms between runs of 3
FAMILY_REPEATS = 3  # a random family's runs of each engine, each workload


@dataclass(slots=True)
class VLLMBenchConfig:
    """The checkpoint and workload both engines serve, and what they are given alike."""

    model: str = "tiny"  # a preset, saved as a checkpoint both load (lab.models.qwen3.save_checkpoint)
    dtype: str = "float32"
    num_requests: int = 32
    prompt_range: tuple[int, int] = (100, 400)
    output_range: tuple[int, int] = (80, 120)
    block_size: int = 32
    num_blocks: int = 512  # vLLM's count; ours is one fewer (vLLM keeps block 0 as its null block)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    repeats: int = FIXED_REPEATS
    seed: int = 0
    kv_cache_dtype: str = "auto"  # both engines' KV cache (vLLM's names); FP8: with vLLM's default scales of 1.0
    tie_margin: float = 0.5  # FP8: first tokens whose top-2 logit margin (ours, full-precision cache) is below it
    # are near ties, left out of the *_clear agreements (and, in the *_clear_2x ones, those below twice it)
    background_load: bool = False  # each repeat also with one core kept busy (lab.bench.contention.BackgroundLoad)


def _percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _latencies(arrival, first, finish, tokens) -> dict:
    """TTFT and TPOT p50/p90 of requests (``lab.latency``'s definitions; ``tokens``: each request's counted output
    tokens)."""
    table = request_latencies(arrival, first, finish, tokens)
    return {"ttft_p50_s": _percentile(table["ttft_s"], 50), "ttft_p90_s": _percentile(table["ttft_s"], 90),
            "tpot_p50_s": _percentile(table["tpot_s"], 50), "tpot_p90_s": _percentile(table["tpot_s"], 90)}


# A timed run starts this long after the last one ended, so that neither engine's first steps share the cores with
# the other's last work (in one measurement our first step right after vLLM's run took 105-167 ms against 40-60 ms,
# and a half-second gap removed the spike; later, vLLM's process was seen idle within 0.1 s of its runs).
QUIET_GAP_S = 0.5


def _ours(engine: LLMEngine, prompts, max_tokens, arrival_steps=None) -> dict:
    time.sleep(QUIET_GAP_S)
    steps_before, preempted_before = len(engine.step_log()), engine.step_log()["num_preempted"].sum()
    started = time.perf_counter()
    finished_before = len(engine.finished)
    run = serve(engine, prompts, max_tokens, arrival_steps, record_steps=False)
    done = engine.finished[finished_before:]
    log = engine.step_log()
    return {"output_tok_s": sum(map(len, run["outputs"])) / run["elapsed_s"],
            **_latencies([o.arrival_s - started for o in done], [o.first_token_s - started for o in done],
                         [o.finish_s - started for o in done],
                         counted_tokens([[len(s) for s in o.outputs] for o in done])),
            "steps": len(log) - steps_before, "preemptions": int(log["num_preempted"].sum() - preempted_before),
            "peak_memory_bytes": status_bytes("VmHWM"), "outputs": run["outputs"]}


def _theirs(peer: VLLMPeer, prompts, max_tokens, arrival_steps=None) -> dict:
    time.sleep(QUIET_GAP_S)
    run = peer.run(prompts, max_tokens, arrival_steps)
    return {"output_tok_s": sum(map(len, run["outputs"])) / run["elapsed_s"],
            **_latencies(run["arrival_s"], run["first_token_s"], run["finish_s"], [len(o) for o in run["outputs"]]),
            "steps": len(run["steps"]), "preemptions": sum(len(s["preempted"]) for s in run["steps"]),
            "peak_memory_bytes": status_bytes("VmHWM", peer.process.pid), "outputs": run["outputs"]}


def run_vllm_bench(config: VLLMBenchConfig, progress=None) -> pd.DataFrame:
    """One row per (system, repeat) and a median row per system, then a ``ours / vLLM`` row of the medians' ratios
    and a ``ours / vllm, paired`` row of the repeats' ratios' medians (``_medians``);
    ``greedy_agreement`` says which share of the generated tokens the two engines agree on (position by position),
    ``first_token_agreement`` which share of the requests start with the same token."""
    if config.model not in PRESETS:
        raise ValueError(f"model must be a preset ({', '.join(PRESETS)}); got {config.model!r}")
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = save_checkpoint(config.model, Path(folder) / config.model, getattr(torch, config.dtype),
                                     config.seed)
        prompts, max_tokens = random_requests(config.num_requests, config.prompt_range, config.output_range,
                                              PRESETS[config.model][6], config.seed)
        settings = PeerSettings(str(checkpoint), config.dtype, config.block_size, config.num_blocks,
                                config.max_num_seqs, config.max_num_batched_tokens,
                                max_model_len=config.prompt_range[1] + config.output_range[1],
                                kv_cache_dtype=config.kv_cache_dtype)
        common = dict(block_size=config.block_size, num_blocks=config.num_blocks - 1, max_num_seqs=config.max_num_seqs,
                      max_num_batched_tokens=config.max_num_batched_tokens, scheduling="vllm",
                      enable_prefix_caching=False, dtype=getattr(torch, config.dtype))
        engine = LLMEngine(str(checkpoint), kv_cache_dtype=config.kv_cache_dtype, **common)
        full = _first_tokens(LLMEngine(str(checkpoint), record_logits=True, **common), prompts) \
            if config.kv_cache_dtype != "auto" else None
        rows = []
        with VLLMPeer(settings) as peer:
            warm = prompts[:4], [8] * 4
            _ours(engine, *warm), _theirs(peer, *warm)
            loads = (QUIET, LOADED) if config.background_load else (QUIET,)
            for repeat in range(config.repeats):  # alternating, so a slow spell of the machine touches both
                for load in loads if repeat % 2 == 0 else loads[::-1]:
                    systems = (("ours", lambda: _ours(engine, prompts, max_tokens)),
                               ("vllm", lambda: _theirs(peer, prompts, max_tokens)))
                    with BackgroundLoad() if load == LOADED else contextlib.nullcontext():
                        # each engine first in every other repeat: neither always runs right after the other
                        for system, run in systems if repeat % 2 == 0 else systems[::-1]:
                            rows.append({"system": system, "load": load, "repeat": repeat, **run()})
                            if progress:
                                progress(len(rows), 2 * config.repeats * len(loads))
    table = pd.DataFrame(rows)
    summary = [row for load in loads for row in _medians(table[table["load"] == load], load)]
    if config.background_load:  # each engine's slowdown: its loaded median time over its quiet one
        for name in ("ours", "vllm"):
            quiet, loaded = (next(r for r in summary if r["system"] == name and r["load"] == load)
                             for load in (QUIET, LOADED))
            summary.append({"system": f"{name}: slowdown", "load": LOADED, "repeat": "median",
                            "output_tok_s": quiet["output_tok_s"] / loaded["output_tok_s"]})
    ours, theirs = (table[(table["system"] == name) & (table["load"] == QUIET)] for name in ("ours", "vllm"))
    our_tokens, their_tokens = ours["outputs"].iloc[0], theirs["outputs"].iloc[0]
    agree = sum(a == b for x, y in zip(our_tokens, their_tokens) for a, b in zip(x, y))
    total = sum(len(y) for y in their_tokens)
    first = sum(x[:1] == y[:1] for x, y in zip(our_tokens, their_tokens)) / len(their_tokens)
    table = pd.concat([table.drop(columns="outputs"), pd.DataFrame(summary)], ignore_index=True)
    table["greedy_agreement"] = agree / total if total else float("nan")
    table["first_token_agreement"] = first  # a sequence that parts once (a near-tie) differs from there on
    if full is not None:
        tokens, margins = full
        table["tie_margin"] = config.tie_margin
        for name, threshold in (("", config.tie_margin), ("_2x", 2 * config.tie_margin)):
            clear = [m >= threshold for m in margins]
            table[f"clear_prompts{name}"] = sum(clear)
            for column, a, b in ((f"first_token_agreement_clear{name}", our_tokens, their_tokens),
                                 (f"ours_vs_full_precision_clear{name}", our_tokens, tokens),
                                 (f"vllm_vs_full_precision_clear{name}", their_tokens, tokens)):
                same = [x[:1] == y[:1] for x, y, c in zip(a, b, clear) if c]
                table[column] = sum(same) / len(same) if same else float("nan")
                table[f"{column}_count"] = sum(same)  # of clear_prompts{name}
    table["model"], table["dtype"], table["num_requests"] = config.model, config.dtype, config.num_requests
    table["kv_cache_dtype"] = config.kv_cache_dtype
    return table


def _medians(runs: pd.DataFrame, load: str) -> list[dict]:
    """Each engine's median row of ``runs`` (one load), the ``ours / vllm`` ratio of the medians, and ``ours / vllm,
    paired``: the median of each repeat's ratio (the two runs of a repeat are back to back, so a slow spell of the
    machine that spans a repeat cancels out there, not in the ratio of medians)."""
    medians = [{"system": name, "load": load, "repeat": "median",
                **{m: statistics.median(runs[runs["system"] == name][m]) for m in METRICS}} for name in ("ours", "vllm")]
    ratio = {"system": "ours / vllm", "load": load, "repeat": "median",
             **{m: medians[0][m] / medians[1][m] if medians[1][m] else float("nan") for m in METRICS}}
    ours, theirs = (runs[runs["system"] == name].set_index("repeat")[list(METRICS)] for name in ("ours", "vllm"))
    paired = (ours / theirs.where(theirs != 0)).median()
    return medians + [ratio, {"system": "ours / vllm, paired", "load": load, "repeat": "median",
                              **{m: float(paired[m]) for m in METRICS}}]


def _first_tokens(engine: LLMEngine, prompts) -> tuple[list[list[int]], list[float]]:
    """Each prompt's first token on ``engine`` (ours, full-precision cache) and its top-2 logit margin: a prompt
    below the tie margin is a near tie, which FP8's perturbation (ours or vLLM's) may flip either way."""
    outputs = engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    margins = []
    for output in outputs:
        top = engine.recorded_logits[output.request_id][0][0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return [output.token_ids for output in outputs], margins
