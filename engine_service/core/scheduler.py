"""Continuous batching: one rule for every step.

Each sequence has num_computed_tokens catching up with num_tokens; a step gives every running
sequence what it still needs (a decode token, or a prefill chunk) within the token budget, then
admits waiting requests. Chunked prefill and prefix caching fall out of that rule. When blocks
run out, the latest arrival is preempted (its whole sequence group) by recompute or swap.

Every block count here is exact (the KV cache manager counts a group's shared blocks once), so a
group whose peak footprint fits the pool always makes progress once it runs alone.
"""

import bisect
import logging
from collections import deque
from dataclasses import dataclass

from engine_service.core.kv_cache_manager import KVCacheManager
from engine_service.core.scheduler_output import (
    MAX_SCORED_TOKENS_PER_STEP,
    ScheduledSeq,
    SchedulerOutput,
)
from engine_service.core.sequence import Sequence, SequenceGroup, SequenceStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step
    max_num_seqs: int = 256
    preemption_mode: str = "recompute"  # or "swap"
    # Fraction of the pool kept free when admitting new requests, so running ones can grow
    # for a while before anyone is preempted.
    admission_watermark: float = 0.01
    defer_shared_prefill: bool = True  # see EngineConfig


@dataclass(slots=True)
class SchedulerCounters:
    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_recomputed: int = 0
    num_pins_released: int = 0  # idle pinned blocks unpinned so a lone request could run
    # Admissions put off one step because a running request was computing the same prompt
    # blocks (counted once per request and step).
    num_prefill_deferrals: int = 0


# Waiting groups passed over in one step (each costs a prefix lookup) before admission stops
# for that step: 2,000 requests queued on one new 8k-token prefix took 1 s a step unbounded.
MAX_DEFERRED_PER_STEP = 32


def _order_key(group: SequenceGroup) -> tuple[int, int]:
    # Lower priority value first (vLLM's convention), then arrival.
    return (group.priority, group.arrival_order)


