"""What a client is told when no replica can take its request: counts only. The replicas'
names, addresses and errors are the deployment's; the router's log keeps them."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine_service.core.block_hash import BlockHasher
from pagedgen_api import generation_pb2 as pb
from router.config import RouterConfig
from router.core import NoReplicaError, Router
from router.replicas import Replica

UP, DOWN = "10.1.2.3:7001", "10.1.2.4:7002"


def test_the_refusal_counts_replicas_and_names_none(caplog):
    async def body() -> str:
        router = Router(RouterConfig(), ["127.0.0.1:1"], None)
        for placeholder in router.replicas.replicas.values():  # (this test sets its own)
            await placeholder.close()
        up, down = Replica(UP, "engine-up"), Replica(DOWN, "engine-down")
        up.healthy, up.info = True, pb.ModelInfoResponse()
        down.last_error = f"UNAVAILABLE: failed to connect to {DOWN}"
        router.replicas.replicas = {r.address: r for r in (up, down)}
        router.replicas.hasher = BlockHasher.for_identity("m", 16)
        with pytest.raises(NoReplicaError) as refused:
            await router.route([1, 2, 3], "", {UP})  # the one up already failed this request
        for replica in (up, down):
            await replica.close()
        return str(refused.value)

    with caplog.at_level(logging.WARNING, logger="router.core"):
        message = asyncio.run(body())
    assert message == ("no engine replica can take the request (2 known, 1 unavailable, "
                       "1 tried for this request)")
    # The operator still learns which, and why.
    assert UP in caplog.text and DOWN in caplog.text and "engine-down" in caplog.text
