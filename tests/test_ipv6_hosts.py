"""A server bound to an IPv6 host: its bind address, the line launchers read and the address
it registers are bracketed ('[::1]:port'), so gRPC can parse them."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.serving.server import advertised_address
from prefix_index.tools.addresses import join_host_port
from prefix_index.tools.redis_process import free_port
from trust.cli_args import tls_argv


def test_host_port_brackets_ipv6_only() -> None:
    assert join_host_port("127.0.0.1", 5) == "127.0.0.1:5"
    assert join_host_port("engine-0.pagedgen", 5) == "engine-0.pagedgen:5"
    assert join_host_port("::1", 5) == "[::1]:5"
    assert join_host_port("[::1]", 5) == "[::1]:5"
    assert join_host_port("fd00::2", 5) == "[fd00::2]:5"


def test_the_engine_registers_a_bracketed_ipv6_address() -> None:
    assert advertised_address("", "::1", 50051) == "[::1]:50051"


def test_a_router_on_ipv6_loopback_answers_there(test_certs) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.server", "--host", "::1", "--port", "0",
         "--engines", "127.0.0.1:9", "--prefix-index", "none",
         *tls_argv(test_certs.files("router"))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("router listening on [::1]:"), (line, proc.stderr.read())
        target = line.split()[-1]
        with test_certs.end_client_channel(target) as channel:  # (its certificate names ::1)
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30)
        assert answer.status in (health_pb2.HealthCheckResponse.SERVING,
                                 health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_router_on_bracketed_ipv6_serves_its_metrics_there() -> None:
    """--host [::1] (as gRPC writes it) with a metrics port: the metrics bind ::1 too (the
    server failed to start: Prometheus' server takes no brackets)."""
    metrics_port = free_port()  # (free on 127.0.0.1: as good as on ::1 here)
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.server", "--host", "[::1]", "--port", "0",
         "--engines", "127.0.0.1:9", "--prefix-index", "none", "--insecure",
         "--metrics-port", str(metrics_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("router listening on [::1]:"), (line, proc.stderr.read())
        with urllib.request.urlopen(f"http://[::1]:{metrics_port}/metrics", timeout=10) as got:
            assert b"pagedgen_router" in got.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
