"""An engine says SERVING once its index link's first round has ended: registered (the index
counts its first requests' prefixes, routers list it), or failed (it serves on its local LRU).
Real pagedgen-engine processes on the tiny model; the index is a dead port or a socket that
takes connections and never answers (test_index_integration covers a live index)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tests.service.index_fixtures import prompt_ids
from trust.cli_args import tls_argv

pytestmark = pytest.mark.timeout(120)

ENGINE_ARGS = ["--num-blocks", "64", "--block-size", "16", "--max-model-len", "512",
               "--log-level", "WARNING", "--grace-s", "1"]


def _index_details_at_serving(model_dir, index_target: str, tmp_path, certs) -> tuple:
    """EngineProcess returns at the first health SERVING: the engine's stats right then, and a
    4-token greedy reply after."""
    args = [*ENGINE_ARGS, "--prefix-index", index_target, "--engine-id", "engine-first"]
    with EngineProcess(model_dir, args, log_path=tmp_path / "engine.log",
                       tls=certs.files("engine")) as engine:
        with certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
            reply = stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt_ids(seed=40, length=20)),
                sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
                timeout=60)
    return stats, reply, (tmp_path / "engine.log").read_text()


def test_an_engine_whose_index_is_down_serves_on_its_local_lru(tiny_llama_dir, tmp_path,
                                                               test_certs):
    """A refused connection ends the first round at once: SERVING, degraded, having tried."""
    stats, reply, _ = _index_details_at_serving(
        tiny_llama_dir, f"127.0.0.1:{free_port()}", tmp_path, test_certs)
    assert stats.degraded and stats.index_details["state"] == "degraded"
    assert stats.index_details["registrations"] == "0"
    assert len(reply.completions[0].token_ids) == 4


def test_health_waits_out_an_index_that_does_not_answer(tiny_llama_dir, tmp_path,
                                                        test_certs):
    """An index that takes the connection and says nothing holds SERVING back until the
    Register call's deadline (3 s; the wait's own bound is 5 s): health never says
    SERVING while the link is still starting (grpc's health servicer says SERVING for "" from
    its creation, so it did as soon as the port served)."""
    with socket.socket() as silent:  # listens, never accepts: the handshake never ends
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        stats, reply, log = _index_details_at_serving(tiny_llama_dir, target, tmp_path,
                                                      test_certs)
    assert stats.index_details["state"] == "degraded", dict(stats.index_details)
    assert stats.index_details["registrations"] == "0"
    assert len(reply.completions[0].token_ids) == 4
    # The Register deadline ended the round, not the wait's own bound.
    assert "has not answered the engine's registration" not in log


@contextmanager
def _silent_index() -> Iterator[str]:
    """An index address that takes connections and never answers: the first Register waits
    out its 3 s deadline, the window the tests below act in."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        yield f"127.0.0.1:{silent.getsockname()[1]}"


def _spawn(model_dir, index_target: str, certs, log_path: Path, *extra: str):
    port = free_port()
    command = [sys.executable, "-m", "engine_service.serving.server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS, "--prefix-index",
               index_target, "--engine-id", "engine-waiting", *extra,
               *tls_argv(certs.files("engine"))]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, f"127.0.0.1:{port}"


def _health(certs, target: str) -> int | None:
    """The engine's gRPC health, None while it does not answer."""
    try:
        with certs.channel(target) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5).status
    except grpc.RpcError:
        return None


def _wait_until_waiting(proc, certs, target: str) -> None:
    """Until gRPC health answers NOT_SERVING: the server runs and waits for the index."""
    deadline = time.monotonic() + 60
    while _health(certs, target) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert proc.poll() is None, "the engine exited before it served"
        assert time.monotonic() < deadline, "the engine never answered health"
        time.sleep(0.05)


def _core_pid(pid: int) -> int:
    """The engine core: the front's child started by multiprocessing's spawn."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            return int(child)
    raise AssertionError(f"no engine core among {children}")


def test_a_core_dying_while_health_waits_ends_the_engine(tiny_llama_dir, tmp_path,
                                                         test_certs):
    """Exit 1 at once, never SERVING, no port announced (the front used to sit out the wait,
    say SERVING after the core's death had said NOT_SERVING, and print its port)."""
    log_path = tmp_path / "engine.log"
    with _silent_index() as index:
        proc, target = _spawn(tiny_llama_dir, index, test_certs, log_path)
        try:
            _wait_until_waiting(proc, test_certs, target)
            os.kill(_core_pid(proc.pid), signal.SIGKILL)
            stdout, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    log = log_path.read_text()
    assert proc.returncode == 1, log[-3000:]
    assert b"engine listening" not in stdout
    assert "has not answered the engine's registration" not in log
    assert "engine serving on" not in log


def test_sigterm_while_health_waits_stops_cleanly(tiny_llama_dir, tmp_path, test_certs):
    log_path = tmp_path / "engine.log"
    with _silent_index() as index:
        proc, target = _spawn(tiny_llama_dir, index, test_certs, log_path)
        try:
            _wait_until_waiting(proc, test_certs, target)
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        finally:
            proc.kill()
    log = log_path.read_text()
    assert proc.returncode == 0, log[-3000:]
    # The gRPC server was stopped, not dropped with the loop.
    assert "never awaited" not in log and "Event loop is closed" not in log, log[-3000:]


def test_http_health_waits_with_grpc_health(tiny_llama_dir, tmp_path, test_certs):
    """HTTP /health (an HTTP readiness probe) says 200 only once the link's first round has
    ended, as gRPC health does (it said 200 from the start of the wait)."""
    http_port = free_port()
    log_path = tmp_path / "engine.log"
    context = test_certs.ssl_context("client")  # mutual TLS: a client certificate
    with _silent_index() as index:
        proc, target = _spawn(tiny_llama_dir, index, test_certs, log_path,
                              "--http-port", str(http_port))
        try:
            _wait_until_waiting(proc, test_certs, target)
            statuses = []
            while not statuses or statuses[-1] != 200:
                assert len(statuses) < 600, statuses[-5:]
                try:
                    with urllib.request.urlopen(f"https://127.0.0.1:{http_port}/health",
                                                timeout=0.5, context=context) as reply:
                        statuses.append(reply.status)
                except OSError:
                    statuses.append(None)
                    time.sleep(0.05)
            with test_certs.channel(target) as channel:
                stats = pb_grpc.GenerationStub(channel).EngineStats(
                    pb.EngineStatsRequest(), timeout=10)
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
    assert stats.index_details["state"] == "degraded", dict(stats.index_details)
