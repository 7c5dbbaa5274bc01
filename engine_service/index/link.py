"""The engine's connection to the prefix index: one background thread running an asyncio loop.

It registers, sends the op batches each step recorded (engine_service/index/policy.py) as
batched Applies, heartbeats when idle, and never lets a failure reach the engine: any error flips
`degraded` (the engine keeps serving on its local LRU), then it re-registers (new epoch) and
re-syncs the mirror on its own until the index answers again: the first retry after
`retry_interval_s`, later ones further apart (RetryBackoff: up to RETRY_MAX_S, jittered, so
the engines of one index do not retry in step), back to `retry_interval_s` once a call succeeds.

An Apply the index refuses with RESOURCE_EXHAUSTED (past this engine's --apply-ops-per-s, or
Redis full) applied nothing and is no outage: the link keeps those ops, waits (the delay the
index names, else a bounded exponential back-off, with jitter either way; heartbeating so the
lease holds) and sends the same Apply again, and the ops that steps record meanwhile after it.
A re-registration would not help: its re-sync is more ops than the ones refused.

The link never touches the policy's state: it reads the policy's outbox, and everything that
changes the mirror (results, the re-sync snapshot, pins) is posted to the engine thread's command
queue and runs there between two steps.

    link = connect_prefix_index(engine, "127.0.0.1:50061", "engine-0")  # None for "none"
    ...
    link.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import random
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from engine_service.index.policy import (
    DEFAULT_MAX_BACKLOG_BATCHES,
    IndexPolicy,
    LowWaterMark,
    OpBatch,
    PendingOp,
)
from prefix_index.api.client import PrefixIndexClient, PrefixIndexClientError
from prefix_index.api.ops import Acquire, ApplyResult, OpStatus, Pin, Release, Unpin
from trust.credentials import TlsMaterial

if TYPE_CHECKING:
    from engine_service.core.engine import LLMEngine

log = logging.getLogger(__name__)

ENGINE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Waits after an Apply refused with RESOURCE_EXHAUSTED that named no delay (Redis full): the
# first, doubled after each refusal in a row, up to the most.
REFUSED_BACKOFF_S = 0.1
REFUSED_BACKOFF_MAX_S = 5.0
REFUSED_JITTER = 0.2  # each wait is stretched by up to this share, so engines do not align
REFUSED_LOG_INTERVAL_S = 30.0  # the most often refused Applies are logged (RefusedApplies)
# The longest wait between two attempts to register while degraded: what an index that comes
# back may wait for an engine, at most, besides the call itself.
RETRY_MAX_S = 5.0
TARGET = re.compile(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}")


class IndexUnavailableError(ConnectionError):
    """The prefix index cannot be reached now (the engine runs degraded on its local LRU)."""


class StaleBatchError(Exception):
    """The ops being sent belong to a generation the policy has left (it dropped its backlog
    for a re-sync while the index refused them): they are not sent."""


class PinRefusedError(Exception):
    """The index answered and refused the pin: `reason` is "invalid" (a bad request) or
    "budget" (the pin budget is full); the link itself is fine."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):
        # Crosses from the engine core's process to the front pickled: keep the reason.
        return type(self), (self.reason, str(self))


@dataclass(slots=True)
class IndexLinkOptions:
    lease_s: float = 30.0  # the index drops our entries if we are silent this long
    rpc_timeout_s: float = 1.0  # deadline of every call: a hung index degrades us fast
    # The first wait before registering again while degraded; later ones grow (jittered)
    # to RETRY_MAX_S, and start over from this once the index answers.
    retry_interval_s: float = 0.5
    max_ops_per_apply: int = 1024  # the index allows 4096
    max_hashes_per_apply: int = 16384  # the index allows 65536
    low_water: LowWaterMark | None = None  # default: LowWaterMark.for_pool (one step's blocks)
    # Where this engine serves Generation ("host:port"), registered so routers find it; ""
    # registers no address (the engine is then not a routable replica).
    serving_address: str = ""
    # What this process's ModelInfo answers with. With serving_address, it lets the index
    # take our engine id's lease over from a crashed process of ours at once (it asks that
    # address who answers) instead of refusing us until the dead one's lease lapses.
    instance_id: str = ""
    # Register's deadline: the index may first ask a holder of our id at its address (up to
    # its --holder-probe-timeout-s, 1 s by default).
    register_timeout_s: float = 3.0
    # Mutual TLS to the index, presenting this engine's certificate; None: plain text.
    tls: TlsMaterial | None = None
    # Steps of ops held unsent while the index refuses them (its Apply rate) before they are
    # dropped for a re-sync (IndexPolicy._drop_backlog): the backlog's memory stays bounded.
    max_backlog_batches: int = DEFAULT_MAX_BACKLOG_BATCHES


