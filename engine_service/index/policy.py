"""A prefix policy steered by the prefix index service (DESIGN "Prefix index", "Failure").

Everything here runs on the engine thread, the only writer of the policy's state: a local mirror
of this engine's cached blocks (hash -> parent, block id, refcount), its LRU, the pins. Each hook
records the matching index op; at the end of a step the recorded ops go to `outbox` as one batch
for the link thread (engine_service/index/link.py), which sends it as batched Applies and posts
the results back through the engine's command queue (`on_results`, run between two steps).
Victims are asked for ahead of need (a low-water mark on never-used free blocks) and applied at
the start of a later step, if still cached.

The index decides: its victims are applied, and the pins it reports in every Apply reply
(automatic hot-prefix pins and explicit ones) are mirrored, so a pinned block is never counted
free nor evicted locally. When the engine must evict on its own (degraded, or the index's victims
came late) it tells the index which block with a Forget op, instead of a full re-sync.

While the index or Redis is down nothing is recorded and the mirror's LRU serves alone
(degraded); on reconnect the link re-registers (new epoch) and asks for the mirror as a re-sync.
Each registration is a new generation: batches and results of an older one are dropped.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.core.pin_set import PinSet
from prefix_index.api.ops import (
    Acquire,
    AcquireKind,
    Commit,
    Evict,
    EvictedBlock,
    Forget,
    Op,
    OpResult,
    OpStatus,
    Pin,
    PinChange,
    PinState,
    Release,
    SetPinBudget,
    Unpin,
)

if TYPE_CHECKING:
    from engine_service.core.block_pool import BlockPool

log = logging.getLogger(__name__)

MAX_HASHES_PER_OP = 4096  # the index allows 16384 per chain; smaller ops keep Applies even
# Steps of ops the link may leave unsent (the index refusing its Apply rate) before they are
# dropped for a re-sync: about 10 s of 10 ms steps, each a few ops; a re-sync is one op per
# cached block.
DEFAULT_MAX_BACKLOG_BATCHES = 1024


@dataclass(slots=True)
class MirroredBlock:
    parent: bytes  # b"" for the first block of a chain
    block_id: int
    ref_count: int


@dataclass(slots=True)
class PendingOp:
    op: Op
    local_hits: int = 0  # acquire: how many of the chain the engine took from its own cache


@dataclass(slots=True)
class OpBatch:
    """Ops recorded by one step (or a re-sync), for the registration `generation`."""

    generation: int
    ops: list[PendingOp]


@dataclass(slots=True)
class MirrorCounters:
    """Where the index and the local mirror disagreed, and what the policy did locally."""

    index_victims_applied: int = 0  # blocks the index chose that left the local cache
    local_evictions: int = 0  # blocks the local LRU picked (degraded, or the index lagged)
    forgets_sent: int = 0  # local evictions reported to the index one block at a time
    index_pins: int = 0  # pins the index reported (automatic or explicit) and we mirrored
    mismatches: int = 0  # index results that did not match the mirror (races; self-healing)
    pins_released: int = 0  # idle pinned blocks unpinned so a request could run
    backlog_resyncs: int = 0  # backlogs past max_backlog_batches dropped for a re-sync


@dataclass(slots=True)
class LowWaterMark:
    """Ask the index for victims when fewer than `low` never-used blocks are free; ask for
    enough to get back to `high`."""

    low: int
    high: int

    @classmethod
    def for_pool(cls, num_blocks: int, blocks_per_step: int) -> LowWaterMark:
        """Victims arrive a step after they are asked for, so keep about one step's new blocks
        free, but at most 1/32 of the pool: a free block is a cached block lost, and when the
        index's victims come late the engine evicts locally (and says so with Forget)."""
        low = max(1, min(blocks_per_step, num_blocks // 32))
        return cls(low=low, high=max(low + 1, min(2 * low, num_blocks // 16)))


class IndexPolicy:
    """PrefixPolicy for one engine whose prefix cache the prefix index steers. Every method
    runs on the engine thread; the link reads only `outbox`, `needs_resync` and `generation`."""

    def __init__(self, pool: BlockPool, low_water: LowWaterMark,
                 max_backlog_batches: int = DEFAULT_MAX_BACKLOG_BATCHES) -> None:
        if max_backlog_batches < 1:
            raise ValueError(f"max_backlog_batches must be >= 1, got {max_backlog_batches}")
        self.pool = pool
        self.low_water = low_water
        self.max_backlog_batches = max_backlog_batches
        self._mirror: dict[bytes, MirroredBlock] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # refcount 0, unpinned; LRU
        self._pins: dict[bytes, float] = {}  # hash -> monotonic expiry (inf: until unpinned)
        # No block's pin lapses before this (a bound: an expiry only grows, a pin may go
        # sooner): lapse_pins, run between steps too, scans _pins only once it has passed.
        self._no_block_lapses_before = math.inf
        self._auto_pins: set[bytes] = set()  # of _pins, those the index pinned as hot
        # The explicit pins made through the index, whole (as the index keeps them: named by
        # the chain's last hash, each with its own expiry): what unpin drops, what a re-sync
        # states again, what release_pins gives up. _pins' expiry is the latest of a block's.
        self._records = PinSet()
        # Refcount 0 but pinned (not evictable), in pinning order: release_pins takes the oldest.
        self._idle_pinned: dict[bytes, None] = {}
        self._pending: list[PendingOp] = []  # recorded since the last batch
        self.outbox: queue.SimpleQueue[OpBatch] = queue.SimpleQueue()  # to the link thread
        self.generation = 0  # of the registration being recorded for
        self._recording = False  # registered: hooks record ops for the index
        self._covered_acquires = 0  # on_acquire calls an admission's Acquire op already counts
        self._victims: list[EvictedBlock] = []  # chosen by the index, applied at begin_step
        self._victims_in_flight = 0
        self.needs_resync = False
        # The engine's pin budget (core/pin_budget.py), sent to the index when it changes and
        # at each re-sync; None: not told yet (the index keeps Register's).
        self.pin_budget: int | None = None
        self.counters = MirrorCounters()
        self.wake: Callable[[], None] = lambda: None  # set by the link: "a batch is waiting"

    # ---- PrefixPolicy -------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_pinned_idle(self) -> int:
        return len(self._idle_pinned)

    def is_evictable(self, block_hash: bytes) -> bool:
        return block_hash in self._evictable

    def is_pinned(self, block_hash: bytes) -> bool:
        return block_hash in self._pins

    @property
    def num_pinned(self) -> int:
        """Pinned blocks, idle or in use (what the budget counts)."""
        return len(self._pins)

    def evictable_hashes(self) -> list[bytes]:
        return list(self._evictable)

    def on_commit(self, block_hash: bytes, parent_hash: bytes | None, block_id: int) -> None:
        parent = parent_hash or b""
        ref_count = self.pool.blocks[block_id].ref_count
        self._mirror[block_hash] = MirroredBlock(parent, block_id, ref_count)
        if ref_count == 0:
            self._evictable[block_hash] = None
        if self._recording:
            self._pending.append(PendingOp(Commit(block_hash, parent, block_id)))
            # The index starts a commit at refcount 1: match the pool's count, one acquire per
            # extra user (a chain never repeats a hash).
            for _ in range(ref_count - 1):
                self._pending.append(
                    PendingOp(Acquire([block_hash], AcquireKind.FORK), local_hits=1))
            if ref_count == 0:
                self._record_release(block_hash)

    def on_acquire(self, block_hash: bytes, was_evictable: bool) -> None:
        self._mirror[block_hash].ref_count += 1
        if was_evictable:
            self._evictable.pop(block_hash, None)
            self._idle_pinned.pop(block_hash, None)
        if self._covered_acquires:
            self._covered_acquires -= 1
        elif self._recording:
            # A fork sharing a block: one more user in the index too, but no admission (only
            # admissions count as hits in the index's history).
            self._pending.append(PendingOp(Acquire([block_hash], AcquireKind.FORK), local_hits=1))

    def on_release(self, block_hash: bytes, now_evictable: bool) -> None:
        self._mirror[block_hash].ref_count -= 1
        if now_evictable:
            if block_hash in self._pins:
                self._idle_pinned[block_hash] = None
            else:
                self._evictable[block_hash] = None
        if self._recording:
            self._record_release(block_hash)

    def _record_release(self, block_hash: bytes) -> None:
        # Consecutive releases (a sequence's blocks, tail first) share one op.
        last = self._pending[-1].op if self._pending else None
        if isinstance(last, Release) and len(last.hashes) < MAX_HASHES_PER_OP:
            last.hashes.append(block_hash)
        else:
            self._pending.append(PendingOp(Release([block_hash])))

    def pick_victims(self, num_blocks: int) -> list[bytes]:
        """The local LRU's choice: while degraded, or when the index's victims lagged."""
        victims = []
        while self._evictable and len(victims) < num_blocks:
            block_hash = self._evictable.popitem(last=False)[0]
            entry = self._mirror.pop(block_hash)
            victims.append(block_hash)
            if self._recording:
                # The index must drop exactly this entry before the block id is committed
                # again (ops are applied in order, and the commit comes later).
                self._pending.append(PendingOp(Forget(block_hash, entry.block_id)))
                self.counters.forgets_sent += 1
        self.counters.local_evictions += len(victims)
        return victims

    def release_pins(self, num_blocks: int) -> int:
        """Unpin idle pinned blocks until num_blocks are evictable (a lone request needs the
        room): automatic pins first (guesses), then whole explicit pins, least recently pinned
        first (a pin's blocks that another pin covers stay pinned); the index is told."""
        freed = 0
        unpins: list[Unpin] = []
        for block_hash in [h for h in self._idle_pinned if h in self._auto_pins]:
            if freed >= num_blocks:
                break
            self._unpin_locally(block_hash)
            unpins.append(Unpin([block_hash], automatic_only=True))  # no explicit pin of that name
            freed += 1
        while freed < num_blocks and self._idle_pinned:
            name = self._records.oldest()
            if name is None:
                break
            for block_hash in self._records.unpin(name):
                if block_hash in self._pins:
                    freed += block_hash in self._idle_pinned
                    self._unpin_locally(block_hash)
            unpins.append(Unpin([name]))  # the index drops the pin of that name
        if unpins and self._recording:
            self._pending += [PendingOp(op) for op in unpins]
            self._send_pending()
        self.counters.pins_released += freed
        return freed

    def on_prefix_query(self, chain: list[bytes], num_hit_blocks: int) -> None:
        self._covered_acquires = num_hit_blocks
        if self._recording and chain:
            self._pending.append(PendingOp(Acquire(list(chain)), local_hits=num_hit_blocks))

    def begin_step(self) -> None:
        """Apply the victims the index chose (only those still cached in the same block) and
        drop pins whose TTL ran out."""
        self._apply_victims()
        self.lapse_pins()

    def lapse_pins(self, now: float | None = None) -> bool:
        """Drops the pins whose TTL ran out by `now` (the index lapses them on its own, and
        tells us only in an Apply's reply, which an idle engine does not send)."""
        now = time.monotonic() if now is None else now
        lapsed = False
        for block_hash in self._records.expire(now):  # whole pins lapse: what they alone held
            if block_hash in self._pins and block_hash not in self._auto_pins:
                self._unpin_locally(block_hash)
                lapsed = True
        if now >= self._no_block_lapses_before:
            for block_hash in [h for h, expiry in self._pins.items() if expiry <= now]:
                self._unpin_locally(block_hash)
                lapsed = True
            self._no_block_lapses_before = min(self._pins.values(), default=math.inf)
        return lapsed

    def _apply_victims(self) -> None:
        victims, self._victims = self._victims, []
        for victim in victims:
            entry = self._mirror.get(victim.hash)
            if entry is None or entry.block_id != victim.block_id:
                self.counters.mismatches += 1
                continue
            del self._mirror[victim.hash]
            self._evictable.pop(victim.hash, None)
            self._idle_pinned.pop(victim.hash, None)
            self._pins.pop(victim.hash, None)
            # A block in use stays with its users, privately: the index forgot it.
            self.pool.uncache(victim.hash)
            self.counters.index_victims_applied += 1

    def set_pin_budget(self, blocks: int) -> None:
        """The engine's budget moved: the index's automatic pins follow it (shrinking it
        unpins some; the pin changes of that Apply unpin them here)."""
        self.pin_budget = blocks
        if self._recording:
            self._pending.append(PendingOp(SetPinBudget(blocks)))

    def end_step(self) -> None:
        if self._recording:
            self._ask_for_victims()
        self._send_pending()

    def _send_pending(self) -> None:
        if self._pending and self._recording:
            if self.outbox.qsize() >= self.max_backlog_batches:
                self._drop_backlog()
                return
            self.outbox.put(OpBatch(self.generation, self._pending))
            self._pending = []
            self.wake()
        elif self.needs_resync:
            self.wake()

    def _ask_for_victims(self) -> None:
        free_now = self.pool.num_free_blocks - len(self._evictable)
        coming = self._victims_in_flight + len(self._victims)
        if free_now + coming >= self.low_water.low:
            return
        k = min(self.low_water.high - free_now - coming, len(self._evictable) - coming)
        if k > 0:
            self._pending.append(PendingOp(Evict(k)))
            self._victims_in_flight += k

    def _drop_backlog(self) -> None:
        """The link has not sent the last max_backlog_batches steps' ops (the index keeps
        refusing them: its Apply rate): the backlog would grow for as long as that lasts. A
        re-sync states the whole mirror in ops bounded by the pool instead, so the queued
        batches (now of an old generation) are dropped unsent."""
        self.counters.backlog_resyncs += 1
        log.warning("prefix index: %d steps of ops unsent; dropping them for a re-sync",
                    self.outbox.qsize())
        self._ask_for_resync()
        self.wake()

    def _ask_for_resync(self) -> None:
        self.needs_resync = True
        self.stop_recording()

    # ---- pins ---------------------------------------------------------------------------------
    def pin_locally(self, chain: list[bytes], ttl_s: float, count: int | None = None) -> int:
        """The pin the index made: named by chain's last hash, covering the cached prefix of
        its first `count` blocks (all: None), never evicted locally; the blocks it covers.
        Pinned again, the pin covers what it covers now and keeps the later expiry."""
        expiry = time.monotonic() + ttl_s if ttl_s > 0 else math.inf
        held = []
        for block_hash in chain[:count]:
            if block_hash not in self._mirror:
                break
            held.append(block_hash)
        if not held:
            return 0
        _, uncovered = self._records.pin(chain[-1], held, expiry)
        for block_hash in held:
            self._mark_pinned(block_hash, expiry)
        for block_hash in uncovered:
            if block_hash in self._pins and block_hash not in self._auto_pins:
                self._unpin_locally(block_hash)
        return len(held)

    def _mark_pinned(self, block_hash: bytes, expiry: float) -> None:
        self._pins[block_hash] = expiry = max(expiry, self._pins.get(block_hash, expiry))
        self._no_block_lapses_before = min(self._no_block_lapses_before, expiry)
        if block_hash in self._evictable:
            del self._evictable[block_hash]
            self._idle_pinned[block_hash] = None

    def unpin_locally(self, chain: list[bytes]) -> int:
        """Drops the pin named by chain's last hash and the automatic pins among its blocks,
        as the index does; blocks another pin covers stay pinned. How many it unpinned."""
        if not chain:
            return 0
        count = 0
        for block_hash in self._records.unpin(chain[-1]):
            if block_hash in self._pins and block_hash not in self._auto_pins:
                count += self._unpin_locally(block_hash)
        for block_hash in chain:
            if block_hash in self._auto_pins:
                count += self._unpin_locally(block_hash)
        return count

    def _unpin_locally(self, block_hash: bytes) -> bool:
        del self._pins[block_hash]
        self._auto_pins.discard(block_hash)
        if block_hash in self._idle_pinned:
            self._idle_pinned.pop(block_hash, None)
            self._evictable[block_hash] = None
        return True

    # ---- what the link asks for (posted to the engine thread) ---------------------------------
    def stop_recording(self) -> None:
        """The index is unreachable or fenced us: its state is unknown until a re-sync."""
        self._recording = False
        self._pending = []
        self._victims = []  # chosen for a registration that is gone
        self._victims_in_flight = 0
        self.generation += 1  # batches already in the outbox are stale now

    def resync_ops(self) -> OpBatch:
        """The mirror as ops for a fresh registration (parents first, refcounts as they are,
        idle blocks released in LRU order so the index's LRU matches ours); recording resumes
        from here under a new generation, so nothing is lost between this snapshot and the
        next step's ops."""
        self.stop_recording()
        # Register set the index's default budget. The pins re-stated below were each made
        # within the budget of their time, which may be larger than ours now: a shrink never
        # drops an explicit pin, so neither may a re-sync. The budget is the whole pool while
        # they are re-stated, and ours at the end (which unpins only automatic pins past it).
        opened = self.pin_budget is not None
        ops = [PendingOp(SetPinBudget(self.pool.num_blocks))] if opened else []
        ops += [
            PendingOp(Commit(h, self._mirror[h].parent, self._mirror[h].block_id))
            for h in self._parents_first()
        ]
        idle = [h for h in self._mirror if self._mirror[h].ref_count == 0]
        idle_order = list(self._evictable) + [h for h in idle if h in self._idle_pinned]
        for i in range(0, len(idle_order), MAX_HASHES_PER_OP):
            ops.append(PendingOp(Release(idle_order[i : i + MAX_HASHES_PER_OP])))
        # Refcounts above 1: acquire level by level (a chain never repeats a hash, and every
        # hash of it is held, so each gets +1).
        level = 2
        while shared := [h for h, e in self._mirror.items() if e.ref_count >= level]:
            for i in range(0, len(shared), MAX_HASHES_PER_OP):
                chunk = shared[i : i + MAX_HASHES_PER_OP]
                ops.append(PendingOp(Acquire(chunk, AcquireKind.RESYNC), local_hits=len(chunk)))
            level += 1
        # Pins do not survive a registration: send them again, explicit ones with what is left
        # of their TTL, then the automatic ones as automatic. The index re-decides those from
        # its hit history, or takes our word when it has none (Redis lost it with the pins);
        # any it does not pin again are unpinned here when the results come back.
        # Only the pins still alive: one whose TTL ran out since the last step (the mirror
        # lapses pins at begin_step; an idle engine takes none) is dropped here, not re-stated
        # with a fresh millisecond that the index lapses at its next heartbeat, unreported
        # until an Apply, while this mirror kept it until the next step.
        now = time.monotonic()
        self.lapse_pins(now)
        names = set()
        for name, hashes, expiry in self._records.items():  # whole, under their names
            ttl = 0.0 if math.isinf(expiry) else max(0.001, expiry - now)
            chain = list(hashes) if hashes[-1] == name else [*hashes, name]
            ops.append(PendingOp(Pin(chain, ttl)))
            # The index covers the held prefix of that chain, its name too once it is held
            # (committed since the pin was made): the mirror's pin says the same.
            self.pin_locally(chain, ttl)
            names.add(name)
        for h, expiry in self._pins.items():  # pinned by the index alone: block by block
            # (Never under a whole pin's name: that Pin would replace the whole pin.)
            if h not in self._auto_pins and h not in self._records and h not in names:
                ttl = 0.0 if math.isinf(expiry) else max(0.001, expiry - now)
                ops.append(PendingOp(Pin([h], ttl)))
        ops += [PendingOp(Pin([h], automatic=True)) for h in self._pins if h in self._auto_pins]
        if opened:
            ops.append(PendingOp(SetPinBudget(self.pin_budget)))
        self._recording = True
        self.needs_resync = False
        self._covered_acquires = 0
        return OpBatch(self.generation, ops)

    def _parents_first(self) -> list[bytes]:
        depth: dict[bytes, int] = {}
        for block_hash in self._mirror:
            chain = []
            h = block_hash
            while h in self._mirror and h not in depth:
                chain.append(h)
                h = self._mirror[h].parent
            base = depth.get(h, -1)
            for offset, node in enumerate(reversed(chain), start=1):
                depth[node] = base + offset
        return sorted(self._mirror, key=depth.__getitem__)

    def on_results(self, batch: OpBatch, results: list[OpResult],
                   pin_changes: list[PinChange] = ()) -> None:
        """Reconcile one Apply's results and pin changes with the mirror (an older
        registration's are dropped: a re-sync replaced everything they could correct)."""
        if batch.generation != self.generation:
            return
        for pending, result in zip(batch.ops, results, strict=True):
            self._reconcile(pending, result)
        self.on_pin_changes(pin_changes)
        # Between two steps (this runs as an engine command): the victims can go now, so the
        # next step's allocations find them free instead of evicting on their own.
        self._apply_victims()
        self._send_pending()

    def on_pin_changes(self, changes: list[PinChange]) -> None:
        """The index pinned or unpinned these hashes: a pinned block leaves the evictable set
        (never evicted locally, never counted free) while we still hold that block."""
        for change in changes:
            entry = self._mirror.get(change.hash)
            if change.state == PinState.NONE:
                if change.hash in self._pins:
                    self._unpin_locally(change.hash)
                continue
            if entry is None or entry.block_id != change.block_id:
                continue  # we no longer hold that block: nothing to keep
            if change.hash not in self._pins:
                self._mark_pinned(change.hash, math.inf)  # the index unpins it: a change
                self.counters.index_pins += 1
            if change.state == PinState.AUTOMATIC:
                # Until the index unpins it, whatever explicit pin with a TTL also held it: at
                # that one's lapse the mirror dropped the block the index still pinned.
                self._mark_pinned(change.hash, math.inf)
                self._auto_pins.add(change.hash)
            else:
                self._auto_pins.discard(change.hash)

    def _reconcile(self, pending: PendingOp, result: OpResult) -> None:
        op = pending.op
        if isinstance(op, Evict):
            self._victims_in_flight = max(0, self._victims_in_flight - op.k)
            if self._recording:
                self._victims.extend(result.evicted)
        elif isinstance(op, Acquire):
            held = len(result.block_ids)
            if held > pending.local_hits and self._recording:
                # The index held more than the engine could verify: give the extra back.
                self._pending.append(PendingOp(Release(op.chain[pending.local_hits : held])))
            if held != pending.local_hits:
                self.counters.mismatches += 1
        elif isinstance(op, Release):
            if not result.ok:
                self.counters.mismatches += 1
                rest = op.hashes[result.count + 1 :]
                if rest and self._recording:
                    self._pending.append(PendingOp(Release(rest)))
        elif isinstance(op, Commit):
            if result.status == OpStatus.NOT_HELD and self._recording:
                # Its parent was evicted meanwhile: the block is unreachable, forget it here.
                self._victims.append(EvictedBlock(op.hash, op.block_id))
            elif result.status in (OpStatus.HASH_EXISTS, OpStatus.BLOCK_IN_USE):
                self.counters.mismatches += 1
                self._ask_for_resync()
        elif isinstance(op, Forget) and not result.ok:
            self.counters.mismatches += 1  # the index had dropped or moved it already
        elif isinstance(op, Pin) and op.automatic and (
                not result.ok or result.count < len(op.chain)):
            # Not pinned again (a re-stated automatic pin the index no longer finds hot): not
            # pinned here either.
            for block_hash in op.chain[result.count if result.ok else 0 :]:
                if block_hash in self._pins:
                    self._unpin_locally(block_hash)
        elif isinstance(op, Pin) and not result.ok:
            # A re-stated explicit pin refused (the pin budget): that pin is gone here too.
            for block_hash in [*self._records.unpin(op.chain[-1]), op.chain[-1]]:
                if (block_hash in self._pins and block_hash not in self._records
                        and block_hash not in self._auto_pins):
                    self._unpin_locally(block_hash)
