"""The server process: health under both names, reflection, Prometheus metrics, SIGTERM drain."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from prefix_index.api.ops import Acquire
from prefix_index.server.config import IndexConfig
from prefix_index.server.main import IndexServer
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import free_port
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import INDEX_ARGS
from trust.cli_args import tls_argv
from trust.identity import INDEX_ROLE, ROUTER_ROLE

SERVICE = "pagedgen.prefix_index.v1.PrefixIndex"


def test_health_reflection_metrics_and_sigterm(redis_server, engine_id, test_certs):
    metrics_port = free_port()
    index = IndexProcess(redis_server.url, INDEX_ARGS + [
        "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"],
        tls=test_certs.files("index")).start()
    try:
        with test_certs.channel(index.target, ROUTER_ROLE, INDEX_ROLE) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            [answer] = list(reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=2))
            names = {s.name for s in answer.list_services_response.service}
            assert {SERVICE, "grpc.health.v1.Health"} <= names

        async def traffic():
            async with test_certs.index_client(index.target, 5.0) as c:
                await c.register(engine_id, "m", 16, 8)
                chain = make_chain("metrics", 2)
                await c.apply(commit_ops(chain, 0) + [Acquire(chain + make_chain("x", 1))])
        asyncio.run(traffic())
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=5).read().decode()
        assert "pagedgen_prefix_index_redis_up 1.0" in text
        assert "pagedgen_prefix_index_queried_blocks_total 3.0" in text
        assert "pagedgen_prefix_index_hit_blocks_total 2.0" in text
        assert 'pagedgen_prefix_index_rpcs_total{code="OK",method="Apply"} 1.0' in text

        check = [sys.executable, "-m", "prefix_index.tools.healthcheck", index.target,
                 *tls_argv(test_certs.files(ROUTER_ROLE)), "--service", SERVICE]
        assert subprocess.run(check, timeout=30).returncode == 0

        started = time.monotonic()
        assert index.terminate() == 0                # drains and exits cleanly on SIGTERM
        assert time.monotonic() - started < 5
    finally:
        index.kill()
    gone = subprocess.run(check[:10] + ["--timeout-s", "0.3"], capture_output=True, timeout=30)
    assert gone.returncode == 1 and b"not SERVING" in gone.stderr


def test_in_process_server(redis_server, engine_id, test_certs):
    """IndexServer runs inside the caller's event loop (for other components' tests)."""

    async def body():
        server = IndexServer(IndexConfig(redis_url=redis_server.url), port=0,
                             tls=test_certs.material(INDEX_ROLE))
        port = await server.start()
        try:
            async with test_certs.index_client(f"127.0.0.1:{port}", 5.0) as c:
                await c.register(engine_id, "m", 16, 8)
                chain = make_chain("inproc", 1)
                [ok, acq] = await c.apply(commit_ops(chain, 3) + [Acquire(chain)])
                assert ok.ok and acq.block_ids == [3]
        finally:
            await server.stop(0.5)
    asyncio.run(body())