@dataclass(slots=True)
class IndexLinkStats:
    """Counters for metrics (monotonic totals) and the link's state."""

    degraded: bool = True
    epoch: int = 0
    registrations: int = 0  # first one included: every later one re-synced the mirror
    applies: int = 0
    ops_sent: int = 0
    rpc_errors: int = 0
    apply_backoffs: int = 0  # Applies refused with RESOURCE_EXHAUSTED, kept and sent again
    rpc_seconds: dict[str, float] = field(default_factory=dict)  # method -> total latency
    rpc_calls: dict[str, int] = field(default_factory=dict)  # method -> calls


class RefusedApplies:
    """The link's log of Applies the index refused (RESOURCE_EXHAUSTED): one WARNING when
    refusals start, then at most one line every `interval_s`: a WARNING with the count refused
    meanwhile while refusals go on, an INFO with that count once an Apply is taken again. Past
    its --apply-ops-per-s the index refuses an Apply per back-off for as long as a burst lasts:
    a line each buried the log (each is counted in apply_backoffs already). Under a rate limit
    Applies are refused and taken by turns: a run of refusals ends at an Apply taken once the
    interval since its last line has passed (refusals in between carry it on), so no pair of
    lines is logged per refusal (as the router's RefusalLog)."""

    def __init__(self, target: str, interval_s: float = REFUSED_LOG_INTERVAL_S) -> None:
        self.target = target
        self.interval_s = interval_s
        self.unlogged = 0  # refused since the last line
        self._refusing = False  # a run of refusals was logged and has not ended
        self._logged_at = 0.0

    def refused(self, num_ops: int, details: str, delay_s: float) -> None:
        now = time.monotonic()
        if self._refusing and now - self._logged_at < self.interval_s:
            self.unlogged += 1
            return
        meanwhile = (f" ({self.unlogged} more refused since the last such line)"
                     if self.unlogged else "")
        log.warning("prefix index %s: Apply of %d ops refused (%s); keeping them, backing off "
                    "%.2fs%s", self.target, num_ops, details, delay_s, meanwhile)
        self._refusing, self._logged_at, self.unlogged = True, now, 0

    def taken(self) -> None:
        """An Apply was taken: a run of refusals, if any, has ended, said once the interval
        since its last line has passed."""
        if not self._refusing or time.monotonic() - self._logged_at < self.interval_s:
            return
        meanwhile = (f"; {self.unlogged} more refused since the last such line"
                     if self.unlogged else "")
        log.info("prefix index %s: Applies taken again%s", self.target, meanwhile)
        self._refusing, self.unlogged = False, 0


