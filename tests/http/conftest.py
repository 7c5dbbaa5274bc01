"""An engine serving the OpenAI-compatible HTTP API next to gRPC (a subprocess on the tiny
Llama, loopback), with an API key, shared by the HTTP tests; clients are the official `openai`
package's, sync and async. The engine is served alone to end clients, as deployed that way:
TLS on the session's certificates (--tls-server-only: keys, no client certificates), HTTPS;
clients verify the CA."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tenancy.client import with_api_key
from tests.http.http_util import call
from tests.service.conftest import engine_args
from tests.support.tls import SessionCerts

API_KEY = "test-key-0123456789"


@dataclass
class HttpEngine:
    process: EngineProcess
    http_port: int
    metrics_port: int
    log_path: Path
    certs: SessionCerts

    @property
    def target(self) -> str:  # gRPC
        return self.process.target

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.http_port}"

    def call(self, url: str, *args, **kwargs) -> tuple[int, dict]:
        """http_util.call over the engine's TLS (trusting the session's CA)."""
        return call(url, *args, context=self.certs.ssl_context(), **kwargs)

    def openai(self, api_key: str, **kwargs) -> openai.OpenAI:
        return self.certs.openai_client(f"{self.base_url}/v1", api_key, **kwargs)

    def async_openai(self, api_key: str, **kwargs) -> openai.AsyncOpenAI:
        return self.certs.async_openai_client(f"{self.base_url}/v1", api_key, **kwargs)

    def channel(self) -> grpc.Channel:
        """An end client's gRPC channel (TLS verifying the CA)."""
        return self.certs.end_client_channel(self.target)

    @property
    def model(self) -> str:
        return Path(self.process.model).name  # the default served model name

    def metric(self, name: str) -> float:
        """One sample of the engine's Prometheus metrics (`name` with its labels)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0


def start_engine(model_dir: Path, log_path: Path, certs: SessionCerts,
                 extra: list[str] = ()) -> HttpEngine:
    http_port, metrics_port = free_port(), free_port()
    args = [*engine_args(metrics_port, None), "--http-port", str(http_port), "--tls-server-only",
            *extra]
    process = EngineProcess(model_dir, args, log_path=log_path,
                            tls=certs.files("engine")).start()
    return HttpEngine(process, http_port, metrics_port, log_path, certs)


@pytest.fixture(scope="session")
def http_engine(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[HttpEngine]:
    log_path = tmp_path_factory.mktemp("http_engine") / "engine.log"
    engine = start_engine(tiny_llama_dir, log_path, test_certs, ["--api-key", API_KEY])
    try:
        yield engine
    finally:
        engine.process.terminate()


@pytest.fixture(scope="session")
def client(http_engine) -> Iterator[openai.OpenAI]:
    with http_engine.openai(API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def async_client(http_engine) -> openai.AsyncOpenAI:
    return http_engine.async_openai(API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def engine_stub(http_engine) -> Iterator[pb_grpc.GenerationStub]:
    with http_engine.channel() as channel:  # the key guards gRPC too
        yield pb_grpc.GenerationStub(with_api_key(channel, API_KEY))
