"""CUDA graphs for steps that carry prefill chunks: the whole forward replayed as one launch
for padded token counts, as the decode graphs (cuda_graphs.py) do for pure decode steps.

Eagerly, an 8B-shaped decode step took 19-21 ms on an H200 against 5.7 ms replayed
(bench/results/gpu_h200): the host launching ~400 kernels one by one. Without these graphs
every step that admits a prompt chunk paid that, and so did every running stream's next token.

- One graph per token bucket (`mixed_capture_sizes`: powers of two from 16 to 256, then
  multiples of 256 up to the token budget, `max_num_batched_tokens`; past MAX_MIXED_GRAPHS
  buckets the step doubles). A step of t tokens replays the smallest bucket >= t. All
  graphs share the decode graphs' private memory pool (replayed one at a time, they need the
  largest forward's activations once, not once per graph: the KV plan keeps one profiled
  forward at the token budget for them, kv_cache_setup.profile_memory_plan).
- A bucket of T tokens is captured with S = min(T - 1, decode rows) sequence rows: a step
  that reaches these graphs has a sequence of two tokens or more (the decode graphs take the
  others), so fewer sequences than tokens, and no more than the decode graphs' rows
  (graph_rows). Fewer rows than tokens also gives the kernels the variant an eager mixed step
  gets (prefill-sized query tiles, no split-KV). The attention
  metadata lives in fixed device buffers, uploaded from pinned host mirrors each step: token
  ids, positions and slots [T], query_start_loc [S + 1], and the sequence rows' context
  lengths and block tables, which are the decode graphs' own (DecodeGraphs.write_rows): a
  sequence keeps its row whether its step decodes or carries a chunk, and a step uploads only
  the table entries that changed. The Triton kernels read all of it on the device: no host
  metadata, no sync. The host loop is O(sequences) plus a numpy slice per prefill chunk.
- Tokens follow the rows: row r's tokens are query_start_loc[r] .. query_start_loc[r + 1].
  Padding rows (r >= the step's sequences) have no tokens (query_start_loc repeats), so their
  attention tiles exit at once. Padding tokens (t .. T-1) belong to no sequence: they write
  no K/V (slot -1), use position 0, are never sampled, and their attention output is left
  unwritten; every other op of the forward works row by row (norms, GEMMs, SiLU), so nothing
  they hold reaches a real token.
- The attention grid is sized for the bucket's worst case (T // BLOCK_Q + S query tiles:
  surplus programs exit); steps with more tokens than sequences do not split keys
  (kernels/attention_splits.py splits decode batches only).
- Logits are computed only for the rows that sample: the graph gathers the hidden states of
  the token indices in a fixed buffer [S] (the last token of each sampling sequence, in
  schedule order, then token 0 as padding) before the LM head, into the decode graphs' logits
  buffer. So the logits come out in schedule order.

Only the Triton backend is graphed (kv_cache_setup.uses_cuda_graphs): the torch reference
attention builds its index tensors on the host from the metadata, which a replay cannot redo,
so with it every step runs eagerly. `enforce_eager` turns these graphs off with the decode
ones. Off CUDA there is nothing to capture, but the same buffers run the forward eagerly (the
tests do this, tests/engine/test_mixed_graphs.py, so the buffer handling is checked on every
machine). One owner: the model runner, on the engine thread. Under tensor parallelism rank 0
prepares a step and sends what it wrote (`MixedStep`) to the workers, which apply it to their
own buffers, as for the decode graphs (cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine_service.core.scheduler_output import ScheduledSeq
from engine_service.model.cuda_graphs import DecodeGraphs, RowWrites
from engine_service.model.models.llama import StepContext

log = logging.getLogger(__name__)

MIN_BUCKET = 16
BUCKET_STEP = 256
# Each graph's nodes cost host memory and capture time (an 8B forward is ~400 kernels): at a
# budget of 8,192 tokens, 36 graphs; past that the step between buckets doubles.
MAX_MIXED_GRAPHS = 40


@dataclass(slots=True)
class MixedStep:
    """One step's writes into the mixed-step graphs' host mirrors (MixedGraphs.prepare): what
    rank 0 sends every tensor-parallel worker, as DecodeStep does for decode steps."""

    size: int  # the token bucket
    num_rows: int  # the bucket's sequence rows
    rows: RowWrites
    tokens: np.ndarray  # int64 [3, size]: each token's id, position, slot
    samples: np.ndarray  # int64 [num_rows]: the token behind each logits row
    query_start_loc: np.ndarray  # int32 [num_rows + 1]
    num_sampled: int

    def __reduce__(self):  # as raw bytes (cuda_graphs.RowWrites says why)
        return _mixed_step, (self.size, self.num_rows, self.rows, self.tokens.tobytes(),
                             self.samples.tobytes(), self.query_start_loc.tobytes(),
                             self.num_sampled)


def _mixed_step(size: int, num_rows: int, rows: RowWrites, tokens: bytes, samples: bytes,
                query_start_loc: bytes, num_sampled: int) -> MixedStep:
    return MixedStep(size, num_rows, rows, np.frombuffer(tokens, np.int64).reshape(3, size),
                     np.frombuffer(samples, np.int64), np.frombuffer(query_start_loc, np.int32),
                     num_sampled)


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token buckets: powers of two from 16 to the step (256, doubled while there would be
    more than MAX_MIXED_GRAPHS buckets), then multiples of the step, and the budget itself.
    A step pads to under twice its tokens, and by less than one step past the powers."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    step = BUCKET_STEP
    while step.bit_length() - MIN_BUCKET.bit_length() + 1 + max_num_batched_tokens // step \
            > MAX_MIXED_GRAPHS:
        step *= 2
    powers = [1 << e for e in range(MIN_BUCKET.bit_length() - 1, step.bit_length())]
    sizes = {s for s in powers if s < max_num_batched_tokens}
    sizes |= set(range(2 * step, max_num_batched_tokens, step)) | {max_num_batched_tokens}
    return sorted(sizes)


class MixedGraphs:
    """Captured forwards of steps with prefill chunks, per token bucket, and the buffers they
    read; the sequence rows are the decode graphs' (`rows`)."""

    def __init__(self, runner, rows: DecodeGraphs, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.rows = rows
        self.sizes = mixed_capture_sizes(max_num_batched_tokens)
        self.max_tokens = self.sizes[-1]
        dev = runner.device
        self.on_cuda = dev.type == "cuda"
        # Regions of a multiple of 16 bytes: Triton specializes pointers on that alignment.
        self.token_region = -(-self.max_tokens // 2) * 2
        sample_region = -(-rows.max_size // 2) * 2
        # int64: token ids, positions, slots (token_region each), then the token index of
        # each logits row. int32: query_start_loc [rows + 1].
        self.host64 = torch.zeros(3 * self.token_region + sample_region, dtype=torch.int64,
                                  pin_memory=self.on_cuda)
        self.host32 = torch.zeros(-(-(rows.max_size + 1) // 4) * 4, dtype=torch.int32,
                                  pin_memory=self.on_cuda)
        self.dev64 = torch.zeros_like(self.host64, device=dev)
        self.dev32 = torch.zeros_like(self.host32, device=dev)
        flat = self.host64.numpy()
        at = self.token_region
        self._ids, self._positions, self._slots = (flat[i * at : (i + 1) * at] for i in range(3))
        self._samples = flat[3 * at :]
        # Token ids, positions and slots as one [3, token_region] view (made once: a step
        # takes no Tensor.numpy, which the launch counter reads as a possible sync).
        self._token_rows = flat[: 3 * at].reshape(3, at)
        self._query_start_loc = self.host32.numpy()
        self._slots[:] = -1
        self._q_lens = np.zeros(rows.max_size, dtype=np.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # steps that ran through these buffers

    def rows_for(self, num_tokens: int) -> int:
        """Sequence rows of the bucket of num_tokens tokens (fewer than its tokens: see the
        module docstring; one for a bucket of one token, whose steps the decode graphs run)."""
        return max(1, min(num_tokens - 1, self.rows.max_size))

    def _token_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        at = self.token_region
        dev = self.dev64
        return dev[:num_tokens], dev[at : at + num_tokens], dev[2 * at : 2 * at + num_tokens]

    def _forward(self, num_tokens: int) -> torch.Tensor:
        """The forward of one bucket over the fixed buffers; logits [rows, vocab]."""
        runner, num_rows = self.runner, self.rows_for(num_tokens)
        ids, positions, slots = self._token_views(num_tokens)
        at = 3 * self.token_region
        ctx = StepContext(
            positions=positions,
            slot_mapping=slots,
            block_tables=self.rows.table_rows(num_rows),
            seq_lens=self.rows.dev32[:num_rows],
            query_start_loc=self.dev32[: num_rows + 1],
            attention_plan=None,
            cos=runner.cos[positions],
            sin=runner.sin[positions],
        )
        hidden = runner.model(ids, ctx, runner.kv_caches, runner.kernels)
        sampled = hidden.index_select(0, self.dev64[at : at + num_rows])
        return runner.model.compute_logits(sampled, out=self.rows.logits[:num_rows])

    @torch.inference_mode()
    def capture(self) -> int:
        """One graph per bucket, largest first, in the decode graphs' memory pool (captured
        before these). The buffers hold no sequence (every row empty, every slot -1), so
        neither the warm-up runs nor the captures write the KV pool. Off CUDA, nothing to
        capture. Returns the device memory the graphs and their buffers added (0 off CUDA)."""
        if not self.on_cuda:
            return 0
        if self.rows.pool is None:
            raise RuntimeError("the mixed-step graphs are captured after the decode graphs "
                               "(they share their rows and memory pool)")
        dev = self.runner.device
        start = time.perf_counter()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # as DecodeGraphs.capture: reserved memory from an empty cache
        before = torch.cuda.memory_reserved(dev)
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        for size in reversed(self.sizes):
            self._forward(size)  # eager first: anything lazily built is built outside capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.rows.pool):
                self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(dev)
        buffers = sum(t.numel() * t.element_size() for t in (self.dev64, self.dev32))
        added = torch.cuda.memory_reserved(dev) - before + buffers
        log.info("captured %d mixed-step CUDA graphs (token buckets %s, up to %d sequence "
                 "rows) in %.2f s; %.1f MiB more with their buffers", len(self.graphs),
                 self.sizes, self.rows_for(self.max_tokens), time.perf_counter() - start,
                 added / 2**20)
        return added

    def accepts(self, scheduled: list[ScheduledSeq]) -> bool:
        """A step a graph can run: within the token budget, no more sequences than its
        bucket's rows, every block table within the rows' width."""
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        if not scheduled or num_tokens > self.max_tokens:
            return False
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        width = self.rows.width
        return (len(scheduled) <= self.rows_for(size)
                and all(len(item.block_table) <= width for item in scheduled))

    def prepare(self, scheduled: list[ScheduledSeq]) -> MixedStep:
        """One step's writes into the host mirrors, made here (rank 0, from the schedule);
        what a tensor-parallel worker applies to its own buffers (`apply`) before every rank
        launches the step (`launch`)."""
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        num_rows = self.rows_for(size)
        rows = self.rows.write_rows(scheduled, num_rows)  # waits for the last step's copies
        q_lens, starts = self._q_lens, self._query_start_loc
        q_lens[:num_rows] = 0
        for row, item in zip(rows, scheduled, strict=True):
            q_lens[row] = item.num_new_tokens
        starts[0] = 0
        np.cumsum(q_lens[:num_rows], out=starts[1 : num_rows + 1])
        ids, positions, slots = self._ids, self._positions, self._slots
        bs = self.runner.block_size
        samples = self._samples
        num_sampled = 0
        for row, item in zip(rows, scheduled, strict=True):
            seq, table, count = item.seq, item.block_table, item.num_new_tokens
            first, at = seq.num_computed_tokens, int(starts[row])
            if count == 1:  # a decode: scalars (numpy calls cost more than they save here)
                ids[at] = seq.token_ids[first]
                positions[at] = first
                slots[at] = table[first // bs] * bs + first % bs
            else:
                end = first + count
                ids[at : at + count] = seq.token_ids[first:end]
                pos = np.arange(first, end)
                positions[at : at + count] = pos
                blocks = np.asarray(table[first // bs : (end - 1) // bs + 1], dtype=np.int64)
                slots[at : at + count] = blocks[pos // bs - first // bs] * bs + pos % bs
            if item.samples:
                samples[num_sampled] = at + count - 1
                num_sampled += 1
        ids[num_tokens:size] = 0
        positions[num_tokens:size] = 0
        slots[num_tokens:size] = -1  # padding tokens write no K/V
        samples[num_sampled:num_rows] = 0
        return MixedStep(size, num_rows, self.rows.row_writes(num_rows), self._tokens()[:, :size],
                         samples[:num_rows], starts[: num_rows + 1], num_sampled)

    def _tokens(self) -> np.ndarray:
        """Token ids, positions and slots of the host mirror as one [3, token_region] view."""
        return self._token_rows

    def apply(self, step: MixedStep) -> None:
        """Rank 0's `prepare`, into this rank's host mirrors (a tensor-parallel worker's)."""
        self.rows.apply_rows(step.rows)  # waits for the last step's copies
        self._tokens()[:, : step.size] = step.tokens
        self._samples[: step.num_rows] = step.samples
        self._query_start_loc[: step.num_rows + 1] = step.query_start_loc

    def launch(self, step: MixedStep) -> torch.Tensor:
        """Upload the prepared (or applied) step and replay its graph (off CUDA: run its
        forward); logits [sampling sequences, vocab] in schedule order."""
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.rows.upload_rows()
        self.rows.mark_copied()
        if self.on_cuda:
            self.graphs[step.size].replay()
        else:
            self._forward(step.size)
        self.num_replays += 1
        return self.rows.logits[: step.num_sampled]

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [sampling sequences, vocab] of one step, in schedule order."""
        return self.launch(self.prepare(scheduled))

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers a step writes and a graph reads, besides the rows' (rows.buffers())."""
        return (self.host64, self.host32, self.dev64, self.dev32)
