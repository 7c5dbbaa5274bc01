"""One engine server (a subprocess on the tiny Llama, loopback gRPC) shared by the service tests.

When the prefix index link exists (engine_service/index/policy.py) the engine runs against a
real redis-server and prefix index, as in production; otherwise with `--prefix-index none`.
Both on mutual TLS with the session's certificates (tests/support/tls.py); tests call the
engine through `engine_server.channel()` (a client certificate).
"""

from __future__ import annotations

import importlib.util
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess, free_port
from tests.service.index_fixtures import INDEX_ARGS
from tests.support.tls import SessionCerts

# 240 blocks of 16 tokens: room for 64 short concurrent requests, while a request that may
# grow to the whole 4096-token context (256 blocks) can never fit (INVALID_ARGUMENT).
NUM_BLOCKS = 240
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
MAX_LIVE_REQUESTS = 200
SERVICE = "pagedgen.generation.v1.Generation"


def has_index_link() -> bool:
    return importlib.util.find_spec("engine_service.index.link") is not None


class EngineUnderTest:
    def __init__(self, process: EngineProcess, metrics_port: int, log_path: Path,
                 certs: SessionCerts) -> None:
        self.process = process
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.certs = certs

    @property
    def target(self) -> str:
        return self.process.target

    def channel(self, **kwargs) -> grpc.Channel:
        """A client's blocking channel to the engine (mutual TLS, a client certificate)."""
        return self.certs.channel(self.target, **kwargs)

    def aio_channel(self, **kwargs) -> grpc.aio.Channel:
        return self.certs.aio_channel(self.target, **kwargs)

    def metrics_text(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=5).read().decode()


def engine_args(metrics_port: int, index_target: str | None) -> list[str]:
    return [
        "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-live-requests", str(MAX_LIVE_REQUESTS),
        "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
        "--prefix-index", index_target or "none", "--grace-s", "5", "--log-level", "WARNING",
        # Server outputs are compared token for token with the offline API under other batch
        # shapes: exact in float32 only ("auto" may pick bfloat16).
        "--dtype", "float32",
    ]


@pytest.fixture(scope="session")
def engine_server(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[EngineUnderTest]:
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    metrics_port = free_port()
    with ExitStack() as stack:
        index_target = None
        if has_index_link():
            redis = stack.enter_context(RedisProcess())
            index = stack.enter_context(IndexProcess(redis.url, ["--log-level", "WARNING"],
                                                     tls=test_certs.files("index")))
            index_target = index.target
        process = EngineProcess(tiny_llama_dir, engine_args(metrics_port, index_target),
                                log_path=log_path, tls=test_certs.files("engine"))
        stack.enter_context(process)
        engine = EngineUnderTest(process, metrics_port, log_path, test_certs)
        if index_target is not None:
            # The link registers once the server serves: a PinPrefix before that is refused
            # (UNAVAILABLE, "not registered yet"), which a test's first call could meet.
            wait_linked(engine)
        yield engine


def wait_linked(engine: EngineUnderTest, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with engine.channel() as channel:
        stub = pb_grpc.GenerationStub(channel)
        while stub.EngineStats(pb.EngineStatsRequest(), timeout=10).degraded:
            assert time.monotonic() < deadline, "the engine never registered at the index"
            time.sleep(0.05)


@pytest.fixture(scope="session")
def channel(engine_server) -> Iterator[grpc.Channel]:
    with engine_server.channel() as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="session")
def offline_llm(tiny_llama_dir):
    """The offline API on the same model and pool shape: the reference for server outputs."""
    from engine_service import LLM

    return LLM(model=str(tiny_llama_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
               max_model_len=MAX_MODEL_LEN, dtype="float32")


@pytest.fixture
def redis() -> Iterator[RedisProcess]:
    """A redis-server of the test's own (a test may restart or flush it)."""
    with RedisProcess() as server:
        yield server


@pytest.fixture
def index(redis, test_certs: SessionCerts) -> Iterator[IndexProcess]:
    """The prefix index on that Redis, mutual TLS on the session's index certificate, at the
    settings the in-process engine tests assume (tests/service/index_fixtures.INDEX_ARGS); a
    test module may define its own `index` with other flags."""
    process = IndexProcess(redis.url, INDEX_ARGS, tls=test_certs.files("index")).start()
    yield process
    process.kill()
