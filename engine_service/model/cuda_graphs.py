"""CUDA graphs for decode steps: the whole forward (every layer, the LM head) replayed as one
launch instead of ~30 host-side launches per layer.

Measured on an H200 without graphs (bench/results/gpu_h200), a bf16 decode step of
SmolLM2-135M took 17-29 ms at batch 1 and a Llama-8B-shaped one 19-26 ms, against 0.06 and
3.1 ms to read their weights: the host launching kernels one by one was the step. With graphs:
2.1 and 5.7 ms. As vLLM does:

- Graphs are captured once, at start, for padded batch sizes (`capture_sizes`); a decode batch
  of n sequences replays the smallest graph of at least n rows.
- A graph reads its inputs from fixed device buffers. Each step writes the batch into a pinned
  host mirror of them and copies that in two transfers; the block table has one row per
  sequence as wide as the longest context (`max_model_len`), written in place.
- Padding rows write no K/V (slot -1), attend to one key of block 0 and are never sampled.
- The block table's width is fixed, so each step uploads rows x ceil(max_model_len / block
  size) entries (2 MiB at 256 rows and 32k tokens); vLLM uploads full rows too.
- A graph's attention was captured with the split-KV count of the widest table, so it does
  not match an eager step bit for bit; greedy tokens match (tests/engine/test_cuda_graphs.py).

Only steps where every sequence runs one token are replayed (decode, or a one-token prompt);
prefill and mixed steps run eagerly. `enforce_eager` turns graphs off. One owner: the model
runner, on the engine thread.

Off CUDA there are no graphs, but the same buffers can run the forward eagerly: the engine
never does this, the tests do, so the buffer handling (rows, padding, block tables) is checked
on every machine, not only on a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine_service.core.scheduler_output import ScheduledSeq
from engine_service.model.models.llama import StepContext

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16


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
        self._pad_rows(0, rows)
        # Set when a step's host-to-device copies are queued: the mirror is not rewritten
        # before they have run.
        self._copied = torch.cuda.Event() if self.on_cuda else None
        # Every graph writes its logits here, one buffer for all: with logits of their own,
        # 20 graphs of up to 256 rows held 411 MiB of them (a 49,152-token vocabulary).
        self.logits = torch.empty((rows, runner.config.vocab_size), dtype=torch.float32,
                                  device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # decode steps that ran through these buffers

    def _pad_rows(self, start: int, end: int) -> None:
        self._ids[start:end] = 0
        self._positions[start:end] = 0
        self._slots[start:end] = -1  # no K/V write
        self._seq_lens[start:end] = 1  # one key, the first of block 0
        self._tables[start:end, 0] = 0

    def _forward(self, size: int) -> torch.Tensor:
        """The decode forward over the first `size` rows of the fixed buffers."""
        runner = self.runner
        tables_at = self.region
        positions = self.dev64[1, :size]
        ctx = StepContext(
            positions=positions,
            slot_mapping=self.dev64[2, :size],
            block_tables=self.dev32[tables_at : tables_at + size * self.width].view(
                size, self.width),
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
        pool = torch.cuda.graph_pool_handle()
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

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [sampling rows, vocab] of one decode step (rows in schedule order)."""
        n = len(scheduled)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.runner.block_size
        if self._copied is not None:
            self._copied.synchronize()
        ids, positions, slots = self._ids, self._positions, self._slots
        for i, item in enumerate(scheduled):
            seq, table = item.seq, item.block_table
            pos = seq.num_computed_tokens
            ids[i] = seq.token_ids[pos]
            positions[i] = pos
            slots[i] = table[pos // bs] * bs + pos % bs
            self._seq_lens[i] = pos + 1
            self._tables[i, : len(table)] = table
        self._pad_rows(n, size)
        self.dev64.copy_(self.host64, non_blocking=True)
        used32 = self.region + size * self.width
        self.dev32[:used32].copy_(self.host32[:used32], non_blocking=True)
        if self.on_cuda:
            self._copied.record()
            self.graphs[size].replay()
        else:
            self._forward(size)
        logits = self.logits  # what the graph wrote (the CPU path reads it the same way)
        self.num_replays += 1
        sample_rows = [i for i, item in enumerate(scheduled) if item.samples]
        if len(sample_rows) == n:
            return logits[:n]
        # A row that does not sample: a one-token chunk of a longer prompt (budget of 1).
        rows = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
        return logits[rows]
