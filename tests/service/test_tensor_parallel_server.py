"""A tensor-parallel engine served over gRPC (pagedgen-engine --tensor-parallel-size 2, gloo on
the CPU): it streams; a worker rank killed mid-stream turns it NOT_SERVING within a second,
ends the stream with INTERNAL and makes the process exit 1; SIGTERM stops every process."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.service.test_engine_death import child_pids, core_pid_of, wait_gone

SERVING = health_pb2.HealthCheckResponse.SERVING
PROBE_TIMEOUT_S = 0.5
WORKER_MODULE = b"engine_service.model.parallel.worker"


def worker_pids(core_pid: int) -> list[int]:
    """The tensor-parallel workers the engine core started."""
    return child_pids(core_pid, WORKER_MODULE)


@pytest.fixture
def tp_engine(tiny_llama_dir, tmp_path, test_certs):
    log_path = tmp_path / "engine.log"
    engine = EngineProcess(tiny_llama_dir, ["--tensor-parallel-size", "2", "--num-blocks", "256",
                                            "--dtype", "float32", "--grace-s", "5",
                                            "--log-level", "INFO"],
                           log_path=log_path, tls=test_certs.files("engine")).start()
    core = core_pid_of(engine.proc.pid)
    workers = worker_pids(core)
    assert len(workers) == 1
    try:
        yield engine, core, workers, log_path
    finally:
        engine.kill()
        for pid in [core, *workers]:
            assert wait_gone(pid), f"process {pid} outlived the engine"


def test_tp2_streams_and_sigterm_stops_every_process(tp_engine, test_certs):
    engine, core, workers, log_path = tp_engine
    request = pb.GenerateRequest(text="The capital of France is",
                                 sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True,
                                                            temperature=0))
    with test_certs.channel(engine.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        streamed = [t for m in stub.GenerateStream(request, timeout=120)
                    for c in m.choices for t in c.token_ids]
        whole = stub.Generate(request, timeout=120).completions[0].token_ids
    assert info.tensor_parallel_size == 2
    assert len(streamed) == 16 and streamed == list(whole)
    engine.proc.send_signal(signal.SIGTERM)
    assert engine.proc.wait(timeout=60) == 0, log_path.read_text()[-2000:]
    for pid in [core, *workers]:
        assert wait_gone(pid), f"process {pid} outlived SIGTERM"


def test_a_worker_killed_mid_stream_turns_the_engine_not_serving_and_exits_1(tp_engine,
                                                                           test_certs):
    engine, core, workers, log_path = tp_engine
    with test_certs.channel(engine.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        stream = stub.GenerateStream(pb.GenerateRequest(
            text="a long one", sampling=pb.SamplingParams(max_tokens=4000, ignore_eos=True)),
            timeout=120)
        next(stream)  # it is running
        os.kill(workers[0], signal.SIGKILL)
        killed_at = time.monotonic()
        while True:
            # A probe's view: an answer other than SERVING, a refusal, or no answer within
            # the probe's timeout all read as not serving (a kubelet's timeoutSeconds is 1).
            # A 5 s timeout here once turned a front that was already going down into 5.05 s.
            try:
                status = health.Check(health_pb2.HealthCheckRequest(),
                                      timeout=PROBE_TIMEOUT_S).status
            except grpc.RpcError:
                status = None  # going down or gone: nothing serves here any more
            if status != SERVING:
                break
            time.sleep(0.01)
        not_serving_after = time.monotonic() - killed_at
        try:
            for _ in stream:
                pass
            code = None
        except grpc.RpcError as error:
            code, details = error.code(), error.details()
    returncode = engine.proc.wait(timeout=30)
    assert not_serving_after < 1.0
    assert code == grpc.StatusCode.INTERNAL
    assert "tensor-parallel" in details, details
    assert returncode == 1, log_path.read_text()[-2000:]
