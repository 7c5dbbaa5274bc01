"""Redis with a password (--requirepass, as compose and Kubernetes run it): a client without it
gets nothing; an index without it never serves (UNAVAILABLE, saying why) and an index with it
serves; neither ever logs the password. Real redis-server and index processes, the index on
the session's certificates."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis

from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Release
from prefix_index.tools.launch import IndexProcess, wait_serving
from prefix_index.tools.redis_process import RedisProcess
from tests.prefix_index.chains import commit_ops, make_chain
from trust.identity import ENGINE_ROLE, ROUTER_ROLE

PASSWORD = "pw-8d1f0c-never-logged"
INDEX_ARGS = ["--log-level", "INFO", "--grace-s", "1", "--probe-interval-s", "0.2",
              "--redis-timeout-s", "0.5"]
REFUSED_FOR_S = 3.0  # how long the index without the password is watched failing


def started(index: IndexProcess, log_path, wait: bool) -> IndexProcess:
    """Starts `index` with its stderr (its log) in `log_path`."""
    index.spawn(index.command(), log_path)
    if wait:
        wait_serving(index.target, index.start_timeout_s, proc=index.proc, tls=index.tls)
    return index


def test_redis_without_the_password_gets_nothing(test_certs, tmp_path):
    with RedisProcess(password=PASSWORD) as redis_process:
        # Redis itself: a client without the password cannot read or write.
        bare = redis.Redis(host=redis_process.host, port=redis_process.port)
        with pytest.raises(redis.exceptions.AuthenticationError):
            bare.set("stolen", "x")
        bare.close()

        # An index without the password never serves: every call is UNAVAILABLE, with why.
        no_password_url = f"redis://{redis_process.host}:{redis_process.port}/0"
        refused_log = tmp_path / "index-no-password.log"
        index = started(IndexProcess(no_password_url, INDEX_ARGS, wait_for_redis=False,
                                     tls=test_certs.files("index")), refused_log, wait=False)
        try:
            async def refused() -> set[str]:
                details = set()
                async with test_certs.index_client(index.target, 2.0, ENGINE_ROLE) as engine:
                    # Until it listens (a loaded machine starts it slowly) the refusal is the
                    # connection's; once it says why, it is watched failing a while more.
                    give_up = time.monotonic() + 120
                    watch_until = None
                    while time.monotonic() < (watch_until or give_up):
                        with pytest.raises(PrefixIndexClientError) as err:
                            await engine.register("no-password", "m", 16, 8, 30, nonce="n")
                        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
                        details.add(err.value.details)
                        if watch_until is None and "auth" in err.value.details.lower():
                            watch_until = time.monotonic() + REFUSED_FOR_S
                        await asyncio.sleep(0.2)
                return details
            details = asyncio.run(refused())
            assert any("auth" in d.lower() for d in details), details
        finally:
            index.kill()

        # With the password: it serves engines and routers.
        served_log = tmp_path / "index-password.log"
        with started(IndexProcess(redis_process.url, INDEX_ARGS,
                                  tls=test_certs.files("index")), served_log, wait=True) as index:
            async def serves() -> None:
                chain = make_chain("behind-a-password", 2)
                async with test_certs.index_client(index.target, 5.0, ENGINE_ROLE) as engine, \
                        test_certs.index_client(index.target, 5.0, ROUTER_ROLE) as router:
                    await engine.register("with-password", "m", 16, 8, 30, nonce="n")
                    await engine.apply(commit_ops(chain, 0) + [Release(chain)])
                    [match] = await router.lookup(chain)
                    assert (match.engine_id, match.matched_blocks) == ("with-password", 2)
            asyncio.run(serves())
        logs = served_log.read_text() + refused_log.read_text()
        assert "***" in served_log.read_text()  # the URL is logged, its password redacted
        assert PASSWORD not in logs
