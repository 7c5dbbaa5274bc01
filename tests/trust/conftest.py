"""Certificates from the real pagedgen-certs (one CA per session), Redis and a prefix index
served over mutual TLS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from trust.credentials import TlsFiles

ENGINE_IDS = ("engine-a", "engine-b", "engine-c", "stack-0", "stack-1", "restarted")


def make_certs(out: Path, *flags: str) -> None:
    """pagedgen-certs, the console script's own code, in a child process."""
    subprocess.run([sys.executable, "-c", "from trust.certs_tool import main; main()",
                    "--out", str(out), *flags], check=True, capture_output=True)


def files(out: Path, stem: str) -> TlsFiles:
    return TlsFiles(out / f"{stem}.pem", out / f"{stem}-key.pem", out / "ca.pem")


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    engines = [arg for engine_id in ENGINE_IDS for arg in ("--engine", engine_id)]
    make_certs(out, *engines, "--engine", "", "--router", "--index", "--client")
    return out


@pytest.fixture(scope="session")
def redis_server():
    with RedisProcess() as redis:
        yield redis


@pytest.fixture(scope="session")
def tls_index(redis_server, certs):
    with IndexProcess(redis_server.url, ["--log-level", "WARNING", "--grace-s", "1"],
                      tls=files(certs, "index")) as index:
        yield index
