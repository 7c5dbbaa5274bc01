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
    max_concurrency: int | None,
    progress: bool,
) -> tuple[EngineRun, dict]:
    from engine_service.index_link import connect_prefix_index
    from engine_service.sampling_params import SamplingParams

    engine = make_engine(enable_prefix_caching=True)
    link = connect_prefix_index(engine, target, "bench-engine-0") if target else None
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
    progress: bool = True,
) -> dict:
    from prefix_index.launch import IndexProcess
    from prefix_index.redis_process import RedisProcess

    local, _ = _drive_once(
        make_engine, workload, "index_off_local_lru", None, max_concurrency, progress
    )
    with ExitStack() as stack:
        redis = stack.enter_context(RedisProcess())
        index = stack.enter_context(IndexProcess(redis.url, ["--log-level", "WARNING"]))
        steered, link_stats = _drive_once(
            make_engine, workload, "index_on", index.target, max_concurrency, progress
        )
    local_summary = summarize(local.records, local.duration_s)
    steered_summary = summarize(steered.records, steered.duration_s)
    return {
        "local": asdict(local_summary),
        "index": asdict(steered_summary),
        "link": link_stats,
        "throughput_ratio": steered_summary.output_throughput / local_summary.output_throughput,
        "ttft_p50_ratio": steered_summary.ttft["p50_ms"] / local_summary.ttft["p50_ms"],
    }
