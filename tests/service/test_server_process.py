"""The server process: Prometheus metrics, and the SIGTERM drain (health NOT_SERVING, new
requests UNAVAILABLE, in-flight requests finish, exit 0)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.service.conftest import has_index_link
from tests.support.tls import SessionCerts


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_metrics_endpoint(engine_server, stub):
    before = engine_server.metrics_text()
    ttft_before = metric(before, "pagedgen_engine_time_to_first_token_seconds_count")
    reply = stub.Generate(pb.GenerateRequest(
        text="Count the metrics", sampling=pb.SamplingParams(temperature=0, max_tokens=5,
                                                               ignore_eos=True)))
    assert reply.usage.completion_tokens == 5
    text = engine_server.metrics_text()
    assert metric(text, "pagedgen_engine_time_to_first_token_seconds_count") == ttft_before + 1
    assert metric(text, "pagedgen_engine_time_per_output_token_seconds_count") >= 1
    assert metric(text, "pagedgen_engine_generation_tokens_total") >= 5
    assert metric(text, "pagedgen_engine_prefix_cache_queries_total") >= reply.usage.prompt_tokens
    assert 'pagedgen_engine_requests_finished_total{finish_reason="length"}' in text
    assert metric(text, "pagedgen_engine_kv_blocks") == 240
    # Between the floor (10%) and the ceiling (50%) of the pool, as recent demand left it.
    assert 24 <= metric(text, "pagedgen_engine_pin_budget_blocks") <= 120
    assert metric(text, "pagedgen_engine_tensor_parallel_size") == 1
    assert stub.ModelInfo(pb.ModelInfoRequest()).tensor_parallel_size == 1
    # Idle again: the gauges were refreshed when the engine went idle.
    assert metric(text, "pagedgen_engine_num_requests_running") == 0
    assert metric(text, "pagedgen_engine_kv_cache_usage_perc") == 0
    for name in ("num_requests_waiting", "num_requests_swapped", "num_preemptions_total",
                 "prefix_cache_hits_total", "num_prefill_deferrals_total"):
        metric(text, f"pagedgen_engine_{name}")
    if has_index_link():
        assert metric(text, "pagedgen_engine_prefix_index_degraded") == 0
        assert re.search(r'^pagedgen_engine_index_rpc_seconds_count\{method="\w+"\} [1-9]',
                         text, flags=re.M)
        stats = stub.EngineStats(pb.EngineStatsRequest())
        assert not stats.degraded and stats.index_details


def health_status(target: str, certs: SessionCerts) -> int:
    with certs.channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=2)
        return reply.status


def test_sigterm_drains_in_flight_requests(tiny_llama_dir, tmp_path, test_certs):
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "128", "--grace-s", "60",
                                            "--prefix-index", "none", "--log-level", "INFO"],
                           log_path=tmp_path / "engine.log",
                           tls=test_certs.files("engine")).start()
    try:
        async def body():
            async with test_certs.aio_channel(engine.target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                call = stub.GenerateStream(pb.GenerateRequest(
                    text="Keep going while the server drains",
                    sampling=pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)),
                    timeout=120)
                first = await call.read()
                engine.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 5
                not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
                while health_status(engine.target, test_certs) != not_serving:
                    assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
                    await asyncio.sleep(0.02)
                try:
                    await stub.Generate(pb.GenerateRequest(text="too late"), timeout=5)
                    refused = None
                except grpc.aio.AioRpcError as error:
                    refused = (error.code(), error.details())
                try:  # (before the drain: FAILED_PRECONDITION, this engine has no index)
                    await stub.PinPrefix(pb.PinPrefixRequest(text="too late"), timeout=5)
                    pin_refused = None
                except grpc.aio.AioRpcError as error:
                    pin_refused = (error.code(), error.details())
                messages = [first]
                while (message := await call.read()) is not grpc.aio.EOF:
                    messages.append(message)
                return refused, pin_refused, messages, await call.code()

        refused, pin_refused, messages, code = asyncio.run(body())
        assert refused is not None and refused[0] == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused[1]
        assert pin_refused is not None and pin_refused[0] == grpc.StatusCode.UNAVAILABLE
        assert "draining" in pin_refused[1]
        assert code == grpc.StatusCode.OK and messages[-1].finished
        assert messages[-1].usage.completion_tokens == 400  # finished, not cut short
        assert [c.finish_reason for c in messages[-1].choices] == [pb.FINISH_REASON_LENGTH]
        engine.proc.wait(30)
        log = (tmp_path / "engine.log").read_text()
        assert engine.proc.returncode == 0, log[-2000:]
        assert "draining (grace 60.0s, 1 live requests)" in log  # it was in flight at SIGTERM
    finally:
        engine.kill()


def _engines_on_port(port: int) -> list[int]:
    """Our children whose command line serves `port`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == os.getpid() and str(port).encode() in args:
            pids.append(int(entry.name))
    return pids


def test_with_on_a_started_engine_runs_one_and_stops_it(tiny_llama_dir, tmp_path, test_certs):
    """`with EngineProcess(...).start() as e:` (as tests and benchmarks write it) must not
    start a second engine on the same port: the first one, no longer tracked, outlived the
    block (found as leaked engines after benchmark runs)."""
    engine = EngineProcess(tiny_llama_dir, ["--prefix-index", "none"],
                           log_path=tmp_path / "engine.log", tls=test_certs.files("engine"))
    with engine.start() as same:
        assert same is engine
        assert _engines_on_port(engine.port) == [engine.proc.pid]
        pid = engine.proc.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert _engines_on_port(engine.port) == []
