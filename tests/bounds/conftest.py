"""An engine on the tiny Llama and a router in front of it, real processes over loopback, for
the bounds tests (tests/bounds): what one client sends or leaves unread must not stall others.

The engine's pool (4096 blocks of 16 tokens; the tiny model's blocks are small) runs four
n = 64 requests of a few hundred tokens at once; its unsent-token bound is small so an unread
stream is stopped after a few steps (the router's too). Both on the session's certificates:
mutual TLS at the engine (the router's, a test client's), TLS at the router's front door. The
router runs at its defaults otherwise: it learns the engine's context from ModelInfo, and its
message size limit is sized for a 128K-token context.
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
from tests.router.stack import RouterStack
from tests.support.tls import SessionCerts

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
    certs: SessionCerts

    def channel(self, target: str, options=()) -> grpc.Channel:
        """A client's channel to the router (an end client's TLS) or to the engine (mutual
        TLS, a client certificate)."""
        if target == self.router.target:
            return self.certs.end_client_channel(target, options)
        return self.certs.channel(target, options=options)

    def router_in_flight(self) -> float:
        """The requests the router counts as running on its replicas (its metrics)."""
        url = f"http://127.0.0.1:{self.router_metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedgen_router_in_flight_requests{"))

    def engine_stub(self, channel: grpc.Channel) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="session")
def bounded(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[Bounded]:
    log_dir = tmp_path_factory.mktemp("bounds")
    http_port, metrics_port = free_port(), free_port()
    shape = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
             "--max-model-len", str(CONTEXT_TOKENS), "--max-unsent-tokens", str(MAX_UNSENT_TOKENS),
             "--http-port", str(http_port)]
    # The router at its default --max-context-tokens (128K: 16 MiB messages), as deployed; its
    # unsent-token bound the engine's.
    router_args = ["--max-unsent-tokens", str(MAX_UNSENT_TOKENS), "--metrics-port",
                   str(metrics_port), "--metrics-host", "127.0.0.1", "--log-level", "WARNING"]
    with RouterStack(tiny_llama_dir, log_dir, test_certs, num_engines=1, with_index=False,
                     router_args=router_args, engine_shape=shape) as stack:
        yield Bounded(stack.engines["engine-0"], stack.router, http_port, metrics_port, log_dir,
                      test_certs)


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


def engine_stats(bounded: Bounded, target: str) -> pb.EngineStatsResponse:
    with bounded.channel(target) as channel:
        return pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(), timeout=10)


def greedy(max_tokens: int = 8, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              **kwargs)
