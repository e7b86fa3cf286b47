"""Beam search on the paged engine, with beams sharing KV blocks.

A prompt is prefilled once; its ``beam_width`` beams then decode together. Each step every live beam proposes its
continuations; the best ``beam_width`` (sum of log-probabilities) survive. A beam kept by several candidates is
forked (``KVBlockManager.fork_sequence``: the blocks are shared, a shared partly filled last block is copied on
write through ``kernels.copy_blocks`` when a child appends), a beam kept by none is released. Scores, tie order
and end-of-sequence handling follow HF ``generate(num_beams=k, do_sample=False, early_stopping=True)``: the top
``2k`` candidates are ranked; one ending in EOS within the first ``k`` ranks becomes a finished hypothesis (score =
sum of log-probabilities / generated length ** ``length_penalty``), the first ``k`` others continue; the search stops
when ``k`` hypotheses are finished or ``max_tokens`` tokens are generated.
"""
from __future__ import annotations

import itertools
from collections import abc
from dataclasses import dataclass, field

import torch

from .errors import LabError
from .checks import check_bool, check_int, check_real
from .model_runner import ModelInput
from .scheduler import PrefillChunk, SchedulerOutput


class BeamSearchError(LabError):
    """A ``BeamSearchParams`` field has a wrong type or value, or a prompt cannot be searched; nothing ran."""


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's shape: ``beam_width`` beams, up to ``max_tokens`` new tokens each."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def check(self) -> None:
        check_int("BeamSearchParams", "beam_width", self.beam_width, 1, 256, error=BeamSearchError)
        check_int("BeamSearchParams", "max_tokens", self.max_tokens, 1, error=BeamSearchError)
        check_real("BeamSearchParams", "length_penalty", self.length_penalty, -100.0, 100.0, error=BeamSearchError)
        check_bool("BeamSearchParams", "ignore_eos", self.ignore_eos, error=BeamSearchError)


@dataclass(slots=True)
class BeamSequence:
    """One returned beam: its new tokens and the sum of their log-probabilities."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # what the ranking uses: cumulative_logprob / len(token_ids) ** length_penalty


@dataclass(slots=True)
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first. ``block_usage``: per decode step, (blocks the
    live beams hold with sharing, blocks they would hold as separate copies)."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    block_usage: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Data:
    token_ids: list[int]  # prompt + generated (what the runner reads)
    output: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Beam:
    seq_id: object
    data: _Data
    logprob: float = 0.0


def beam_search(engine, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for each prompt on ``engine`` (its model runner and block manager; the engine must be idle).
    Every block is released at the end."""
    if not isinstance(params, BeamSearchParams):
        raise BeamSearchError(f"params must be a BeamSearchParams, got {params!r:.80}")
    params.check()
    if engine.has_unfinished():
        raise BeamSearchError("beam search needs an idle engine (finish or drain the queued requests first)")
    if isinstance(prompts, (str, bytes, dict, set)) or not isinstance(prompts, abc.Sequence):
        raise BeamSearchError(f"prompts must be a list of prompts, got {prompts!r:.80}")
    encoded = [engine._encode(prompt) for prompt in prompts]
    for prompt in encoded:
        total = len(prompt) + params.max_tokens
        if total > engine.max_model_len:
            raise BeamSearchError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceed max_model_len "
                                  f"{engine.max_model_len}")
        worst = params.beam_width * engine.block_manager.blocks_for_tokens(total)
        if worst > engine.block_manager.num_physical_blocks:
            raise BeamSearchError(f"{params.beam_width} beams of {total} tokens may need {worst} blocks; the pool "
                                  f"has {engine.block_manager.num_physical_blocks}")
    return [_search(engine, prompt, params) for prompt in encoded]


def _search(engine, prompt: list[int], params: BeamSearchParams) -> BeamSearchOutput:
    manager, runner, width = engine.block_manager, engine.runner, params.beam_width
    ids = (f"beam-{n}" for n in itertools.count())
    first = _Beam(next(ids), _Data(list(prompt)))
    manager.create_sequence(first.seq_id, prompt)
    out = SchedulerOutput(0)
    out.prefill_chunks = [PrefillChunk(first, 0, len(prompt), [first])]
    _execute_copies(runner, manager, out)
    logits = _forward(runner, manager, out, lambda beam: len(beam.data.token_ids))
    beams, finished, usage = [first], [], []
    eos = set() if params.ignore_eos else engine.eos_token_ids
    try:
        for step in range(params.max_tokens):
            candidates = _rank(beams, logits, width)
            beams = _advance(manager, beams, candidates, eos, finished, width, params, ids)
            usage.append(_usage(manager, beams))
            done = len(finished) >= width or step + 1 == params.max_tokens or not beams
            if done:
                break
            out = SchedulerOutput(0)
            out.decode_seqs = beams
            _execute_copies(runner, manager, out)
            logits = _forward(runner, manager, out, lambda beam: len(beam.data.token_ids))
        for beam in beams:  # HF's finalize: live beams join the hypotheses
            _add_hypothesis(finished, beam.data.output, beam.logprob, width, params.length_penalty)
    finally:
        for beam in beams:
            manager.release_sequence(beam.seq_id)
        manager.take_pending_copies()
    finished.sort(key=lambda h: -h.score)
    return BeamSearchOutput(list(prompt), finished[:width], usage)


