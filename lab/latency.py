"""The per-request latency metrics, defined once: the engine's run metrics (``lab.engine``), the simulator's
(``simulator.core.metrics``) and the twins' comparisons of the two all call these, so they cannot diverge.

A request is described by four numbers: when it arrived, when its first output token came, when it finished and
how many output tokens its latency counts (``counted_tokens``). With ``n > 1`` samples (or a beam search) the
request finishes when its last sample does, and the samples decode together, so the last to finish is the longest:
the counted tokens are the **longest sample's**. This is vLLM's definition for that sample: vLLM (v1) fans a
request with ``n > 1`` out into one child request per sample and gives each child its own TTFT and TPOT
(``vllm/v1/metrics/stats.py``, ``update_from_finished_request``: decode time over the child's generated tokens less
one); the request's end-to-end latency is its last child's, and so is the TPOT defined here.

- TTFT: first token - arrival.
- TPOT: (finish - first token) / (counted tokens - 1); vLLM's "mean time per output token", the prefill's token not
  counted. A one-token request's decode time is zero and it divides by 1.
- ITL (inter-token latency): a request's mean gap between consecutive tokens. With only the first and the last
  token's times it is the TPOT; a pool of every gap (vLLM's benchmark) weighs long requests more, which a
  per-request table does not do.
- E2E: finish - arrival.
- Normalized latency (the vLLM paper's): E2E / counted tokens (at least 1), averaged over requests.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from lab.errors import InputError

PERCENTILES = (50, 90, 99)
METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "normalized_latency_s")
SUMMARIZED = ("ttft", "tpot", "e2e")  # the summaries' percentiles (``latency_summary``)


def counted_tokens(sample_tokens) -> np.ndarray:
    """Each request's counted output tokens: its longest sample's. ``sample_tokens``: one length per request (one
    sample each), a ``[requests, n]`` array, or one sequence of sample lengths per request (any ``n``)."""
    if isinstance(sample_tokens, np.ndarray) and sample_tokens.ndim == 2:
        return sample_tokens.max(axis=1) if sample_tokens.shape[1] else np.zeros(len(sample_tokens), np.int64)
    values = list(sample_tokens)
    if values and isinstance(values[0], Sequence | np.ndarray):
        if not all(len(v) for v in values):
            raise InputError("a request with no samples has no output tokens to count")
        return np.array([max(v) for v in values], dtype=np.int64)
    return np.asarray(values, dtype=np.int64)


def request_latencies(arrival_s, first_token_s, finish_s, tokens) -> pd.DataFrame:
    """One row per request (``METRICS``, seconds) from its arrival, first-token and finish times and its counted
    output tokens (``counted_tokens``); an unfinished request's row is NaN."""
    arrival, first, finish = (np.asarray(x, dtype=np.float64) for x in (arrival_s, first_token_s, finish_s))
    tokens = np.asarray(tokens, dtype=np.float64)
    if not arrival.shape == first.shape == finish.shape == tokens.shape:
        raise InputError(f"request latencies need one arrival, first token, finish and token count per request; got "
                         f"{len(arrival)}, {len(first)}, {len(finish)} and {len(tokens)}")
    e2e = finish - arrival
    tpot = (finish - first) / np.maximum(tokens - 1, 1)
    return pd.DataFrame({"ttft_s": first - arrival, "tpot_s": tpot, "itl_s": tpot, "e2e_s": e2e,
                         "normalized_latency_s": e2e / np.maximum(tokens, 1)})


def latencies_of(requests: pd.DataFrame) -> pd.DataFrame:
    """``request_latencies`` of a table with ``arrival_s``, ``first_token_s``, ``finish_s`` and ``output_tokens``
    (the counted tokens), finished requests only, indexed from 0."""
    done = requests[requests["finish_s"].notna()]
    return request_latencies(done["arrival_s"], done["first_token_s"], done["finish_s"],
                             done["output_tokens"]).reset_index(drop=True)


def latency_summary(requests: pd.DataFrame) -> dict:
    """TTFT, TPOT and end-to-end latency p50/p90/p99 (seconds) over the finished requests of ``requests`` (as
    ``latencies_of`` reads it), and the normalized latency (their mean seconds per counted output token). Over
    several replicas: of their pooled requests, never an average of their percentiles."""
    table = latencies_of(requests)
    out = {}
    for name in SUMMARIZED:
        values = table[f"{name}_s"].to_numpy()
        quantiles = np.percentile(values, PERCENTILES) if len(values) else (np.nan,) * len(PERCENTILES)
        out.update({f"{name}_p{q}_s": float(v) for q, v in zip(PERCENTILES, quantiles)})
    normalized = table["normalized_latency_s"].to_numpy()
    out["normalized_latency_s"] = float(np.mean(normalized)) if len(normalized) else np.nan
    return out
