"""Index overhead: the same engine and workload with the prefix cache steered by the prefix
index service (Redis + the index's gRPC server, on this machine, over loopback) and with the
standalone local LRU. Both runs have the prefix cache on; the difference is what the index's
batched Apply per step and its low-water eviction cost."""

from __future__ import annotations

import gc
from contextlib import ExitStack
from dataclasses import asdict

from bench.metrics import summarize
from bench.peers_engine import EngineRun, drive, warm_up
from bench.prefix import EngineFactory
from bench.workloads import Workload


def _drive_once(
    make_engine: EngineFactory,
    workload: Workload,
    name: str,
    target: str | None,
    engine_id: str | None,
    max_concurrency: int | None,
    progress: bool,
) -> tuple[EngineRun, dict]:
    from engine_service.index.link import connect_prefix_index
    from engine_service.model.sampling_params import SamplingParams

    engine = make_engine(enable_prefix_caching=True)
    link = connect_prefix_index(engine, target, engine_id) if target else None
    link_stats = {}
    try:
        warm_up(engine, SamplingParams)
        run = drive(engine, workload, name, max_concurrency=max_concurrency, progress=progress)
        if link is not None:
            s = link.stats()
            link_stats = {
                "degraded": s.degraded,
                "applies": s.applies,
                "ops_sent": s.ops_sent,
                "rpc_errors": s.rpc_errors,
                "rpc_mean_ms": {
                    m: 1e3 * s.rpc_seconds[m] / s.rpc_calls[m]
                    for m in s.rpc_calls
                    if s.rpc_calls[m]
                },
            }
    finally:
        if link is not None:
            link.close()
    del engine
    gc.collect()
    return run, link_stats


def index_overhead(
    make_engine: EngineFactory,
    workload: Workload,
    max_concurrency: int | None = 4,
    repeats: int = 1,
    progress: bool = True,
) -> dict:
    """Alternates local / index runs `repeats` times (a fresh engine each) and compares the
    best of each side, which discounts interference from other work on the machine."""
    from prefix_index.tools.launch import IndexProcess
    from prefix_index.tools.redis_process import RedisProcess

    local_runs, index_runs, link_stats = [], [], {}
    with ExitStack() as stack:
        redis = stack.enter_context(RedisProcess())
        index = stack.enter_context(IndexProcess(redis.url,
            ["--log-level", "WARNING", "--insecure"]))
        for i in range(repeats):
            run, _ = _drive_once(
                make_engine,
                workload,
                "index_off_local_lru",
                None,
                None,
                max_concurrency,
                progress,
            )
            local_runs.append(summarize(run.records, run.duration_s))
            run, link_stats = _drive_once(
                make_engine,
                workload,
                "index_on",
                index.target,
                f"bench-engine-{i}",
                max_concurrency,
                progress,
            )
            index_runs.append(summarize(run.records, run.duration_s))
    best_local = max(local_runs, key=lambda s: s.output_throughput)
    best_index = max(index_runs, key=lambda s: s.output_throughput)
    return {
        "local": asdict(best_local),
        "index": asdict(best_index),
        "output_throughput_local": [s.output_throughput for s in local_runs],
        "output_throughput_index": [s.output_throughput for s in index_runs],
        "link": link_stats,
        "throughput_ratio": best_index.output_throughput / best_local.output_throughput,
        "ttft_p50_ratio": best_index.ttft["p50_ms"] / best_local.ttft["p50_ms"],
    }
