"""Run pagedgen-router as a subprocess on a free port and wait for health SERVING (tests,
benchmarks, pagedgen-stack --replicas)."""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from prefix_index.tools.redis_process import free_port
from prefix_index.tools.server_process import ServerProcess, wait_serving
from trust.cli_args import tls_argv
from trust.credentials import TlsFiles
from trust.identity import ROUTER_ROLE


class RouterProcess(ServerProcess):
    name = "router"

    def __init__(self, extra_args: Sequence[str] = (), port: int | None = None,
                 host: str = "127.0.0.1", start_timeout_s: float = 60.0,
                 log_path: Path | None = None, tls: TlsFiles | None = None) -> None:
        """`tls`: the router's certificate, key and CA; None: plain text."""
        self.extra_args = list(extra_args)
        self.tls = tls
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path

    def command(self) -> list[str]:
        script = shutil.which("pagedgen-router")
        base = [script] if script else [sys.executable, "-m", "router.server"]
        return base + ["--host", self.host, "--port", str(self.port), *self.extra_args,
                       *(tls_argv(self.tls) if self.tls else [])]

    def _wait(self, stopped: threading.Event | None) -> None:
        wait_serving(self.target, self.start_timeout_s, name="router", proc=self.proc,
                     log_path=self.log_path, tls=self.tls.load() if self.tls else None,
                     peer_role=ROUTER_ROLE, stopped=stopped)
