"""Decode block tables on the device (``lab.worker.block_tables``): after any sequence of pool operations (appends across
block boundaries, forks and copy-on-write, swaps out and back, releases and new sequences reusing ids) the gathered
rows equal the pool's tables, and a step uploads only what changed."""
import random

import pytest
import torch

from lab.kv_cache.block_manager import KVBlockManager
from lab.worker.block_tables import DeviceBlockTables


def step(tables: DeviceBlockTables, manager: KVBlockManager, seq_ids: list) -> tuple[torch.Tensor, int]:
    """One decode step's tables (as the runner builds them) and how many entries it uploaded."""
    rows, updates = tables.plan(seq_ids, manager)
    tables.apply(torch.tensor(updates, dtype=torch.long))
    width = max(len(manager.block_table_view(s)) for s in seq_ids)
    return tables.gather(torch.tensor(rows, dtype=torch.long), width), len(updates) // 3


def assert_equal_tables(gathered: torch.Tensor, manager: KVBlockManager, seq_ids: list) -> None:
    for row, seq_id in zip(gathered.tolist(), seq_ids):
        table = manager.get_block_table(seq_id)
        assert row[:len(table)] == table, (seq_id, row, table)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("seed", range(6))
def test_gathered_tables_follow_every_pool_operation(block_size, seed):
    rng = random.Random(seed)
    manager, host = KVBlockManager(6000, block_size), KVBlockManager(6000, block_size)
    tables = DeviceBlockTables(torch.device("cpu"), num_rows=4, num_cols=2)  # small: rows and columns must grow
    live, next_id = [], 0
    for _ in range(120):
        action = rng.random()
        if action < 0.2 or not live:
            manager.create_sequence(next_id, num_prompt_tokens=rng.randint(1, 20))
            live.append(next_id)
            next_id += 1
        elif action < 0.3:
            parent = rng.choice(live)
            manager.fork_sequence(parent, next_id)  # the next append copies a shared partial block
            live.append(next_id)
            next_id += 1
        elif action < 0.38 and len(live) > 1:
            victim = live.pop(rng.randrange(len(live)))
            manager.release_sequence(victim)
        elif action < 0.44:
            moved = rng.choice(live)
            manager.move_sequences([moved], host)  # swapped out, then back: new blocks
            manager.check_invariants()
            host.move_sequences([moved], manager)
        elif action < 0.48 and len(live) > 1:
            old = live.pop(rng.randrange(len(live)))
            manager.release_sequence(old)
            manager.create_sequence(old, num_prompt_tokens=rng.randint(1, 9))  # an id reused: a new table
            live.append(old)
        for seq_id in live:
            if rng.random() < 0.8 and manager.num_blocks_to_append(seq_id, 1) <= manager.num_free_blocks:
                manager.append_token(seq_id)
        batch = rng.sample(live, rng.randint(1, len(live)))
        gathered, _ = step(tables, manager, batch)
        assert_equal_tables(gathered, manager, batch)


def test_a_step_uploads_only_new_blocks():
    manager = KVBlockManager(64, 4)
    for seq_id in range(3):
        manager.create_sequence(seq_id, num_prompt_tokens=8)  # two full blocks each
    tables = DeviceBlockTables(torch.device("cpu"))
    assert step(tables, manager, [0, 1, 2])[1] == 6
    assert step(tables, manager, [0, 1, 2])[1] == 0  # nothing changed
    manager.append_token(1)  # sequence 1 starts its third block
    gathered, uploaded = step(tables, manager, [2, 1])
    assert uploaded == 1
    assert_equal_tables(gathered, manager, [2, 1])
    manager.fork_sequence(1, 9)
    manager.append_token(9)  # the fork copies its shared partial block: its last entry changes
    gathered, uploaded = step(tables, manager, [1, 9])
    assert uploaded == 3  # the fork's new row
    manager.append_token(1)  # and now the parent copies its own
    gathered, uploaded = step(tables, manager, [1, 9])
    assert_equal_tables(gathered, manager, [1, 9])
