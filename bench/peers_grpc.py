"""Our engine over gRPC: a grpc.aio client streaming GenerateStream from a pagedgen-engine
subprocess, open-loop (Poisson) or closed-loop (max concurrency), every token stamped on
arrival at the client. Same request shapes as the in-process peer: token-id prompts, greedy,
ignore_eos, max_tokens = the target output length."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
from tqdm import tqdm

from bench.metrics import RequestRecord, run_duration
from bench.peers_hf import PeerRun
from bench.workloads import BenchRequest, Workload, poisson_arrivals
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc


async def _one(stub, request_id: str, r: BenchRequest, record: RequestRecord) -> None:
    req = pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=list(r.prompt_token_ids)),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
        cache_salt=r.cache_salt or "",
    )
    record.arrival = time.monotonic()
    async for chunk in stub.GenerateStream(req):
        t = time.monotonic()
        for choice in chunk.choices:
            record.token_times.extend([t] * len(choice.token_ids))
        if chunk.finished:
            record.finish = t
            record.num_cached_tokens = chunk.usage.cached_tokens
    record.output_len = len(record.token_times)


async def _run(
    target: str,
    workload: Workload,
    name: str,
    rate: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool,
) -> tuple[list[RequestRecord], int]:
    requests = workload.requests
    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    offsets = poisson_arrivals(len(requests), rate, seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    bar = tqdm(total=len(requests), desc=name, disable=not progress)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        steps_before = (await stub.EngineStats(pb.EngineStatsRequest())).num_steps
        start = time.monotonic()

        async def send(index: int) -> None:
            await asyncio.sleep(max(0.0, start + offsets[index] - time.monotonic()))
            async with limit:
                await _one(stub, f"{name}-{index}", requests[index], records[index])
            bar.update(1)

        await asyncio.gather(*(send(i) for i in range(len(requests))))
        steps_after = (await stub.EngineStats(pb.EngineStatsRequest())).num_steps
    bar.close()
    return records, steps_after - steps_before


def run_grpc(
    target: str,
    workload: Workload,
    name: str = "engine_grpc",
    rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> PeerRun:
    records, num_steps = asyncio.run(
        _run(target, workload, name, rate, max_concurrency, seed, progress)
    )
    return PeerRun(name, records, run_duration(records), num_forward_passes=num_steps)
