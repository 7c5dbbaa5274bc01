"""One step's batch as host-side lists (what the model runner uploads), and synthetic batches
of a chosen shape for the profiling forward and the warm-up."""

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # block_id * block_size + offset of each token's K/V
    seq_lens: list[int]  # context length of each sequence, new tokens included
    query_start_loc: list[int]  # [num_seqs + 1] cumulative new-token counts
    # One row per sequence, padded to the longest (the engine's steps pass an int32 array,
    # model/eager_block_tables.py; synthetic batches lists).
    block_tables: list[list[int]] | np.ndarray
    # Token rows whose logits are computed: the sampled ones (each sequence's last), then
    # those that score prompt tokens (prompt_logprobs)
    sample_rows: list[int]


@dataclass(slots=True)
class SyntheticBatch:
    inputs: StepInputs
    num_blocks: int  # blocks 0 .. num_blocks - 1 of the pool are written / read


def _batch(query_lens: list[int], context_lens: list[int], block_size: int) -> SyntheticBatch:
    """Sequence i owns consecutive blocks and runs query_lens[i] new tokens ending a context of
    context_lens[i]; token ids are 0 (any valid id: only shapes matter here)."""
    inputs = StepInputs([], [], [], [], [0], [], [])
    tables = []
    next_block = 0
    for query_len, context_len in zip(query_lens, context_lens, strict=True):
        num_blocks = -(-context_len // block_size)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        positions = range(context_len - query_len, context_len)
        inputs.input_ids.extend([0] * query_len)
        inputs.positions.extend(positions)
        inputs.slots.extend(table[p // block_size] * block_size + p % block_size
                            for p in positions)
        inputs.seq_lens.append(context_len)
        inputs.query_start_loc.append(inputs.query_start_loc[-1] + query_len)
        inputs.sample_rows.append(inputs.query_start_loc[-1] - 1)
        tables.append(table)
    width = max(len(t) for t in tables)
    inputs.block_tables = [t + [0] * (width - len(t)) for t in tables]
    return SyntheticBatch(inputs, next_block)


def prefill_batch(num_tokens: int, num_seqs: int, block_size: int) -> SyntheticBatch:
    """num_tokens prompt tokens split as evenly as possible over num_seqs new sequences."""
    if num_tokens < 1 or num_seqs < 1:
        raise ValueError(f"need num_tokens >= 1 and num_seqs >= 1, got {num_tokens}, {num_seqs}")
    num_seqs = min(num_seqs, num_tokens)
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    return _batch(lens, lens, block_size)


def decode_batch(num_seqs: int, context_len: int, block_size: int) -> SyntheticBatch:
    """One new token for each of num_seqs sequences of context_len tokens."""
    if num_seqs < 1 or context_len < 1:
        raise ValueError(f"need num_seqs >= 1 and context_len >= 1, got {num_seqs}, "
                         f"{context_len}")
    return _batch([1] * num_seqs, [context_len] * num_seqs, block_size)