def _seq_slots(group: SequenceGroup) -> int:
    """The sequences a group holds of max_num_seqs: a group that has not forked yet (it runs
    one sequence while it prefills) holds all it will fork into, its n samples or beams, from
    admission on; one that has forked, those still live."""
    if group.has_forked:
        return len(group.live_seqs())
    return max(len(group.live_seqs()), group.params.num_sequences)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[SequenceGroup] = []  # sorted by _order_key
        self.running: list[SequenceGroup] = []  # sorted by _order_key
        self.swapped: deque[SequenceGroup] = deque()
        self.counters = SchedulerCounters()
        # Bumped whenever a request starts or stops holding blocks (admitted, swapped in or
        # out, preempted, finished, aborted): the engine recomputes the pin budget's demand
        # only then, not every step.
        self.num_running_changes = 0
        # This step's room for prompt tokens of requests scoring their prompt (reset by
        # schedule()).
        self._scored_tokens_left = MAX_SCORED_TOKENS_PER_STEP
        self._watermark_blocks = int(config.admission_watermark * kv.pool.num_blocks)

    # ---- queues -------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        bisect.insort(self.waiting, group, key=_order_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        # Read every step (the engine's stats): counted in place, no list per group.
        finished = SequenceStatus.FINISHED
        return sum(1 for g in self.running for s in g.seqs if s.status is not finished)

    def num_waiting_prefill_tokens(self) -> int:
        """Prompt tokens not computed yet: what a router weighs as queued prefill work. A
        group prefills its prompt once (its other sequences share it), so the leader counts."""
        waiting = sum(g.num_prompt_tokens for g in self.waiting)
        running = 0
        for group in self.running:
            leader = group.seqs[0]
            running += max(0, leader.num_prompt_tokens - leader.num_computed_tokens)
        return waiting + running

    def remove_finished(self) -> list[SequenceGroup]:
        finished = [g for g in self.running if g.is_finished]
        if finished:
            self.running = [g for g in self.running if not g.is_finished]
            self.num_running_changes += 1
        return finished

    def abort(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self.num_running_changes += 1
                    self.free_group(group)
                    return group
        return None

    def free_group(self, group: SequenceGroup) -> None:
        self.kv.free_cpu([s for s in group.seqs if s.status == SequenceStatus.SWAPPED])
        for seq in group.seqs:
            self.kv.forget(seq)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._scored_tokens_left = MAX_SCORED_TOKENS_PER_STEP
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._swap_in()
            if not self.swapped:
                self._admit_waiting(out, budget)
        out.moves = self.kv.take_moves()
        tables = self.kv.device_tables()
        for item in out.scheduled:
            item.block_table = tables.get(item.seq.seq_id, [])
        return out

    def after_forward(self, out: SchedulerOutput) -> None:
        """The step's tokens are in the cache: advance, commit full blocks, and let parked
        sequences share their leader's recomputed prompt (before anyone can finish and free)."""
        kv = self.kv
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            kv.commit_full_blocks(item.seq, item.group.cache_salt)
        # Only a group of several sequences has followers to unpark (a lone one never parks).
        groups = {id(s.group): s.group for s in out.scheduled if len(s.group.seqs) > 1}
        for group in groups.values():
            self._unpark(group)

    def _unpark(self, group: SequenceGroup) -> None:
        parked = [s for s in group.seqs if s.status == SequenceStatus.PARKED]
        if not parked:
            return
        shared = group.num_shared_prompt_blocks(self.kv.block_size)
        leader = self._leader(group)
        if leader.num_computed_tokens < shared * self.kv.block_size:
            return
        for seq in parked:
            self.kv.share_prefix(leader, seq, shared)
            seq.num_computed_tokens = shared * self.kv.block_size
            seq.status = SequenceStatus.RUNNING

    @staticmethod
    def _leader(group: SequenceGroup) -> Sequence:
        return next(s for s in group.seqs if s.status == SequenceStatus.RUNNING)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        running_status, kv = SequenceStatus.RUNNING, self.kv
        while index < len(self.running) and budget > 0:
            group = self.running[index]
            # The common step of a lone sequence (no beams, no samples): one decode token into
            # a block it holds alone. Exactly what the general path below does for it (no block
            # needed: nothing to check, grow or preempt), without its lists.
            seqs = group.seqs
            if group.beam is None and len(seqs) == 1:
                seq = seqs[0]
                if seq.status is running_status and seq.num_tokens - seq.num_computed_tokens == 1:
                    table = kv.table_for_decode(seq)
                    if table is not None:
                        # out.scheduled, not a local: a preemption rebinds it.
                        out.scheduled.append(ScheduledSeq(seq, group, 1, True, table))
                        budget -= 1
                        index += 1
                        continue
            scores_prompt = group.scores_prompt
            plans = self._plan(group, min(budget, self._scored_tokens_left) if scores_prompt
                               else budget)
            if scores_prompt:
                self._scored_tokens_left -= sum(num_new for _, num_new in plans)
            if not plans:
                index += 1
                continue
            # All-or-nothing per group: preempt the latest arrivals until it fits (most steps
            # need no new block: then nothing is checked). The group stays in `running` until
            # it is the victim itself, so it runs alone when it is the only one left.
            needed = self.kv.blocks_to_grow(plans)
            preempted_itself = False
            while needed and needed > self._free_for(needed, alone=len(self.running) == 1):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is group:
                    preempted_itself = True
                    break
            if preempted_itself:
                break
            for seq, num_new in plans:
                self.kv.grow(seq, num_new)
                out.scheduled.append(
                    ScheduledSeq(
                        seq, group, num_new, seq.num_computed_tokens + num_new == seq.num_tokens
                    )
                )
                budget -= num_new
            index += 1
        return budget

    @staticmethod
    def _plan(group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """(seq, tokens to compute) for the group's running sequences within the budget."""
        if group.beam is None and len(group.seqs) == 1:  # the common case, in a few steps
            seq = group.seqs[0]
            if seq.status is not SequenceStatus.RUNNING:
                return []
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            return [(seq, num_new)] if num_new > 0 else []
        running = [s for s in group.seqs if s.status == SequenceStatus.RUNNING]
        # A beam search step needs the logits of all of a request's beams at once: its beams
        # reach their last token in the same step, or all stop one short of it (catching up
        # after a recompute, or when the budget cannot hold every beam's last token).
        hold_back = int(
            group.beam is not None
            and (
                any(s.status == SequenceStatus.PARKED for s in group.seqs)
                or sum(s.num_tokens - s.num_computed_tokens for s in running) > budget
            )
        )
        plans: list[tuple[Sequence, int]] = []
        left = budget
        for seq in running:
            num_new = min(seq.num_tokens - seq.num_computed_tokens - hold_back, left)
            if num_new > 0:
                plans.append((seq, num_new))
                left -= num_new
        return plans

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        self.num_running_changes += 1
        out.preempted.append(group)
        out.scheduled = [s for s in out.scheduled if s.group is not group]
        self.counters.num_preemptions += 1
        seqs = group.live_seqs()
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(seqs):
            self.kv.swap_out(seqs)
            for seq in seqs:
                if seq.status == SequenceStatus.RUNNING:
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

    def _swap_in(self) -> None:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs()
            needed = self.kv.blocks_to_swap_in(seqs)
            if needed + self._watermark() > self._free_for(needed, not self.running):
                return
            self.swapped.popleft()
            self.num_running_changes += 1
            self.kv.swap_in(seqs)
            for seq in seqs:
                if seq.status == SequenceStatus.SWAPPED:
                    seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, group, key=_order_key)

    def _free_for(self, needed: int, alone: bool) -> int:
        """Free blocks; for a request that would run alone, idle pinned blocks are unpinned when
        it cannot fit otherwise (a pin must never stall the engine)."""
        pool = self.kv.pool
        free = pool.num_free_blocks
        if needed > free and alone:
            released = pool.policy.release_pins(needed - free)
            if released:
                self.counters.num_pins_released += released
                log.warning("unpinned %d idle blocks: the next request needs %d blocks and "
                            "only %d were free", released, needed, free)
            free = pool.num_free_blocks
        return free

    def _blocks_in_flight(self) -> set[bytes]:
        return {h for group in self.running for seq in group.seqs
                for h in self.kv.blocks_in_flight(seq)}

    def _num_in_flight(self, leader: Sequence, group: SequenceGroup, num_hits: int,
                       in_flight: set[bytes]) -> int:
        """How many of leader's prompt blocks after its hits running requests are computing,
        in a row (the block holding its last token aside: it is recomputed anyway). Above 0,
        leader waits one step and finds them cached, instead of computing the same prefix a
        second time in the same step (a burst of requests for a new system prompt)."""
        if not in_flight:
            return 0
        hashes = self.kv.block_hashes(leader, group.cache_salt)
        limit = min(len(hashes), (leader.num_tokens - 1) // self.kv.block_size)
        count = 0
        while num_hits + count < limit and hashes[num_hits + count] in in_flight:
            count += 1
        return count

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting groups in order while they fit. A group (re-)enters through one
        sequence, its leader: the leader's cache hits are acquired before anything is allocated;
        the other sequences of a re-admitted forked group share the leader's prompt blocks at
        once when they are cached, or park until the leader has recomputed them.

        A group whose next prompt block a running request is computing is passed over for this
        step (_num_in_flight). It gives up only this step's tokens: the blocks and sequence
        slots it would take now stay held for it, so the groups behind it are admitted only
        beside it (otherwise later arrivals took its memory and it waited for them to end),
        and past MAX_DEFERRED_PER_STEP passed-over groups this step admits no more (a long
        queue on one new prefix is not scanned whole every step). So is a prompt to be scored
        once this step's scored tokens are spent (MAX_SCORED_TOKENS_PER_STEP)."""
        if not self.waiting:  # nothing to admit: no scan of the running requests
            return
        defer = self.config.defer_shared_prefill
        in_flight = self._blocks_in_flight() if defer else set()
        num_running = sum(_seq_slots(group) for group in self.running)
        held_blocks = held_seqs = num_deferred = 0
        index = 0
        while index < len(self.waiting) and budget > 0:
            group = self.waiting[index]
            seqs = group.live_seqs()
            num_seqs = _seq_slots(group)
            if num_running + held_seqs + num_seqs > self.config.max_num_seqs:
                return
            leader, followers = seqs[0], seqs[1:]
            scores_prompt = group.scores_prompt
            hits = [] if scores_prompt else self.kv.cached_prefix(leader, group.cache_salt)
            num_cached = len(hits) * self.kv.block_size
            # A re-admitted beam search leader stops one token short: its beams take their
            # next step together, once the parked ones have caught up (see _plan).
            hold_back = int(group.beam is not None and bool(followers))
            num_new = min(leader.num_tokens - num_cached - hold_back, budget)
            # A prompt being scored waits for next step's room when this step's is spent:
            # sized as the chunk it will run then, it is passed over as a deferred one is.
            capped = scores_prompt and not self._scored_tokens_left
            if scores_prompt:
                num_new = min(num_new, self._scored_tokens_left or MAX_SCORED_TOKENS_PER_STEP)
            needed = self.kv.blocks_to_admit(leader, hits, num_new) + held_blocks
            if needed + self._watermark() > self._free_for(needed, not self.running):
                return
            # Next step it shares the in-flight blocks instead of allocating them.
            shared = 0 if scores_prompt else self._num_in_flight(leader, group, len(hits),
                                                                 in_flight)
            if shared or capped:
                if num_deferred == MAX_DEFERRED_PER_STEP:
                    return
                num_deferred += 1
                if shared:
                    self.counters.num_prefill_deferrals += 1
                held_blocks, held_seqs = max(held_blocks, needed - shared), held_seqs + num_seqs
                index += 1
                continue
            self.waiting.pop(index)
            self.num_running_changes += 1
            self.kv.admit(leader, hits, num_new, group.cache_salt)
            if scores_prompt:
                self._scored_tokens_left -= num_new
            leader.num_computed_tokens = num_cached
            if defer:
                in_flight.update(self.kv.blocks_in_flight(leader))
            leader.status = SequenceStatus.RUNNING
            num_running += num_seqs
            if group.num_cached_tokens is None:
                group.num_cached_tokens = num_cached
                if not scores_prompt:  # (it looked nothing up: no miss for the hit rate)
                    self.kv.record_query(leader.num_prompt_tokens, num_cached)
            for seq in followers:
                seq.status = SequenceStatus.PARKED
            self._unpark(group)
            if num_new > 0:
                out.scheduled.append(
                    ScheduledSeq(leader, group, num_new, num_cached + num_new == leader.num_tokens)
                )
            budget -= num_new
            bisect.insort(self.running, group, key=_order_key)
