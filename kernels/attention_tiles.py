"""Tile shapes of the attention kernel's prefill / mixed-batch mode, and the candidates a
CUDA warm-up times for each model (engine_service/model/warmup.py).

A prefill program holds BLOCK_M query rows (query tokens x the query heads of one KV head)
against TILE_N keys per loop step; num_warps and num_stages (software pipelining of the K/V
loads) set how it runs. The best shape depends on the architecture and the head size (shared
memory holds num_stages copies of a [TILE_N, head] K and V tile), so it is timed once per
model at warm-up rather than fixed. Decode rows are one token each: their tile stays 16 rows
whatever this says (kernels/triton_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows / columns on NVIDIA GPUs
# sm_80 spilled from 96 accumulator registers a thread (128 x 64 tiles on 8 warps at head 128,
# 64 x 64 on 4); 80 compiled clean (ptxas -v, Triton 3.9).
SM80_ACC_REGS = 80


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    block_m: int  # query rows per program (power of two >= 16)
    tile_n: int  # keys per loop step (power of two >= 16; may span KV blocks)
    num_warps: int
    num_stages: int | None = None  # None: Triton's default

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < MIN_DOT_ROWS or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_DOT_ROWS}, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages is not None and not 1 <= self.num_stages <= 5:
            raise ValueError(f"num_stages must be 1..5 or None, got {self.num_stages}")

    def describe(self) -> str:
        stages = "default" if self.num_stages is None else self.num_stages
        return (f"BLOCK_M {self.block_m}, TILE_N {self.tile_n}, {self.num_warps} warps, "
                f"{stages} stages")


def fp32_num_warps(head_pad: int) -> int:
    """fp32 tiles hold their dot operands in registers: spread over 8 warps, or 16 from 128
    padded dims, no variant spills (measured with ptxas for sm_80 and sm_90;
    tests/kernels/test_kernel_cuda_compile.py checks every variant)."""
    return 16 if head_pad >= 128 else 8


def default_prefill_tiles(dtype: torch.dtype, head_pad: int, block_size: int) -> PrefillTiles:
    """What runs before (or without) a warm-up's tuning, and in the interpreter. fp32
    ("ieee") dots run on the FMA units with every operand in registers: a 64-row tile needs
    over 255 registers per thread and spills, 32 rows do not. 16-bit tiles run their dots on
    tensor cores and fit 4 warps."""
    tile_n = max(32, _next_power_of_2(block_size))
    if dtype == torch.float32:
        return PrefillTiles(32, tile_n, fp32_num_warps(head_pad))
    return PrefillTiles(64, tile_n, 4)


def prefill_candidates(dtype: torch.dtype, head_pad: int, block_size: int,
                       queries_per_kv: int, cc_major: int = 9) -> list[PrefillTiles]:
    """Shapes a CUDA warm-up times, the default first. fp32 keeps its default (larger fp32
    tiles spill); 16-bit ones try taller tiles, wider key steps and deeper pipelines, the
    larger ones only where K/V stages fit the shared memory of sm_80 (163 KiB) at this head
    size. Before Hopper (cc_major < 9) the dots' accumulators live in registers: a shape
    whose score and output accumulators pass SM80_ACC_REGS fp32 registers a thread spills
    there (ptxas, tests/kernels/test_kernel_cuda_compile.py), so it is left out."""
    default = default_prefill_tiles(dtype, head_pad, block_size)
    if dtype == torch.float32:
        return [default]
    # Each costs a compile (seconds) at an engine's first start on a machine.
    shapes = [(64, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
              (128, 128, 8, 2)]
    found = [default]
    for block_m, tile_n, warps, stages in shapes:
        # per stage: a K and a V tile of [tile_n, head_pad] 16-bit values; plus the Q tile
        shared = stages * 2 * tile_n * head_pad * 2 + block_m * head_pad * 2
        acc_regs = block_m * (tile_n + head_pad) // (32 * warps)
        if tile_n < block_size or shared > 160 * 1024 or (
                cc_major < 9 and acc_regs > SM80_ACC_REGS):
            continue
        tiles = PrefillTiles(block_m, tile_n, warps, stages)
        if tiles not in found:
            found.append(tiles)
    rows = max(MIN_DOT_ROWS, _next_power_of_2(queries_per_kv))
    return [t for t in found if t.block_m >= rows] or [
        PrefillTiles(rows, default.tile_n, default.num_warps)]


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
