"""When the engine thread dies the server must stop attracting traffic and get restarted:
health NOT_SERVING at once, live streams end with INTERNAL, the process exits non-zero."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from trust.cli_args import tls_argv

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_dead_engine_thread_turns_not_serving_and_fails_live_streams(tiny_llama_dir,
                                                                     test_certs):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=64))

    async def body():
        server = EngineServer(engine, ServerOptions(port=0, tls=test_certs.material("engine")))
        port = await server.start()
        try:
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                stub = pb_grpc.GenerationStub(channel)
                before = (await health.Check(health_pb2.HealthCheckRequest())).status
                stream = stub.GenerateStream(pb.GenerateRequest(
                    text="a long one", sampling=pb.SamplingParams(max_tokens=500,
                                                                  ignore_eos=True)))
                await stream.read()  # it is running

                def crash(_engine: LLMEngine) -> None:
                    raise RuntimeError("injected: the engine thread dies here")

                engine.post(crash)
                crashed_at = time.monotonic()
                while (await health.Check(health_pb2.HealthCheckRequest())).status != NOT_SERVING:
                    assert time.monotonic() - crashed_at < 1.0, "still SERVING after 1 s"
                    await asyncio.sleep(0.01)
                not_serving_after = time.monotonic() - crashed_at
                try:
                    while True:
                        await stream.read()
                except grpc.aio.AioRpcError as error:
                    stream_error = (error.code(), error.details())
                try:
                    await stub.Generate(pb.GenerateRequest(text="after"))
                    later = None
                except grpc.aio.AioRpcError as error:
                    later = error.code()
                return before, not_serving_after, stream_error, later
        finally:
            await server.stop(1.0)

    before, not_serving_after, stream_error, later = asyncio.run(body())
    assert before == SERVING
    assert not_serving_after < 1.0
    assert stream_error[0] == grpc.StatusCode.INTERNAL
    assert "injected: the engine thread dies here" in stream_error[1]
    assert later in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)


def test_engine_process_exits_non_zero_when_its_engine_thread_dies(tiny_llama_dir, tmp_path,
                                                                   test_certs):
    port = free_port()
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.crashing_engine", "--crash-at-step", "3",
             "--model", str(tiny_llama_dir), "--port", str(port), "--num-blocks", "64",
             "--log-level", "INFO", "--grace-s", "2", *tls_argv(test_certs.files("engine"))],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
    try:
        assert "engine listening" in proc.stdout.readline()
        with test_certs.channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            try:
                list(stub.GenerateStream(pb.GenerateRequest(
                    text="x", sampling=pb.SamplingParams(max_tokens=50, ignore_eos=True)),
                    timeout=30))
                code = None
            except grpc.RpcError as error:
                code = error.code()
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == grpc.StatusCode.INTERNAL
    assert returncode == 1, log_path.read_text()[-2000:]
    assert "injected engine failure at step 3" in log_path.read_text()


def child_pids(parent_pid: int, cmdline_part: bytes) -> list[int]:
    """The live children of `parent_pid` whose command line holds `cmdline_part`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == parent_pid and cmdline_part in cmdline:
            pids.append(int(entry.name))
    return pids


def _running_stream(stub: pb_grpc.GenerationStub):
    """A long stream, its first message read: the core is stepping it."""
    stream = stub.GenerateStream(pb.GenerateRequest(
        text="a long one", sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True)),
        timeout=120)
    next(stream)
    return stream


def core_pid_of(front_pid: int) -> int:
    """The engine core: the front's child running the step loop (multiprocessing spawn)."""
    for pid in child_pids(front_pid, b"spawn_main"):
        return pid
    raise AssertionError(f"no engine core process under {front_pid}")


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True  # exited, not reaped yet by a parent that is itself gone
        time.sleep(0.05)
    return False


def test_a_killed_engine_core_ends_streams_and_the_front_exits_non_zero(tiny_llama_dir, tmp_path,
                                                                       test_certs):
    """SIGKILL of the core process (the OOM killer's way): no last word from it, so the front
    must notice by itself: NOT_SERVING, live streams INTERNAL, exit 1."""
    log_path = tmp_path / "engine.log"
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "256", "--grace-s", "2",
                                            "--log-level", "INFO"], log_path=log_path,
                           tls=test_certs.files("engine")).start()
    try:
        with test_certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            stream = _running_stream(stub)
            os.kill(core_pid_of(engine.proc.pid), signal.SIGKILL)
            try:
                for _ in stream:
                    pass
                code = None
            except grpc.RpcError as error:
                code, details = error.code(), error.details()
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError:
                status = None  # already exiting: nothing serves here any more
        returncode = engine.proc.wait(timeout=30)
    finally:
        engine.kill()
    assert code == grpc.StatusCode.INTERNAL
    assert "engine core process exited" in details
    assert status in (NOT_SERVING, None)
    assert returncode == 1, log_path.read_text()[-2000:]


