"""Beam search on the paged engine: beam requests are requests of the shared scheduler.

``LLMEngine.add_request(prompt, BeamSearchParams(...))`` queues a group of ``beam_width`` sequences. They are
prefilled once (the others fork the first: the prompt's blocks are shared) and decode in the same batches as every
other request. After each step that computed their logits, the request's ``BeamRanking`` ranks the continuations; at
the next step the scheduler asks it how many of the next beams continue each live beam (``parent_counts``), re-forks
the sequences to match (``KVPolicy.refork``: blocks shared, a shared partly filled last block copied on write when
the children append) and tells it which sequence carries which continuation (``forked``). The simulator's
``simulator.core.beams.BeamSurvival`` answers the same questions from a seeded model: the scheduling is one code.

The ranking is HF ``generate(num_beams=k, do_sample=False, early_stopping=True)``'s: the top ``max(2, 1 + #eos) * k``
candidates (a beam's cumulative log-probability plus a token's) are ranked; one ending in EOS within the first ``k``
ranks becomes a finished hypothesis (score = cumulative log-probability / generated length ** ``length_penalty``),
the first ``k`` others continue; the search stops when ``k`` hypotheses are finished or ``max_tokens`` tokens are
generated, and the live beams then join the hypotheses. A recompute preemption restarts a search from its prompt
(``restart``): a beam's continuation depends on its siblings', so one beam cannot be recomputed alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lab.errors import LabError
from lab.checks import check_bool, check_int, check_real, entry_point


class BeamSearchError(LabError):
    """A ``BeamSearchParams`` field has a wrong type or value, or a prompt cannot be searched; nothing ran."""


@entry_point
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
    """The ``beam_width`` best sequences of one prompt, best first. ``block_usage``: per ranking, (blocks the live
    beams hold with sharing, blocks they would hold as separate copies)."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    block_usage: list[tuple[int, int]] = field(default_factory=list)


def memory_saving(usage: list[tuple[int, int]]) -> float:
    """1 - (blocks with sharing) / (blocks as separate copies), summed over the steps (the paper's Figure 15)."""
    shared, copies = sum(u[0] for u in usage), sum(u[1] for u in usage)
    return 1 - shared / copies if copies else 0.0


class BeamRanking:
    """One request's beam search in the engine (the ``beam`` of its ``SequenceGroup``). Its sequences' ``data``
    are the engine's (``.output``: the beam's tokens); ``rank`` is called after each step that computed their
    logits, ``parent_counts``/``forked``/``restart`` by the scheduler."""

    __slots__ = ("params", "eos", "finished", "block_usage", "num_rankings", "logprob", "rank_of", "picks")

    def __init__(self, params: BeamSearchParams, eos: set[int]):
        self.params, self.eos = params, set() if params.ignore_eos else set(eos)
        self.restart(())

    def restart(self, seqs) -> None:
        """Start again from the prompt: the beams' KV was dropped (recompute preemption)."""
        self.finished: list[BeamSequence] = []
        self.block_usage: list[tuple[int, int]] = []
        self.num_rankings = 0
        self.logprob: dict = {}  # seq_id -> the beam's cumulative log-probability
        self.rank_of: dict = {}  # seq_id -> the beam's rank at the latest ranking (HF orders beams by it)
        self.picks: dict = {}  # parent seq_id -> [(rank, score, token)] that continue it at the next step
        for seq in seqs:
            seq.data.output = []

    def rank(self, logits: torch.Tensor, rows: list[tuple[int, list]]) -> bool:
        """Rank the continuations of the live beams, given as ``(row of logits, sequences)``: after the prefill,
        the prompt's one row that every sequence shares, then one row per beam. Returns True when the search is
        done (``sequences`` then holds the result)."""
        width = self.params.beam_width
        if self.num_rankings == 0:
            row, seqs = rows[0]
            beams, row_index = [seqs[0]], [row]
        else:
            ordered = sorted(((self.rank_of[seqs[0].seq_id], row, seqs[0]) for row, seqs in rows),
                             key=lambda item: item[0])
            beams, row_index = [beam for _, _, beam in ordered], [row for _, row, _ in ordered]
        self.num_rankings += 1
        logprobs = torch.log_softmax(logits[row_index].float(), dim=-1)
        cumulative = [self.logprob.get(beam.seq_id, 0.0) for beam in beams]
        values, indices = top_candidates(cumulative, logprobs, width, max(2, 1 + len(self.eos)) * width)
        vocab = logprobs.shape[1]
        chosen = []
        for rank, (score, index) in enumerate(zip(values.tolist(), indices.tolist())):
            parent, token = beams[index // vocab], index % vocab
            if token in self.eos:
                if rank < width:
                    self._add_hypothesis(parent.data.output + [token], score)
                continue
            chosen.append((score, parent, token))
            if len(chosen) == width:
                break
        if len(self.finished) >= width or self.num_rankings == self.params.max_tokens or not chosen:
            for score, parent, token in chosen:  # HF's finalize: the live beams join the hypotheses
                self._add_hypothesis(parent.data.output + [token], score)
            return True
        self.picks = {}
        for rank, (score, parent, token) in enumerate(chosen):
            self.picks.setdefault(parent.seq_id, []).append((rank, score, token))
        return False

    def parent_counts(self, live: list) -> list[int]:
        """How many of the next beams continue each of the ``live`` sequences (the scheduler's order)."""
        return [len(self.picks.get(seq.seq_id, ())) for seq in live]

    def forked(self, parent, children: list) -> None:
        """``parent`` continues as itself and as ``children`` (just re-forked from it): each takes one of its
        picks, in rank order, with the parent's tokens so far."""
        base = parent.data.output
        for seq, (rank, score, token) in zip([parent, *children], self.picks[parent.seq_id]):
            seq.data.output = base + [token]
            self.logprob[seq.seq_id], self.rank_of[seq.seq_id] = score, rank

    @property
    def sequences(self) -> list[BeamSequence]:
        """The finished hypotheses, best first."""
        return sorted(self.finished, key=lambda h: -h.score)[:self.params.beam_width]

    def _add_hypothesis(self, tokens: list[int], logprob: float) -> None:
        score = logprob / (max(len(tokens), 1) ** self.params.length_penalty)
        self.finished.append(BeamSequence(list(tokens), logprob, score))
        if len(self.finished) > self.params.beam_width:
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.params.beam_width:]


def top_candidates(cumulative: list[float], logprobs: torch.Tensor, width: int,
                   count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores and flat indices (beam x vocab + token) of the best ``count`` continuations, as tensors on
    ``logprobs``' device (a GPU's logits cannot take a CPU tensor's rows). Fewer beams than ``width`` (HF's first
    step) are padded with copies at -1e9, never chosen."""
    device = logprobs.device
    scores = logprobs + torch.tensor(cumulative, dtype=logprobs.dtype, device=device)[:, None]
    if len(cumulative) < width:
        pad = torch.full((width - len(cumulative), scores.shape[1]), -1e9, dtype=scores.dtype, device=device)
        scores = torch.cat([scores, pad])
    top = torch.topk(scores.reshape(-1), min(count, scores.numel()))
    return top.values, top.indices
