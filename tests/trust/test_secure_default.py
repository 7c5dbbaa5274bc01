"""Secure is the default for every service alone (issue 32): given no TLS files and no
--insecure, each console script that serves or connects refuses to start (exit 2) with a message
that says how to get TLS; with --insecure it serves in plain text and logs a warning.

The only tests that run services with --insecure (the README's examples call an engine on
TLS with an API key: tests/support/readme_server.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_service.tools.launch import EngineProcess
from prefix_index.tools.launch import IndexProcess, wait_serving
from prefix_index.tools.redis_process import RedisProcess
from router.tools.launch import RouterProcess

# Each console script's module, and the flags it needs besides TLS.
SCRIPTS = {
    "pagedgen-prefix-index": ("prefix_index.server.main", ["--redis-url", "redis://127.0.0.1:1"]),
    "pagedgen-engine": ("engine_service.serving.server", ["--model", "/nonexistent-model"]),
    "pagedgen-router": ("router.server", ["--engines", "127.0.0.1:1"]),
    "launch --check": ("engine_service.tools.launch", ["--check", "127.0.0.1:1"]),
}
NO_TLS_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDGEN_TLS_")}
WARNING = "runs in PLAIN TEXT (--insecure)"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_tls_files_and_no_insecure_is_refused(script):
    module, flags = SCRIPTS[script]
    done = subprocess.run([sys.executable, "-m", module, *flags], env=NO_TLS_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    for named in ("--tls-cert", "--tls-key", "--tls-ca", "PAGEDGEN_TLS_CERT",
                  "PAGEDGEN_TLS_KEY", "PAGEDGEN_TLS_CA", "pagedgen-certs", "--insecure"):
        assert named in done.stderr, (named, done.stderr)


def test_with_insecure_each_service_serves_in_plain_text_and_warns(tiny_llama_dir, tmp_path):
    with RedisProcess() as redis:
        index_log = tmp_path / "index.log"
        index = IndexProcess(redis.url, ["--insecure"])
        with open(index_log, "wb") as log:
            index.proc = subprocess.Popen(index.command(), stdout=subprocess.DEVNULL, stderr=log,
                                          env=NO_TLS_ENV)
        try:
            wait_serving(index.target, 30.0, proc=index.proc)  # plain text: no tls
        finally:
            index.kill()
        assert WARNING in index_log.read_text()
        assert "pagedgen-prefix-index" in index_log.read_text()

    engine = EngineProcess(tiny_llama_dir, ["--prefix-index", "none", "--num-blocks", "64",
                                            "--insecure", "--grace-s", "1"],
                           log_path=tmp_path / "engine.log")
    with engine:
        router = RouterProcess(["--engines", engine.target, "--insecure", "--grace-s", "1"],
                               log_path=tmp_path / "router.log")
        with router:
            pass  # SERVING, over plain text (the launchers asked without TLS)
    for name in ("engine", "router"):
        text = (tmp_path / f"{name}.log").read_text()
        assert WARNING in text and f"pagedgen-{name}" in text, text[-2000:]
