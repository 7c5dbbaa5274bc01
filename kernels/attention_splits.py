"""How a decode batch's keys are cut into splits (flash-decoding), per sequence.

A decode step has one query token per sequence, so its attention grid is (sequence x KV head)
programs: too few to fill a GPU at small batch, and, when one long sequence sits among short
ones, that sequence's few programs walk its keys alone while the rest of the GPU idles. So
each sequence's keys are cut into splits of about P keys, and each split is a program:

    P   = max(min_keys_per_split, total keys of the batch x KV heads / target_programs)
    s_i = min(max_splits, ceil(len_i / P))   (in whole key tiles, spread evenly; none empty)

P is chosen per step from the batch's real lengths, so the grid holds about target_programs
busy programs (a few per SM) whatever the mix: at 1 x 8,192 one sequence gets many splits; in
a skewed batch the long sequence gets many and the short ones one each; at 256 x 512 nobody
splits. The attention kernel computes P and each program's (sequence, split) on the device
from the context lengths (kernels/triton_attention.py), so a step needs no host metadata and
a CUDA graph captured once serves every step. Its split axis is flattened: work items are
numbered sequence by sequence, and since sum_i ceil(len_i / P) <= num_seqs + total / P, the
grid needs at most num_seqs + ceil(target_programs / KV heads) items per KV head
(`work_items`), a bound the host knows from the batch size alone (or fewer, from the block
table's width); items past the last split exit at once.

`plan_splits` is the same arithmetic on the host: what tests and benchmarks read (the kernel
never waits for it).

Prefill / mixed batches split too, more simply, when their grid of query tiles is small (a
short chunk at a long position: 256 new tokens at 30k are 17 tiles per KV head): the host
gives the grid a split axis of S (`prefill_splits`, from the token and sequence counts, so a
CUDA graph's bucket fixes it), and each tile cuts its keys into at most S splits of at least
min_keys_per_split keys; partials go to token x S items.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

PROGRAMS_PER_SM = 4  # one wave at the decode tile's occupancy (bf16: ~48 KiB shared each)
MAX_KV_SPLITS = 64  # a 32k sequence alone: 512 keys a split
MIN_KEYS_PER_SPLIT = 256  # below this a split costs more in the combine step than it saves


@dataclass(frozen=True, slots=True)
class KVSplitPolicy:
    """How a decode batch splits its keys; see the module docstring."""

    target_programs: int  # busy programs a decode grid aims at (SMs x PROGRAMS_PER_SM)
    max_splits: int = MAX_KV_SPLITS  # per sequence, a power of two; 1: never split
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT
    # > 0: every split holds this many keys (rounded up to whole tiles) whatever the batch,
    # still at most max_splits per sequence (tests and benchmarks force shapes with it).
    keys_per_split: int = 0

    def __post_init__(self) -> None:
        for name in ("target_programs", "max_splits", "min_keys_per_split"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_splits & (self.max_splits - 1):
            raise ValueError(f"max_splits must be a power of two, got {self.max_splits}")
        if not isinstance(self.keys_per_split, int) or self.keys_per_split < 0:
            raise ValueError(f"keys_per_split must be an int >= 0 (0: chosen per batch), got "
                             f"{self.keys_per_split!r}")

    def work_items(self, num_seqs: int, num_kv_heads: int, max_keys: int) -> int:
        """The grid's split axis (per KV head): enough for every split of any batch of
        num_seqs sequences of at most max_keys keys each (the block table's width; see the
        module docstring)."""
        smallest = self.keys_per_split or self.min_keys_per_split
        bound = num_seqs * min(self.max_splits, max(1, -(-max_keys // smallest)))
        if self.keys_per_split:
            return bound
        return min(bound, num_seqs + -(-self.target_programs // num_kv_heads))

    def prefill_splits(self, num_q_tiles: int, num_kv_heads: int) -> int:
        """The split axis of a prefill / mixed batch's grid of num_q_tiles query tiles (a
        bound from its token and sequence counts): doubled while the grid stays within
        target_programs, so only a few query tiles (a short chunk over a long context)
        split. Each tile then cuts its keys into at most that many splits of at least
        min_keys_per_split keys (forced: keys_per_split keys, up to max_splits) in the
        kernel. Per-tile partials cost num_tokens x splits rows, bounded the same way."""
        if self.keys_per_split:
            return self.max_splits
        splits, programs = 1, num_q_tiles * num_kv_heads
        while splits < self.max_splits and programs * splits * 2 <= self.target_programs:
            splits *= 2
        return splits

    def tiles_per_split(self, total_tiles: int, num_kv_heads: int, tile_n: int) -> int:
        """P in key tiles, from the batch's total key tiles (the kernel's arithmetic)."""
        if self.keys_per_split:
            return -(-self.keys_per_split // tile_n)
        planned = -(-(total_tiles * num_kv_heads) // self.target_programs)
        return max(-(-self.min_keys_per_split // tile_n), planned)


def decode_tile_n(block_size: int) -> int:
    """Keys per loop step of the kernel's decode mode: the unit splits are made of."""
    return max(32, 1 << (block_size - 1).bit_length())


def split_count(num_tiles: int, tiles_per_split: int, max_splits: int) -> int:
    """Splits of one sequence of num_tiles key tiles (the kernel's _split_count): at most
    max_splits; split j of s holds tiles [j * n // s, (j + 1) * n // s), so none is empty and
    their sizes differ by at most one tile."""
    return min(max_splits, -(-max(num_tiles, 1) // tiles_per_split))


def plan_splits(policy: KVSplitPolicy, seq_lens: list[int], num_kv_heads: int,
                tile_n: int) -> list[int]:
    """Splits of each sequence of a decode batch with these context lengths."""
    tiles = [-(-n // tile_n) for n in seq_lens]
    per = policy.tiles_per_split(sum(tiles), num_kv_heads, tile_n)
    return [split_count(t, per, policy.max_splits) for t in tiles]


NO_SPLITS = KVSplitPolicy(target_programs=1, max_splits=1)


@functools.cache
def _cuda_policy(device_index: int) -> KVSplitPolicy:
    num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return KVSplitPolicy(target_programs=PROGRAMS_PER_SM * num_sms)


def default_split_policy(device: torch.device) -> KVSplitPolicy:
    """The policy for this device: sized by its SMs on CUDA; no splits elsewhere (in the
    interpreter more programs only cost time)."""
    if device.type != "cuda":
        return NO_SPLITS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_policy(index)
