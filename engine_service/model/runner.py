"""Runs one forward for the whole mixed batch (prefill chunks + decode tokens) per step."""

import torch

from engine_service.core.kv_cache_manager import BlockMoves
from engine_service.core.scheduler import ScheduledSeq
from engine_service.model.config import ModelConfig
from engine_service.model.dtype import DTYPES
from engine_service.model.loader import load_model
from engine_service.model.models.llama import StepContext, rope_cos_sin_cache
from kernels import get_kernel_backend


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
        num_blocks: int,
        num_cpu_blocks: int,
        max_model_len: int,
    ) -> None:
        self.config = model_config
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.block_size = block_size
        self.kernels = get_kernel_backend(kernel_backend, self.device)
        self.model = load_model(model_config, self.dtype, self.device)
        shape = (
            model_config.num_layers,
            2,
            num_blocks,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        # kv_caches[layer] = (key_cache, value_cache), each
        # [num_blocks, block_size, num_kv_heads, head_size]
        self.kv_caches = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cpu_shape = (shape[0], 2, num_cpu_blocks) + shape[3:]
        self.cpu_kv_caches = (
            torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            if num_cpu_blocks
            else None
        )
        self.cos, self.sin = rope_cos_sin_cache(
            model_config, max_model_len, self.dtype, self.device
        )

    def apply_moves(self, moves: BlockMoves) -> None:
        """Swap out, then swap in, then copy-on-write copies (the order the scheduler assumes)."""
        if moves.swap_out:
            device_ids = torch.tensor([d for d, _ in moves.swap_out], device=self.device)
            cpu_ids = torch.tensor([c for _, c in moves.swap_out])
            self.cpu_kv_caches[:, :, cpu_ids] = self.kv_caches[:, :, device_ids].cpu()
        if moves.swap_in:
            cpu_ids = torch.tensor([c for c, _ in moves.swap_in])
            device_ids = torch.tensor([d for _, d in moves.swap_in], device=self.device)
            self.kv_caches[:, :, device_ids] = self.cpu_kv_caches[:, :, cpu_ids].to(self.device)
        if moves.copies:
            mapping = torch.tensor(moves.copies, dtype=torch.int64, device=self.device)
            self.kernels.copy_blocks(self.kv_caches, mapping)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Forward the scheduled tokens; logits [num sampling seqs, vocab] in schedule order."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        sample_rows: list[int] = []
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        block_tables = []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            block_tables.append(table + [0] * (max_blocks - len(table)))
            if item.samples:
                sample_rows.append(query_start_loc[-1] - 1)

        dev = self.device
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        block_tables_t = torch.tensor(block_tables, dtype=torch.int32, device=dev)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        query_start_loc_t = torch.tensor(query_start_loc, dtype=torch.int32, device=dev)
        plan = None
        if self.kernels.build_attention_plan is not None:
            plan = self.kernels.build_attention_plan(
                block_tables_t, seq_lens_t, query_start_loc_t, bs
            )
        ctx = StepContext(
            positions=positions_t,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=block_tables_t,
            seq_lens=seq_lens_t,
            query_start_loc=query_start_loc_t,
            attention_plan=plan,
            cos=self.cos[positions_t],
            sin=self.sin[positions_t],
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            ctx,
            self.kv_caches,
            self.kernels,
        )
        if not sample_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
        return self.model.compute_logits(hidden[rows])
