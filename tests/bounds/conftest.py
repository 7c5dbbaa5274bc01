"""An engine on the tiny Llama and a router in front of it, real processes over loopback, for
the bounds tests (tests/bounds): what one client sends or leaves unread must not stall others.

The engine's pool (4096 blocks of 16 tokens; the tiny model's blocks are small) runs four
n = 64 requests of a few hundred tokens at once; its unsent-token bound is small so an unread
stream is stopped after a few steps (the router's too). The router runs at its defaults
otherwise: it learns the engine's context from ModelInfo, and its message size limit is sized
for a 128K-token context.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from router.tools.launch import RouterProcess

CONTEXT_TOKENS = 4096
NUM_BLOCKS = 4096
BLOCK_SIZE = 16
MAX_UNSENT_TOKENS = 1024


@dataclass
class Bounded:
    engine: EngineProcess
    router: RouterProcess
    http_port: int  # the engine's OpenAI-compatible HTTP API
    router_metrics_port: int
    log_dir: Path

    def router_in_flight(self) -> float:
        """The requests the router counts as running on its replicas (its metrics)."""
        url = f"http://127.0.0.1:{self.router_metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedgen_router_in_flight_requests{"))

    def engine_stub(self, channel: grpc.Channel) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="session")
def bounded(tiny_llama_dir, tmp_path_factory) -> Iterator[Bounded]:
    log_dir = tmp_path_factory.mktemp("bounds")
    http_port = free_port()
    engine = EngineProcess(tiny_llama_dir, [
        "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(CONTEXT_TOKENS), "--max-unsent-tokens", str(MAX_UNSENT_TOKENS),
        "--prefix-index", "none", "--http-port", str(http_port), "--grace-s", "2",
        "--log-level", "WARNING"], log_path=log_dir / "engine.log")
    with engine:
        # The router at its default --max-context-tokens (128K: 16 MiB messages), as deployed;
        # its unsent-token bound the engine's.
        metrics_port = free_port()
        router = RouterProcess(["--engines", engine.target, "--prefix-index", "none",
                                "--max-unsent-tokens", str(MAX_UNSENT_TOKENS),
                                "--metrics-port", str(metrics_port),
                                "--metrics-host", "127.0.0.1", "--log-level", "WARNING"],
                               log_path=log_dir / "router.log")
        with router:
            wait_until(lambda: engine_stats(router.target).index_details.get(
                "replicas_routable") == "1", "the router routing to the engine")
            yield Bounded(engine, router, http_port, metrics_port, log_dir)


def wait_until(predicate, what: str, timeout_s: float = 60.0):
    """`predicate()` once true; a generous deadline (engines start slowly on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout_s}s")
        time.sleep(0.05)


def engine_stats(target: str) -> pb.EngineStatsResponse:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(), timeout=10)


def greedy(max_tokens: int = 8, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              **kwargs)
