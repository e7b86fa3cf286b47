"""Block manager micro-benchmark: appends/s, bulk appends/s, forks/s, create+release/s (medians)."""
from __future__ import annotations

import pandas as pd

from lab.kv_cache.block_manager import KVBlockManager
from lab.bench.timing import median_seconds


def _appends(num_seqs: int, tokens_per_seq: int, block_size: int) -> float:
    def run():
        manager = KVBlockManager(num_seqs * (tokens_per_seq // block_size + 1), block_size)
        for seq in range(num_seqs):
            manager.create_sequence(seq)
        for _ in range(tokens_per_seq):
            for seq in range(num_seqs):
                manager.append_token(seq)
    return num_seqs * tokens_per_seq / median_seconds(run, repeats=5, warmup=1)


def _bulk_appends(num_seqs: int, tokens_per_seq: int, block_size: int) -> float:
    def run():
        manager = KVBlockManager(num_seqs * (tokens_per_seq // block_size + 1), block_size)
        for seq in range(num_seqs):
            manager.create_sequence(seq)
            manager.append_tokens(seq, tokens_per_seq)
    return num_seqs * tokens_per_seq / median_seconds(run, repeats=5, warmup=1)


def _forks(num_forks: int, prompt_len: int, block_size: int) -> float:
    def run():
        manager = KVBlockManager(prompt_len // block_size + num_forks + 2, block_size)
        manager.create_sequence("parent", num_prompt_tokens=prompt_len)
        for child in range(num_forks):
            manager.fork_sequence("parent", child)
            manager.append_token(child)  # copy-on-write of the shared partial block
    return num_forks / median_seconds(run, repeats=5, warmup=1)


def _create_release(num_seqs: int, prompt_len: int, block_size: int, caching: bool) -> float:
    prompts = [[seq % 7] * prompt_len for seq in range(num_seqs)]

    def run():
        manager = KVBlockManager(4 * prompt_len // block_size + 8, block_size, enable_prefix_caching=caching)
        for seq, prompt in enumerate(prompts):
            manager.create_sequence(seq, prompt if caching else None, None if caching else prompt_len)
            manager.release_sequence(seq)
    return num_seqs / median_seconds(run, repeats=5, warmup=1)


def run_block_manager_bench(block_size: int = 16) -> pd.DataFrame:
    """One row per operation with its median rate."""
    rows = [("append_token", "tokens/s", _appends(256, 512, block_size)),
            ("append_tokens (bulk)", "tokens/s", _bulk_appends(256, 512, block_size)),
            ("fork_sequence + CoW append", "forks/s", _forks(20_000, 100, block_size)),
            ("create+release (no caching)", "sequences/s", _create_release(20_000, 512, block_size, False)),
            ("create+release (prefix caching)", "sequences/s", _create_release(2_000, 512, block_size, True))]
    return pd.DataFrame(rows, columns=["operation", "unit", "median_rate"]).assign(block_size=block_size)
