"""Beam search in the simulator: which beams survive each step, as a seeded stochastic model.

A real beam search keeps the ``k`` best of the live beams' continuations; which beams those come from depends on
the model's probabilities. The simulator has no probabilities, so each step the ``k`` next beams draw their parents
among the ``k`` live beams with probability proportional to ``BEAM_PARENT_DECAY ** rank`` (the better-ranked beams
spawn more, as in a real search where a few strong hypotheses dominate). A beam no candidate continues dies and its
blocks are released; a beam continued several times is forked (``KVPolicy.refork``). It is the scheduler's
``BeamModel``, as the engine's ranking (``lab.engine.beam.BeamRanking``) is: the scheduler calls it once per decode step
of each beam search; ``simulator.experiments.paper`` checks its memory saving against the vLLM
paper's Figure 15 and against the real engine's ``LLMEngine.beam_search`` at tiny scale.
"""
from __future__ import annotations

import numpy as np

BEAM_PARENT_DECAY = 0.5
DRAWS_AT_ONCE = 64


class BeamSurvival:
    """The survival draws of one request's beam search, seeded by ``(seed, request)`` so that a run is
    reproducible whatever the other requests do."""

    __slots__ = ("rng", "decay", "drawn", "drawn_beams")

    def __init__(self, seed: int, request: int, decay: float = BEAM_PARENT_DECAY):
        self.rng = np.random.default_rng((seed, request))
        self.decay = decay
        self.drawn: list[list[int]] = []  # the next steps' counts, last one first
        self.drawn_beams = 0

    def parent_counts(self, live: list) -> list[int]:
        """How many of the next beams continue each of the ``live`` beams (rank order). Steps are drawn
        ``DRAWS_AT_ONCE`` at a time (one NumPy call per step cost more than the rest of a beam step); the stream
        is the same as one draw a step while the number of beams stays the same."""
        num_beams = len(live)
        if not self.drawn or num_beams != self.drawn_beams:
            weights = self.decay ** np.arange(num_beams)
            parents = self.rng.choice(num_beams, size=(DRAWS_AT_ONCE, num_beams), p=weights / weights.sum())
            rows = parents + num_beams * np.arange(DRAWS_AT_ONCE)[:, None]  # each step's parents in its own range
            counts = np.bincount(rows.ravel(), minlength=DRAWS_AT_ONCE * num_beams)
            self.drawn = counts.reshape(DRAWS_AT_ONCE, num_beams)[::-1].tolist()
            self.drawn_beams = num_beams
        return self.drawn.pop()

    def forked(self, parent, children: list) -> None:
        """Nothing to hand over: the model has no tokens."""

    def restart(self, seqs: list) -> None:
        """A restarted search keeps drawing from the same stream."""
