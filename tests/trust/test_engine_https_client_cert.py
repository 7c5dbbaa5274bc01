"""An engine's HTTPS port asks for what its gRPC port asks for: a client certificate the CA
signed (mutual TLS, an engine behind a router), unless --tls-server-only (an engine serving end
clients alone, who bring API keys). It served any TLS client before (found in review)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request

import pytest

from engine_service.tools.launch import EngineProcess
from prefix_index.tools.redis_process import free_port
from tests.trust.conftest import files

REFUSED = (urllib.error.URLError, ssl.SSLError, ConnectionError, http.client.HTTPException)


def _health(port: int, context: ssl.SSLContext) -> int:
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=context,
                                timeout=30) as reply:
        assert json.loads(reply.read())["status"] == "serving"
        return reply.status


@pytest.mark.parametrize("server_only", [False, True], ids=["mutual", "server-only"])
def test_engine_https_asks_for_the_grpc_ports_client_certificate(tiny_llama_dir, certs, tmp_path,
                                                                 server_only):
    port = free_port()
    extra = ["--tls-server-only"] if server_only else []
    engine = EngineProcess(tiny_llama_dir, ["--prefix-index", "none", "--http-port", str(port),
                                            "--log-level", "WARNING", *extra],
                           tls=files(certs, "engine"), log_path=tmp_path / "engine.log")
    with engine:
        anonymous = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        if server_only:
            assert _health(port, anonymous) == 200
        else:
            with pytest.raises(REFUSED):
                _health(port, anonymous)
        with_certificate = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_certificate.load_cert_chain(certs / "client.pem", certs / "client-key.pem")
        assert _health(port, with_certificate) == 200
