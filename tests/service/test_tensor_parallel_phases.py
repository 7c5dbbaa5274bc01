"""A served tensor-parallel engine (pagedgen-engine --tensor-parallel-size 2, gloo on the CPU)
at each phase a rank can fail in (issue 33), beside the worker killed mid-decode in
test_tensor_parallel_server.py: a worker killed mid-prefill or while the engine idles, one
that hangs (SIGSTOP: the collective timeout fires), rank 0 (the engine core) killed, and
SIGTERM to the server mid-stream. Never a hang; NOT_SERVING within a second of a kill; live
streams end INTERNAL; the process exits 1 (0 for SIGTERM, which drains); no process is left.
A worker killed while the server starts (at its rendezvous, while it loads its shards) fails
the start: the server exits non-zero, leaves nothing, and the next one starts."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.model.parallel.worker import STOP_AT_ENV
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.service.test_engine_death import child_pids, core_pid_of, wait_gone
from tests.service.test_tensor_parallel_server import worker_pids
from tests.support.process_state import process_state, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
DEADLINE_S = 120.0  # generous: a loaded 2-core machine
HANG_TIMEOUT_S = 3  # the collective timeout of the engine whose worker hangs
PREFILL_CHUNK = 16  # tokens a step: a long prompt takes many steps before its first token


def _start(model_dir, log_path, certs, extra: list[str]) -> tuple[EngineProcess, int, int]:
    engine = EngineProcess(model_dir, ["--tensor-parallel-size", "2", "--num-blocks", "256",
                                       "--dtype", "float32", "--grace-s", "5",
                                       "--log-level", "INFO", *extra],
                           log_path=log_path, tls=certs.files("engine")).start()
    core = core_pid_of(engine.proc.pid)
    workers = worker_pids(core)
    assert len(workers) == 1
    return engine, core, workers[0]


def _until_not_serving(health) -> float:
    """Polls health until it is no longer SERVING; returns when that was seen."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            status = None  # already exiting: nothing serves here any more
        if status != SERVING:
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"still SERVING {DEADLINE_S:.0f} s on")


def _drain(stream) -> tuple[int, grpc.StatusCode | None, str]:
    """(tokens streamed, the stream's error code or None, its details)."""
    tokens = 0
    try:
        for message in stream:
            tokens += sum(len(c.token_ids) for c in message.choices)
    except grpc.RpcError as error:
        return tokens, error.code(), error.details()
    return tokens, None, ""


def _long_stream(stub, text: str = "a long one", max_tokens: int = 4000):
    return stub.GenerateStream(pb.GenerateRequest(
        text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        timeout=DEADLINE_S)


def _running(stub) -> bool:
    return stub.EngineStats(pb.EngineStatsRequest(), timeout=30).num_running > 0


PHASES = {
    # phase: (extra engine flags, what fails the engine)
    "prefill": (["--max-num-batched-tokens", str(PREFILL_CHUNK)], "worker"),
    "idle": ([], "worker"),
    "hung": (["--tensor-parallel-timeout-s", str(HANG_TIMEOUT_S)], "worker"),
    "rank0": ([], "core"),
    "sigterm": ([], "front"),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_rank_failing_at_each_phase_never_hangs_and_leaves_nothing(phase, tiny_llama_dir,
                                                                     tmp_path, test_certs):
    extra, _ = PHASES[phase]
    log_path = tmp_path / "engine.log"
    engine, core, worker = _start(tiny_llama_dir, log_path, test_certs, extra)
    try:
        with test_certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            stream = None
            if phase == "prefill":
                # ~1,500 prompt tokens in steps of 16: the kill lands before the first token.
                stream = _long_stream(stub, "the cat sat on the mat " * 250, max_tokens=64)
                deadline = time.monotonic() + DEADLINE_S
                while not _running(stub):
                    assert time.monotonic() < deadline, "the request never ran"
                    time.sleep(0.005)
            elif phase != "idle":
                stream = _long_stream(stub)
                next(stream)  # it is decoding
            killed_at = time.monotonic()
            if phase in ("prefill", "idle"):
                os.kill(worker, signal.SIGKILL)
            elif phase == "hung":
                os.kill(worker, signal.SIGSTOP)
            elif phase == "rank0":
                os.kill(core, signal.SIGKILL)
            else:
                engine.proc.send_signal(signal.SIGTERM)
            not_serving_after = _until_not_serving(health) - killed_at
            tokens, code, details = _drain(stream) if stream is not None else (0, None, "")
        returncode = engine.proc.wait(timeout=DEADLINE_S)
    finally:
        engine.kill()
        left = [pid for pid in (core, worker) if not wait_gone(pid)]
        for pid in left:  # (failing below; not left to stall the machine)
            os.kill(pid, signal.SIGKILL)
    log = log_path.read_text()[-3000:]
    if phase == "sigterm":
        assert returncode == 0, log
    else:
        assert returncode == 1, log
    assert left == [], f"processes {left} outlived the engine"
    if phase in ("prefill", "idle", "rank0"):
        assert not_serving_after < 1.0
    if phase == "prefill":
        assert tokens == 0, "the worker was killed after the prefill, not during it"
    if phase in ("prefill", "hung"):
        assert code == grpc.StatusCode.INTERNAL, (code, details)
        assert "tensor-parallel" in details, details
    if phase == "hung":
        assert "collective failed" in details, details
    if phase == "rank0":
        assert code == grpc.StatusCode.INTERNAL, (code, details)
        assert "engine core process exited" in details, details
    if phase == "sigterm":
        assert code in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), details


@pytest.mark.parametrize("phase", ["rendezvous", "load"])
def test_a_worker_killed_while_the_server_starts_fails_the_start(phase, tiny_llama_dir, tmp_path,
                                                                 test_certs, monkeypatch):
    """The worker stops itself on reaching the phase (PAGEDGEN_TP_TEST_STOP_AT, inherited
    through the front and the core) and is killed there."""
    log_path = tmp_path / "engine.log"
    monkeypatch.setenv(STOP_AT_ENV, phase)
    engine = EngineProcess(tiny_llama_dir, ["--tensor-parallel-size", "2", "--num-blocks", "64",
                                            "--dtype", "float32", "--log-level", "INFO"],
                           log_path=log_path, tls=test_certs.files("engine"))
    engine.spawn(engine.command(), log_path)
    monkeypatch.delenv(STOP_AT_ENV)
    found: list[int] = []
    try:
        def worker_stopped() -> bool:
            cores = child_pids(engine.proc.pid, b"spawn_main")
            found[:] = cores + (worker_pids(cores[0]) if cores else [])
            return len(found) == 2 and process_state(found[1]) == "T"

        wait_until(worker_stopped, f"a worker stopped at {phase}", DEADLINE_S)
        core, worker = found
        os.kill(worker, signal.SIGKILL)
        returncode = engine.proc.wait(timeout=DEADLINE_S)
    finally:
        engine.kill()
        left = [pid for pid in found if not wait_gone(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    log = log_path.read_text()[-3000:]
    assert returncode != 0, log
    assert f"rank 1 (pid {worker}) exited with status -9" in log, log
    assert left == [], f"processes {left} outlived the failed start"
    again = EngineProcess(tiny_llama_dir, ["--tensor-parallel-size", "2", "--num-blocks", "64",
                                           "--dtype", "float32"],
                          log_path=tmp_path / "again.log", tls=test_certs.files("engine")).start()
    try:
        with test_certs.channel(again.target) as channel:
            info = pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)
        assert info.tensor_parallel_size == 2
    finally:
        assert again.terminate() == 0
