"""Runs one forward for the whole mixed batch (prefill chunks + decode tokens) per step."""

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_service.core.scheduler_output import (
    MAX_SCORED_TOKENS_PER_STEP,
    BlockMoves,
    ScheduledSeq,
)
from engine_service.model.config import ModelConfig
from engine_service.model.cpu_malloc import keep_step_buffers
from engine_service.model.cuda_graphs import DecodeGraphs
from engine_service.model.dtype import DTYPES
from engine_service.model.eager_block_tables import EagerBlockTables
from engine_service.model.huge_pages import huge_page_zeros
from engine_service.model.loader import load_model, model_weight_bytes
from engine_service.model.memory_plan import check_weights_fit
from engine_service.model.mixed_graphs import MixedGraphs
from engine_service.model.models.llama import StepContext, rope_cos_sin_cache
from engine_service.model.prompt_logprobs import score_tokens
from engine_service.model.sampling_params import MAX_LOGPROBS
from engine_service.model.step_inputs import StepInputs, prefill_batch
from kernels import get_kernel_backend

if TYPE_CHECKING:
    from engine_service.model.parallel.rank import RankOf

log = logging.getLogger(__name__)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        dtype: str,
        device: str,
        kernel_backend: str,
        block_size: int,
        max_model_len: int,
        parallel: "RankOf | None" = None,
    ) -> None:
        """Loads the weights; the KV pool comes later (`allocate_kv_cache`), sized from the
        memory the weights and a profiling forward leave (engine_service/model/kv_cache_setup).
        With `parallel`, one rank of a tensor-parallel group (engine_service/model/parallel):
        its shards of the weights, its heads of the KV pool; `config` is the rank's model."""
        self.config = model_config
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        self.kernels = get_kernel_backend(kernel_backend, self.device)
        if self.device.type == "cuda":
            # Refuse a model too large for the device here, not by an OOM halfway through.
            free, total = torch.cuda.mem_get_info(self.device)
            check_weights_fit(model_weight_bytes(model_config, self.dtype)
                              // (parallel.shard.world_size if parallel else 1), free, total)
        if parallel is None:
            self.model = load_model(model_config, self.dtype, self.device)
        else:
            from engine_service.model.parallel.shard import local_config
            from engine_service.model.parallel.sharded_loader import load_sharded_model

            self.model = load_sharded_model(model_config, parallel.shard, parallel.group,
                                            self.dtype, self.device)
            self.config = local_config(model_config, parallel.shard)
        # kv_caches[layer] = (key_cache, value_cache), each
        # [num_blocks, block_size, num_kv_heads, head_size]
        self.kv_caches = torch.empty(0)
        self.cpu_kv_caches: torch.Tensor | None = None
        self.cos, self.sin = rope_cos_sin_cache(
            model_config, max_model_len, self.dtype, self.device
        )
        self.decode_graphs: DecodeGraphs | None = None  # CUDA only, see capture_decode_graphs
        self.mixed_graphs: MixedGraphs | None = None  # CUDA only, see capture_mixed_graphs
        self.eager_tables = EagerBlockTables(-(-max_model_len // block_size))
        if self.device.type == "cpu":
            # Each step's large buffers stay in the heap from now on. Not before the load: its
            # temporaries (1-32 MiB each) would be kept too, freed inside the heap where no
            # trim returns them (~200 MiB held for the process's life on SmolLM2).
            tuning = keep_step_buffers()
            log.debug("C allocator: %s", tuning.detail)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> int:
        """Capture the decode forward as CUDA graphs (engine_service/model/cuda_graphs.py),
        once the KV pool is allocated and warmed up; decode steps replay them from then on.
        Returns the device memory they added."""
        graphs = DecodeGraphs(self, max_num_seqs, max_model_len)
        added = graphs.capture()
        self.decode_graphs = graphs
        return added

    def capture_mixed_graphs(self, max_num_batched_tokens: int) -> int:
        """Capture the forwards of steps with prefill chunks, per token bucket up to the
        step's token budget (engine_service/model/mixed_graphs.py), after the decode graphs,
        whose sequence rows and memory pool they share. Returns the device memory added."""
        if self.decode_graphs is None:
            raise RuntimeError("capture the decode graphs first: the mixed-step graphs share "
                               "their sequence rows")
        graphs = MixedGraphs(self, self.decode_graphs, max_num_batched_tokens)
        added = graphs.capture()
        self.mixed_graphs = graphs
        return added

    def _refuse_if_captured(self) -> None:
        # The graphs read the pool (and the weights, the RoPE tables) at fixed addresses.
        if self.decode_graphs is not None:
            raise RuntimeError("the KV pool is captured by the decode CUDA graphs: it cannot "
                               "be replaced")

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._refuse_if_captured()
        shape = self.kv_cache_shape(num_blocks)
        if self.device.type == "cpu":  # read all over every step (huge_pages.py says why)
            self.kv_caches = huge_page_zeros(shape, self.dtype)
        else:
            self.kv_caches = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cpu_shape = (shape[0], 2, num_cpu_blocks) + shape[3:]
        self.cpu_kv_caches = (
            torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            if num_cpu_blocks
            else None
        )

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> int:
        """One forward of `num_tokens` prompt tokens over `num_seqs` sequences (the largest
        step the scheduler can issue), through a scratch KV pool just large enough, which is
        freed after. Returns the scratch pool's bytes (to leave out of the activation peak)."""
        self._refuse_if_captured()
        # No sequence longer than the context (the RoPE tables end there).
        num_seqs = max(num_seqs, -(-num_tokens // self.cos.shape[0]))
        batch = prefill_batch(num_tokens, num_seqs, self.block_size)
        self.kv_caches = torch.zeros(
            self.kv_cache_shape(batch.num_blocks), dtype=self.dtype, device=self.device
        )
        scratch_bytes = self.kv_caches.numel() * self.kv_caches.element_size()
        # A step may also score prompt tokens (prompt_logprobs): their logits rows and the
        # scoring's temporaries are part of its peak.
        num_scored = min(num_tokens, MAX_SCORED_TOKENS_PER_STEP)
        batch.inputs.sample_rows.extend(range(num_scored))
        try:
            logits = self.run_batch(batch.inputs)
            score_tokens(logits[-num_scored:, : self.config.vocab_size], [0] * num_scored,
                         [MAX_LOGPROBS] * num_scored)
        finally:
            self.kv_caches = torch.empty(0)
        return scratch_bytes

    def apply_moves(self, moves: BlockMoves) -> None:
        """Swap out, then swap in, then copy-on-write copies (the order the scheduler assumes)."""
        if moves.swap_out:
            self._swap_out(moves.swap_out)
        if moves.swap_in:
            self._swap_in(moves.swap_in)
        if moves.copies:
            mapping = torch.tensor(moves.copies, dtype=torch.int64, device=self.device)
            self.kernels.copy_blocks(self.kv_caches, mapping)

    def _staging(self, num_blocks: int) -> torch.Tensor:
        """Host memory for `num_blocks` blocks of every layer on their way between the pools.
        Page-locked on CUDA: a copy from or to pageable memory goes through the driver's own
        bounce buffer at a fraction of the link's speed, and cannot overlap the host.
        torch's pinned-memory cache hands the same pages back on the next swap and keeps them
        until the copy that reads them has run."""
        shape = self.cpu_kv_caches.shape[:2] + (num_blocks,) + self.cpu_kv_caches.shape[3:]
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def _swap_out(self, pairs: list[tuple[int, int]]) -> None:
        device_ids = torch.tensor([d for d, _ in pairs], device=self.device)
        cpu_ids = torch.tensor([c for _, c in pairs])
        staging = self._staging(len(pairs))
        # The host scatters after the copy has landed: one wait, as before, at full speed.
        staging.copy_(self.kv_caches.index_select(2, device_ids))
        self.cpu_kv_caches.index_copy_(2, cpu_ids, staging)

    def _swap_in(self, pairs: list[tuple[int, int]]) -> None:
        cpu_ids = torch.tensor([c for c, _ in pairs])
        device_ids = torch.tensor([d for _, d in pairs], device=self.device)
        staging = torch.index_select(self.cpu_kv_caches, 2, cpu_ids,
                                     out=self._staging(len(pairs)))
        # Queued on the stream ahead of the step that reads these blocks: the host goes on.
        blocks = staging.to(self.device, non_blocking=True)
        self.kv_caches.index_copy_(2, device_ids, blocks)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], scores_prompts: bool = False
                ) -> torch.Tensor:
        """Forward the scheduled tokens; logits [num sampling seqs, vocab] in schedule order.
        scores_prompts: some items have prompt_positions, whose rows' logits follow (eager:
        the graphs compute the sampling rows' only)."""
        if scores_prompts:
            return self.run_batch(self.step_inputs(scheduled, scores_prompts=True))
        if self.decode_graphs is not None and self.decode_graphs.accepts(scheduled):
            return self.decode_graphs.run(scheduled)
        if self.mixed_graphs is not None and self.mixed_graphs.accepts(scheduled):
            return self.mixed_graphs.run(scheduled)
        return self.run_batch(self.step_inputs(scheduled))

    def step_inputs(self, scheduled: list[ScheduledSeq],
                    scores_prompts: bool = False) -> StepInputs:
        """The scheduled tokens as the host-side lists run_batch uploads; with scores_prompts,
        the rows of each item's prompt_positions after the sampling rows."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        sample_rows: list[int] = []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            if item.num_new_tokens == 1:  # a decode token: no slice, range or generator
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(item.block_table[start // bs] * bs + start % bs)
                seq_lens.append(start + 1)
                query_start_loc.append(query_start_loc[-1] + 1)
                if item.samples:
                    sample_rows.append(query_start_loc[-1] - 1)
                continue
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = item.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            if item.samples:
                sample_rows.append(query_start_loc[-1] - 1)
        if scores_prompts:
            for item, first_row in zip(scheduled, query_start_loc[:-1], strict=True):
                if item.prompt_positions:
                    offset = first_row - item.seq.num_computed_tokens
                    sample_rows.extend(offset + p for p in item.prompt_positions)

        return StepInputs(input_ids, positions, slots, seq_lens, query_start_loc,
                          self.eager_tables.gather(scheduled), sample_rows)

    @torch.inference_mode()
    def run_batch(self, inputs: StepInputs) -> torch.Tensor:
        """Upload one step's host-side lists (two copies, pinned and non-blocking on CUDA),
        run the model over them, and return the logits of the sampling rows."""
        int64_parts = (inputs.input_ids, inputs.positions, inputs.slots, inputs.sample_rows)
        tables = np.asarray(inputs.block_tables, dtype=np.int32)
        int32_parts = (inputs.seq_lens, inputs.query_start_loc, tables.reshape(-1))
        input_ids_t, positions_t, slots_t, rows_t = self._upload(int64_parts, torch.int64)
        seq_lens_t, query_start_loc_t, tables_flat = self._upload(int32_parts, torch.int32)
        block_tables_t = tables_flat.view(tables.shape)
        plan = None
        if self.kernels.build_attention_plan is not None:
            plan = self.kernels.build_attention_plan(
                block_tables_t, seq_lens_t, query_start_loc_t, self.block_size
            )
        ctx = StepContext(
            positions=positions_t,
            slot_mapping=slots_t,
            block_tables=block_tables_t,
            seq_lens=seq_lens_t,
            query_start_loc=query_start_loc_t,
            attention_plan=plan,
            cos=self.cos[positions_t],
            sin=self.sin[positions_t],
        )
        hidden = self.model(input_ids_t, ctx, self.kv_caches, self.kernels)
        if not inputs.sample_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[rows_t])

    def _upload(self, parts: tuple[list[int] | np.ndarray, ...],
                dtype: torch.dtype) -> list[torch.Tensor]:
        """The lists as one host tensor, copied to the device in one transfer; views of it.

        On CUDA the host tensor is pinned, so the copy is asynchronous (no wait for the GPU to
        drain) and the forward's kernels queue behind it on the same stream. Every view starts
        on a 16-byte boundary: Triton specializes pointer arguments on that alignment, and a
        view whose alignment changed with the batch would compile another kernel variant.
        """
        per_16_bytes = 16 // torch.empty((), dtype=dtype).element_size()
        starts = []
        total = 0
        for part in parts:
            starts.append(total)
            total += len(part) + (-len(part) % per_16_bytes)
        on_cuda = self.device.type == "cuda"
        # Filled by numpy (C-speed from lists and arrays alike), then one tensor over it.
        flat = np.zeros(total, dtype=np.int64 if dtype == torch.int64 else np.int32)
        for start, part in zip(starts, parts, strict=True):
            flat[start : start + len(part)] = part
        host = torch.from_numpy(flat)
        device_flat = host.pin_memory().to(self.device, non_blocking=True) if on_cuda else host
        return [device_flat[s : s + len(part)] for s, part in zip(starts, parts, strict=True)]
