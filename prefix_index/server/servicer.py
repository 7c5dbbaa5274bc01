"""The PrefixIndex gRPC servicer: validate, run one store call, map errors to status codes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from prefix_index.api import wire
from prefix_index.api.retry_after import retry_after_metadata
from prefix_index.server import validate
from prefix_index.server.authorize import PRINCIPAL_SEPARATOR, Caller, Denied, authorize
from prefix_index.server.config import IndexConfig
from prefix_index.server.errors import (
    EngineIdTakenError,
    EngineNotFoundError,
    InvalidRequestError,
    NotOwnerError,
    QuotaExceededError,
    SequenceError,
    StaleEpochError,
)
from prefix_index.server.health import RedisHealth
from prefix_index.server.holder_probe import HolderProber, HolderState
from prefix_index.server.metrics import IndexMetrics
from prefix_index.server.quotas import ApplyRate, WatcherSlots, check_engine_count
from prefix_index.server.residency import MAX_WATCHERS, watch
from prefix_index.server.store import IndexStore
from trust.credentials import TlsMaterial
from trust.identity import peer_certificate_digest

log = logging.getLogger("prefix_index.server.servicer")
T = TypeVar("T")

_REQUEST_ERRORS = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    EngineNotFoundError: grpc.StatusCode.NOT_FOUND,
    StaleEpochError: grpc.StatusCode.FAILED_PRECONDITION,
    EngineIdTakenError: grpc.StatusCode.ALREADY_EXISTS,
    # gRPC's own guidance: ABORTED is for a failed sequencer check; the client must restart
    # from a higher level (register and re-sync), not retry the same call.
    SequenceError: grpc.StatusCode.ABORTED,
    NotOwnerError: grpc.StatusCode.PERMISSION_DENIED,
    QuotaExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
LIVE_ENGINES_AGE_S = 1.0
_OWNERS_CACHED = 4096  # (engine id, epoch) -> the registration's nonce; cleared when full
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# Redis error replies that mean "not now" (loading, failover, busy script), not "wrong".
_REDIS_TRANSIENT = ("LOADING", "BUSY", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN",
                    "MOVED", "ASK")
# A caller refused (its certificate's role, its engine id) is logged once per this long per
# identity: a misconfigured engine retrying every 0.5 s must not fill the log.
REFUSED_LOG_INTERVAL_S = 60.0
REFUSED_IDENTITIES = 1024  # identities remembered for that; the oldest forgotten past it


class RefusedCallers:
    """When each refused caller identity was last logged, for at most `capacity` of them."""

    def __init__(self, interval_s: float = REFUSED_LOG_INTERVAL_S,
                 capacity: int = REFUSED_IDENTITIES) -> None:
        self.interval_s = interval_s
        self.capacity = capacity
        self._logged_at: dict[str, float] = {}  # identity -> monotonic time; oldest first
        self._unlogged: dict[str, int] = {}  # identity -> refusals since its last line

    def should_log(self, identity: str) -> int | None:
        """None: not now (counted); else log, and this many were refused unlogged before."""
        now = time.monotonic()
        logged_at = self._logged_at.get(identity)
        if logged_at is not None and now - logged_at < self.interval_s:
            self._unlogged[identity] = self._unlogged.get(identity, 0) + 1
            return None
        self._logged_at.pop(identity, None)  # (re-inserted last: the newest)
        while len(self._logged_at) >= self.capacity:
            oldest = next(iter(self._logged_at))
            del self._logged_at[oldest]
            self._unlogged.pop(oldest, None)
        self._logged_at[identity] = now
        return self._unlogged.pop(identity, 0)


class PrefixIndexServicer(pb_grpc.PrefixIndexServicer):
    def __init__(self, store: IndexStore, config: IndexConfig, health: RedisHealth,
                 metrics: IndexMetrics, tls: TlsMaterial | None = None) -> None:
        self.store = store
        self.secure = tls is not None  # TLS: callers are authorized by role (authorize.py)
        # A registration's nonce never changes under its epoch: what Heartbeat and Apply
        # check their caller against, read from Redis once per registration.
        self._owners: dict[tuple[str, int], str] = {}
        self.config = config
        self.health = health
        self.metrics = metrics
        quotas, limits = config.quotas, config.limits
        self.watchers = WatcherSlots(quotas, MAX_WATCHERS)
        self.apply_rate = ApplyRate(quotas.apply_ops_per_s, limits.max_ops,
                                    limits.max_num_blocks, quotas.max_engines)
        # New engine ids register one at a time in this process, so two cannot both take the
        # last slot of a quota (other index processes may still overshoot it by their own).
        self._new_engines = asyncio.Lock()
        self.prober = HolderProber(config.holder_probe_timeout_s, tls)
        self.refused_callers = RefusedCallers()

    async def _call(self, method: str, context: grpc.aio.ServicerContext,
                    work: Callable[[], Awaitable[T]], extra_s: float = 0.0) -> T:
        """Runs `work` within the caller's deadline and the Redis timeout (plus `extra_s` for
        work that waits on something else); never hangs past either. Aborts the RPC with the
        status code the error maps to."""
        started = time.perf_counter()
        code, message = grpc.StatusCode.OK, ""
        remaining = context.time_remaining()
        redis_budget = 2 * self.config.redis_timeout_s + extra_s
        budget = redis_budget if remaining is None else min(remaining, redis_budget)
        try:
            async with asyncio.timeout(budget):
                result = await work()
            if self.health.redis_up is False:
                self.health.probe_soon()  # back, perhaps: before the next probe would see it
            return result
        except tuple(_REQUEST_ERRORS) as exc:
            code, message = _REQUEST_ERRORS[type(exc)], str(exc)
            if getattr(exc, "retry_after_s", None) is not None:
                context.set_trailing_metadata(retry_after_metadata(exc.retry_after_s))
        except TimeoutError:
            if remaining is not None and remaining <= redis_budget:
                code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed"
            else:
                code, message = grpc.StatusCode.UNAVAILABLE, "redis did not answer in time"
                await self.health.set_redis_up(False, f"{method}: {message}")
        except _REDIS_DOWN as exc:
            code, message = grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {exc}"
            await self.health.set_redis_up(False, f"{method}: {message}")
        except OutOfMemoryError as exc:
            # maxmemory with noeviction: nothing more fits until entries leave (leases lapse,
            # blocks are evicted) or Redis gets more memory. Not the caller's fault, not a bug.
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            message = (f"redis is full (its maxmemory; writes refused until memory frees or "
                       f"the limit is raised): {exc}")
            log.error("%s: %s", method, message)
        except ResponseError as exc:
            transient = str(exc).startswith(_REDIS_TRANSIENT)
            code = grpc.StatusCode.UNAVAILABLE if transient else grpc.StatusCode.INTERNAL
            message = f"redis refused the call: {exc}"
            log.error("%s: %s", method, message)
        finally:
            self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - started)
            self.metrics.rpcs.labels(method, code.name).inc()
        if code == grpc.StatusCode.UNAVAILABLE:
            self._log_unavailable(method, message)
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    async def _authorize(self, method: str, context, engine_id: str | None = None) -> Caller:
        try:
            return authorize(method, context, self.secure, engine_id)
        except Denied as denied:
            self.metrics.rpcs.labels(method, denied.code.name).inc()
            # Who: its certificate (one engine's connections come from many ports).
            digest = peer_certificate_digest(context)
            before = self.refused_callers.should_log(digest or context.peer())
            if before is not None:
                log.warning("%s refused (%s) to %s%s: %s%s", method, denied.code.name,
                            context.peer(), f" (certificate sha256 {digest[:16]})" if digest
                            else "", denied,
                            f" ({before} more refusals to it in the last "
                            f"{self.refused_callers.interval_s:g}s)" if before else "")
            await context.abort(denied.code, str(denied))
            raise AssertionError("unreachable: context.abort raises") from None

    def _log_unavailable(self, method: str, message: str) -> None:
        """A call refused UNAVAILABLE: a WARNING, unless health knows Redis is down already
        (its logger said so once for the outage): then every engine's and router's retry
        would repeat it, a DEBUG."""
        level = logging.DEBUG if self.health.redis_up is False else logging.WARNING
        log.log(level, "%s: %s", method, message)

    async def _check_owner(self, caller: Caller, engine_id: str, epoch: int) -> None:
        """NotOwnerError when `engine_id` is registered at `epoch` by another principal (a
        stale or unknown epoch is left to the store's own refusal)."""
        if caller.principal is None:
            return
        nonce = self._owners.get((engine_id, epoch))
        if nonce is None:
            nonce = await self.store.registration_nonce(engine_id, epoch)
            if nonce is None:
                return
            if len(self._owners) >= _OWNERS_CACHED:
                self._owners.clear()
            self._owners[(engine_id, epoch)] = nonce
        if not caller.owns(nonce):
            raise NotOwnerError(f"engine_id {engine_id!r} is registered by another engine's "
                                "certificate; an engine acts only on the ids it registered")

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        caller = await self._authorize("Register", context, request.engine_id)
        args = None

        async def work():
            nonlocal args
            args = validate.register(request, self.config.limits, self.config.default_lease_s)
            args = dataclasses.replace(args, nonce=caller.stored_nonce(args.nonce))
            if await self.store.is_live(args.engine_id):
                return await self._register_or_take_over(args)  # adds no engine
            async with self._new_engines:
                # Counted at most LIVE_ENGINES_AGE_S ago (plus the registrations here since):
                # a flood of refused registrations costs no scan each. Leases that lapsed
                # meanwhile free their slots that much later.
                live = await self.store.live_engines(LIVE_ENGINES_AGE_S)
                check_engine_count(args.engine_id, live, caller.principal,
                                   PRINCIPAL_SEPARATOR, self.config.quotas)
                return await self._register_or_take_over(args)

        reg = await self._call("Register", context, work,
                               extra_s=self.config.holder_probe_timeout_s)
        log.info("registered engine %s epoch %d (%d blocks, lease %.1fs, serving at %s)",
                 args.engine_id, reg.epoch, args.num_blocks, reg.lease_s,
                 args.serving_address or "no address")
        return pb.RegisterResponse(epoch=reg.epoch, lease_s=reg.lease_s,
                                   pin_budget=reg.pin_budget)

    async def _register_or_take_over(self, args: validate.RegisterArgs):
        try:
            registration = await self._register(args)
        except EngineIdTakenError as taken:
            registration = await self._take_over(args, taken)
        self.apply_rate.registered(args.engine_id, args.num_blocks, registration.epoch)
        return registration

    async def _register(self, args: validate.RegisterArgs, replaces: str = ""):
        return await self.store.register(args.engine_id, args.model_identity, args.block_size,
                                         args.num_blocks, args.lease_s, args.nonce,
                                         args.serving_address, args.instance_id, replaces)

    async def _take_over(self, args: validate.RegisterArgs, taken: EngineIdTakenError):
        """Registers `args` in place of a lease holder that is gone (crashed, restarted under
        the same id), found by asking its serving address; refuses as before when the holder
        answers, or cannot be asked (it registered no address or instance id, probes are off,
        or it did not answer in time)."""
        if not (taken.holder_address and taken.holder_instance
                and self.config.holder_probe_timeout_s > 0):
            raise taken
        probe = await self.prober.probe(taken.holder_address, taken.holder_instance)
        if probe.state is not HolderState.GONE:
            raise EngineIdTakenError(f"{taken} ({probe.detail})", taken.holder_address,
                                     taken.holder_instance) from None
        # The script takes over only from that same holder: had it re-registered meanwhile,
        # or another newcomer won, this is refused as above.
        registration = await self._register(args, replaces=taken.holder_instance)
        self.metrics.lease_takeovers.inc()
        log.warning("engine %s: lease taken over by instance %s from instance %s, which is "
                    "gone (%s); its blocks are dropped", args.engine_id,
                    args.instance_id or "(none)", taken.holder_instance, probe.detail)
        return registration

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        caller = await self._authorize("Heartbeat", context, request.engine_id)

        async def work():
            validate.engine_id(request.engine_id)
            validate.epoch(request.epoch)
            await self._check_owner(caller, request.engine_id, request.epoch)
            return await self.store.heartbeat(request.engine_id, request.epoch)

        return pb.HeartbeatResponse(lease_s=await self._call("Heartbeat", context, work))

    async def Apply(self, request: pb.ApplyRequest, context) -> pb.ApplyResponse:
        caller = await self._authorize("Apply", context, request.engine_id)
        ops = []

        async def work():
            ops.extend(validate.apply_ops(request, self.config.limits))
            await self._check_owner(caller, request.engine_id, request.epoch)
            if not self.apply_rate.sized_for(request.engine_id, request.epoch):
                # Registered (again) through another index process, or before this one
                # started: its bucket holds its own pool's re-sync, read once per registration
                # (epoch) from Redis, not the largest pool's (8M ops). Not registered (None):
                # the largest pool's, for this epoch too; the store refuses it (NOT_FOUND).
                num_blocks = await self.store.pool_size(request.engine_id)
                self.apply_rate.registered(request.engine_id, num_blocks, request.epoch)
            self.apply_rate.take(request.engine_id, len(ops))
            return await self.store.apply(request.engine_id, request.epoch, ops, request.seq)

        result = await self._call("Apply", context, work)
        if result.replayed:
            self.metrics.replayed_applies.inc()
        else:
            self.metrics.record_ops(ops, result.results)
        return wire.apply_result_to_proto(result)

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        await self._authorize("Lookup", context)

        async def work():
            chain = validate.hashes("chain", request.chain, self.config.limits)
            model = validate.model_identity_filter(request.model_identity)
            return await self.store.lookup(chain, model)

        matches = await self._call("Lookup", context, work)
        return pb.LookupResponse(engines=[wire.match_to_proto(m) for m in matches])

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        await self._authorize("Stats", context)

        async def work():
            if request.engine_id:
                validate.engine_id(request.engine_id)
            return await self.store.stats(request.engine_id)

        stats = await self._call("Stats", context, work)
        return pb.StatsResponse(engines=[wire.stats_to_proto(s) for s in stats])

    async def WatchResidency(self, request: pb.WatchResidencyRequest, context):
        await self._authorize("WatchResidency", context)
        identity = peer_certificate_digest(context) if self.secure else None
        connection = context.peer()
        try:
            self.watchers.acquire(identity, connection)
        except QuotaExceededError as full:
            self.metrics.rpcs.labels("WatchResidency", "RESOURCE_EXHAUSTED").inc()
            log.warning("WatchResidency refused to %s: %s", connection, full)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(full))
        code, message = grpc.StatusCode.OK, ""
        try:
            # Closed here, not when collected: its subscription is a Redis connection.
            async with contextlib.aclosing(watch(self.store)) as changes:
                async for change in changes:
                    if self.health.draining:  # (a heartbeat comes every few seconds at least)
                        code, message = (grpc.StatusCode.UNAVAILABLE,
                                         "the index is shutting down")
                        break
                    yield wire.residency_to_proto(change)
        except _REDIS_DOWN as exc:
            code, message = grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {exc}"
        except ResponseError as exc:
            code, message = grpc.StatusCode.UNAVAILABLE, f"redis refused the call: {exc}"
        finally:
            self.watchers.release(identity, connection)
            if code != grpc.StatusCode.OK:  # (a watcher that left is not counted: no status)
                self.metrics.rpcs.labels("WatchResidency", code.name).inc()
        if code == grpc.StatusCode.UNAVAILABLE:
            self._log_unavailable("WatchResidency", message)
        else:
            log.warning("WatchResidency: %s", message)
        await context.abort(code, message + "; watch again for a new snapshot")
