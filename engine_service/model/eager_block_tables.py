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
    index: int  # its row in the mirror
    table: list[int]  # the KV cache manager's list this row mirrors
    written: int  # how many of the table's entries the row holds
    last: int  # the last entry written (a copy-on-write replaces it)


class EagerBlockTables:
    def __init__(self, width: int, rows: int = 64) -> None:
        self.width = width  # block table columns for max_model_len
        self._mirror = np.zeros((rows, width), dtype=np.int32)
        self._free = list(range(rows - 1, -1, -1))
        self._rows: dict[int, _Row] = {}  # seq_id -> its row

    def gather(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        """The batch's tables [len(scheduled), longest table] (int32, zero padded), in
        schedule order. Sequences not in this batch give their rows back (rebuilt if they
        return)."""
        previous, rows = self._rows, {}
        indices = []
        longest = 0
        for item in scheduled:
            seq_id, table = item.seq.seq_id, item.block_table
            row = previous.pop(seq_id, None)
            if row is None:
                row = _Row(self._take(), table, 0, -1)
            rows[seq_id] = row
            end = len(table)
            # Most steps change nothing in most rows: a block is added every block_size tokens.
            if row.table is not table or row.written != end or (end and row.last != table[-1]):
                self._update(row, table)
            indices.append(row.index)
            if end > longest:
                longest = end
        for row in previous.values():  # rows are handed out zeroed
            self._mirror[row.index, : row.written] = 0
            self._free.append(row.index)
        self._rows = rows
        return self._mirror[indices, :longest]

    def _update(self, row: _Row, table: list[int]) -> None:
        """The row brought up to `table`: the entries that changed."""
        mirror, index, end = self._mirror, row.index, len(table)
        if end > self.width:
            raise ValueError(f"a block table of {end} blocks; the width is {self.width}")
        if row.table is not table:  # a new list: written whole
            mirror[index, end : row.written] = 0
            row.table, row.written = table, 0
        written = row.written
        if end < written:  # a shorter table in the same list: padding is zeros
            mirror[index, end:written] = 0
            written = end
        elif written and row.last != table[written - 1]:
            written -= 1  # copy-on-write of the last block written so far
        if end > written:
            mirror[index, written:end] = table[written:end]
        row.last = table[end - 1] if end else -1
        row.written = end

    def _take(self) -> int:
        """A free row of the mirror, which doubles when none is left."""
        if not self._free:
            old = self._mirror
            self._mirror = np.zeros((2 * len(old), self.width), dtype=np.int32)
            self._mirror[: len(old)] = old
            self._free = list(range(2 * len(old) - 1, len(old) - 1, -1))
        return self._free.pop()
