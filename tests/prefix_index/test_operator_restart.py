"""The index restarted (a rolling update, a crash) while engines stay registered in Redis:
each engine's Apply rate bucket is sized from its own registered pool, as when this process
saw it register. It was sized for the largest pool any engine may register (two ops a block
of --max-num-blocks: 8M ops by default), so after a restart every engine could burst that far
past --apply-ops-per-s. Real Redis, real index processes on the session's certificates."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Evict
from prefix_index.tools.launch import IndexProcess
from trust.identity import ENGINE_ROLE

NUM_BLOCKS = 4
MAX_OPS = 4
# One re-sync of the pool (2 ops a block) plus one largest Apply.
BUCKET_OPS = 2 * NUM_BLOCKS + MAX_OPS
ARGS = ["--log-level", "WARNING", "--grace-s", "1", "--apply-ops-per-s", "0.01",
        "--max-ops", str(MAX_OPS)]


async def _ops_until_refused(client, limit: int) -> tuple[int, PrefixIndexClientError | None]:
    sent = 0
    while sent < limit:
        try:
            await client.apply([Evict(0)] * MAX_OPS)
        except PrefixIndexClientError as error:
            return sent, error
        sent += MAX_OPS
    return sent, None


@pytest.mark.parametrize("same_process", [True, False])
def test_an_engines_apply_rate_survives_an_index_restart(redis_server, test_certs, engine_id,
                                                         same_process):
    files = test_certs.files("index")
    with IndexProcess(redis_server.url, ARGS, tls=files) as first:
        async def register():
            async with test_certs.index_client(first.target, 5.0, ENGINE_ROLE) as client:
                return await client.register(engine_id, "m", 16, NUM_BLOCKS, 60)
        epoch = asyncio.run(register())
        if same_process:  # the baseline: the process that saw it register
            target = first.target
            sent, refusal = asyncio.run(_send(target, test_certs, engine_id, epoch))
    if not same_process:
        with IndexProcess(redis_server.url, ARGS, tls=files) as second:
            sent, refusal = asyncio.run(_send(second.target, test_certs, engine_id, epoch))
    assert sent == BUCKET_OPS, sent
    assert refusal is not None and refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
    assert "--apply-ops-per-s" in refusal.details and f"{BUCKET_OPS:g} ops" in refusal.details


async def _send(target, test_certs, engine_id, epoch):
    async with test_certs.index_client(target, 5.0, ENGINE_ROLE) as client:
        client.attach(engine_id, epoch)
        return await _ops_until_refused(client, 10 * BUCKET_OPS)


def test_a_re_registration_through_another_index_resizes_the_bucket(redis_server, test_certs,
                                                                    engine_id):
    """Two index processes on one Redis: the engine sends an Apply through A, re-registers
    through B with a pool 16x larger, then sends its Applies through A again. A sizes the
    bucket for the new registration (its epoch), not the one it had sized first (it throttled
    the new pool's re-sync at the old pool's 12 ops)."""
    files = test_certs.files("index")
    big = 16 * NUM_BLOCKS
    with IndexProcess(redis_server.url, ARGS, tls=files) as a, \
            IndexProcess(redis_server.url, ARGS, tls=files) as b:
        async def body():
            async with test_certs.index_client(b.target, 5.0, ENGINE_ROLE) as via_b, \
                    test_certs.index_client(a.target, 5.0, ENGINE_ROLE) as via_a:
                first = await via_b.register(engine_id, "m", 16, NUM_BLOCKS, 60)
                via_a.attach(engine_id, first)
                await via_a.apply([Evict(0)])
                second = await via_b.register(engine_id, "m", 16, big, 60)
                via_a.attach(engine_id, second)
                return await _ops_until_refused(via_a, 10 * big)

        sent, refusal = asyncio.run(body())
    assert sent == 2 * big + MAX_OPS, sent
    assert refusal is not None and f"{2 * big + MAX_OPS:g} ops" in refusal.details, refusal
