"""The engine replicas behind the router: where each one is, what it serves, how loaded it is.

Each replica's EngineStats is polled every `stats_interval_s`; the router's own counts (requests
it has running there, prompt tokens it expects them to prefill) are exact and immediate: active
requests are the larger of the two views, and queued prefill is the router's own (uncached
tokens) plus what the engine reports past the router's requests (other clients'). A replica is
routable while its last poll succeeded, it is not draining, and it hashes prompts as the router
does (model identity and block size from its ModelInfo).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine_service.core.block_hash import BlockHasher
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from trust.credentials import TlsMaterial, aio_channel
from trust.identity import ENGINE_ROLE

log = logging.getLogger("router.replicas")


@dataclass(slots=True)
class ReportedLoad:
    """What the replica's last EngineStats said."""

    waiting_prefill_tokens: int = 0
    running_seqs: int = 0
    live_requests: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0  # the pool's size (0: not reported yet)


# The router relays a replica's stream only as fast as its client takes it. Without BDP probing
# the replica's stream runs at most HTTP/2's 64 KiB window ahead of that (probing grows the
# window to megabytes on a fast link): a client that stops reading stops the replica's stream
# too, and the engine's bound on unsent output (--max-unsent-tokens) stops the request and
# frees its blocks, instead of the router's transport holding the stream. Token streams are
# small: a 64 KiB window is far more than they need in flight.
REPLICA_CHANNEL_OPTIONS = (("grpc.http2.bdp_probe", 0),)


