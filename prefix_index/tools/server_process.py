"""A gRPC server run as a child process, ready once its health service says SERVING.

Shared by the prefix index and engine launchers (tests, benchmarks, pagedgen-stack).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_index.tools.redis_process import tied_to_this_process
from trust.credentials import TlsMaterial, sync_channel


def wait_serving(target: str, timeout_s: float, *, name: str = "server", service: str = "",
                 proc: subprocess.Popen | None = None, log_path: Path | None = None,
                 tls: TlsMaterial | None = None, peer_role: str | None = None,
                 stopped: threading.Event | None = None) -> None:
    """Blocks until the health service at `target` reports SERVING; fails early if `proc`
    exits first (with the tail of its log, when there is one). `tls`: asked over mutual TLS
    (presenting that certificate; the server must hold a `peer_role` one), else plain text.
    `stopped`: once set (from another thread), returns within a Check's timeout, serving
    or not: whoever set it stops the server."""
    deadline = time.monotonic() + timeout_s
    with sync_channel(target, tls, peer_role) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while stopped is None or not stopped.is_set():
            if proc is not None and proc.poll() is not None:
                tail = log_path.read_text()[-3000:] if log_path and log_path.exists() else ""
                raise RuntimeError(f"{name} exited with {proc.returncode} before serving:\n{tail}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} at {target} not SERVING after {timeout_s}s")
            if stopped is not None:
                stopped.wait(0.05)
            else:
                time.sleep(0.05)


class ServerProcess:
    """Lifecycle of one child server: launch, wait_serving (subclasses' _wait), SIGTERM drain,
    kill, `with`."""

    name = "server"
    proc: subprocess.Popen | None = None
    log_path: Path | None = None  # the child's stderr, when given
    env: dict[str, str] | None = None  # joins the child's environment
    # A session of its own, SIGTERMed when this process dies (tied_to_this_process).
    own_session = False
    host: str
    port: int

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def spawn(self, command: list[str], log_path: Path | None = None) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        command, session = (tied_to_this_process(command) if self.own_session
                            else (command, {}))
        stderr = open(log_path, "wb") if log_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                         stderr=stderr, **session)
        finally:
            if stderr is not None:
                stderr.close()  # the child holds its own descriptor
        return self.proc

    def command(self) -> list[str]:
        raise NotImplementedError

    def _wait(self, stopped: threading.Event | None) -> None:
        """Blocks until the launched server serves (wait_serving, with its name and TLS)."""
        raise NotImplementedError

    def start(self) -> ServerProcess:
        self.launch()
        return self.wait_serving()

    def launch(self) -> ServerProcess:
        """The process started, not waited for: several servers start at once, then each is
        waited for (wait_serving)."""
        self.spawn(self.command(), self.log_path)
        return self

    def wait_serving(self, stopped: threading.Event | None = None) -> ServerProcess:
        """Blocks until the launched server serves; it is killed if it does not. `stopped`:
        set from another thread, this returns soon (wait_serving), leaving the process to
        whoever set it."""
        try:
            self._wait(stopped)
        except BaseException:
            self.kill()
            raise
        return self

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM (drain, then exit); returns the exit code. (`proc` read once: a start's
        wait may kill the process from its own thread meanwhile.)"""
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None
        return proc.returncode

    def kill(self) -> None:
        proc = self.proc
        if proc is not None:
            proc.kill()
            proc.wait()
            self.proc = None

    def __enter__(self):
        # `with server.start():` (started already) must not start a second process: that one
        # fails to bind the port, and the first, no longer tracked, outlives the block.
        if self.proc is not None and self.proc.poll() is None:
            return self
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()