def _usage(manager, beams) -> tuple[int, int]:
    """Blocks the beams hold (shared blocks once) and would hold as separate copies."""
    ids = [beam.seq_id for beam in beams]
    return manager.num_distinct_blocks(ids), sum(len(manager.get_block_table(i)) for i in ids)


def memory_saving(usage: list[tuple[int, int]]) -> float:
    """1 - (blocks with sharing) / (blocks as separate copies), summed over the steps (the paper's Figure 15)."""
    shared, copies = sum(u[0] for u in usage), sum(u[1] for u in usage)
    return 1 - shared / copies if copies else 0.0


def _execute_copies(runner, manager, out: SchedulerOutput) -> None:
    """The block copies the manager queued for this step (copy-on-write, the offload tier's stores and loads)."""
    out.blocks_to_copy = manager.take_pending_copies()
    out.blocks_to_store, out.blocks_to_load = manager.take_offload_copies()
    runner.execute_copies(out)


def _forward(runner, manager, out, kv_len) -> torch.Tensor:
    return torch.log_softmax(runner.run(ModelInput.from_plan(out, kv_len), manager, eager=True).float(),
                             dim=-1)


def _rank(beams: list[_Beam], logprobs: torch.Tensor, width: int) -> list[tuple[float, int, int]]:
    """The best ``2 * width`` (score, beam index, token) over every beam's continuations, HF's order: ranked on the
    logits' device and read back once."""
    values, indices = _top_candidates(beams, logprobs, width)
    vocab = logprobs.shape[1]
    return [(value, index // vocab, index % vocab) for value, index in zip(values.tolist(), indices.tolist())]


def _top_candidates(beams: list[_Beam], logprobs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores and flat indices (beam x vocab + token) of the best ``2 * width`` continuations, as tensors on
    ``logprobs``' device (a GPU's logits cannot take a CPU tensor's rows)."""
    device = logprobs.device
    scores = logprobs + torch.tensor([b.logprob for b in beams], dtype=logprobs.dtype, device=device)[:, None]
    if len(beams) < width:  # HF's first step: beams 1.. are copies of beam 0 at -1e9, never chosen
        pad = torch.full((width - len(beams), scores.shape[1]), -1e9, dtype=scores.dtype, device=device)
        scores = torch.cat([scores, pad])
    top = torch.topk(scores.reshape(-1), min(2 * width, scores.numel()))
    return top.values, top.indices


def _advance(manager, beams, candidates, eos, finished, width, params, ids) -> list[_Beam]:
    """The next beams: forks for parents kept more than once, releases for parents kept by none, one token
    appended to each."""
    chosen = []
    for rank, (score, parent, token) in enumerate(candidates):
        if token in eos:
            if rank < width:
                _add_hypothesis(finished, beams[parent].data.output + [token], score, width, params.length_penalty)
            continue
        chosen.append((score, parent, token))
        if len(chosen) == width:
            break
    children: dict[int, list] = {}
    for score, parent, token in chosen:
        children.setdefault(parent, []).append((score, token))
    next_beams: list[_Beam | None] = []
    kept = set(children)
    for index, beam in enumerate(beams):
        if index not in kept:
            manager.release_sequence(beam.seq_id)
    made: dict[tuple[int, int], _Beam] = {}
    for parent, picks in children.items():  # fork first, while the parent still holds only its own tokens
        beam = beams[parent]
        for position, (score, token) in enumerate(picks):
            if position == 0:
                child = beam
            else:
                child = _Beam(next(ids), _Data(list(beam.data.token_ids), list(beam.data.output)))
                manager.fork_sequence(beam.seq_id, child.seq_id)
            made[(parent, position)] = child
    counters: dict[int, int] = {}
    for score, parent, token in chosen:  # in rank order, as HF orders the next beams
        position = counters.get(parent, 0)
        counters[parent] = position + 1
        child = made[(parent, position)]
        child.logprob = score
        child.data.token_ids.append(token)
        child.data.output.append(token)
        manager.append_token(child.seq_id, token)
        next_beams.append(child)
    return next_beams


def _add_hypothesis(finished: list[BeamSequence], tokens: list[int], logprob: float, width: int,
                    length_penalty: float) -> None:
    score = logprob / (max(len(tokens), 1) ** length_penalty)
    finished.append(BeamSequence(list(tokens), logprob, score))
    if len(finished) > width:
        finished.sort(key=lambda h: -h.score)
        del finished[width:]
