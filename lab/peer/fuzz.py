"""Differential testing of the ``vllm`` scheduling policy against the real vLLM: seeded random workloads under pool
pressure, run on both engines, step logs compared by identity (``lab.peer.client.compare_step_logs``), and each
difference shrunk to the fewest requests and tokens that still differ.

One vLLM start serves every workload of one ``PoolShape`` (its prefix cache emptied between runs by the driver);
workloads vary arrivals, prompt and output lengths (from one token to past the chunk budget), shared prefixes
(block-aligned and not) and the long-prefill threshold. ``python -m lab peer fuzz --runs N`` runs them.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lab import user_files
from lab.errors import InputError, LabError
from lab.files import write_text_atomically
from lab.peer.client import (
    PeerSettings,
    VLLMPeer,
    compare_step_logs,
    count_requests,
    first_divergence,
    our_step_table,
    serve,
    vllm_step_table,
)

MAX_MODEL_LEN = 2048
VOCAB = 1024  # the tiny checkpoint's


@dataclass(slots=True, frozen=True)
class PoolShape:
    """What one vLLM start fixes: the block size, vLLM's block count (ours: one fewer, its null block), the caps and
    whether prefix caching is on."""

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool

    @property
    def slots(self) -> int:
        """Token slots both engines can use (vLLM keeps block 0 as its null block)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_model_len(self) -> int:
        return min(MAX_MODEL_LEN, self.slots)

    def peer_settings(self, checkpoint: str) -> PeerSettings:
        return PeerSettings(checkpoint, block_size=self.block_size, num_blocks=self.num_blocks,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching)


# From "just enough for one long request" to ample, block sizes 32/64/128, prefix caching on and off.
SHAPES = (PoolShape(32, 24, 8, 256, True), PoolShape(64, 12, 16, 512, True), PoolShape(128, 8, 8, 384, False),
          PoolShape(32, 48, 16, 512, False), PoolShape(64, 40, 32, 1024, True), PoolShape(32, 200, 32, 512, True))


@dataclass(slots=True)
class Workload:
    """One run's requests: request i (``prompts[i]``, ``max_tokens[i]`` greedy tokens) joins before engine step
    ``arrival_steps[i]``; ``long_prefill_token_threshold`` 0 is no cap."""

    prompts: list[list[int]]
    max_tokens: list[int]
    arrival_steps: list[int]
    long_prefill_token_threshold: int = 0
    scheduler_reserve_full_isl: bool = True  # vLLM's default
    seed: int = -1  # the seed it was drawn with (-1: made by hand or shrunk)

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, keep: list[int]) -> Workload:
        return Workload([self.prompts[i] for i in keep], [self.max_tokens[i] for i in keep],
                        [self.arrival_steps[i] for i in keep], self.long_prefill_token_threshold,
                        self.scheduler_reserve_full_isl)


def random_workload(shape: PoolShape, seed: int) -> Workload:
    """A seeded workload that presses ``shape``'s pool: 2-16 requests, each fitting the pool alone (prompt and
    output within its slots and ``max_model_len``), prompts from 1 token to past the token budget, some sharing a
    prefix (block-aligned or not), all at once or staggered, a long-prefill threshold sometimes."""
    rng = random.Random(seed)
    longest = shape.max_model_len
    count = rng.randint(2, 16)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice(
        [shape.block_size, 2 * shape.block_size, rng.randint(1, 3 * shape.block_size)]))] for _ in range(2)]
    prompts, max_tokens = [], []
    for _ in range(count):
        output = rng.choice([1, rng.randint(1, 16), rng.randint(16, 128)])
        room = longest - output
        length = min(room, rng.choice([rng.randint(1, 32), rng.randint(32, shape.max_num_batched_tokens),
                                       rng.randint(shape.max_num_batched_tokens, 2 * shape.max_num_batched_tokens),
                                       rng.randint(1, room)]))
        prefix = rng.choice(prefixes)[:length - 1] if shape.enable_prefix_caching and rng.random() < 0.4 else []
        prompts.append(prefix + [rng.randrange(VOCAB) for _ in range(max(1, length - len(prefix)))])
        max_tokens.append(output)
    if rng.random() < 0.5:
        arrivals = [0] * count
    else:
        gap = rng.randint(1, 8)
        arrivals = sorted(rng.randint(0, gap * count) for _ in range(count))
    threshold = rng.choice([0, 0, shape.block_size, rng.randint(1, shape.max_num_batched_tokens)])
    return Workload(prompts, max_tokens, arrivals, threshold, rng.random() >= 0.1, seed)


@dataclass(slots=True)
class Verdict:
    """One workload on both engines: whether every step and every greedy token was the same, where it first
    differed, and what the run held."""

    same: bool
    tokens_same: bool
    steps: int
    preemptions: int
    first_difference: str | None = None