class RetryBackoff:
    """Waits between attempts while degraded: decorrelated jitter (each wait drawn between
    `base_s` and three times the previous one, at most `max_s`), back to `base_s` after a
    success. Engines that lost the index together spread their retries instead of all
    registering every `base_s`."""

    def __init__(self, base_s: float, max_s: float = RETRY_MAX_S,
                 rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.max_s = max(base_s, max_s)
        self._rng = rng or random.Random()
        self.last_s = 0.0  # the latest wait; 0: none since the last success

    def next_s(self) -> float:
        if not self.last_s:
            self.last_s = self.base_s
        else:
            self.last_s = min(self.max_s, self._rng.uniform(self.base_s, 3 * self.last_s))
        return self.last_s

    def reset(self) -> None:
        self.last_s = 0.0


def _check_target(target: str) -> None:
    if not TARGET.fullmatch(target):
        raise ValueError(f"prefix index target must be HOST:PORT or 'none', got {target!r}")


def connect_prefix_index(
    engine: LLMEngine,
    target: str | None,
    engine_id: str,
    options: IndexLinkOptions | None = None,
    on_rpc: Callable[[str, float], None] | None = None,
    start: bool = True,
) -> PrefixIndexLink | None:
    """Steer `engine`'s prefix cache by the index at `target` (HOST:PORT); None or "none" keeps
    the local LRU and returns None. Call before the engine has cached anything. `on_rpc(method,
    seconds)` observes each call's latency (for a metrics histogram). `start=False`: the caller
    calls `link.start()` later (once it knows its serving address); until then the engine runs
    on its local LRU and the first registration re-syncs what it cached."""
    if target is None or target == "none":
        return None
    _check_target(target)
    if not ENGINE_ID.fullmatch(engine_id):
        raise ValueError(f"engine_id must match [A-Za-z0-9._:-]{{1,128}}, got {engine_id!r}")
    pool = engine.pool
    if pool.num_cached_blocks:
        raise ValueError(
            f"connect the prefix index before serving: the pool already caches "
            f"{pool.num_cached_blocks} blocks"
        )
    options = options or IndexLinkOptions()
    config = engine.config
    low_water = options.low_water or LowWaterMark.for_pool(
        pool.num_blocks, config.max_num_batched_tokens // config.block_size
    )
    policy = IndexPolicy(pool, low_water, options.max_backlog_batches)
    pool.policy = policy
    identity = engine.hasher.identity  # what seeds the engine's block-hash chain
    link = PrefixIndexLink(
        policy, target, engine_id, identity, engine.config.block_size, pool.num_blocks,
        options, on_rpc, post=engine.post,
    )
    return link.start() if start else link


class PrefixIndexLink:
    def __init__(
        self,
        policy: IndexPolicy,
        target: str,
        engine_id: str,
        model_identity: str,
        block_size: int,
        num_blocks: int,
        options: IndexLinkOptions,
        on_rpc: Callable[[str, float], None] | None = None,
        post: Callable[[Callable], None] | None = None,
    ) -> None:
        self.policy = policy
        # How the link runs something on the engine thread (LLMEngine.post).
        self._post = post or (lambda command: command(None))
        self.target = target
        self.engine_id = engine_id
        self.model_identity = model_identity
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.options = options
        self._on_rpc = on_rpc
        self._stats = IndexLinkStats()
        self.last_error = "not registered yet"
        self._degraded_since = time.monotonic()
        self._registered = False
        # The first round (a registration, or an attempt that failed) has ended: health says
        # "starting" until then, and the front waits for it before it says SERVING.
        self._first_round_ended = False
        # This process's token at the index: a second live process with our engine id is
        # refused (ALREADY_EXISTS) instead of each wiping the other's state.
        self.nonce = secrets.token_hex(12)
        self.refused = False  # another live process holds our engine id
        self._seq = 0  # of the last Apply the index acknowledged, since our registration
        self._generation: int | None = None  # the policy generation being sent; None: none
        self._channel_failed = False
        self._closing = False
        self._last_rpc = 0.0
        self._refusals = RefusedApplies(target)
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()  # one Apply at a time keeps the ops in order
        self._client: PrefixIndexClient | None = None
        self._jitter = random.Random()
        self.retry = RetryBackoff(options.retry_interval_s, rng=self._jitter)
        # (The coroutine is made on the thread: one made here and never started, a link
        # connected with start=False and dropped, warned that it was never awaited.)
        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(self._run()),
            name=f"prefix-index-link-{engine_id}", daemon=True,
        )

    # ---- state (any thread: plain attribute reads) --------------------------------------------
    @property
    def degraded(self) -> bool:
        return self._stats.degraded

    @property
    def epoch(self) -> int:
        return self._stats.epoch

    def stats(self) -> IndexLinkStats:
        s = self._stats
        return IndexLinkStats(
            s.degraded, s.epoch, s.registrations, s.applies, s.ops_sent, s.rpc_errors,
            s.apply_backoffs, dict(s.rpc_seconds), dict(s.rpc_calls),
        )

    def health_details(self) -> dict[str, str]:
        s = self._stats
        mirror = self.policy.counters
        details = {
            "index": self.target,
            # "refused": another live process holds our engine id (we do not fight it).
            "state": ("refused" if self.refused else "starting" if not self._first_round_ended
                      else "degraded" if s.degraded else "ok"),
            "epoch": str(s.epoch),
            "registrations": str(s.registrations),
            "local_evictions": str(mirror.local_evictions),
            "index_victims_applied": str(mirror.index_victims_applied),
            "mismatches": str(mirror.mismatches),
            "forgets_sent": str(mirror.forgets_sent),
            "index_pins": str(mirror.index_pins),
            "apply_backoffs": str(s.apply_backoffs),
            "backlog_resyncs": str(mirror.backlog_resyncs),
        }
        if s.degraded:
            details["degraded_for_s"] = f"{time.monotonic() - self._degraded_since:.1f}"
            details["last_error"] = self.last_error
            # The latest wait between two attempts to register (RetryBackoff).
            details["retry_wait_s"] = f"{self.retry.last_s:.2f}"
        return details

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> PrefixIndexLink:
        self.policy.wake = self._wake_soon
        self._thread.start()
        return self

    def _wake_soon(self) -> None:
        if self._closing:
            return
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:
            pass  # closed between the check and the call: nothing is listening any more

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is pending (best effort), then stop the thread."""
        if self._closing:
            return
        self._closing = True
        self.policy.wake = lambda: None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._wake.set)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
        # The policy stays in the engine as a plain local LRU: nothing is recorded any more.
        self._post(lambda _engine: self.policy.stop_recording())
        self._stats.degraded = True
        self.last_error = "closed"
        self._first_round_ended = True  # no round will come: not "starting" for good

    # ---- the loop (link thread) ---------------------------------------------------------------
    async def _run(self) -> None:
        try:
            self._client = PrefixIndexClient(self.target, self.options.rpc_timeout_s,
                                             self.options.tls)
        except Exception as error:  # noqa: BLE001 - the engine serves on its local LRU
            log.error("prefix index %s: cannot make a client, serving on the local LRU for "
                      "good: %s", self.target, error)
            self._on_failure(error)
            return
        heartbeat_every = max(0.05, self.options.lease_s / 3)
        try:
            while not self._closing:
                self._wake.clear()
                try:
                    if not self._registered or self.policy.needs_resync:
                        await self._register_and_resync()
                    await self._flush()
                    if time.monotonic() - self._last_rpc > heartbeat_every:
                        await self._timed("Heartbeat", self._client.heartbeat())
                except Exception as error:  # noqa: BLE001 - the engine must never see it
                    self._on_failure(error)
                    wait_s = self.retry.next_s()
                    # Refused: the other process's lease must lapse first; no point hammering.
                    await self._sleep(max(wait_s, self.options.lease_s / 3)
                                      if self.refused else wait_s)
                    continue
                self.retry.reset()  # (every call of this round succeeded)
                try:
                    await asyncio.wait_for(self._wake.wait(), heartbeat_every)
                except TimeoutError:
                    pass
            if self._registered:
                try:
                    await self._flush()
                except Exception as error:  # noqa: BLE001 - shutting down anyway
                    log.info("prefix index: final flush failed: %s", error)
        finally:
            await self._client.close()

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._closing_wait(), seconds)
        except TimeoutError:
            pass

    async def _closing_wait(self) -> None:
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()

    def _on_failure(self, error: Exception) -> None:
        self._first_round_ended = True
        self._post(lambda _engine: self.policy.stop_recording())
        self._generation = None
        self._registered = False
        self._channel_failed = True
        self._stats.rpc_errors += 1
        self.last_error = str(error)
        refused = (isinstance(error, PrefixIndexClientError)
                   and error.code == grpc.StatusCode.ALREADY_EXISTS)
        if refused and not self.refused:
            log.error("prefix index %s: engine id %r is held by another live process; serving "
                      "on the local LRU and retrying: %s", self.target, self.engine_id,
                      error.details)
        self.refused = refused
        if not self._stats.degraded:
            self._stats.degraded = True
            self._degraded_since = time.monotonic()
            log.warning("prefix index %s: degraded, serving on the local LRU: %s",
                        self.target, error)

    async def _on_engine(self, fn: Callable[[], object]) -> object:
        """fn() run on the engine thread between two steps; its result. A slow step is no index
        outage: this waits as long as the engine takes, unless the link closes (as it does when
        the engine thread dies). The command never raises on the engine thread."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command(_engine: object) -> None:
            if not done.set_running_or_notify_cancel():
                return  # the link gave up waiting (closing): nothing to hand back
            try:
                done.set_result(fn())
            except Exception as error:  # noqa: BLE001 - handed to the awaiting link
                done.set_exception(error)

        self._post(command)
        waiting = asyncio.wrap_future(done)
        while not self._closing:
            finished, _ = await asyncio.wait([waiting], timeout=0.5)
            if finished:
                return waiting.result()
        waiting.cancel()
        raise IndexUnavailableError(f"prefix index {self.target}: the link is closed")

    async def _register_and_resync(self) -> None:
        assert self._client is not None
        self._generation = None
        if self._channel_failed:
            # A fresh channel connects at once; the old one may sit in its reconnect backoff.
            self._channel_failed = False
            await self._client.close()
            self._client = PrefixIndexClient(self.target, self.options.rpc_timeout_s,
                                             self.options.tls)
        self._registered = False
        epoch = await self._timed("Register", self._client.register(
            self.engine_id, self.model_identity, self.block_size, self.num_blocks,
            self.options.lease_s, nonce=self.nonce,
            serving_address=self.options.serving_address,
            instance_id=self.options.instance_id,
            timeout_s=max(self.options.register_timeout_s, self.options.rpc_timeout_s)))
        self.refused = False
        self._seq = 0
        self._stats.epoch = epoch
        self._stats.registrations += 1
        async with self._send_lock:
            batch: OpBatch = await self._on_engine(self.policy.resync_ops)
            self._generation = batch.generation
            try:
                await self._send(batch)
            except StaleBatchError:
                return  # refused past the backlog's bound: the loop re-registers
        self._registered = True
        if self._stats.degraded:
            log.info("prefix index %s: registered, epoch %d, mirror re-synced",
                     self.target, epoch)
        self._stats.degraded = False
        self._first_round_ended = True  # (after degraded: health never reads the two apart)

    async def _flush(self) -> None:
        async with self._send_lock:
            while True:
                try:
                    batch = self.policy.outbox.get_nowait()
                except queue.Empty:
                    return
                if batch.generation == self._generation:
                    try:
                        await self._send(batch)  # others belong to a registration that is gone
                    except StaleBatchError:
                        return  # the policy asked for a re-sync: the loop registers anew

    async def _send(self, batch: OpBatch) -> None:
        assert self._client is not None
        for chunk in self._chunks(batch.ops):
            reply = await self._apply([p.op for p in chunk], batch.generation)
            self._stats.ops_sent += len(chunk)
            sent = OpBatch(batch.generation, chunk)
            self._post(lambda _engine, sent=sent, reply=reply:
                       self.policy.on_results(sent, reply.results, reply.pin_changes))

    async def _apply(self, ops: list, generation: int | None = None) -> ApplyResult:
        """One Apply with the next sequence number. A timeout or an unreachable index leaves
        its outcome unknown: it is sent once more with the same number, which the index applies
        at most once; a gap or a replay (ABORTED: the index lost or repeated our writes) fails,
        and the caller re-registers and re-syncs. CANCELLED from the index (its drain's grace
        ran out: a rolling restart) leaves the outcome unknown too, and is sent once more. A
        refusal (RESOURCE_EXHAUSTED: nothing was applied) waits and sends the same Apply
        again, for as long as the index refuses it, unless the policy has dropped the backlog
        meanwhile for a re-sync (its generation moved on): then StaleBatchError, and the ops
        are never sent. Pins (no generation) are sent again until the index takes them."""
        assert self._client is not None
        client = self._client
        seq = self._seq + 1
        retried_unknown = False
        refusals_in_a_row = 0
        while True:
            try:
                reply = await self._timed("Apply", self._client.apply_batch(ops, seq))
                break
            except PrefixIndexClientError as error:
                if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not self._closing:
                    await self._back_off(error, len(ops), refusals_in_a_row, generation)
                    refusals_in_a_row += 1
                    if generation is not None and generation != self.policy.generation:
                        raise StaleBatchError from error
                    continue
                # (A CANCELLED of the link's own, closing or replacing its client, is not the
                # index's: this Apply's seq and epoch died with that client.)
                transient = error.code in (grpc.StatusCode.UNAVAILABLE,
                                           grpc.StatusCode.DEADLINE_EXCEEDED) or (
                    error.code == grpc.StatusCode.CANCELLED and not self._closing
                    and self._client is client)
                if retried_unknown or not transient:
                    raise
                retried_unknown = True
        self._seq = seq
        self._stats.applies += 1
        self._refusals.taken()
        return reply

    async def _back_off(self, error: PrefixIndexClientError, num_ops: int,
                        refusals_in_a_row: int, generation: int | None) -> None:
        """Waits out a refused Apply: the delay the index named, else REFUSED_BACKOFF_S doubled
        per refusal in a row up to REFUSED_BACKOFF_MAX_S; either stretched by a random share up
        to REFUSED_JITTER. Heartbeats meanwhile (the lease must not lapse over a long wait)."""
        if error.retry_after_s is not None:
            delay_s = error.retry_after_s
        else:
            delay_s = min(REFUSED_BACKOFF_MAX_S, REFUSED_BACKOFF_S * 2 ** refusals_in_a_row)
        delay_s *= 1 + self._jitter.uniform(0, REFUSED_JITTER)
        self._stats.apply_backoffs += 1
        self._refusals.refused(num_ops, error.details, delay_s)
        deadline = time.monotonic() + delay_s
        heartbeat_every = max(0.05, self.options.lease_s / 3)
        while (not self._closing and generation in (None, self.policy.generation)
               and (left := deadline - time.monotonic()) > 0):
            if time.monotonic() - self._last_rpc > heartbeat_every:
                await self._timed("Heartbeat", self._client.heartbeat())
            await self._sleep(min(left, heartbeat_every))

    def _chunks(self, pending: list[PendingOp]) -> list[list[PendingOp]]:
        chunks: list[list[PendingOp]] = []
        current: list[PendingOp] = []
        hashes = 0
        for p in pending:
            size = len(p.op.chain) if isinstance(p.op, Acquire | Pin | Unpin) else (
                len(p.op.hashes) if isinstance(p.op, Release) else 1)
            if current and (len(current) >= self.options.max_ops_per_apply
                            or hashes + size > self.options.max_hashes_per_apply):
                chunks.append(current)
                current, hashes = [], 0
            current.append(p)
            hashes += size
        if current:
            chunks.append(current)
        return chunks

    async def _timed(self, method: str, call):
        start = time.monotonic()
        try:
            return await call
        finally:
            seconds = time.monotonic() - start
            self._last_rpc = time.monotonic()
            s = self._stats
            s.rpc_seconds[method] = s.rpc_seconds.get(method, 0.0) + seconds
            s.rpc_calls[method] = s.rpc_calls.get(method, 0) + 1
            if self._on_rpc is not None:
                self._on_rpc(method, seconds)

    # ---- pins (called from another event loop, e.g. the gRPC servicer's) ----------------------
    def pin_prefix_future(self, chain: list[bytes], ttl_s: float, unpin: bool
                          ) -> concurrent.futures.Future:
        """pin_prefix for a caller outside any event loop (the engine core's step loop): a
        future resolved on the link's thread."""
        if self._closing:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(IndexUnavailableError(
                f"prefix index {self.target}: the link is closed"))
            return future
        return asyncio.run_coroutine_threadsafe(self._pin(chain, ttl_s, unpin), self._loop)

    async def pin_prefix(self, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
        """Pins (or unpins) the held prefix of `chain` in the index and the mirror; how many
        blocks it changed. IndexUnavailableError while degraded."""
        if self._closing:
            raise IndexUnavailableError(f"prefix index {self.target}: the link is closed")
        future = asyncio.run_coroutine_threadsafe(self._pin(chain, ttl_s, unpin), self._loop)
        return await asyncio.wrap_future(future)

    async def _pin(self, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
        if not self._registered or self._client is None:
            raise IndexUnavailableError(f"prefix index {self.target}: {self.last_error}")
        op = Unpin(list(chain)) if unpin else Pin(list(chain), ttl_s)
        try:
            await self._flush()  # the chain's commits may still be waiting: send them first
        except Exception as error:  # noqa: BLE001 - the step batches' failure, not the pin's
            self._on_failure(error)
            self._wake.set()
            raise IndexUnavailableError(f"prefix index {self.target}: {error}") from None
        try:
            async with self._send_lock:
                reply = await self._apply([op])
                [result] = reply.results
                if reply.pin_changes:
                    # Not tied to a batch: changes concern blocks, whatever generation.
                    self._post(lambda _engine, c=reply.pin_changes:
                               self.policy.on_pin_changes(c))
        except PrefixIndexClientError as error:
            if error.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise PinRefusedError("invalid", f"the prefix index refused the pin: "
                                                 f"{error.details}") from None
            self._on_failure(error)
            self._wake.set()
            raise IndexUnavailableError(f"prefix index {self.target}: {error}") from None
        if result.status == OpStatus.PIN_BUDGET_EXCEEDED:
            raise PinRefusedError("budget", f"the prefix index refused the pin: {result.detail}")
        if not result.ok:
            return 0  # nothing of the chain is cached here: nothing to pin
        if unpin:
            await self._on_engine(lambda: self.policy.unpin_locally(chain))
        else:
            await self._on_engine(lambda: self.policy.pin_locally(chain, ttl_s, result.count))
        return result.count
