"""Health of the index = health of its Redis: a background probe flips grpc.health.v1."""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from redis.exceptions import RedisError

from prefix_index.server.metrics import IndexMetrics
from prefix_index.server.store import IndexStore

log = logging.getLogger("prefix_index.server.health")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RedisHealth:
    """Owns the serving status of the service names; NOT_SERVING for good once draining."""

    def __init__(self, store: IndexStore, servicer: health_aio.HealthServicer,
                 service_names: list[str], metrics: IndexMetrics, probe_interval_s: float,
                 probe_timeout_s: float) -> None:
        self.store = store
        self.servicer = servicer
        self.service_names = service_names
        self.metrics = metrics
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.redis_up: bool | None = None  # None until the first probe
        self.draining = False
        self._early_probe: asyncio.Task | None = None

    def probe_soon(self) -> None:
        """A call succeeded while Redis was taken for down: probe now rather than at the next
        interval. Not "Redis is back" by itself: a call may succeed without reaching Redis (an
        empty Lookup, one answered from the cached engine list), which flipped health to
        SERVING and back every call of an outage."""
        if self._early_probe is None or self._early_probe.done():
            self._early_probe = asyncio.ensure_future(self.probe_once())

    async def _publish(self, up: bool) -> None:
        status = SERVING if up and not self.draining else NOT_SERVING
        for name in self.service_names:
            await self.servicer.set(name, status)
        self.metrics.redis_up.set(1 if up else 0)

    async def set_redis_up(self, up: bool, reason: str = "") -> None:
        """`reason`: why Redis is down, for the log (what an operator acts on: a refused
        connection, a wrong password, a timeout)."""
        if up == self.redis_up:
            return
        # Set before any await: the probe and failing calls notice an outage at once, and
        # the first of them alone logs it and resets the connections.
        self.redis_up = up
        if up:
            log.info("redis reachable: serving")
        else:
            log.warning("redis unreachable: not serving (%s)", reason or "a call to it failed")
            # Pooled connections point at a dead server: drop them so the next call dials anew.
            await self.store.reset_connections()
        await self._publish(self.redis_up)  # (the state now: it may have flipped meanwhile)

    async def probe_once(self) -> bool:
        reason = ""
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                up = await self.store.ping()
        except TimeoutError:
            up, reason = False, f"no answer to PING within {self.probe_timeout_s:g}s"
        except (RedisError, OSError) as error:
            # redis-py's messages name the host and port, never the password.
            up, reason = False, f"{type(error).__name__}: {error}"
        await self.set_redis_up(up, reason)
        return up

    async def run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self.probe_interval_s)

    async def drain_off(self) -> None:
        """NOT_SERVING until the first probe answers."""
        self.draining = False
        await self._publish(False)

    async def drain(self) -> None:
        self.draining = True
        await self._publish(False)
