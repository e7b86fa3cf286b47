"""Picking the next tokens: ``SamplingParams`` (what a request asks for) and ``Sampler`` (one call a step over every
row that samples: greedy rows by one argmax, the others drawn with their own temperature, top-k, top-p and seed)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from paged_kernels.torch_backend import greedy_argmax
from lab.checks import check_bool, check_int, check_real, entry_point
from lab.errors import LabError

MAX_TEMPERATURE = 1e4  # past this every token is equally likely to within float precision
# Below this a softmax over logits / temperature puts all mass on the argmax to within float precision, and the
# division itself overflows (1e-40 is 0 in bf16): such rows sample greedily.
GREEDY_BELOW_TEMPERATURE = 1e-5


@entry_point
@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens: greedy when ``temperature == 0``; else temperature, then top-k / top-p filtering."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """Whether rows of this request take the argmax (temperature 0, or too small to sample safely)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def check(self) -> None:
        """Raise ``SamplingParamsError`` (a ``ValueError``) naming the first field of a wrong type or out of range."""
        owner, error = "SamplingParams", SamplingParamsError
        check_int(owner, "max_tokens", self.max_tokens, 1, error=error)  # the scheduler checks it against the model
        check_int(owner, "top_k", self.top_k, 0, error=error)
        check_int(owner, "n", self.n, 1, error=error)
        check_real(owner, "temperature", self.temperature, 0.0, MAX_TEMPERATURE, error=error)
        check_real(owner, "top_p", self.top_p, 0.0, 1.0, low_open=True, error=error)
        check_int(owner, "seed", self.seed, 0, 2**63 - 1, optional=True, error=error)
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)) or any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                                       for t in stops):
            raise error(f"SamplingParams.stop_token_ids={stops!r}: expected a tuple of token ids")
        check_bool(owner, "ignore_eos", self.ignore_eos, error=error)


class SamplingParamsError(LabError):
    """A ``SamplingParams`` field has a wrong type or value; nothing was queued."""


class Sampler:
    """The next token of every sampling sequence of a step, read back from the device once (per token, each read
    would wait for the GPU). ``drawn``: the seeded generators the latest call drew from, with their states before
    it, so that a failed step can give their draws back."""

    def __init__(self):
        self.drawn: list[tuple[torch.Generator, torch.Tensor]] = []

    def sample(self, logits: torch.Tensor | None, rows: list[list]) -> list[int]:
        """``rows[i]``: the sequences sampling from logits row ``i``, each with ``.data.params`` (its
        ``SamplingParams``) and ``.data.generator`` (a seeded one or None); a row's sequences belong to one request,
        so its first one says whether the row is greedy. Tokens come row by row, a row's sequences in order; greedy
        rows share one argmax, each other sequence draws with its generator in that order."""
        self.drawn = []
        if not rows:
            return []
        is_greedy = [row[0].data.params.greedy for row in rows]
        if all(is_greedy) and len(rows) == logits.shape[0] and all(len(row) == 1 for row in rows):
            return greedy_argmax(logits).tolist()  # the common step: one read-back, nothing else
        self.drawn = [(seq.data.generator, seq.data.generator.get_state()) for index, row in enumerate(rows)
                      if not is_greedy[index] for seq in row if seq.data.generator is not None]
        draws = [draw(logits[index], seq.data.params, seq.data.generator)
                 for index, row in enumerate(rows) if not is_greedy[index] for seq in row]
        values = torch.cat([greedy_argmax(logits), *draws]).tolist()  # every row's argmax, then the draws
        drawn = iter(values[len(rows):])
        return [values[index] if is_greedy[index] else next(drawn) for index, row in enumerate(rows) for _ in row]


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """A token drawn from one row's logits with ``params``' temperature, top-k and top-p, as a one-element tensor on
    the logits' device (not read back)."""
    logits = logits.float()  # the runner hands the model's dtype; drawing wants float32's resolution
    logits = (logits - logits.max()) / float(params.temperature)  # <= 0: no overflow to inf, so no NaN
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, 0) - sorted_probs > params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator)