class Differential:
    """Both engines on one ``PoolShape``: vLLM started once (``with`` it), ours built per run."""

    def __init__(self, checkpoint: str, shape: PoolShape):
        self.checkpoint, self.shape = checkpoint, shape
        self.peer = VLLMPeer(shape.peer_settings(checkpoint))

    def __enter__(self) -> Differential:
        return self

    def __exit__(self, *exc) -> None:
        self.peer.close()

    def run(self, workload: Workload) -> Verdict:
        """``workload`` on vLLM and on our engine (``vllm`` scheduling, the same pool less the null block)."""
        from lab.engine import LLMEngine

        shape = self.shape
        theirs = self.peer.run(workload.prompts, workload.max_tokens, workload.arrival_steps,
                               long_prefill_token_threshold=workload.long_prefill_token_threshold,
                               scheduler_reserve_full_isl=workload.scheduler_reserve_full_isl)
        engine = LLMEngine(self.checkpoint, block_size=shape.block_size, num_blocks=shape.num_blocks - 1,
                           max_num_seqs=shape.max_num_seqs, max_num_batched_tokens=shape.max_num_batched_tokens,
                           max_model_len=shape.max_model_len, scheduling="vllm",
                           enable_prefix_caching=shape.enable_prefix_caching,
                           long_prefill_token_threshold=workload.long_prefill_token_threshold,
                           scheduler_reserve_full_isl=workload.scheduler_reserve_full_isl)
        ours = serve(engine, workload.prompts, workload.max_tokens, workload.arrival_steps)
        table = compare_step_logs(our_step_table(engine.step_log(), ours["steps"]),
                                  vllm_step_table(theirs["steps"], shape.num_blocks))
        tokens_same = ours["outputs"] == theirs["outputs"]
        difference = first_divergence(table)
        if difference is None and not tokens_same:
            difference = "greedy tokens differ"
        return Verdict(difference is None, tokens_same, len(table), count_requests(table["preempted_vllm"]),
                       difference)

    def shrink(self, workload: Workload, budget: int = 40) -> tuple[Workload, Verdict, bool]:
        """The smallest workload found (fewest requests, then fewest output tokens) that still differs, its verdict,
        and whether the search stopped at its bound of ``budget`` runs before no single step shrank it further
        (delta debugging: one request dropped or one output halved at a time)."""
        best, verdict = workload, self.run(workload)
        if verdict.same:
            raise LabError("the workload does not differ: nothing to shrink")
        tries = 0

        def attempt(candidate: Workload) -> bool:
            nonlocal best, verdict, tries
            tries += 1
            result = self.run(candidate)
            if not result.same:
                best, verdict = candidate, result
            return not result.same

        changed = True
        while changed and tries < budget:
            changed = False
            for i in reversed(range(len(best))):
                if tries >= budget or len(best) == 1:
                    break
                changed |= attempt(best.subset([j for j in range(len(best)) if j != i]))
            for i in range(len(best)):
                if tries >= budget:
                    break
                if best.max_tokens[i] > 1:
                    smaller = best.subset(list(range(len(best))))
                    smaller.max_tokens[i] = max(1, best.max_tokens[i] // 2)
                    changed |= attempt(smaller)
        best.seed = -1
        return best, verdict, changed


@dataclass(slots=True)
class FuzzReport:
    """What a fuzz run covered and found."""

    workloads: int = 0
    steps: int = 0
    preemptions: int = 0
    differing: list[dict] = field(default_factory=list)  # shape, seed, first difference, the shrunk workload
    shrinks_bounded: int = 0  # shrinks that hit their run budget: those cases may not be minimal


def fuzz(checkpoint: str, runs: int, seed: int = 0, shapes: tuple[PoolShape, ...] = SHAPES, shrink_budget: int = 40,
         progress=None) -> FuzzReport:
    """``runs`` seeded random workloads spread over ``shapes`` (one vLLM start each), every difference shrunk."""
    report = FuzzReport()
    per_shape = [runs // len(shapes) + (i < runs % len(shapes)) for i in range(len(shapes))]
    for index, (shape, count) in enumerate(zip(shapes, per_shape)):
        if not count:
            continue
        with Differential(checkpoint, shape) as differential:
            for k in range(count):
                workload_seed = seed * 1_000_003 + index * 10_007 + k
                verdict = differential.run(random_workload(shape, workload_seed))
                report.workloads += 1
                report.steps += verdict.steps
                report.preemptions += verdict.preemptions
                if not verdict.same:
                    small, small_verdict, bounded = differential.shrink(random_workload(shape, workload_seed),
                                                                        shrink_budget)
                    report.shrinks_bounded += bounded
                    report.differing.append({"name": f"seed {workload_seed}", "shape": asdict(shape),
                                             "workload": asdict(small), "difference": small_verdict.first_difference,
                                             "found_as": verdict.first_difference})
                if progress is not None:
                    progress(report.workloads, runs)
    return report


def save_cases(report: FuzzReport, path: str | Path) -> None:
    """The shrunk differing workloads as JSON, in ``load_cases``'s form (what a named regression test loads)."""
    write_text_atomically(path, json.dumps(report.differing, indent=1))


def load_cases(path: str | Path) -> dict[str, tuple[PoolShape, Workload]]:
    """Named cases (``save_cases``'s JSON: a list of ``name``, ``shape``, ``workload``) by name."""
    return {case["name"]: (PoolShape(**case["shape"]), Workload(**case["workload"]))
            for case in user_files.read_json(path, InputError)}
