"""Run pagedgen-prefix-index as a subprocess on a free port and wait for health SERVING
(tests, benchmarks, the stack launcher)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence

from prefix_index.server.redis_url import REDIS_URL_ENV
from prefix_index.tools.redis_process import free_port
from prefix_index.tools.server_process import ServerProcess
from prefix_index.tools.server_process import wait_serving as wait_until_serving
from trust.cli_args import tls_argv
from trust.credentials import TlsFiles
from trust.identity import INDEX_ROLE


def wait_serving(target: str, timeout_s: float, service: str = "",
                 proc: subprocess.Popen | None = None, tls: TlsFiles | None = None,
                 stopped: threading.Event | None = None) -> None:
    """Blocks until the prefix index at `target` reports SERVING (`tls`: over mutual TLS,
    presenting that certificate; `stopped`: as server_process.wait_serving's)."""
    wait_until_serving(target, timeout_s, name="prefix index", service=service, proc=proc,
                       tls=tls.load() if tls else None, peer_role=INDEX_ROLE, stopped=stopped)


class IndexProcess(ServerProcess):
    """`pagedgen-prefix-index` (or `python -m prefix_index.server.main`) as a child process."""

    name = "prefix index"

    def __init__(self, redis_url: str, extra_args: Sequence[str] = (), port: int | None = None,
                 host: str = "127.0.0.1", start_timeout_s: float = 20.0,
                 wait_for_redis: bool = True, tls: TlsFiles | None = None,
                 redis_url_in_env: bool = False) -> None:
        """`tls`: the index's certificate, key and CA (mutual TLS); None: plain text.
        `redis_url_in_env`: the URL (a password in it) goes in the child's environment
        ($PAGEDGEN_REDIS_URL, readable by this user alone), not on its command line."""
        self.redis_url = redis_url
        self.redis_url_in_env = redis_url_in_env
        self.env = {REDIS_URL_ENV: redis_url} if redis_url_in_env else None
        self.tls = tls
        self.extra_args = list(extra_args)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.start_timeout_s = start_timeout_s
        self.wait_for_redis = wait_for_redis
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        script = shutil.which("pagedgen-prefix-index")
        base = [script] if script else [sys.executable, "-m", "prefix_index.server.main"]
        url = [] if self.redis_url_in_env else ["--redis-url", self.redis_url]
        return base + [*url, "--host", self.host,
                       "--port", str(self.port), *self.extra_args,
                       *(tls_argv(self.tls) if self.tls else [])]

    def _wait(self, stopped: threading.Event | None) -> None:
        if self.wait_for_redis:  # (without Redis it serves nothing: not waited for)
            wait_serving(self.target, self.start_timeout_s, proc=self.proc, tls=self.tls,
                         stopped=stopped)
