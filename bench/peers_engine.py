"""Our engine as a peer, driven through its offline API (LLMEngine.add_request / step) by an
open-loop (Poisson arrivals) or closed-loop (fixed concurrency) client in the same process.

The engine is synchronous, so the client is the loop: before each step it sends every request
whose time has come (and for which a concurrency slot is free), then runs one step and stamps
every token the step produced. A request's arrival is the time it was due (open loop) or the
time its slot freed (closed loop), not the time the loop got round to it, so a long step that
delays a send is counted as latency, as a real client would see it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from tqdm import tqdm

from bench.memory import kv_slot_usage
from bench.metrics import RequestRecord, run_duration
from bench.peers_hf import PeerRun
from bench.workloads import Workload, poisson_arrivals


@dataclass(slots=True)
class KVSample:
    time_s: float  # since the start of the run
    used_slots: int  # token slots of in-use blocks holding a computed token
    allocated_slots: int  # token slots of blocks with refcount > 0
    num_running_seqs: int


@dataclass(slots=True)
class EngineRun(PeerRun):
    kv_samples: list[KVSample] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def sample_kv(engine, t: float) -> KVSample:
    used, allocated, num_seqs = kv_slot_usage(
        engine.scheduler, engine.pool, engine.config.block_size
    )
    return KVSample(t, used, allocated, num_seqs)


def kv_utilization(samples: list[KVSample]) -> float:
    """Pooled over the run: all used slots / all allocated slots across the samples."""
    allocated = sum(s.allocated_slots for s in samples)
    return sum(s.used_slots for s in samples) / allocated if allocated else math.nan


def warm_up(engine, params_cls, num_prompts: int = 8, prompt_len: int = 256) -> None:
    """Untimed: one full token-budget prefill and a few decode steps, so one-off costs of the
    first large forward (allocator growth, thread pools) do not land on the first measured
    run (vLLM's engine does a profile run at start for the same reason). Its prompts share no
    block with the benchmark workloads, so it leaves nothing in the prefix cache to hit."""
    params = params_cls(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(num_prompts):
        tokens = [100 + (i * prompt_len + j) % 30000 for j in range(prompt_len)]
        engine.add_request(f"warmup-{i}", tokens, params)
    while engine.has_unfinished_requests():
        engine.step()


def drive(
    engine,
    workload: Workload,
    name: str,
    rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    track_kv: bool = True,
    progress: bool = True,
) -> EngineRun:
    from engine_service.model.sampling_params import SamplingParams

    requests = workload.requests
    offsets = poisson_arrivals(len(requests), rate, seed)
    pending = deque(range(len(requests)))
    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    live: dict[str, int] = {}
    free_slot_times: deque[float] = deque()  # closed loop: when each freed slot opened
    samples: list[KVSample] = []
    before = engine.stats()
    bar = tqdm(total=len(requests), desc=name, disable=not progress)
    start = time.monotonic()
    if max_concurrency is not None:
        free_slot_times.extend([start] * max_concurrency)
    while pending or live:
        now = time.monotonic()
        while pending and start + offsets[pending[0]] <= now:
            if max_concurrency is not None and not free_slot_times:
                break
            index = pending.popleft()
            r = requests[index]
            due = start + offsets[index]
            slot = free_slot_times.popleft() if max_concurrency is not None else due
            records[index].arrival = max(due, slot)
            request_id = f"{name}-{index}"
            params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(
                request_id, list(r.prompt_token_ids), params, cache_salt=r.cache_salt
            )
            live[request_id] = index
        if not live:
            time.sleep(max(0.0, start + offsets[pending[0]] - time.monotonic()))
            continue
        outputs = engine.step()
        t = time.monotonic()
        for out in outputs:
            index = live.get(out.request_id)
            if index is None:
                continue
            rec = records[index]
            rec.token_times.extend([t] * len(out.outputs[0].token_ids_delta))
            if out.finished:
                rec.finish = t
                rec.output_len = len(rec.token_times)
                rec.num_cached_tokens = out.num_cached_tokens
                del live[out.request_id]
                if max_concurrency is not None:
                    free_slot_times.append(t)
                bar.update(1)
        if track_kv:
            samples.append(sample_kv(engine, t - start))
    bar.close()
    after = engine.stats()
    stats = {
        "num_steps": after.num_steps - before.num_steps,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "num_blocks": after.num_blocks,
        "block_size": engine.config.block_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "rate": rate,
        "max_concurrency": max_concurrency,
    }
    return EngineRun(
        name,
        records,
        run_duration(records),
        num_forward_passes=stats["num_steps"],
        kv_samples=samples,
        stats=stats,
    )
