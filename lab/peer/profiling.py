"""The step-time profile (``lab.profiling.profile``, same format, same grids) measured on the vLLM peer instead of our engine.

The profile's scenarios that vLLM's engine can run as they are (decode batches, prefills, a prefill after a cached
prefix, a prefill after an idle pause; not our chunk-budget, swap or parallel-sample ones) are served by the peer
(``VLLMPeer.run``), which times each ``engine.step()`` and records what the step's scheduler scheduled: per request
the tokens it computed before the step, the tokens scheduled and the tokens it holds. ``step_quantities`` turns that
into the quantities ``lab.profiling.profile.plan_quantities`` reads from our scheduler's plan, so the fit, the file and the
simulator that prices steps with it are the ones of our own engine's profile.
"""
from __future__ import annotations

import random
from typing import Callable

from .client import VLLMPeer
from lab.profiling.profile import (QUANTITIES, Profile, ProfileError, _longest_sequence, _scenarios, decode_knots, fit,
                                   grouped_samples)

BACKEND = "vllm"  # the profile's ``backend``: the engine measured, vLLM's own attention backend behind it
PREFIX_ARRIVAL_STEP = 1  # a scenario's requests join after the step that prefilled (and cached) its shared prefix


def step_quantities(step: dict, prompt_lens: list[int], block_size: int, idle_s: float = 0.0,
                    previous_prefill_tokens: int = 0) -> list[float]:
    """The ``lab.profiling.profile.QUANTITIES`` of one step of vLLM's recorded log (``lab/peer/driver.py``: ``scheduled``,
    ``computed`` and ``tokens`` per request, by the request's index into ``prompt_lens``). A request decodes when its
    prompt is computed and it is scheduled its one missing token; otherwise it runs a prefill chunk from ``computed``
    on (of a prompt, or of a preempted request's prompt and outputs), which samples when it reaches the request's
    last known token."""
    chunks = prefill_tokens = decode_seqs = kv_tokens = longest = logit_rows = 0
    pairs = 0.0
    for request, take in step["scheduled"].items():
        start, known = step["computed"][request], step["tokens"][request]
        if take == 1 and start == known - 1 and start >= prompt_lens[int(request)]:
            decode_seqs += 1
            kv_tokens += known
            longest = max(longest, known)
            continue
        chunks += 1
        prefill_tokens += take
        pairs += take * (2 * start + take + 1) / 2
        logit_rows += start + take >= known
    padded = decode_seqs * -(-longest // block_size) * block_size
    values = {"constant": 1.0, "prefill_seqs": chunks, "prefill_tokens": prefill_tokens, "decode_seqs": decode_seqs,
              "prefill_attention_pairs": pairs, "decode_kv_tokens": kv_tokens, "decode_padded_kv_tokens": padded,
              "copied_blocks": 0, "swapped_blocks": 0, "idle_s": idle_s,
              "previous_prefill_tokens": previous_prefill_tokens, "prefill_logit_rows": logit_rows}
    return [float(values[name]) for name in QUANTITIES]


def run_quantities(steps: list[dict], prompt_lens: list[int], block_size: int,
                   idle_s: float = 0.0) -> list[tuple[tuple, float]]:
    """``(quantities, seconds)`` for each step of a run's log that scheduled tokens (``idle_s`` before the first)."""
    out, previous = [], 0
    for index, step in enumerate(s for s in steps if s["scheduled"]):
        quantities = step_quantities(step, prompt_lens, block_size, idle_s if index == 0 else 0.0, previous)
        out.append((tuple(quantities), float(step["step_s"])))
        previous = int(quantities[QUANTITIES.index("prefill_tokens")])
    return out


# vLLM's decode scenarios run this many times the outputs of ours: measured on the tiny checkpoint, the steps of a
# 6-token decode scenario ran 20-25 % slower than the same batch's steps inside a serving run (2.6-3.0 against 2.1
# ms for one sequence), and a profile of them priced a 48-request serving run's decode steps 15-40 % high; with 24
# tokens it priced them within the machine's run-to-run spread (0-18 %).
DECODE_OUTPUT_FACTOR = 4


# Decode batches that fill the pool: a serving run's decode steps read up to the whole pool's KV (the vLLM twin's
# shared-prefix workload read 5,928 tokens a step), beyond the grid's own decode scenarios (3,396 at most on the
# small grid), and a step time extrapolated that far priced its TPOT 44 % high.
POOL_DECODE_BATCHES = (4, 8, 16)
POOL_DECODE_FILL = 0.9  # of the usable pool: the scenario's sequences and their outputs, with room to spare


def usable_pool_tokens(num_blocks: int, block_size: int) -> int:
    """The tokens vLLM's pool of ``num_blocks`` can hold: its block 0 is its null block."""
    return (num_blocks - 1) * block_size


def pool_decode_scenarios(block_size: int, pool_tokens: int, max_model_len: int) -> list[tuple[str, dict, list]]:
    """Decode batches of ``POOL_DECODE_BATCHES`` sequences of equal context that together (with their outputs)
    fill ``POOL_DECODE_FILL`` of ``pool_tokens``, contexts in whole blocks, none longer than ``max_model_len``."""
    scenarios = []
    outputs = 6 * DECODE_OUTPUT_FACTOR
    output_blocks = -(-outputs // block_size)
    for batch in POOL_DECODE_BATCHES:
        blocks = int(POOL_DECODE_FILL * pool_tokens / block_size) // batch  # a sequence's share, its outputs' too
        context = min((blocks - output_blocks) * block_size, (max_model_len - outputs) // block_size * block_size)
        if context > 0:
            scenarios.append((f"decode {batch}x{context} (pool)", {}, [(context, outputs, 1)] * batch))
    return scenarios


def vllm_scenarios(block_size: int, grid: str, max_model_len: int,
                   pool_tokens: int | None = None) -> list[tuple[str, dict, list]]:
    """The grid's scenarios vLLM runs as they are: one sample per request, our engine's defaults for the budgets
    (a cached prefix or an idle pause as the only settings), no longer than ``max_model_len``; decode scenarios
    ``DECODE_OUTPUT_FACTOR`` times as long. With ``pool_tokens`` (the usable pool), and a grid other than
    ``quick``, decode batches that fill the pool too (``pool_decode_scenarios``)."""
    scenarios = []
    for name, settings, requests in _scenarios(block_size, grid):
        if name.startswith("decode"):
            requests = [(length, outputs * DECODE_OUTPUT_FACTOR, n) for length, outputs, n in requests]
        scenario = (name, settings, requests)
        if set(settings) <= {"cached_prefix", "idle_s"} and all(n == 1 for _, _, n in requests) \
                and _longest_sequence(scenario) <= max_model_len:
            scenarios.append(scenario)
    if pool_tokens and grid != "quick":
        scenarios += pool_decode_scenarios(block_size, pool_tokens, max_model_len)
    return scenarios


def _job(settings: dict, requests: list, rng: random.Random, vocab_size: int) -> dict:
    """The peer's run of one scenario: random prompts, a shared prefix served (and cached) first when it has one."""
    prefix = [rng.randrange(vocab_size) for _ in range(settings.get("cached_prefix", 0))]
    prompts = [prefix + [rng.randrange(vocab_size) for _ in range(length)] for length, _, _ in requests]
    max_tokens = [outputs for _, outputs, _ in requests]
    arrivals = [0] * len(prompts)
    if prefix:
        prompts, max_tokens = [prefix + [1], *prompts], [1, *max_tokens]
        arrivals = [0] + [PREFIX_ARRIVAL_STEP] * len(requests)
    return {"prompts": prompts, "max_tokens": max_tokens, "arrival_steps": arrivals,
            "idle_s": settings.get("idle_s", 0.0)}


def profile_vllm(peer: VLLMPeer, model_name: str, vocab_size: int, grid: str = "small", repeats: int = 3,
                 seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Profile:
    """Serve the grid's scenarios on ``peer`` in ``repeats`` + 1 rounds (the first unmeasured, each later one in a
    fresh seeded order, as ``lab.profiling.profile.Profiler`` runs ours), group steps of equal quantities (their mean is one
    sample) and fit the step-time model. A step that had a cached prefix's prefill before it counts it as the
    previous step's prefill, as a serving engine's would."""
    settings = peer.settings
    scenarios = vllm_scenarios(settings.block_size, grid, settings.max_model_len,
                               usable_pool_tokens(settings.num_blocks, settings.block_size))
    if not scenarios:
        raise ProfileError(f"no scenario of the {grid!r} grid fits vLLM's max_model_len {settings.max_model_len}")
    rng, groups, sources = random.Random(seed), {}, {}
    total, done = (repeats + 1) * len(scenarios), 0
    for round_ in range(repeats + 1):
        order = list(range(len(scenarios)))
        if round_:
            random.Random(seed * 1000 + round_).shuffle(order)
        for index in order:
            name, scenario_settings, requests = scenarios[index]
            job = _job(scenario_settings, requests, rng, vocab_size)
            answer = peer.run(**job)
            if round_:
                lens = [len(prompt) for prompt in job["prompts"]]
                for quantities, seconds in run_quantities(answer["steps"], lens, settings.block_size,
                                                          scenario_settings.get("idle_s", 0.0)):
                    groups.setdefault(quantities, []).append(seconds)
                    names = sources.setdefault(quantities, [])
                    if name not in names:
                        names.append(name)
            done += 1
            if progress is not None:
                progress(done, total)
    samples = grouped_samples(groups, sources)
    knots = decode_knots(grid)
    coefficients, median_error, max_error = fit(samples, knots, seed=seed)
    # add_request_s 0: a server's API process adds requests beside the engine's loop, not between its steps
    return Profile(model_name, "cpu", settings.dtype, settings.block_size, BACKEND, coefficients, knots, samples,
                   median_error, max_error, add_request_s=0.0)
