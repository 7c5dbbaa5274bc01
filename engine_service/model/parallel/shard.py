"""Which heads, MLP columns and vocabulary rows one rank of a tensor-parallel group holds.

Attention heads and MLP columns are split evenly (qkv and gate/up column-parallel, o_proj and
down_proj row-parallel). KV heads are split too when there are at least as many as ranks;
with fewer, each KV head is replicated on the ranks whose query heads read it (a rank holds one).
The vocabulary (embedding and LM head) is split in equal row ranges, the last one padded with
zero rows, so every rank's LM head has the same shape (the gather needs it).
"""

import dataclasses
from dataclasses import dataclass

from engine_service.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorShard:
    rank: int
    world_size: int
    heads: range  # query heads
    kv_heads: range
    intermediate: range  # MLP columns (of gate and of up), rows of down_proj's input
    vocab: range  # vocabulary rows held; the last rank's may be shorter than vocab_per_rank
    vocab_per_rank: int


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError naming what the model has and what tensor_parallel_size must divide."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world_size!r}")
    if config.num_heads % world_size:
        raise ValueError(f"tensor_parallel_size must divide the model's {config.num_heads} "
                         f"attention heads, got {world_size}")
    kv = config.num_kv_heads
    if kv % world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size must divide the model's {kv} KV heads or be a "
                         f"multiple of them, got {world_size}")
    if config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size must divide the model's MLP size "
                         f"{config.intermediate_size}, got {world_size}")


def plan_shard(config: ModelConfig, rank: int, world_size: int) -> TensorShard:
    check_tensor_parallel(config, world_size)
    heads_per_rank = config.num_heads // world_size
    kv = config.num_kv_heads
    if kv >= world_size:
        kv_per_rank = kv // world_size
        kv_heads = range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    else:  # replicated: ranks r*kv/ws .. read KV head r // (ws / kv)
        first = rank // (world_size // kv)
        kv_heads = range(first, first + 1)
    columns = config.intermediate_size // world_size
    vocab_per_rank = -(-config.vocab_size // world_size)
    vocab_start = min(rank * vocab_per_rank, config.vocab_size)
    return TensorShard(
        rank=rank,
        world_size=world_size,
        heads=range(rank * heads_per_rank, (rank + 1) * heads_per_rank),
        kv_heads=kv_heads,
        intermediate=range(rank * columns, (rank + 1) * columns),
        vocab=range(vocab_start, min(vocab_start + vocab_per_rank, config.vocab_size)),
        vocab_per_rank=vocab_per_rank,
    )


def local_config(config: ModelConfig, shard: TensorShard) -> ModelConfig:
    """The model as one rank computes it: its heads and MLP columns. The vocabulary stays
    whole: rank 0's logits are gathered over every rank's rows."""
    return dataclasses.replace(config, num_heads=len(shard.heads),
                               num_kv_heads=len(shard.kv_heads),
                               intermediate_size=len(shard.intermediate))
