"""The block tables of an eager step, kept from step to step so a step costs O(batch), not
O(context).

Rebuilding every sequence's padded table from its Python list each step grew with every
token generated (bench/step_loop.py: the eager step inputs went from 6 to 11 us per sequence
per step between 100 and 1,000 output tokens). Here each sequence keeps a row of its own; a
step writes only what changed in it and gathers the batch's rows in one copy.

What changed is found as the decode graphs find it (cuda_graphs.py): the KV cache manager
changes a sequence's table in place only by appending blocks and by replacing the block being
written (copy-on-write); every other change (swap-in, recompute, fork) gives the sequence a new
list, which is written whole. One owner: the model runner, on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_service.core.scheduler_output import ScheduledSeq


@dataclass(slots=True)
class _Row:
    table: list[int]  # the KV cache manager's list this row mirrors
    entries: np.ndarray  # int32, as wide as the longest context
    written: int  # how many of the table's entries the row holds


class EagerBlockTables:
    def __init__(self, width: int) -> None:
        self.width = width  # block table columns for max_model_len
        self._rows: dict[int, _Row] = {}  # seq_id -> its row

    def gather(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        """The batch's tables [len(scheduled), longest table] (int32, zero padded), in
        schedule order. Sequences not in this batch lose their rows (rebuilt if they return)."""
        rows: dict[int, _Row] = {}
        batch: list[np.ndarray] = []
        longest = 0
        for item in scheduled:
            table = item.block_table
            row = self._rows.get(item.seq.seq_id)
            if row is None or row.table is not table or len(table) > len(row.entries):
                row = _Row(table, np.zeros(max(self.width, len(table)), dtype=np.int32), 0)
            written, end = row.written, len(table)
            if end < written:  # a shorter table in the same list: padding is zeros
                row.entries[end:written] = 0
                written = end
            if written and row.entries[written - 1] != table[written - 1]:
                written -= 1  # copy-on-write of the last block written so far
            if end > written:
                row.entries[written:end] = table[written:end]
            row.written = end
            rows[item.seq.seq_id] = row
            batch.append(row.entries)
            longest = max(longest, end)
        self._rows = rows
        return np.stack([entries[:longest] for entries in batch])
