"""Run pagedgen-engine as a subprocess on a free port and wait for health SERVING
(tests, benchmarks, the stack launcher)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_index.tools.redis_process import free_port
from prefix_index.tools.server_process import ServerProcess, wait_serving
from trust.cli_args import add_tls_args, resolve_tls_args, tls_argv
from trust.credentials import TlsFiles, sync_channel
from trust.identity import ENGINE_ROLE, INDEX_ROLE, ROUTER_ROLE


def wait_engine_serving(target: str, timeout_s: float, proc: subprocess.Popen | None = None,
                        log_path: Path | None = None, tls: TlsFiles | None = None,
                        stopped: threading.Event | None = None, name: str = "engine") -> None:
    """Blocks until the engine's health service at `target` reports SERVING (`tls`: over
    mutual TLS, presenting that certificate; `stopped`: as wait_serving's; `name`: what its
    errors call it)."""
    wait_serving(target, timeout_s, name=name, proc=proc, log_path=log_path,
                 tls=tls.load() if tls else None, peer_role=ENGINE_ROLE, stopped=stopped)


class EngineProcess(ServerProcess):
    """`pagedgen-engine` (or `python -m engine_service.serving.server`) as a child process; its
    stderr goes to `log_path` when given (kept for errors), else is inherited."""

    name = "engine"

    def __init__(self, model: str | Path, extra_args: Sequence[str] = (),
                 port: int | None = None, host: str = "127.0.0.1",
                 start_timeout_s: float = 120.0, log_path: Path | None = None,
                 tls: TlsFiles | None = None) -> None:
        """`tls`: the engine's certificate, key and CA; None: plain text."""
        self.model = str(model)
        self.tls = tls
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
                       *self.extra_args, *(tls_argv(self.tls) if self.tls else [])]

    def _wait(self, stopped: threading.Event | None) -> None:
        wait_engine_serving(self.target, self.start_timeout_s, self.proc, self.log_path,
                            self.tls, stopped, self.name)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain, then exit); returns the exit code."""
        return super().terminate(timeout_s)


def parse_check_args(argv: list[str] | None = None):
    """The --check command's flags (deployment tests parse their probes with it)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine_service.tools.launch")
    p.add_argument("--check", required=True, metavar="HOST:PORT")
    p.add_argument("--timeout-s", type=float, default=3.0)
    # A probe reaches the pod as localhost, which a certificate issued for the Service's names
    # (cert-manager's, say) does not name: with --role the server proves that role instead
    # (<role>.pagedgen.internal), as the services check each other.
    p.add_argument("--role", choices=(ENGINE_ROLE, ROUTER_ROLE, INDEX_ROLE), default=None,
                   help="over TLS, the role the server's certificate must hold (engine, router, "
                        "index), checked by its <role>.pagedgen.internal name instead of the "
                        "target's host")
    add_tls_args(p)
    args = p.parse_args(argv)
    resolve_tls_args(p, args)
    return args


def main(argv: list[str] | None = None) -> None:
    """`python -m engine_service.tools.launch --check HOST:PORT`: exit 0 when the gRPC server there
    reports SERVING (container healthchecks of the engine, the router and the prefix index)."""
    args = parse_check_args(argv)
    try:
        with sync_channel(args.check, args.tls, peer_role=args.role) as channel:
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
