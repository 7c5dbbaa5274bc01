"""An engine or router whose HTTP port is taken exits 1 with one line naming the port, before
it starts anything (the port is bound with the gRPC one)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.test_bind_errors import SERVERS, tls_flags


@pytest.mark.parametrize("server", ["engine", "router"])
def test_an_http_port_in_use_is_a_clear_exit(server, tiny_llama_dir, test_certs) -> None:
    extra = ["--model", str(tiny_llama_dir)] if server == "engine" else []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", *SERVERS[server], *extra, "--port", "0", "--http-port",
             str(port), *tls_flags(test_certs, server)], capture_output=True, text=True,
            timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot serve: HTTP port 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr
