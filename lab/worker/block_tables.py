"""Decode block tables kept on the device and updated incrementally.

A decode step's attention reads each sequence's block table. Building the whole ``[batch, max_blocks]`` table on the
host and uploading it every step costs host time that grows with the context; but between two steps a sequence's
table changes by at most one new block (every ``block_size`` tokens) or a new last block (copy-on-write of a shared
partly filled block). So each sequence keeps a row of a device tensor, and a step uploads only the entries that
changed; the batch's tables are one gather of its rows on the device.

A row is tied to the table object the pool handed out (``KVView.block_table_view``): the pool makes a new one when
a sequence is created, forked, moved (swap) or re-forked (beam search), and changes an existing one only by appending
blocks or by replacing its last block (copy-on-write), which the last uploaded entry detects.
"""
from __future__ import annotations

import torch


class DeviceBlockTables:
    """Rows of block ids on ``device``, one per sequence seen in recent decode steps (grown as needed)."""

    def __init__(self, device: torch.device, num_rows: int = 64, num_cols: int = 64):
        self.device = device
        with torch.inference_mode(False):
            self.tables = torch.zeros((num_rows, num_cols), dtype=torch.int32, device=device)
        self.entries: dict = {}  # seq_id -> [row, table object, entries uploaded, last uploaded block id]
        self.free_rows = list(range(num_rows - 1, -1, -1))

    def plan(self, seq_ids: list, kv) -> tuple[list[int], list[int]]:
        """The batch's rows, and the changed entries as one flat list: rows, then columns, then block ids (to
        upload with the step's other integers and apply with ``apply``)."""
        entries, rows, cols, blocks, batch = self.entries, [], [], [], []
        for seq_id in seq_ids:
            table = kv.block_table_view(seq_id)
            entry = entries.get(seq_id)
            if entry is None or entry[1] is not table:
                entry = self._assign(seq_id, table, seq_ids)
            row, _, done, last = entry
            if done and table[done - 1] != last:  # its last block was copied on write
                done -= 1
            end = len(table)
            if end > done:
                rows += [row] * (end - done)
                cols += range(done, end)
                blocks += table[done:end]
                entry[2], entry[3] = end, table[end - 1]
            batch.append(row)
        if cols and max(cols) >= self.tables.shape[1]:
            self._grow(self.tables.shape[0], max(max(cols) + 1, 2 * self.tables.shape[1]))
        return batch, rows + cols + blocks

    def apply(self, updates: torch.Tensor) -> None:
        """Write ``plan``'s changed entries (on the device, as one int64 tensor)."""
        if updates.numel():
            rows, cols, blocks = updates.view(3, -1)
            self.tables[rows, cols] = blocks.to(torch.int32)

    def gather(self, batch_rows: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's ``[len(batch_rows), width]`` block tables (entries past a table's end are stale: the kernels
        read only a sequence's first ``ceil(seq_len / block_size)`` blocks)."""
        return torch.index_select(self.tables[:, :width], 0, batch_rows, out=out)

    def _assign(self, seq_id, table, batch: list) -> list:
        """A row for ``seq_id`` (whose table is new to us); rows of sequences outside ``batch`` are dropped when
        none is free, and the tensor doubles when they were all needed."""
        old = self.entries.pop(seq_id, None)
        if old is not None:
            self.free_rows.append(old[0])
        if not self.free_rows:
            keep = set(batch)
            for other in [s for s in self.entries if s not in keep]:
                self.free_rows.append(self.entries.pop(other)[0])
            if not self.free_rows:
                rows = self.tables.shape[0]
                self._grow(2 * rows, self.tables.shape[1])
                self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        entry = self.entries[seq_id] = [self.free_rows.pop(), table, 0, -1]
        return entry

    def _grow(self, num_rows: int, num_cols: int) -> None:
        # a plain tensor even when a step in inference mode (a CUDA graph's decode) grows it: an inference tensor
        # could not be written by the next eager step outside it
        with torch.inference_mode(False):
            tables = torch.zeros((num_rows, num_cols), dtype=torch.int32, device=self.device)
            tables[:self.tables.shape[0], :self.tables.shape[1]] = self.tables
        self.tables = tables
