"""Throughput and latency across block sizes on the ShareGPT-like serving workload (the
paper's Fig. 18b).

The same requests (the run's serving workload: ShareGPT-like lengths, Poisson arrivals at the
run's rate) through the offline engine at each block size, on a pool of the same number of
tokens (the engine's default pool), prefix caching off so every run computes everything.
Per block size: output throughput, TTFT, normalized latency (each request's end-to-end latency
over its output tokens, the paper's metric, averaged), and the pooled KV utilization (token
slots holding a token over slots of allocated blocks: what small blocks win).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.metrics import summarize
from bench.workloads import Workload


@dataclass(frozen=True, slots=True)
class BlockSizeShape:
    block_sizes: tuple[int, ...]
    repeats: int  # runs per block size, rotated through the sizes; the best throughput kept


FULL_SHAPE = BlockSizeShape((8, 16, 32, 64), 1)
QUICK_SHAPE = BlockSizeShape((8, 16, 64), 1)


def block_size_run(make_engine, workload: Workload, block_size: int, rate: float,
                   seed: int) -> dict:
    from bench.peers_engine import drive, kv_utilization

    engine = make_engine(block_size=block_size, enable_prefix_caching=False)
    run = drive(engine, workload, f"block_size_{block_size}", rate=rate, seed=seed,
                progress=False)
    s = summarize(run.records, run.duration_s)
    normalized = [r.e2el / len(r.token_times) for r in run.records if r.token_times]
    return {
        "block_size": block_size,
        "num_blocks": run.stats["num_blocks"],
        "num_preemptions": run.stats["num_preemptions"],
        "duration_s": run.duration_s,
        "output_throughput": s.output_throughput,
        "ttft_p50_ms": s.ttft["p50_ms"],
        "ttft_p90_ms": s.ttft["p90_ms"],
        "normalized_latency_ms": 1000 * sum(normalized) / len(normalized),
        "kv_utilization": kv_utilization(run.kv_samples),
    }


def block_size_sweep(make_engine, workload: Workload, shape: BlockSizeShape, rate: float,
                     seed: int, log=print) -> dict:
    best: dict[int, dict] = {}
    runs = []
    for repeat in range(shape.repeats):
        for block_size in shape.block_sizes:
            log(f"block sizes: {block_size} (run {repeat + 1} of {shape.repeats})")
            run = block_size_run(make_engine, workload, block_size, rate, seed)
            runs.append(run)
            kept = best.get(block_size)
            if kept is None or run["output_throughput"] > kept["output_throughput"]:
                best[block_size] = run
    return {"shape": {"block_sizes": list(shape.block_sizes), "repeats": shape.repeats,
                      "rate": rate},
            "best": [best[b] for b in shape.block_sizes], "runs": runs}
