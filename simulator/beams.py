"""Beam search in the simulator: which beams survive each step, as a seeded stochastic model.

A real beam search keeps the ``k`` best of the live beams' continuations; which beams those come from depends on
the model's probabilities. The simulator has no probabilities, so each step the ``k`` next beams draw their parents
among the ``k`` live beams with probability proportional to ``BEAM_PARENT_DECAY ** rank`` (the better-ranked beams
spawn more, as in a real search where a few strong hypotheses dominate). A beam no candidate continues dies and its
blocks are released; a beam continued several times is forked (``KVPolicy.refork``). The scheduler calls the
model once per decode step of each beam search; ``simulator.paper`` checks its memory saving against the vLLM
paper's Figure 15 and against the real engine's ``LLMEngine.beam_search`` at tiny scale.
"""
from __future__ import annotations

import numpy as np

BEAM_PARENT_DECAY = 0.5


class BeamSurvival:
    """The survival draws of one request's beam search, seeded by ``(seed, request)`` so that a run is
    reproducible whatever the other requests do."""

    __slots__ = ("rng", "decay")

    def __init__(self, seed: int, request: int, decay: float = BEAM_PARENT_DECAY):
        self.rng = np.random.default_rng((seed, request))
        self.decay = decay

    def parent_counts(self, num_beams: int) -> list[int]:
        """How many of the ``num_beams`` next beams continue each live beam (rank order)."""
        weights = self.decay ** np.arange(num_beams)
        parents = self.rng.choice(num_beams, size=num_beams, p=weights / weights.sum())
        return np.bincount(parents, minlength=num_beams).tolist()
