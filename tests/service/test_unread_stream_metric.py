"""A stream the engine stops because its client does not read it (--max-unsent-tokens) is
counted among the finished requests (finish_reason "abort"), as a client's cancel is: the
dashboards that sum requests_finished must see every request that ended."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port

ABORTED = 'pagedgen_engine_requests_finished_total{finish_reason="abort"}'
MAX_UNSENT_TOKENS = 1024


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory, test_certs):
    metrics_port = free_port()
    process = EngineProcess(
        tiny_llama_dir,
        ["--num-blocks", "2048", "--block-size", "16", "--max-model-len", "1024",
         "--max-unsent-tokens", str(MAX_UNSENT_TOKENS), "--prefix-index", "none",
         "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
         "--log-level", "WARNING"],
        log_path=tmp_path_factory.mktemp("unread") / "engine.log",
        tls=test_certs.files("engine"))
    with process:
        yield process, metrics_port


def _aborted(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(ABORTED):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout_s}s")
        time.sleep(0.05)


def test_an_unread_stream_stopped_is_counted_as_aborted(engine, test_certs):
    process, metrics_port = engine
    request = pb.GenerateRequest(
        text="Count to a thousand.",
        sampling=pb.SamplingParams(n=16, temperature=1.0, seed=1, max_tokens=500,
                                   ignore_eos=True, logprobs=5))
    before = _aborted(metrics_port)
    # No BDP probing: the transport's windows stay small, so the engine's buffer fills.
    with test_certs.channel(process.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        unread = stub.GenerateStream(request, timeout=300)

        def stopped() -> bool:
            stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
            return stats.num_live_requests == 0 and stats.num_free_blocks == stats.num_blocks

        _wait(lambda: unread.initial_metadata() is not None and stopped(),
              "the unread request stopped in the engine")
        with pytest.raises(grpc.RpcError) as refused:
            for _ in unread:
                pass
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "the stream was not read" in refused.value.details()
    _wait(lambda: _aborted(metrics_port) == before + 1, "the stopped stream counted",
          timeout_s=10)
