"""Run pagedgen-engine as a subprocess on a free port and wait for health SERVING
(tests, benchmarks, the stack launcher)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_index.tools.redis_process import free_port
from prefix_index.tools.server_process import ServerProcess, wait_serving


def wait_engine_serving(target: str, timeout_s: float, proc: subprocess.Popen | None = None,
                        log_path: Path | None = None) -> None:
    """Blocks until the engine's health service at `target` reports SERVING."""
    wait_serving(target, timeout_s, name="engine", proc=proc, log_path=log_path)


class EngineProcess(ServerProcess):
    """`pagedgen-engine` (or `python -m engine_service.serving.server`) as a child process; its
    stderr goes to `log_path` when given (kept for errors), else is inherited."""

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

    def command(self) -> list[str]:
        script = shutil.which("pagedgen-engine")
        base = [script] if script else [sys.executable, "-m", "engine_service.serving.server"]
        return base + ["--model", self.model, "--host", self.host, "--port", str(self.port),
                       *self.extra_args]

    def start(self) -> EngineProcess:
        self.spawn(self.command(), self.log_path)
        try:
            wait_engine_serving(self.target, self.start_timeout_s, self.proc, self.log_path)
        except BaseException:
            self.kill()
            raise
        return self

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain, then exit); returns the exit code."""
        return super().terminate(timeout_s)


def main(argv: list[str] | None = None) -> None:
    """`python -m engine_service.tools.launch --check HOST:PORT`: exit 0 when the gRPC server there
    reports SERVING (container healthchecks; works for the engine and the prefix index)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine_service.tools.launch")
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
