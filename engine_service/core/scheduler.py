"""Continuous batching: one rule for every step.

Each sequence has num_computed_tokens catching up with num_tokens; a step gives every running
sequence what it still needs (a decode token, or a prefill chunk) within the token budget, then
admits waiting requests. Chunked prefill and prefix caching fall out of that rule. When blocks
run out, the latest arrival is preempted (its whole sequence group) by recompute or swap.
"""

import bisect
from collections import deque
from dataclasses import dataclass, field

from engine_service.core.kv_cache_manager import BlockMoves, KVCacheManager
from engine_service.core.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step
    max_num_seqs: int = 256
    preemption_mode: str = "recompute"  # or "swap"
    # Fraction of the pool kept free when admitting new requests, so running ones can grow
    # for a while before anyone is preempted.
    admission_watermark: float = 0.01


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int
    samples: bool  # this chunk reaches the end of the sequence: sample a token from it


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    moves: BlockMoves = field(default_factory=BlockMoves)
    preempted: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class SchedulerCounters:
    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_recomputed: int = 0


def _order_key(group: SequenceGroup) -> tuple[int, int]:
    # Lower priority value first (vLLM's convention), then arrival.
    return (group.priority, group.arrival_order)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[SequenceGroup] = []  # sorted by _order_key
        self.running: list[SequenceGroup] = []  # sorted by _order_key
        self.swapped: deque[SequenceGroup] = deque()
        self.counters = SchedulerCounters()
        self._watermark_blocks = int(config.admission_watermark * kv.pool.num_blocks)

    # ---- queues -------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        bisect.insort(self.waiting, group, key=_order_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        return sum(len(g.live_seqs()) for g in self.running)

    def remove_finished(self) -> list[SequenceGroup]:
        finished = [g for g in self.running if g.is_finished]
        if finished:
            self.running = [g for g in self.running if not g.is_finished]
        return finished

    def abort(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self.free_group(group)
                    return group
        return None

    def free_group(self, group: SequenceGroup) -> None:
        swapped = [s for s in group.seqs if s.status == SequenceStatus.SWAPPED]
        if swapped:
            self.kv.free_cpu(swapped)
        for seq in group.seqs:
            if seq.status != SequenceStatus.SWAPPED:
                self.kv.free(seq)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._swap_in(out)
            if not self.swapped:
                self._admit_waiting(out, budget)
        out.moves = self.kv.take_moves()
        return out

    def _plan(self, seq: Sequence, budget: int) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            group = self.running[index]
            seqs = group.live_seqs()
            plans = []
            for seq in seqs:
                num_new = self._plan(seq, budget - sum(n for _, n in plans))
                if num_new > 0:
                    plans.append((seq, num_new))
            if not plans:
                index += 1
                continue
            # All-or-nothing per group: preempt the latest arrivals until it fits.
            while (
                sum(self.kv.blocks_needed(s, n, []) for s, n in plans)
                > self.kv.pool.num_free_blocks
            ):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is group:
                    break
            if group not in self.running:
                break
            for seq, num_new in plans:
                self.kv.allocate(seq, num_new, [])
                out.scheduled.append(
                    ScheduledSeq(
                        seq, group, num_new, seq.num_computed_tokens + num_new == seq.num_tokens
                    )
                )
                budget -= num_new
            index += 1
        return budget

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        out.preempted.append(group)
        out.scheduled = [s for s in out.scheduled if s.group is not group]
        self.counters.num_preemptions += 1
        seqs = group.live_seqs()
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(seqs):
            self.kv.swap_out(seqs)
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.counters.num_swapped_out += 1
            return
        # Recompute: drop the KV; the prefix cache may give much of it back on re-admission.
        for seq in seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.counters.num_recomputed += 1
        bisect.insort(self.waiting, group, key=_order_key)

    def _watermark(self) -> int:
        # With nothing running there is nobody to keep room for; a request that fits the
        # whole pool must still be admitted.
        return self._watermark_blocks if self.running else 0

    def _swap_in(self, out: SchedulerOutput) -> None:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs()
            needed = self.kv.blocks_to_swap_in(seqs)
            if needed + self._watermark() > self.kv.pool.num_free_blocks:
                return
            self.swapped.popleft()
            self.kv.swap_in(seqs)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, group, key=_order_key)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0:
            group = self.waiting[0]
            seqs = group.live_seqs()
            num_seqs = max(len(seqs), group.params.n if not group.has_forked else 0)
            if self.num_running_seqs() + num_seqs > self.config.max_num_seqs:
                return
            plans = []
            needed = 0
            planned_budget = budget
            for seq in seqs:
                cached = self.kv.find_cached_prefix(seq, group.cache_salt)
                num_computed = len(cached) * self.kv.block_size
                num_new = min(seq.num_tokens - num_computed, planned_budget)
                if num_new <= 0:
                    break
                # blocks_needed counts from the sequence's own (empty) table plus the hits.
                saved = seq.num_computed_tokens
                seq.num_computed_tokens = num_computed
                needed += self.kv.blocks_needed(seq, num_new, cached)
                seq.num_computed_tokens = saved
                plans.append((seq, num_new, cached))
                planned_budget -= num_new
            if len(plans) < len(seqs):
                return  # not enough budget left for the whole group this step
            if needed + self._watermark() > self.kv.pool.num_free_blocks:
                return
            self.waiting.pop(0)
            for seq, num_new, cached in plans:
                self.kv.allocate(seq, num_new, cached)
                seq.status = SequenceStatus.RUNNING
                if group.num_cached_tokens is None:
                    group.num_cached_tokens = seq.num_computed_tokens
                    self.kv.record_query(seq.num_prompt_tokens, seq.num_computed_tokens)
                out.scheduled.append(
                    ScheduledSeq(
                        seq, group, num_new, seq.num_computed_tokens + num_new == seq.num_tokens
                    )
                )
                budget -= num_new
            bisect.insort(self.running, group, key=_order_key)
