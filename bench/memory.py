"""KV memory: utilization (slots holding real tokens / slots allocated) and the largest number
of concurrent sequences under one fixed KV budget, for the paged engine and for a contiguous
allocator that reserves each request's slots up front, as pre-PagedAttention systems do.

The paged side is a simulation with the engine's real BlockPool, KVCacheManager and Scheduler
(no model: a step "computes" what the scheduler scheduled and appends a dummy token), so it
measures exactly the engine's allocation and preemption behaviour, at a scale (hundreds of
requests, 2k-token contexts) a CPU could not run through the model in a benchmark's time.
The contiguous side replays the same workload with the same step rule (iteration-level
scheduling, FCFS, a token budget per step) but a reservation per request:
    max     max_model_len slots (FasterTransformer / Orca "Max")
    pow2    the next power of two of prompt + output ("Pow2")
    oracle  exactly prompt + output, known in advance ("Oracle", not realizable)
External fragmentation of the contiguous pool is ignored, which flatters the baseline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from bench.workloads import Workload

RESERVATIONS = ("max", "pow2", "oracle")
DUMMY_TOKEN = 100


@dataclass(slots=True)
class MemoryRun:
    allocator: str  # "paged" or "contiguous-<reservation>"
    block_size: int
    budget_slots: int
    utilization: float  # sum over steps of used slots / sum of allocated slots
    max_concurrent_seqs: int
    mean_concurrent_seqs: float
    # Mean over the steps in which requests were still waiting: the memory-bound regime, not
    # diluted by the tail where the last long requests run alone.
    saturated_concurrent_seqs: float
    num_steps: int
    num_preemptions: int = 0
    # (step, used slots, allocated slots, running seqs, requests waiting), thinned for plots
    trace: list[tuple[int, int, int, int, int]] = field(default_factory=list)


def kv_slot_usage(scheduler, pool, block_size: int) -> tuple[int, int, int]:
    """(slots holding a computed token, slots of in-use blocks, running sequences); each
    physical block is counted once even when sequences share it."""
    filled: dict[int, int] = {}
    num_seqs = 0
    for group in scheduler.running:
        for seq in group.live_seqs():
            num_seqs += 1
            for i, block_id in enumerate(scheduler.kv.block_table(seq)):
                n = min(block_size, max(0, seq.num_computed_tokens - i * block_size))
                filled[block_id] = max(filled.get(block_id, 0), n)
    in_use = pool.num_blocks - pool.num_free_blocks
    return sum(filled.values()), in_use * block_size, num_seqs


def _thin(trace: list, max_points: int = 400) -> list:
    stride = max(1, len(trace) // max_points)
    return trace[::stride]


def simulate_paged(
    workload: Workload,
    budget_slots: int,
    block_size: int,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 2048,
) -> MemoryRun:
    from engine_service.core.block_hash import BlockHasher
    from engine_service.core.block_pool import BlockPool
    from engine_service.core.kv_cache_manager import KVCacheManager
    from engine_service.core.scheduler import Scheduler, SchedulerConfig
    from engine_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
    from engine_service.model.sampling_params import SamplingParams

    pool = BlockPool(budget_slots // block_size)
    # Prefix caching off: the workload's prompts are unique, and utilization should measure
    # allocation, not sharing (sharing would only raise it).
    hasher = BlockHasher("simulation", "none", block_size)
    kv = KVCacheManager(pool, hasher, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs, "recompute"), kv)
    targets: dict[int, int] = {}
    for i, r in enumerate(workload.requests):
        seq = Sequence(i, 0, list(r.prompt_token_ids), r.prompt_len)
        targets[i] = r.output_len
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        scheduler.add(SequenceGroup(str(i), [seq], params, None, arrival_order=i))
    trace = []
    step = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        kv.take_moves()
        if not out.scheduled:
            raise RuntimeError(f"simulation stalled at step {step}: nothing schedulable")
        scheduler.after_forward(out)
        used, allocated, running = kv_slot_usage(scheduler, pool, block_size)
        trace.append((step, used, allocated, running, len(scheduler.waiting)))
        for item in out.scheduled:
            seq = item.seq
            if item.samples:
                seq.token_ids.append(DUMMY_TOKEN)
                if seq.num_output_tokens >= targets[seq.seq_id]:
                    seq.status = SequenceStatus.FINISHED
                    kv.forget(seq)
        scheduler.remove_finished()
        step += 1
    return _finish("paged", block_size, budget_slots, trace, scheduler.counters.num_preemptions)


def reservation_len(reservation: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    need = prompt_len + output_len
    if reservation == "max":
        return max_model_len
    if reservation == "pow2":
        return min(max_model_len, 1 << (need - 1).bit_length())
    if reservation == "oracle":
        return need
    raise ValueError(f"reservation must be one of {RESERVATIONS}, got {reservation!r}")


def simulate_contiguous(
    workload: Workload,
    budget_slots: int,
    reservation: str,
    max_model_len: int = 2048,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 2048,
) -> MemoryRun:
    """Same step rule as the engine, but a request is admitted only when its whole
    reservation fits, keeps it until it finishes, and never grows past it."""
    waiting = deque(range(len(workload.requests)))
    requests = workload.requests
    # index -> [tokens computed, tokens total (prompt + generated), reserved slots]
    running: dict[int, list[int]] = {}
    reserved = 0
    trace = []
    step = 0
    while waiting or running:
        budget = max_num_batched_tokens
        scheduled: list[tuple[int, int]] = []
        for index, state in running.items():
            num_new = min(state[1] - state[0], budget)
            if num_new > 0:
                scheduled.append((index, num_new))
                budget -= num_new
        while waiting and budget > 0 and len(running) < max_num_seqs:
            r = requests[waiting[0]]
            slots = reservation_len(reservation, r.prompt_len, r.output_len, max_model_len)
            if reserved + slots > budget_slots:
                break
            index = waiting.popleft()
            reserved += slots
            running[index] = [0, r.prompt_len, slots]
            num_new = min(r.prompt_len, budget)
            scheduled.append((index, num_new))
            budget -= num_new
        if not scheduled:
            raise RuntimeError(f"contiguous simulation stalled at step {step}")
        for index, num_new in scheduled:
            running[index][0] += num_new
        used = sum(s[0] for s in running.values())
        trace.append((step, used, reserved, len(running), len(waiting)))
        for index, _ in scheduled:
            state = running[index]
            if state[0] == state[1]:  # caught up: a token was sampled
                state[1] += 1
                if state[1] - requests[index].prompt_len >= requests[index].output_len:
                    reserved -= state[2]
                    del running[index]
        step += 1
    return _finish(f"contiguous-{reservation}", 0, budget_slots, trace, 0)


def _finish(
    allocator: str, block_size: int, budget_slots: int, trace: list, num_preemptions: int
) -> MemoryRun:
    used = sum(t[1] for t in trace)
    allocated = sum(t[2] for t in trace)
    concurrency = [t[3] for t in trace]
    saturated = [t[3] for t in trace if t[4] > 0] or concurrency
    return MemoryRun(
        allocator=allocator,
        block_size=block_size,
        budget_slots=budget_slots,
        utilization=used / allocated if allocated else 0.0,
        max_concurrent_seqs=max(concurrency, default=0),
        mean_concurrent_seqs=sum(concurrency) / len(concurrency) if concurrency else 0.0,
        saturated_concurrent_seqs=sum(saturated) / len(saturated) if saturated else 0.0,
        num_steps=len(trace),
        num_preemptions=num_preemptions,
        trace=_thin(trace),
    )


def memory_comparison(
    workload: Workload,
    budget_slots: int,
    block_sizes: tuple[int, ...] = (8, 16, 32, 64),
    max_model_len: int = 2048,
    progress: bool = True,
) -> list[MemoryRun]:
    from tqdm import tqdm

    jobs = [("paged", bs) for bs in block_sizes] + [(res, 0) for res in RESERVATIONS]
    runs = []
    for kind, block_size in tqdm(jobs, desc="memory simulation", disable=not progress):
        if kind == "paged":
            runs.append(simulate_paged(workload, budget_slots, block_size))
        else:
            runs.append(simulate_contiguous(workload, budget_slots, kind, max_model_len))
    return runs
