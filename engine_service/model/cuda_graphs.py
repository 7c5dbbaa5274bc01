"""CUDA graphs for decode steps: the whole forward (every layer, the LM head) replayed as one
launch instead of ~30 host-side launches per layer.

Measured on an H200 without graphs (bench/results/gpu_h200), a bf16 decode step of
SmolLM2-135M took 17-29 ms at batch 1 and a Llama-8B-shaped one 19-26 ms, against 0.06 and
3.1 ms to read their weights: the host launching kernels one by one was the step. With graphs:
2.1 and 5.7 ms. As vLLM does:

- Graphs are captured once, at start, for padded batch sizes (`capture_sizes`); a decode batch
  of n sequences replays the smallest graph of at least n rows.
- A graph reads its inputs from fixed device buffers. Each step writes token ids, positions,
  slots and context lengths (one entry per row) into a pinned host mirror and copies them.
- The block table has one row per sequence, as wide as the longest context (`max_model_len`).
  A sequence keeps its row while it decodes: a row is written whole once, when a sequence
  takes it, and after that only the entries that changed are written (a new block, and the
  block a copy-on-write replaced), into the host mirror and, as (index, value) pairs, into the
  device buffer (one scatter). So a step's host work and upload are O(batch), not O(context):
  uploading whole rows every step was 2 MiB at 256 rows and 32k tokens, and its host side
  grew with every sequence's length. This relies on how the KV cache manager changes a table
  in place (kv_cache_manager.py): it appends blocks and replaces only the block being written
  (copy-on-write); every other change (swap-in, recompute, fork) gives the sequence a new
  list, which is rewritten whole.
- When a sequence leaves, the last rows move into the holes (as vLLM condenses its persistent
  batch): rows follow arrivals, not the schedule's order, and the logits rows are gathered back
  into schedule order when the two differ.
- Padding rows write no K/V (slot -1), attend to one key of block 0 and are never sampled.
- A graph's attention splits each sequence's keys as an eager step does, planned on the
  device from the context lengths (kernels/attention_splits.py): nothing to write per step
  beyond the lengths. Padding rows add a key each to the batch's total, so a split size can
  differ from the eager step's and the sums need not match bit for bit; greedy tokens match
  (tests/engine/test_cuda_graphs.py).

Only steps where every sequence runs one token are replayed here (decode, or a one-token
prompt); steps carrying a prefill chunk replay the mixed-step graphs (mixed_graphs.py), which
read the same block-table rows and context lengths, so a sequence keeps its row across both.
`enforce_eager` turns graphs off. One owner: the model runner, on the engine thread.

Off CUDA there are no graphs, but the same buffers can run the forward eagerly: the engine
never does this, the tests do, so the buffer handling (rows, padding, block tables) is checked
on every machine, not only on a GPU.

A step is prepared (the host mirror written from the schedule), then launched (uploaded and
replayed). Under tensor parallelism only rank 0 has the schedule: the writes it prepared go to
every worker as a `DecodeStep` (rows, tokens, the table's (index, value) scatter), each worker
applies them to its own buffers and launches the same graph size, so every rank's buffers stay
equal step by step (tests/engine/test_tensor_parallel_graphs.py checks them by digest).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine_service.core.scheduler_output import ScheduledSeq
from engine_service.model.models.llama import StepContext

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16


@dataclass(slots=True)
class RowWrites:
    """What one step wrote into the sequence rows (DecodeGraphs.write_rows), shared by the
    decode and the mixed-step graphs."""

    seq_lens: np.ndarray  # int32 [rows]: rows 0.. of the context lengths
    table_index: np.ndarray  # int64: flat indices into the [rows, width] block table
    table_values: np.ndarray  # int32: the block ids written there

    def __reduce__(self):
        # As raw bytes: numpy's own pickling of a small array costs ~20 us (a 32-sequence
        # decode step pickled in ~100 us that way, ~20 us so).
        return _row_writes, (self.seq_lens.tobytes(), self.table_index.tobytes(),
                             self.table_values.tobytes())


def _row_writes(seq_lens: bytes, table_index: bytes, table_values: bytes) -> RowWrites:
    return RowWrites(np.frombuffer(seq_lens, np.int32), np.frombuffer(table_index, np.int64),
                     np.frombuffer(table_values, np.int32))


@dataclass(slots=True)
class DecodeStep:
    """One decode step's writes into the graphs' host mirror (DecodeGraphs.prepare). Under
    tensor parallelism rank 0 sends it to every worker (parallel/tp_runner.py), which applies
    it to its own buffers: O(batch), like the upload (a sequence keeps its row; only changed
    table entries travel)."""

    size: int  # the graph's rows (the batch padded)
    rows: RowWrites
    tokens: np.ndarray  # int64 [3, size]: each row's token id, position, slot
    sample_rows: list[int] | None  # rows whose logits are sampled, in schedule order (None:
    # rows 0 .. num_seqs - 1 in order)
    num_seqs: int

    def __reduce__(self):  # (as RowWrites')
        return _decode_step, (self.size, self.rows, self.tokens.tobytes(), self.sample_rows,
                              self.num_seqs)


def _decode_step(size: int, rows: RowWrites, tokens: bytes, sample_rows: list[int] | None,
                 num_seqs: int) -> DecodeStep:
    return DecodeStep(size, rows, np.frombuffer(tokens, np.int64).reshape(3, size),
                      sample_rows, num_seqs)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_num_seqs: a batch pads
    to at most 15 rows more (under 2x below 16)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in SMALL_SIZES if s < max_num_seqs]
    sizes += range(SIZE_STEP, max_num_seqs, SIZE_STEP)
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards of one model runner, and the buffers they read."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.width = -(-max_model_len // runner.block_size)  # block table columns
        dev = runner.device
        rows, width = self.max_size, self.width
        # Every buffer a kernel reads starts on a 16-byte boundary (Triton specializes pointer
        # arguments on it): regions of a multiple of 4 entries.
        self.region = -(-rows // 4) * 4
        # int64: token ids, positions, slots. int32: context lengths, then the block table.
        self.on_cuda = dev.type == "cuda"
        self.host64 = torch.zeros((3, self.region), dtype=torch.int64, pin_memory=self.on_cuda)
        self.host32 = torch.zeros(self.region + rows * width, dtype=torch.int32,
                                  pin_memory=self.on_cuda)
        self.dev64 = torch.zeros_like(self.host64, device=dev)
        self.dev32 = torch.zeros_like(self.host32, device=dev)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self._ids, self._positions, self._slots = self.host64.numpy()
        self._seq_lens = self.host32[:rows].numpy()
        self._tables = self.host32[self.region :].view(rows, width).numpy()
        self._dev_tables = self.dev32[self.region :]  # flat, what the scatter writes
        # Table entries changed this step, as flat indices into the table and their values.
        self._stage_index = torch.zeros(rows * width, dtype=torch.int64, pin_memory=self.on_cuda)
        self._stage_values = torch.zeros(rows * width, dtype=torch.int32,
                                         pin_memory=self.on_cuda)
        self._dev_stage_index = torch.zeros_like(self._stage_index, device=dev)
        self._dev_stage_values = torch.zeros_like(self._stage_values, device=dev)
        self._stage_index_np = self._stage_index.numpy()
        self._stage_values_np = self._stage_values.numpy()
        # Who holds each row: a seq_id, and the table list written there (the KV cache
        # manager's own list: the same list means only appends and a copy-on-write of the
        # block being written happened since) and how many of its entries. None: a free row,
        # its table entry 0 is block 0 (a padding row's one key).
        self._owners: list[int | None] = [None] * rows
        self._owner_tables: list[list[int] | None] = [None] * rows
        self._written = [0] * rows
        self._row_of: dict[int, int] = {}  # seq_id -> its row
        self._num_staged = 0
        self._pad_rows(0, rows)
        self._pad_tokens(0, rows)
        # Set when a step's host-to-device copies are queued: the mirror is not rewritten
        # before they have run.
        self._copied = torch.cuda.Event() if self.on_cuda else None
        # Every graph writes its logits here, one buffer for all: with logits of their own,
        # 20 graphs of up to 256 rows held 411 MiB of them (a 49,152-token vocabulary).
        # (As wide as this rank's LM head: under tensor parallelism a worker's has its
        # vocabulary rows, rank 0's the whole vocabulary, gathered.)
        self.logits = torch.empty((rows, runner.model.lm_head.out_features),
                                  dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' private memory pool, once captured
        self.num_replays = 0  # decode steps that ran through these buffers

    def _pad_tokens(self, start: int, end: int) -> None:
        """The decode tokens of rows start..end-1 as padding. (Not in _pad_rows: the
        mixed-step graphs pad rows too and never read these.)"""
        self._ids[start:end] = 0
        self._positions[start:end] = 0
        self._slots[start:end] = -1  # no K/V write

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows start..end-1 as padding (a row that held a sequence is freed)."""
        self._seq_lens[start:end] = 1  # one key, the first of block 0
        for row in range(start, end):
            if self._owners[row] is not None:
                self._release(row, free=True)

    def _release(self, row: int, free: bool) -> None:
        """The row's sequence leaves it; a row left free gets table entry 0 back to block 0
        (a row taken by another sequence is about to be written whole)."""
        del self._row_of[self._owners[row]]
        self._owners[row] = None
        self._owner_tables[row] = None
        self._written[row] = 0
        if free:
            self._tables[row, 0] = 0
            self._stage(row * self.width, [0])

    def _stage(self, index: int, values: list[int]) -> None:
        """values go to table entries index, index + 1, ... on the device this step."""
        staged, count = self._num_staged, len(values)
        self._stage_index_np[staged : staged + count] = range(index, index + count)
        self._stage_values_np[staged : staged + count] = values
        self._num_staged = staged + count

    def _place(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """Each sequence's row, all in 0..n-1: its own when it has one there, else a row left
        by a sequence not in this step (its table then written whole)."""
        n = len(scheduled)
        rows = [-1] * n
        kept = [False] * n
        for i, item in enumerate(scheduled):
            row = self._row_of.get(item.seq.seq_id)
            if row is not None and row < n:
                rows[i] = row
                kept[row] = True
        free = [row for row in range(n - 1, -1, -1) if not kept[row]]
        for i, item in enumerate(scheduled):
            if rows[i] >= 0:
                continue
            row = free.pop()
            seq_id = item.seq.seq_id
            if self._owners[row] is not None:
                self._release(row, free=False)
            old = self._row_of.get(seq_id)  # a row past this batch's end
            if old is not None:
                self._release(old, free=True)
            self._owners[row] = seq_id
            self._row_of[seq_id] = row
            rows[i] = row
        return rows

    def _write_table(self, row: int, table: list[int]) -> None:
        """Row `row`'s table brought up to `table`: the entries that changed, into the host
        mirror and staged for the device."""
        start = 0
        written = self._written[row]
        if self._owner_tables[row] is table and written:
            # The same list: blocks were appended, and the last block written so far may have
            # been replaced by a copy-on-write (a block's first write after a fork).
            start = written - 1 if self._tables[row, written - 1] != table[written - 1] else written
        else:
            self._owner_tables[row] = table
        end = len(table)
        if end > start:
            changed = table[start:end]
            self._tables[row, start:end] = changed
            self._stage(row * self.width + start, changed)
        self._written[row] = end

    def _forward(self, size: int) -> torch.Tensor:
        """The decode forward over the first `size` rows of the fixed buffers."""
        runner = self.runner
        positions = self.dev64[1, :size]
        ctx = StepContext(
            positions=positions,
            slot_mapping=self.dev64[2, :size],
            block_tables=self.table_rows(size),
            seq_lens=self.dev32[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            attention_plan=None,
            cos=runner.cos[positions],
            sin=runner.sin[positions],
        )
        hidden = runner.model(self.dev64[0, :size], ctx, runner.kv_caches, runner.kernels)
        return runner.model.compute_logits(hidden, out=self.logits[:size])

    @torch.inference_mode()
    def capture(self) -> int:
        """One graph per size, largest first so the smaller ones reuse its memory pool. The
        buffers hold padding rows only, so neither the warm-up runs nor the captures write
        the KV pool. Off CUDA, nothing to capture: `run` calls the forward itself. Returns
        the device memory the graphs and their buffers added (0 off CUDA)."""
        if not self.on_cuda:
            return 0
        dev = self.runner.device
        start = time.perf_counter()
        torch.cuda.synchronize(dev)
        # Reserved, not allocated: the graphs' private pool keeps what their captures freed.
        # (It also counts any growth of the ordinary pool by the eager runs: an upper bound.)
        # Emptied first because each capture empties the ordinary pool's cache: measured from
        # a full cache, the figure went negative on an H200 (-177.5 MiB for the 8B shape).
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        pool = self.pool = torch.cuda.graph_pool_handle()  # the mixed-step graphs' too
        for size in reversed(self.sizes):
            self._forward(size)  # eager first: anything lazily built is built outside capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(dev)
        buffers = sum(t.numel() * t.element_size()
                      for t in (self.logits, self.dev64, self.dev32, self.query_start_loc))
        added = torch.cuda.memory_reserved(dev) - before + buffers
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s; %.1f MiB with "
                 "their buffers", len(self.graphs), self.sizes, time.perf_counter() - start,
                 added / 2**20)
        return added

    def accepts(self, scheduled: list[ScheduledSeq]) -> bool:
        """A batch a graph can run: every sequence one token, few enough sequences, every
        block table within the captured width."""
        return (0 < len(scheduled) <= self.max_size
                and all(item.num_new_tokens == 1 and len(item.block_table) <= self.width
                        for item in scheduled))

    def write_rows(self, scheduled: list[ScheduledSeq], num_rows: int) -> list[int]:
        """A step's sequence rows, in the host mirror: each sequence placed (`_place`), its
        context length (new tokens included) and its table's changed entries written and
        staged; rows len(scheduled)..num_rows-1 made padding. Waits first for the previous
        step's copies out of the mirror. Shared with the mixed-step graphs (mixed_graphs.py),
        so a sequence keeps its row whether its step is a decode or carries a prefill chunk.
        Returns each sequence's row."""
        if self._copied is not None:
            self._copied.synchronize()
        self._num_staged = 0
        rows = self._place(scheduled)
        for row, item in zip(rows, scheduled, strict=True):
            self._seq_lens[row] = item.seq.num_computed_tokens + item.num_new_tokens
            self._write_table(row, item.block_table)
        self._pad_rows(len(scheduled), num_rows)
        return rows

    def upload_rows(self) -> None:
        """The context lengths and the staged table entries to the device (non-blocking)."""
        staged = self._num_staged
        self.dev32[: self.region].copy_(self.host32[: self.region], non_blocking=True)
        if staged:
            index = self._dev_stage_index[:staged]
            values = self._dev_stage_values[:staged]
            index.copy_(self._stage_index[:staged], non_blocking=True)
            values.copy_(self._stage_values[:staged], non_blocking=True)
            self._dev_tables.index_copy_(0, index, values)

    def mark_copied(self) -> None:
        """This step's copies out of the host mirrors are queued (call before the replay)."""
        if self._copied is not None:
            self._copied.record()

    def table_rows(self, num_rows: int) -> torch.Tensor:
        """The device block table's first num_rows rows [num_rows, width] (int32)."""
        at = self.region
        return self.dev32[at : at + num_rows * self.width].view(num_rows, self.width)

    def prepare(self, scheduled: list[ScheduledSeq]) -> DecodeStep:
        """One decode step's writes into the host mirror, made here (rank 0: the rows, the
        tokens, the table entries that changed); what a tensor-parallel worker applies to its
        own buffers (`apply`) before every rank launches the step (`launch`)."""
        n = len(scheduled)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.runner.block_size
        rows = self.write_rows(scheduled, size)
        ids, positions, slots = self._ids, self._positions, self._slots
        for row, item in zip(rows, scheduled, strict=True):
            seq, table = item.seq, item.block_table
            pos = seq.num_computed_tokens
            ids[row] = seq.token_ids[pos]
            positions[row] = pos
            slots[row] = table[pos // bs] * bs + pos % bs
        self._pad_tokens(n, size)
        # Rows not sampled: one-token chunks of a longer prompt (budget of 1).
        sample_rows = [row for row, item in zip(rows, scheduled, strict=True) if item.samples]
        return DecodeStep(size, self.row_writes(size), self.host64.numpy()[:, :size],
                          None if sample_rows == list(range(n)) else sample_rows, n)

    def row_writes(self, num_rows: int) -> RowWrites:
        """What write_rows wrote this step, as views of the host mirror."""
        staged = self._num_staged
        return RowWrites(self._seq_lens[:num_rows], self._stage_index_np[:staged],
                         self._stage_values_np[:staged])

    def apply_rows(self, writes: RowWrites) -> None:
        """Another rank's write_rows, into this rank's host mirror (a tensor-parallel
        worker's: it has no sequences, only rank 0's writes). Waits first for the previous
        step's copies out of the mirror, as write_rows does."""
        if self._copied is not None:
            self._copied.synchronize()
        self._seq_lens[: len(writes.seq_lens)] = writes.seq_lens
        staged = len(writes.table_index)
        self._stage_index_np[:staged] = writes.table_index
        self._stage_values_np[:staged] = writes.table_values
        self._tables.reshape(-1)[writes.table_index] = writes.table_values
        self._num_staged = staged

    def apply(self, step: DecodeStep) -> None:
        """Rank 0's `prepare`, into this rank's host mirror."""
        self.apply_rows(step.rows)
        self.host64.numpy()[:, : step.size] = step.tokens

    def launch(self, step: DecodeStep) -> torch.Tensor:
        """Upload the prepared (or applied) step and replay its graph (off CUDA: run its
        forward); logits [sampling rows, vocab] in schedule order."""
        self.dev64.copy_(self.host64, non_blocking=True)
        self.upload_rows()
        self.mark_copied()
        if self.on_cuda:
            self.graphs[step.size].replay()
        else:
            self._forward(step.size)
        logits = self.logits  # what the graph wrote (the CPU path reads it the same way)
        self.num_replays += 1
        if step.sample_rows is None:
            return logits[: step.num_seqs]
        return logits[torch.tensor(step.sample_rows, dtype=torch.long, device=logits.device)]

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [sampling rows, vocab] of one decode step (rows in schedule order)."""
        return self.launch(self.prepare(scheduled))

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers a step writes and a graph reads (every rank's alike under tensor
        parallelism; the logits are not: each rank has its own vocabulary rows)."""
        return (self.host64, self.host32, self.dev64, self.dev32, self.query_start_loc)
