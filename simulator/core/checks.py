"""Closed-form checks of a simulation's numbers, shown beside them: identities every run satisfies and bounds that
follow from how each allocator holds memory. A row that does not hold is a bug in the simulator, not a property of
the workload.

Each check compares a number the run reports with what a closed form gives from other numbers of the same run (or the
workload): the five memory categories cover the pool; every arrived request completes or is rejected, and a completed
one got its first token after it arrived and finished after that; the tokens generated are the completed requests'
output lengths; a workload that shares nothing saves nothing; ``contiguous-max`` holds exactly ``max_model_len`` slots
per batched sequence (time-weighted, so it checks the memory integral against the batch integral);
``contiguous-oracle`` on first-fit wastes nothing inside a region; paged memory has no external fragmentation and, with
prefill-first scheduling, at most ``block_size`` slack slots (reserved or never filled) per batched sequence; and,
when nothing was preempted, the prefix cache hits no more blocks than an unbounded cache would give the workload's
prompts in arrival order (``unbounded_cache_hit_blocks``: the bound a finite pool's evictions fall short of).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from lab.checks import entry_point

from .engine import SimConfig, SimResult, synthetic_token_ids
from .workloads import Workload

COLUMNS = ("label", "check", "simulated", "relation", "closed_form", "holds")
RELATIVE_TOLERANCE = 1e-9  # equalities: float sums over thousands of steps


@entry_point
def closed_form_checks(workload: Workload, results: dict[str, SimResult]) -> pd.DataFrame:
    """One row per (run, check) that applies to it (``COLUMNS``): what the run reports, ``=`` or ``<=``, what the
    closed form gives, and whether it holds. ``results`` maps a label (e.g. ``simulator.compare``'s) to a run of
    ``workload``. A run stopped early skips the checks that need it finished."""
    rows, bounds = [], {}
    for label, result in results.items():
        checks = _checks(workload, result)
        if _prefix_cache_bounded(result):
            size = result.config.block_size
            if size not in bounds:  # one pass over the prompts per block size, shared by the runs
                bounds[size] = unbounded_cache_hit_blocks(workload, size)
            checks.append(("prefix-cache hit blocks <= an unbounded cache's (arrival order)",
                           result.summary["prefix_cache_hit_blocks"], "<=", bounds[size]))
            if result.config.kv_offload_blocks is None:  # an unbounded tier keeps everything the GPU evicts
                checks.append(("prefix-cache hit blocks with an unbounded offload tier = an unbounded cache's",
                               result.summary["prefix_cache_hit_blocks"], "=", bounds[size]))
        checks += _offload_checks(workload, result)
        rows += [(label, *check, _holds(*check[1:])) for check in checks]
    return pd.DataFrame(rows, columns=COLUMNS)


def _offload_checks(workload: Workload, result: SimResult) -> list[tuple]:
    """A run with an offload tier: it never holds more blocks than the host pool, and a workload whose prompts
    share nothing loads nothing back (nothing it stores is ever asked for again, preemption aside)."""
    summary, config = result.summary, result.config
    if "offload_loaded_blocks" not in summary:
        return []
    checks = []
    if config.kv_offload_blocks is not None:  # the tier borrows free blocks of the one host pool
        checks.append(("offload tier's peak blocks <= the host pool's", summary["host_tier_peak_blocks"], "<=",
                       summary["host_capacity_tokens"] // config.block_size))
    if not workload.has_shared_prefixes and summary["preemptions"] == 0:
        checks.append(("blocks loaded from the tier (nothing shared)", summary["offload_loaded_blocks"], "=", 0))
    return checks


def _prefix_cache_bounded(result: SimResult) -> bool:
    """A paged run with prefix caching in which no sequence was preempted (a recomputed one looks up its own blocks
    again; a swapped one returns with its tokens untracked)."""
    summary, config = result.summary, result.config
    return (config.allocator == "paged" and config.enable_prefix_caching and summary["preemptions"] == 0
            and summary["swap_outs"] == 0)


def unbounded_cache_hit_blocks(workload: Workload, block_size: int) -> int:
    """The prefix-cache hits, in blocks, that a cache never evicting anything would give the workload's prompts
    admitted in arrival order (as FCFS admits them): a lookup walks a prompt's full blocks, leaving its last token,
    and stops at the first block no earlier prompt held after the same prefix. Samples fork rather than look up, and
    generated tokens never repeat a prompt's, so without preemption no run of the workload hits more. 0 when no
    prompt shares anything (each then has content of its own)."""
    if not workload.has_shared_prefixes:
        return 0
    chain: dict[tuple, int] = {}  # (id of the prefix before a block, the block's tokens) -> id of the prefix to it
    hits, width = 0, 8 * block_size  # a block's tokens as int64 bytes: slicing them is cheaper than tuples
    for request in range(len(workload)):
        ids = synthetic_token_ids(workload, request, int(workload.prompt_tokens[request]))
        tokens = np.asarray(ids, dtype=np.int64).tobytes()
        lookups, prefix, fresh = (len(ids) - 1) // block_size, -1, False
        for index in range(len(ids) // block_size):
            key = (prefix, tokens[index * width:(index + 1) * width])
            known = None if fresh else chain.get(key)  # after a new prefix every key is new
            if known is None:
                known = chain[key] = len(chain)
                fresh = True
            elif index < lookups:
                hits += 1
            prefix = known
    return hits


def _holds(simulated: float, relation: str, closed_form: float) -> bool:
    if relation == "<=":
        return simulated <= closed_form * (1 + RELATIVE_TOLERANCE)
    return abs(simulated - closed_form) <= RELATIVE_TOLERANCE * max(abs(closed_form), 1.0)


def _checks(workload: Workload, result: SimResult) -> list[tuple[str, float, str, float]]:
    summary, config = result.summary, result.config
    fractions = [summary[name] for name in ("token_states_frac", "reserved_frac", "internal_fragmentation_frac",
                                            "external_fragmentation_frac", "free_frac")]
    checks = [("memory categories sum to the pool (fraction)", sum(fractions), "=", 1.0),
              ("peak KV allocated (fraction of the pool)", summary["peak_allocated_frac"], "<=", 1.0),
              ("peak batch (sequences)", summary["peak_batch_size"], "<=", config.max_num_seqs),
              ("completed requests with arrival <= first token <= finish", *_timed_in_order(result.requests))]
    if workload.n == 1 and workload.beam_width == 1 and not workload.has_shared_prefixes:
        checks.append(("sharing saving with nothing shared (fraction)", summary["sharing_saving_frac"], "=", 0.0))
    if not summary["stopped_early"]:
        checks += [("requests completed + rejected = arrived",
                    summary["num_requests_completed"] + summary["num_requests_rejected"], "=", summary["num_requests"]),
                   ("tokens generated = the completed requests' output tokens", summary["generated_tokens"], "=",
                    completed_output_tokens(workload, result.requests))]
    return checks + _allocator_checks(summary, config, fractions)


def _allocator_checks(summary: dict, config: SimConfig, fractions: list[float]) -> list[tuple[str, float, str, float]]:
    # per replica: a cluster's fractions and batch are busy-time-weighted means over identical replicas
    slots, batch = summary["capacity_tokens"] / config.replicas, summary["mean_batch_size"]
    if config.allocator == "contiguous-max":
        held = slots * (fractions[0] + fractions[1] + fractions[2])
        return [("held slots = batch x max_model_len (time-weighted)", held, "=", batch * config.max_model_len)]
    if config.allocator == "contiguous-oracle" and config.address_space == "first-fit":
        return [("internal fragmentation (fraction)", fractions[2], "=", 0.0)]
    if config.allocator != "paged":
        return []
    checks = [("external fragmentation (fraction)", fractions[3], "=", 0.0)]
    if config.scheduling == "prefill-first":  # chunked: a prompt's blocks are taken at admission (vLLM V0), so the
        # slots of its chunks still to come are reserved too
        checks.append(("reserved + internal slots <= block_size x batch (time-weighted)",
                       slots * (fractions[1] + fractions[2]), "<=", config.block_size * batch))
    return checks


def _timed_in_order(requests: pd.DataFrame) -> tuple[int, str, int]:
    arrival, first, finish = (requests[column].to_numpy(dtype=np.float64)
                              for column in ("arrival_s", "first_token_s", "finish_s"))
    done = ~np.isnan(finish)
    return int(((arrival <= first) & (first <= finish))[done].sum()), "=", int(done.sum())


def completed_output_tokens(workload: Workload, requests: pd.DataFrame) -> int:
    """The output tokens of every sample (or beam) of the requests that completed (``finish_s`` set)."""
    done = requests.index.to_numpy()[~np.isnan(requests["finish_s"].to_numpy(dtype=np.float64))]
    return int(sum(sum(workload.outputs_of(int(index))) for index in done))
