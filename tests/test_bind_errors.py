"""Each server (the prefix index, the engine, the router) whose metrics port is taken exits 1
with one line naming the port, before it starts anything: the router used to die of SIGSEGV
tearing down what it had started, the others with a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from trust.cli_args import tls_argv

SERVERS = {
    "index": ["prefix_index.server.main", "--redis-url", "redis://127.0.0.1:9/0"],
    "engine": ["engine_service.serving.server", "--prefix-index", "none"],
    "router": ["router.server", "--engines", "127.0.0.1:9", "--prefix-index", "none"],
}
ROLES = {"index": "index", "engine": "engine", "router": "router"}


def tls_flags(certs, server: str) -> list[str]:
    """The server's TLS files (a server given none refuses to start)."""
    return tls_argv(certs.files(ROLES[server]))


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_metrics_port_in_use_is_a_clear_exit(server, tiny_llama_dir, test_certs) -> None:
    extra = ["--model", str(tiny_llama_dir)] if server == "engine" else []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", *SERVERS[server], *extra, "--port", "0",
             "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
             *tls_flags(test_certs, server)],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot serve: metrics port 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_grpc_port_in_use_is_a_clear_exit(test_certs) -> None:
    """grpcio raises RuntimeError for a port it cannot bind: the router says which port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", *SERVERS["router"], "--host", "127.0.0.1", "--port",
             str(port), *tls_flags(test_certs, "router")], capture_output=True, text=True,
            timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"cannot serve: gRPC port 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
