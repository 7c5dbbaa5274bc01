"""The index on a real 3-node Redis Cluster: every engine's keys share one slot, scripts load on
whichever node owns it, and lookup spans engines on different nodes."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from redis.crc import key_slot

from prefix_index.api.ops import Acquire, Evict, Release
from prefix_index.server.keys import engine_keys
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisClusterProcess
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import INDEX_ARGS


def test_engine_keys_share_one_slot():
    for engine_id in ("a", "engine-0", "x.y:z_1"):
        slots = {key_slot(k.encode()) for k in engine_keys(engine_id)}
        assert len(slots) == 1, (engine_id, slots)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli builds the cluster")
def test_index_on_redis_cluster(test_certs):
    with RedisClusterProcess(3) as cluster, IndexProcess(
            cluster.url, INDEX_ARGS + ["--redis-cluster"], tls=test_certs.files("index")) as index:
        async def body():
            engines = [f"cluster-engine-{i}" for i in range(6)]
            # redis-cli splits the 16384 slots evenly over the 3 primaries.
            nodes = {key_slot(engine_keys(e)[0].encode()) * 3 // 16384 for e in engines}
            assert len(nodes) > 1           # the engines really live on different nodes
            chain = make_chain("cluster", 4)
            clients = []
            for i, engine_id in enumerate(engines):
                c = test_certs.index_client(index.target, 5.0)
                await c.register(engine_id, "m", 16, 16)
                await c.apply(commit_ops(chain[: i % 4 + 1], 0) + [Release(chain[: i % 4 + 1])])
                clients.append(c)
            ranked = [(m.engine_id, m.matched_blocks) for m in await clients[0].lookup(chain)]
            assert ranked == [("cluster-engine-3", 4), ("cluster-engine-2", 3),
                              ("cluster-engine-1", 2), ("cluster-engine-5", 2),
                              ("cluster-engine-0", 1), ("cluster-engine-4", 1)]
            [acq, rel, ev] = await clients[3].apply([Acquire(chain), Release(chain), Evict(4)])
            assert acq.block_ids == [0, 1, 2, 3]
            assert [e.block_id for e in ev.evicted] == [3, 2, 1, 0]
            assert len(await clients[0].stats("")) == len(engines)
            for c in clients:
                await c.close()
        asyncio.run(body())
