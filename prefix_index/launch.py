"""Run pagedgen-prefix-index as a subprocess on a free port and wait for health SERVING
(tests, benchmarks, the stack launcher)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_index.redis_process import free_port


def wait_serving(target: str, timeout_s: float, service: str = "",
                 proc: subprocess.Popen | None = None) -> None:
    """Blocks until the health service at `target` reports SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"prefix index exited with {proc.returncode} before serving")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefix index at {target} not SERVING after {timeout_s}s")
            time.sleep(0.05)


class IndexProcess:
    """`pagedgen-prefix-index` (or `python -m prefix_index.server`) as a child process."""

    def __init__(self, redis_url: str, extra_args: Sequence[str] = (), port: int | None = None,
                 host: str = "127.0.0.1", start_timeout_s: float = 20.0,
                 wait_for_redis: bool = True) -> None:
        self.redis_url = redis_url
        self.extra_args = list(extra_args)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.start_timeout_s = start_timeout_s
        self.wait_for_redis = wait_for_redis
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        script = shutil.which("pagedgen-prefix-index")
        base = [script] if script else [sys.executable, "-m", "prefix_index.server"]
        return base + ["--redis-url", self.redis_url, "--host", self.host,
                       "--port", str(self.port), *self.extra_args]

    def start(self) -> IndexProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=subprocess.DEVNULL)
        if self.wait_for_redis:
            try:
                wait_serving(self.target, self.start_timeout_s, proc=self.proc)
            except BaseException:
                self.kill()
                raise
        return self

    def terminate(self, timeout_s: float = 10.0) -> int:
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

    def __enter__(self) -> IndexProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()
