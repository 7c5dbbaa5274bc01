"""The router's log while no replica can take requests: one WARNING when it starts (and when
the replicas down change), then at most one per interval with the count refused meanwhile,
and one INFO with that count when requests are routed again. It was one WARNING per refused
request: 22 requests, 22 lines."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine_service.core.block_hash import BlockHasher
from pagedgen_api import generation_pb2 as pb
from router.config import RouterConfig
from router.core import NoReplicaError, Router
from router.replicas import Replica

A, B = "10.1.2.3:7001", "10.1.2.4:7002"


def refusal_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "router.core" and "no replica can take a request" in r.getMessage()]


def routed_again_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "router.core" and "routing requests again" in r.getMessage()]


async def refuse(router: Router, times: int) -> None:
    for _ in range(times):
        with pytest.raises(NoReplicaError):
            await router.route([1, 2, 3], "", set())


def test_an_outage_of_every_replica_logs_once_then_counts(caplog):
    async def body() -> None:
        router = Router(RouterConfig(), ["127.0.0.1:1"], None)
        for placeholder in router.replicas.replicas.values():  # (this test sets its own)
            await placeholder.close()
        a, b = Replica(A, "engine-a"), Replica(B, "engine-b")
        a.last_error = b.last_error = "UNAVAILABLE: failed to connect"
        router.replicas.replicas = {r.address: r for r in (a, b)}
        router.replicas.hasher = BlockHasher.for_identity("m", 16)

        await refuse(router, 22)  # every replica down: one line, naming them and why
        [line] = refusal_lines(caplog)
        assert line.levelno == logging.WARNING
        assert A in line.getMessage() and B in line.getMessage()

        # A partial outage: B routes some requests, others (which failed on B already) find
        # no replica: a new cause (A down alone), said once; routings and refusals by turns
        # then carry the run on, no line a turn (a pair of lines a refusal before).
        b.healthy, b.info = True, pb.ModelInfoResponse()
        for _ in range(10):
            await router.route([1, 2, 3], "", set())
            with pytest.raises(NoReplicaError):
                await router.route([1, 2, 3], "", {B})
        assert len(refusal_lines(caplog)) == 2 and routed_again_lines(caplog) == []
        router.refusals.interval_s = 0.0  # the interval passed: routing again is said, once
        await router.route([1, 2, 3], "", set())
        [again] = routed_again_lines(caplog)
        assert again.levelno == logging.INFO and "9 more refused" in again.getMessage()
        router.refusals.interval_s = 30.0
        b.healthy = False
        await refuse(router, 5)
        assert len(refusal_lines(caplog)) == 3  # a new run of refusals: said again, once

        router.replicas.replicas = {A: a}  # B removed: the replicas down changed
        await refuse(router, 3)
        assert len(refusal_lines(caplog)) == 4

        # Past the interval, the next refusal logs again with the count since the last line.
        router.refusals.interval_s = 0.0
        await refuse(router, 1)
        lines = refusal_lines(caplog)
        assert len(lines) == 5 and "2 more refused since the last such line" in \
            lines[-1].getMessage()
        for replica in (a, b):
            await replica.close()

    with caplog.at_level(logging.INFO, logger="router.core"):
        asyncio.run(body())
