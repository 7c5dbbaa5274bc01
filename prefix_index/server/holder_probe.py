"""Is the process that holds an engine id's lease still there?

Asked when another process registers under that id. compose's `restart: unless-stopped` and a
Kubernetes container restart bring a crashed engine back under the same id; refused as a live
twin, it would serve on its local LRU until the dead process's lease ran out (30 s by default),
and meanwhile the index would credit the dead process's blocks to routers. The holder registered
where it serves and the instance id its ModelInfo answers with, so the index asks it.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

import grpc

from pagedgen_api import generation_pb2 as gen_pb
from pagedgen_api import generation_pb2_grpc as gen_grpc
from trust.credentials import TlsMaterial, aio_channel
from trust.identity import ENGINE_ROLE

# Probes at once: each one is an outbound connection and up to timeout_s of waiting, so a burst
# of registrations cannot make the index dial without bound. Past it, a holder is not probed
# (the lease rules as before).
MAX_CONCURRENT_PROBES = 16


class HolderState(enum.Enum):
    ALIVE = "alive"      # the holder itself answered: a live twin, refuse the newcomer
    GONE = "gone"        # another process, another service or nothing answers there
    UNKNOWN = "unknown"  # no answer in time (or no probe slot): the lease decides


@dataclass(frozen=True, slots=True)
class ProbeResult:
    state: HolderState
    detail: str  # said in the log and in the refusal


class HolderProber:
    def __init__(self, timeout_s: float, tls: TlsMaterial | None = None) -> None:
        self.timeout_s = timeout_s
        self.tls = tls  # TLS: the index's certificate presented, an engine's demanded
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_PROBES)
        # One probe at a time per holder: Registers repeated under one id while its probe runs
        # (a restart loop, a client retrying) wait for that probe's answer instead of dialling
        # the holder again each.
        self._running: dict[tuple[str, str], asyncio.Task[ProbeResult]] = {}

    async def probe(self, address: str, instance_id: str) -> ProbeResult:
        """What answers ModelInfo at `address`, against the holder's `instance_id`."""
        key = (address, instance_id)
        task = self._running.get(key)
        if task is None:
            if self._slots.locked():
                return ProbeResult(HolderState.UNKNOWN,
                                   f"not probed: {MAX_CONCURRENT_PROBES} probes already running")
            task = self._running[key] = asyncio.create_task(self._probe_in_slot(address,
                                                                                instance_id))
            task.add_done_callback(lambda _t: self._running.pop(key, None))
        # Shielded: one waiting Register cancelled (its caller left) does not cancel the probe
        # the others wait for.
        return await asyncio.shield(task)

    async def _probe_in_slot(self, address: str, instance_id: str) -> ProbeResult:
        async with self._slots:
            return await self._ask(address, instance_id)

    async def _ask(self, address: str, instance_id: str) -> ProbeResult:
        async with aio_channel(address, self.tls, ENGINE_ROLE) as channel:
            try:
                reply = await gen_grpc.GenerationStub(channel).ModelInfo(
                    gen_pb.ModelInfoRequest(), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as error:
                code = error.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Alive but stalled, or a host that drops packets: not proof of death.
                    return ProbeResult(HolderState.UNKNOWN, f"{address} did not answer ModelInfo "
                                       f"within {self.timeout_s:g}s")
                details = error.details() or ""
                if code == grpc.StatusCode.UNAVAILABLE and ("resolv" in details
                                                            or "DNS" in details):
                    # A name that does not resolve from here says nothing of the process.
                    return ProbeResult(HolderState.UNKNOWN, f"{address} does not resolve here")
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
                    # Nothing listens there (connection refused, a name that no longer
                    # resolves), or something that is not an engine does.
                    return ProbeResult(HolderState.GONE, f"ModelInfo at {address} failed with "
                                       f"{code.name}: {error.details()}")
                return ProbeResult(HolderState.UNKNOWN, f"ModelInfo at {address} failed with "
                                   f"{code.name}: {error.details()}")
        if reply.instance_id == instance_id:
            return ProbeResult(HolderState.ALIVE, f"instance {instance_id} still answers at "
                               f"{address}")
        return ProbeResult(HolderState.GONE, f"{address} is now instance "
                           f"{reply.instance_id or '(none)'} of engine {reply.engine_id!r}, "
                           f"not the holder's {instance_id}")