def test_a_hung_engine_core_is_killed_and_the_front_exits_non_zero(tiny_llama_dir, tmp_path,
                                                                   test_certs):
    """A core alive but stuck (SIGSTOP here: a step that never returns) sent nothing, and its
    front stayed SERVING with the stream waiting for good; past --core-stall-timeout-s it is
    taken for hung: killed, the stream INTERNAL saying so, the front exits 1."""
    log_path = tmp_path / "engine.log"
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "256", "--grace-s", "2",
                                            "--core-stall-timeout-s", "2", "--log-level",
                                            "INFO"], log_path=log_path,
                           tls=test_certs.files("engine")).start()
    try:
        core = core_pid_of(engine.proc.pid)
        time.sleep(3)  # idle past the timeout: no work, no stall
        with test_certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stream = _running_stream(stub)
            os.kill(core, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                for _ in stream:
                    pass
                code = details = None
            except grpc.RpcError as error:
                code, details = error.code(), error.details()
            ended_after = time.monotonic() - stopped_at
        returncode = engine.proc.wait(timeout=30)
    finally:
        engine.kill()
    assert code == grpc.StatusCode.INTERNAL, details
    assert "sent nothing for" in details and "taken for hung and killed" in details
    assert ended_after >= 2
    assert returncode == 1, log_path.read_text()[-2000:]
    assert wait_gone(core), "the hung core outlived its front"


def test_a_core_stuck_at_sigterm_is_killed_within_the_stop_bound(tiny_llama_dir, tmp_path,
                                                                  test_certs):
    """SIGTERM with the core stuck in a step (SIGSTOP) and a request live, at the CPU's default
    stall timeout (600 s, so the watchdog stays out of it): the drain cuts the stream, and the
    stuck core is killed CORE_STOP_S after it is told to stop. It was given 30 s, past the
    drain plus the fronts' stop that the manifests' termination grace allows for."""
    from engine_service.serving.core_client import CORE_STOP_S

    log_path = tmp_path / "engine.log"
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "256", "--grace-s", "1",
                                            "--log-level", "INFO"], log_path=log_path,
                           tls=test_certs.files("engine")).start()
    try:
        core = core_pid_of(engine.proc.pid)
        with test_certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stream = _running_stream(stub)
            os.kill(core, signal.SIGSTOP)
            engine.proc.send_signal(signal.SIGTERM)
            try:
                for _ in stream:
                    pass
                code = None
            except grpc.RpcError as error:
                code = error.code()
        # The drain (1 s), the cut streams' send, the fronts' stop, then the core's bound.
        returncode = engine.proc.wait(timeout=10 + CORE_STOP_S)
    finally:
        engine.kill()
    log = log_path.read_text()
    assert code == grpc.StatusCode.UNAVAILABLE
    assert f"the engine core did not stop in {CORE_STOP_S:g} s: killing it" in log, log[-2000:]
    assert returncode == 0, log[-2000:]
    assert wait_gone(core), "the stuck core outlived its front"


def test_a_killed_front_takes_its_engine_core_with_it(tiny_llama_dir, tmp_path, test_certs):
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "64", "--log-level", "WARNING"],
                           log_path=tmp_path / "engine.log",
                           tls=test_certs.files("engine")).start()
    core = core_pid_of(engine.proc.pid)
    engine.kill()  # SIGKILL: no drain, no word to the core
    assert wait_gone(core), "the engine core outlived its front"


def test_sigterm_drains_the_front_and_stops_the_core(tiny_llama_dir, tmp_path, test_certs):
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "64", "--grace-s", "10",
                                            "--log-level", "WARNING"],
                           log_path=tmp_path / "engine.log",
                           tls=test_certs.files("engine")).start()
    core = core_pid_of(engine.proc.pid)
    try:
        with test_certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stream = stub.GenerateStream(pb.GenerateRequest(
                text="finish me", sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True)),
                timeout=120)
            first = next(stream)
            engine.proc.send_signal(signal.SIGTERM)  # the in-flight request may finish
            tokens = len(first.choices[0].token_ids) + sum(
                len(c.token_ids) for m in stream for c in m.choices)
        returncode = engine.proc.wait(timeout=60)
    finally:
        engine.kill()
    assert tokens == 40
    assert returncode == 0
    assert wait_gone(core)


def test_the_stall_timeout_a_user_gets_follows_the_device(tiny_llama_dir):
    """Unset (the default), --core-stall-timeout-s is a GPU step's 60 s or a CPU's ten minutes,
    where one step of a long prompt may take many seconds; the flag takes 0 (never)."""
    from engine_service.serving.core_client import default_stall_timeout_s
    from engine_service.serving.server import parse_args

    assert default_stall_timeout_s("cpu") == 600.0
    assert default_stall_timeout_s("cuda:0") == 60.0
    model = ["--model", str(tiny_llama_dir), "--insecure"]
    assert parse_args(model).core_stall_timeout_s is None
    assert parse_args([*model, "--core-stall-timeout-s", "0"]).core_stall_timeout_s == 0