class Replica:
    """One engine as the router sees it. Changed on the router's event loop only."""

    def __init__(self, address: str, engine_id: str = "",
                 tls: TlsMaterial | None = None) -> None:
        self.address = address
        self.engine_id = engine_id  # from the index, else from ModelInfo
        # TLS: the router's certificate presented, and only a server holding an engine's
        # certificate is talked to (whatever address was registered at the index).
        self.channel = aio_channel(address, tls, ENGINE_ROLE, REPLICA_CHANNEL_OPTIONS)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.info: pb.ModelInfoResponse | None = None
        self.reported = ReportedLoad()
        self.healthy = False
        self.compatible = True
        self.last_error = "not polled yet"
        self.in_flight = 0  # requests this router is running on it
        self.pending_prefill_tokens = 0  # of those, uncached prompt tokens not prefilled yet
        # ... and the whole prompts of those not prefilled yet, as the engine's
        # waiting_prefill_tokens counts them (cached prefix included)
        self.pending_prompt_tokens = 0
        # whole prompts of ours that got their first message, ever; and that count when the
        # EngineStats behind `reported` was asked for (a report asked before still counts them)
        self.prefilled_prompt_tokens = 0
        self.reported_after_prefilled = 0
        # Requests of this router that ended on it, and how many had ended when the EngineStats
        # behind `reported` was asked for: a snapshot taken before one of ours ended still
        # counts that request (its whole prompt as queued prefill, its sequence as live), and
        # would steer the next request away from the replica that just cached its prefix.
        self.num_finished = 0
        self.reported_after_finished = 0
        self.retired = False  # no longer a member (its lease lapsed, or it moved address)
        self.poll_task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.engine_id or self.address

    @property
    def lost(self) -> bool:
        """Gone as far as the router can tell: removed, or down for another reason than a
        drain (a draining replica still finishes what it runs)."""
        return self.retired or (not self.healthy and self.last_error != "draining")

    @property
    def routable(self) -> bool:
        return self.healthy and self.compatible and self.info is not None

    @property
    def reported_is_current(self) -> bool:
        """No request of ours ended since the reported load was asked for."""
        return self.reported_after_finished == self.num_finished

    @property
    def active_requests(self) -> int:
        if not self.reported_is_current:  # until the next poll: our own count
            return self.in_flight
        return max(self.in_flight, self.reported.live_requests)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill work queued there: ours as we know it (the uncached part only), plus what
        the engine reports past our requests (other clients'). The engine counts a waiting
        prompt whole, its cached prefix too, so taking its figure for ours would make the
        replica holding a hot prefix look ~a whole prompt busier per queued request, and send
        that prefix where it must be prefilled again."""
        if not self.reported_is_current:
            return self.pending_prefill_tokens
        ours = self.pending_prompt_tokens + (self.prefilled_prompt_tokens
                                             - self.reported_after_prefilled)
        others = max(0, self.reported.waiting_prefill_tokens - ours)
        return self.pending_prefill_tokens + others

    def mark_down(self, reason: str) -> None:
        """A call failed as if the replica were gone: stop routing to it until a poll succeeds."""
        if self.healthy:
            log.warning("replica %s (%s) is down: %s", self.name, self.address, reason)
        self.healthy = False
        self.last_error = reason

    async def close(self) -> None:
        await self.channel.close()


class ReplicaSet:
    """The replicas, by address, and the block hasher they all agree on."""

    def __init__(self, rpc_timeout_s: float,
                 on_restart: Callable[[Replica], None] | None = None,
                 tls: TlsMaterial | None = None) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self.tls = tls  # None: plain text to every replica
        # Called when a replica answers as another process than before (ModelInfo's
        # instance_id; see _adopt): whatever the old one held, its pool does not.
        self.on_restart = on_restart
        self.replicas: dict[str, Replica] = {}
        self.hasher: BlockHasher | None = None  # from the first replica's ModelInfo
        self._retired: list[Replica] = []  # removed while requests still ran there

    # ---- membership ---------------------------------------------------------------------
    async def set_members(self, wanted: dict[str, str]) -> None:
        """Make the set `wanted` (address -> engine id, "" when unknown), and keep a replica
        that is not in it while it still serves: its registration can vanish while it is up
        (Redis restarted empty, the engine's link to the index down), and dropping it would
        refuse requests it can serve. It goes at the first discovery after a failed poll."""
        for address, engine_id in wanted.items():
            current = self.replicas.get(address)
            if current is None:
                self.replicas[address] = Replica(address, engine_id, self.tls)
                log.info("replica %s at %s added", engine_id or "?", address)
            elif engine_id and current.engine_id != engine_id:
                current.engine_id = engine_id
                # Another engine there: asked who it is before anything is routed to it.
                current.info = None
                current.last_error = f"engine id now {engine_id}: asking its ModelInfo"
        for address in [a for a in self.replicas if a not in wanted]:
            if self.replicas[address].healthy:
                continue
            gone = self.replicas.pop(address)
            gone.retired = True
            log.info("replica %s at %s removed", gone.name, address)
            self._retired.append(gone)
        await self._close_retired()

    async def _close_retired(self) -> None:
        idle = [r for r in self._retired if r.in_flight == 0]
        self._retired = [r for r in self._retired if r.in_flight > 0]
        for replica in idle:
            await replica.close()

    def routable(self) -> list[Replica]:
        """The replicas a request may go to, in a stable order (by name)."""
        return sorted((r for r in self.replicas.values() if r.routable), key=lambda r: r.name)

    def by_engine_id(self) -> dict[str, Replica]:
        return {r.engine_id: r for r in self.replicas.values() if r.engine_id}

    # ---- polling ------------------------------------------------------------------------
    async def poll_all(self, wait: bool = False) -> None:
        """Starts a poll of every replica whose last one is done (one hung replica holds up
        nobody else's refresh); `wait`: until these polls end (start-up)."""
        started = []
        for replica in list(self.replicas.values()):
            task = replica.poll_task
            if task is None or task.done():
                replica.poll_task = asyncio.ensure_future(self.poll(replica))
                started.append(replica.poll_task)
        if wait and started:
            await asyncio.gather(*started)
        await self._close_retired()

    async def poll(self, replica: Replica) -> None:
        try:
            if not replica.healthy or replica.info is None:
                # (Re)appearing: it may be another process now, serving another model.
                info = await replica.stub.ModelInfo(pb.ModelInfoRequest(),
                                                    timeout=self.rpc_timeout_s)
                self._adopt(replica, info)
            finished_before = replica.num_finished
            prefilled_before = replica.prefilled_prompt_tokens
            stats = await replica.stub.EngineStats(pb.EngineStatsRequest(),
                                                   timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as error:
            replica.mark_down(f"{error.code().name}: {error.details()}")
            return
        replica.reported = ReportedLoad(
            stats.num_waiting_prefill_tokens, stats.num_running, stats.num_live_requests,
            stats.kv_cache_usage, stats.num_blocks)
        replica.reported_after_finished = finished_before
        replica.reported_after_prefilled = prefilled_before
        if stats.draining:
            replica.mark_down("draining")
            return
        if not replica.healthy:
            log.info("replica %s (%s) is up", replica.name, replica.address)
        replica.healthy = True
        replica.last_error = ""

    def _adopt(self, replica: Replica, info: pb.ModelInfoResponse) -> None:
        before = replica.info
        # Another process than the one the router knew, as far as it can tell: a new
        # instance_id; an engine that sends none (older ones), back after an outage; or a
        # replica the router has not heard from (added, re-added after its lease lapsed,
        # moved address under the same id, its engine id changed). Told now, not once it is
        # routable: that poll may fail, and the next would take this instance as the known one.
        if before is None or not info.instance_id or before.instance_id != info.instance_id:
            if before is not None:
                log.info("replica %s (%s) restarted", replica.name, replica.address)
            if self.on_restart is not None:
                self.on_restart(replica)
        if info.engine_id and replica.engine_id and info.engine_id != replica.engine_id:
            log.warning("replica at %s says it is %s, registered as %s", replica.address,
                        info.engine_id, replica.engine_id)
        replica.engine_id = replica.engine_id or info.engine_id
        replica.info = info
        if self.hasher is None or not any(
                r is not replica and r.healthy and r.compatible for r in self.replicas.values()):
            # The first replica, or none serving the old model is up any more (every replica
            # restarted with another model, dtype or block size): hash as this one does.
            if self.hasher is None or not self._hashes_as(info):
                self.hasher = BlockHasher.for_identity(info.model_identity, info.block_size)
                log.info("hashing prompts as %s, block size %d (from %s)", info.model_identity,
                         info.block_size, replica.name)
                for other in self.replicas.values():
                    if other is not replica and other.info is not None:
                        other.compatible = self._hashes_as(other.info)
        same = self._hashes_as(info)
        if not same and replica.compatible:
            log.error("replica %s serves %s with block size %d, the others %s with %d: not "
                      "routing to it", replica.name, info.model_identity, info.block_size,
                      self.hasher.identity, self.hasher.block_size)
        replica.compatible = same

    def why_not_routed(self, replica: Replica) -> str:
        """Why a replica that is not routable is not, for the router's health and log."""
        if replica.last_error:
            return replica.last_error
        info, hasher = replica.info, self.hasher
        if not replica.compatible and info is not None and hasher is not None:
            return (f"serves {info.model_identity} with block size {info.block_size}, this "
                    f"router {hasher.identity} with {hasher.block_size}: replicas behind one "
                    f"router must serve one model")
        return "not polled yet"

    def _hashes_as(self, info: pb.ModelInfoResponse) -> bool:
        return (info.model_identity == self.hasher.identity
                and info.block_size == self.hasher.block_size)

    async def close(self) -> None:
        for replica in [*self.replicas.values(), *self._retired]:
            if replica.poll_task is not None:
                replica.poll_task.cancel()
            await replica.close()
        self.replicas.clear()
        self._retired.clear()
