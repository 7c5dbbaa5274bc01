"""Run pagedgen-engine as a subprocess on a free port and wait for health SERVING
(tests, benchmarks, the stack launcher)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_index.redis_process import free_port


def wait_engine_serving(target: str, timeout_s: float, proc: subprocess.Popen | None = None,
                        log_path: Path | None = None) -> None:
    """Blocks until the engine's health service at `target` reports SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                tail = log_path.read_text()[-3000:] if log_path and log_path.exists() else ""
                raise RuntimeError(f"engine exited with {proc.returncode} before serving:\n{tail}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine at {target} not SERVING after {timeout_s}s")
            time.sleep(0.05)


class EngineProcess:
    """`pagedgen-engine` (or `python -m engine_service.server`) as a child process; its stderr
    goes to `log_path` when given (kept for errors), else is inherited."""

    def __init__(self, model: str | Path, extra_args: Sequence[str] = (),
                 port: int | None = None, host: str = "127.0.0.1",
                 start_timeout_s: float = 120.0, log_path: Path | None = None) -> None:
        self.model = str(model)
        self.extra_args = list(extra_args)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        script = shutil.which("pagedgen-engine")
        base = [script] if script else [sys.executable, "-m", "engine_service.server"]
        return base + ["--model", self.model, "--host", self.host, "--port", str(self.port),
                       *self.extra_args]

    def start(self) -> EngineProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        stderr = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=subprocess.DEVNULL,
                                         stderr=stderr)
        finally:
            if stderr is not None:
                stderr.close()  # the child holds its own descriptor
        try:
            wait_engine_serving(self.target, self.start_timeout_s, self.proc, self.log_path)
        except BaseException:
            self.kill()
            raise
        return self

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain, then exit); returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()


def main(argv: list[str] | None = None) -> None:
    """`python -m engine_service.launch --check HOST:PORT`: exit 0 when the gRPC server there
    reports SERVING (container healthchecks; works for the engine and the prefix index)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine_service.launch")
    p.add_argument("--check", required=True, metavar="HOST:PORT")
    p.add_argument("--timeout-s", type=float, default=3.0)
    args = p.parse_args(argv)
    try:
        with grpc.insecure_channel(args.check) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=args.timeout_s)
    except grpc.RpcError as error:
        print(f"{args.check}: {error.code().name}", file=sys.stderr)
        sys.exit(1)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.check}: {status}")
    sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)


if __name__ == "__main__":
    main()
