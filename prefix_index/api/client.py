"""Async client of the prefix index (what the generation engine uses).

    client = PrefixIndexClient("127.0.0.1:50061", timeout_s=1.0)
    epoch = await client.register("engine-0", "smollm2-135m@main/float32", 16, 4096, 30.0,
                                  nonce=uuid.uuid4().hex)
    [hit] = await client.apply([Acquire(chain)])
    # Exactly-once writes and pin state: number the Applies 1, 2, ... after each register.
    reply = await client.apply_batch([Acquire(chain)], seq=1)
    reply.results, reply.pin_changes, reply.replayed
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from prefix_index.api import wire
from prefix_index.api.ops import (
    ApplyResult,
    EngineMatch,
    EngineStats,
    Op,
    OpResult,
    ResidencyChange,
)
from prefix_index.api.retry_after import retry_after_s
from trust.credentials import TlsMaterial, aio_channel
from trust.identity import INDEX_ROLE

# WatchResidency: the index sends a heartbeat after each quiet IDLE_PING_S (2 s; prefix_index/
# server/residency.py), and at most twice that after Redis stops answering it ends the stream;
# silence this long means the index or the path to it is gone without a word.
WATCH_SILENCE_S = 15.0


class PrefixIndexClientError(Exception):
    """Any failed call; `code` is the grpc.StatusCode (UNAVAILABLE: index or Redis down,
    FAILED_PRECONDITION: stale epoch, NOT_FOUND: not registered / lease expired,
    ALREADY_EXISTS: another process holds the engine id's lease, ABORTED: the Apply sequence
    number shows lost or duplicated writes, ...).

    After UNAVAILABLE or DEADLINE_EXCEEDED from apply() the outcome is unknown (a hung Redis
    may still run the script once): with a sequence number, send the same ops with the same
    seq again (applied exactly once); without one, re-register and re-sync.

    RESOURCE_EXHAUSTED from apply(): nothing was applied (the engine's Apply rate, or Redis
    full); `retry_after_s` says when the same Apply would pass the rate (None: not named)."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s


class PrefixIndexClient:
    """One engine's session with the index: register once, then heartbeat / apply with the
    epoch it got. Every call has a deadline of `timeout_s`."""

    def __init__(self, target: str, timeout_s: float = 1.0,
                 tls: TlsMaterial | None = None) -> None:
        """`tls`: mutual TLS, presenting this process's certificate (an engine's or a
        router's) to an index that must present the index's; None: plain text."""
        self.target = target
        self.timeout_s = timeout_s
        self._channel = aio_channel(target, tls, INDEX_ROLE)
        self._stub = pb_grpc.PrefixIndexStub(self._channel)
        self.engine_id = ""
        self.epoch = 0
        self.lease_s = 0.0
        self.pin_budget = 0

    async def _call(self, method: str, request, timeout_s: float | None = None):
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise PrefixIndexClientError(method, exc.code(), exc.details() or "",
                                         retry_after_s(exc.trailing_metadata())) from None

    def _require_registered(self) -> None:
        if not self.epoch:
            raise PrefixIndexClientError("client", grpc.StatusCode.FAILED_PRECONDITION,
                                         "call register() first")

    async def register(self, engine_id: str, model_identity: str, block_size: int,
                       num_blocks: int, lease_s: float = 0.0, nonce: str = "",
                       serving_address: str = "", instance_id: str = "",
                       timeout_s: float | None = None) -> int:
        """`nonce`: a token unique to this process (the same on every re-register); while
        another nonce holds a live lease on engine_id the call fails with ALREADY_EXISTS,
        unless the index finds that holder gone: it asks the holder's `serving_address` (where
        the engine serves Generation, also the router's replica list) for ModelInfo and
        compares the `instance_id` it answers with. `timeout_s`: this call's deadline (default
        the client's), which should leave room for that probe."""
        reply = await self._call("Register", pb.RegisterRequest(
            engine_id=engine_id, model_identity=model_identity, block_size=block_size,
            num_blocks=num_blocks, lease_s=lease_s, nonce=nonce,
            serving_address=serving_address, instance_id=instance_id), timeout_s)
        self.engine_id, self.epoch = engine_id, reply.epoch
        self.lease_s, self.pin_budget = reply.lease_s, reply.pin_budget
        return reply.epoch

    def attach(self, engine_id: str, epoch: int) -> None:
        """Act for an engine registered elsewhere (another worker of the same engine)."""
        self.engine_id, self.epoch = engine_id, epoch

    async def heartbeat(self) -> float:
        self._require_registered()
        reply = await self._call("Heartbeat", pb.HeartbeatRequest(
            engine_id=self.engine_id, epoch=self.epoch))
        return reply.lease_s

    async def apply(self, ops: Sequence[Op], seq: int = 0) -> list[OpResult]:
        """Runs the ops in order, atomically; one result per op (see apply_batch)."""
        return (await self.apply_batch(ops, seq)).results

    async def apply_batch(self, ops: Sequence[Op], seq: int = 0) -> ApplyResult:
        """Runs the ops in order, atomically: per-op results, the pin changes since this
        engine's previous Apply, and `replayed` when `seq` had been applied already.
        `seq` 0 = unchecked; else 1, 2, ... after each register (ABORTED on a gap/replay)."""
        self._require_registered()
        reply = await self._call("Apply", pb.ApplyRequest(
            engine_id=self.engine_id, epoch=self.epoch, ops=wire.ops_to_proto(ops), seq=seq))
        return wire.apply_result_from_proto(reply)

    async def lookup(self, chain: Sequence[bytes], model_identity: str = "") -> list[EngineMatch]:
        reply = await self._call("Lookup", pb.LookupRequest(chain=list(chain),
                                                            model_identity=model_identity))
        return [wire.match_from_proto(m) for m in reply.engines]

    async def stats(self, engine_id: str | None = None) -> list[EngineStats]:
        """Stats of `engine_id` (default: this client's engine; "" = all engines)."""
        eid = self.engine_id if engine_id is None else engine_id
        reply = await self._call("Stats", pb.StatsRequest(engine_id=eid))
        return [wire.stats_from_proto(s) for s in reply.engines]

    async def watch_residency(self) -> AsyncIterator[ResidencyChange | None]:
        """Every engine's resident hashes, None (the snapshot is complete), then each change,
        until the stream fails (PrefixIndexClientError; watch again) or the caller stops. No
        deadline: it lasts as long as the caller reads."""
        call = self._stub.WatchResidency(pb.WatchResidencyRequest())
        try:
            while True:
                try:
                    event = await asyncio.wait_for(call.read(), WATCH_SILENCE_S)
                except TimeoutError:
                    raise PrefixIndexClientError(
                        "WatchResidency", grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"nothing heard from the index for {WATCH_SILENCE_S:.0f}s (it sends a "
                        f"heartbeat every few seconds): taking the stream for dead") from None
                if event is grpc.aio.EOF:
                    return
                if not event.heartbeat:
                    yield wire.residency_from_proto(event)
        except grpc.aio.AioRpcError as exc:
            raise PrefixIndexClientError("WatchResidency", exc.code(),
                                         exc.details() or "") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> PrefixIndexClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
