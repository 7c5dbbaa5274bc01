"""Preemption by swap and by recompute across block sizes (the paper's Fig. 19).

Cost per block. For each block size, the same amount of KV (`tokens` tokens, tokens / block
size blocks) preempted and restored both ways:
    swap       the model runner's own swap-out (device pool -> CPU pool) and swap-in (back)
               of those blocks, timed apart;
    recompute  a prefill of `tokens` tokens (one request, prefix caching off): what restoring
               a preempted sequence of that length by recompute costs.
Each the median of `repeats`. On this CPU-only machine the "device" pool is host memory too,
so swap is a memory copy within RAM, not a PCIe transfer: per block it is far cheaper than on a
GPU, and it does not show the paper's penalty for small blocks (many small PCIe transfers).

Under pressure. The same requests (random prompts, EOS ignored) through the offline engine,
all sent at once, on a pool of `pool_tokens` tokens (the same memory at every block size, so
the same pressure) with preemption by recompute and by swap, and on a pool that holds them all
(no preemption: the baseline). Throughput, TTFT and the number of preemptions each.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import asdict, dataclass

from bench.metrics import summarize
from bench.workloads import fixed_random


@dataclass(frozen=True, slots=True)
class PreemptionShape:
    block_sizes: tuple[int, ...]
    tokens: int  # KV preempted and restored per block size, in tokens
    repeats: int
    num_requests: int  # the pressure runs
    prompt_range: tuple[int, int]
    output_len: int
    pool_fraction: float  # the pressure pool against the requests' peak demand


FULL_SHAPE = PreemptionShape((8, 16, 32, 64), 512, 3, 16, (64, 256), 96, 0.35)
QUICK_SHAPE = PreemptionShape((8, 16, 64), 256, 2, 6, (32, 96), 32, 0.4)


@dataclass(slots=True)
class BlockCost:
    block_size: int
    num_blocks: int  # tokens / block_size
    swap_out_ms: float
    swap_in_ms: float
    recompute_ms: float
    swap_us_per_block: float  # (out + in) / num_blocks
    recompute_us_per_block: float


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _moved(runner, moves) -> None:
    """The moves applied and landed: on CUDA a swap in is only queued when apply_moves
    returns."""
    import torch

    runner.apply_moves(moves)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def block_cost(make_engine, block_size: int, tokens: int, repeats: int) -> BlockCost:
    from engine_service.core.scheduler_output import BlockMoves
    from engine_service.model.sampling_params import SamplingParams

    num_blocks = tokens // block_size
    engine = make_engine(block_size=block_size, num_blocks=num_blocks + 8,
                         preemption_mode="swap", enable_prefix_caching=False,
                         max_num_batched_tokens=max(2048, tokens), max_model_len=tokens + 8)
    runner = engine.runner
    # The runner's CPU pool is sized from swap_space; the blocks moved are the first ones.
    pairs = [(i, i) for i in range(num_blocks)]
    out_ms = _median_ms(lambda: _moved(runner, BlockMoves(swap_out=pairs)), repeats)
    in_ms = _median_ms(lambda: _moved(runner, BlockMoves(swap_in=pairs)), repeats)
    prompt = list(fixed_random(1, tokens, tokens, 1, seed=block_size).requests[0]
                  .prompt_token_ids)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill() -> None:
        engine.add_request(uuid.uuid4().hex, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()

    prefill()  # untimed: the first forward of this shape
    recompute_ms = _median_ms(prefill, repeats)
    return BlockCost(block_size, num_blocks, out_ms, in_ms, recompute_ms,
                     1000 * (out_ms + in_ms) / num_blocks, 1000 * recompute_ms / num_blocks)


def _peak_tokens(shape: PreemptionShape, workload) -> int:
    return sum(r.prompt_len + r.output_len for r in workload.requests)


def pressure_run(make_engine, shape: PreemptionShape, block_size: int, mode: str | None,
                 seed: int) -> dict:
    """One pass of the workload; mode None: a pool that holds everything."""
    from bench.peers_engine import drive

    workload = fixed_random(shape.num_requests, *shape.prompt_range, shape.output_len, seed)
    peak = _peak_tokens(shape, workload)
    pool_tokens = int(peak * shape.pool_fraction) if mode else peak + 16 * block_size
    num_blocks = -(-pool_tokens // block_size)
    engine = make_engine(block_size=block_size, num_blocks=num_blocks,
                         preemption_mode=mode or "recompute", enable_prefix_caching=False)
    name = f"b{block_size}_{mode or 'no_pressure'}"
    run = drive(engine, workload, name, track_kv=False, progress=False)
    s = summarize(run.records, run.duration_s)
    return {
        "name": name,
        "block_size": block_size,
        "mode": mode or "none",
        "num_blocks": num_blocks,
        "pool_tokens": num_blocks * block_size,
        "peak_demand_tokens": peak,
        "num_preemptions": run.stats["num_preemptions"],
        "duration_s": run.duration_s,
        "output_throughput": s.output_throughput,
        "ttft_p50_ms": s.ttft["p50_ms"],
        "ttft_p90_ms": s.ttft["p90_ms"],
    }


def preemption_bench(make_engine, shape: PreemptionShape, seed: int, log=print) -> dict:
    """`make_engine(**overrides)` -> an LLMEngine on the run's model (a fresh one per call)."""
    costs = []
    for bs in shape.block_sizes:
        log(f"preemption: swap and recompute of {shape.tokens} tokens at block size {bs}")
        costs.append(asdict(block_cost(make_engine, bs, shape.tokens, shape.repeats)))
    runs = []
    for bs in shape.block_sizes:
        for mode in (None, "recompute", "swap"):
            log(f"preemption under pressure: block size {bs}, {mode or 'no pressure'}")
            runs.append(pressure_run(make_engine, shape, bs, mode, seed))
    return {"shape": asdict(shape), "block_costs": costs, "pressure": runs}
