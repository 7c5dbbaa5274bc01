"""Starting pagedgen-prefix-index as an operator does: flags that cannot work are refused at
start, naming the flag, the value and what is allowed (not served wrongly: --port 70000 served
on 4464); a bad Redis URL is refused without a traceback or its password; a password given as
a query argument (?password=, which redis-py takes) never reaches the log; and the log says
why Redis is unreachable. Real redis-server and index processes, the index on the session's
certificates."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

from prefix_index.server.main import parse_args
from prefix_index.tools.launch import IndexProcess, wait_serving
from prefix_index.tools.redis_process import RedisProcess, free_port
from trust.cli_args import tls_argv

PASSWORD = "pw-5e0a7c-never-logged"
INDEX_ARGS = ["--log-level", "INFO", "--grace-s", "1", "--probe-interval-s", "0.2",
              "--redis-timeout-s", "0.5"]


def _index_command() -> list[str]:
    script = shutil.which("pagedgen-prefix-index")
    return [script] if script else [sys.executable, "-m", "prefix_index.server.main"]


@pytest.mark.parametrize(("flags", "fragments"), [
    (["--port", "70000"], ["--port: 70000", "0..65535"]),
    (["--port", "-1"], ["--port: -1", "0..65535"]),
    (["--metrics-port", "65536"], ["--metrics-port: 65536", "0..65535", "0 = off"]),
    (["--metrics-port", "-5"], ["--metrics-port: -5", "0..65535"]),
    (["--max-ops", "0"], ["--max-ops: 0", "> 0"]),
    (["--max-ops", "-3"], ["--max-ops: -3", "> 0"]),
    (["--max-chain", "0"], ["--max-chain: 0", "> 0"]),
    (["--hot-threshold", "-1"], ["--hot-threshold: -1", ">= 0"]),
    (["--grace-s", "-1"], ["--grace-s: -1.0", ">= 0"]),
    (["--grace-s", "inf"], ["--grace-s: inf", "finite"]),
    (["--hot-window-s", "nan"], ["--hot-window-s: nan", "finite number > 0"]),
    (["--view-ttl-s", "inf"], ["--view-ttl-s: inf", "finite number > 0"]),
    (["--lease-s", "7200"], ["--lease-s: 7200.0", "--max-lease-s (3600.0)"]),
    (["--lease-s", "60", "--max-lease-s", "30"], ["--lease-s: 60.0", "--max-lease-s (30.0)"]),
])
def test_a_flag_that_cannot_work_is_refused_at_start(flags, fragments, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--insecure", *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_the_limits_flags_still_take_good_values():
    args = parse_args(["--insecure", "--port", "65535", "--metrics-port", "0", "--max-ops", "1",
                       "--max-chain", "1", "--hot-threshold", "0", "--grace-s", "0",
                       "--lease-s", "3600"])
    assert (args.port, args.max_ops, args.max_chain, args.lease_s) == (65535, 1, 1, 3600.0)
    assert not math.isinf(args.grace_s)


@pytest.mark.parametrize(("url", "reason"), [
    (f"redis://:{PASSWORD}@127.0.0.1:notaport/0", "its port is not a number"),
    (f"redis://:{PASSWORD}@127.0.0.1:99999/0", "its port is not a number"),
    (f"http://:{PASSWORD}@127.0.0.1:6379/0", "its scheme 'http' is not one of"),
    (f"redis://:{PASSWORD}@127.0.0.1:6379/zero", "its path is not a database number"),
    (f"redis://:{PASSWORD}@127.0.0.1:6379/0?socket_timeout=soon", "'socket_timeout'"),
    # A '#' or '/' left unescaped in a password: the parser's own error quoted its pieces.
    (f"redis://:ab#{PASSWORD}@127.0.0.1:6379/0", "it has a '#'"),
    (f"redis://:ab#cd{PASSWORD}:x@127.0.0.1:6379/0", "it has a '#'"),
    (f"redis://:ab/{PASSWORD}@127.0.0.1:6379/0", "its host is empty (an unescaped '/'"),
    # (A digit to Python, not to redis-py, which took database 0.)
    (f"redis://:{PASSWORD}@127.0.0.1:6379/\u00b2", "its path is not a database number"),
])
def test_a_bad_redis_url_is_refused_without_a_traceback_or_its_password(url, reason,
                                                                        test_certs):
    """It was a Python traceback (from urllib or redis-py) at start, some quoting the URL's
    pieces. From the variable, as compose and Kubernetes pass it (a password inside)."""
    env = {**os.environ, "PAGEDGEN_REDIS_URL": url}
    done = subprocess.run([*_index_command(), "--port", "0",
                           *tls_argv(test_certs.files("index"))],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "--redis-url (or $PAGEDGEN_REDIS_URL)" in done.stderr, done.stderr
    assert reason in done.stderr, done.stderr
    assert "expected redis://" in done.stderr
    assert PASSWORD not in done.stderr + done.stdout
    assert "ab#" not in done.stderr + done.stdout


def test_urls_redis_py_reads_as_meant_are_taken_and_shown_without_secrets():
    from prefix_index.server.redis_url import redacted_url, url_problem

    for url in ("redis://", "redis:///0", "redis://localhost", "redis://u@h",
                "redis://[::1]:6379/0", "unix:///tmp/r.sock?db=1", "rediss://h:6380/0"):
        assert url_problem(url) is None, url  # (no host: redis-py's localhost:6379)
    assert (redacted_url(f"unix:///tmp/r.sock?db=2&password={PASSWORD}")
            == "unix:///tmp/r.sock?db=2&password=***")


def _wait_for_line(path, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = path.read_text() if path.exists() else ""
        if text in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never logged; log:\n{path.read_text()[-3000:]}")


def test_a_password_in_the_urls_query_is_redacted_in_the_log(test_certs, tmp_path):
    """redis-py takes ?password= (and ?username=) from the query: the index served with it and
    logged the URL, password and all."""
    with RedisProcess(password=PASSWORD) as redis_process:
        url = f"redis://{redis_process.host}:{redis_process.port}/0?password={PASSWORD}"
        log_path = tmp_path / "index.log"
        index = IndexProcess(url, INDEX_ARGS, tls=test_certs.files("index"))
        index.spawn(index.command(), log_path)
        try:
            wait_serving(index.target, index.start_timeout_s, proc=index.proc, tls=index.tls)
            log = _wait_for_line(log_path, "prefix index serving on")
        finally:
            index.kill()
        assert "?password=***" in log, log
        assert PASSWORD not in log


def test_the_log_says_why_redis_is_unreachable(test_certs, tmp_path):
    """'redis unreachable: not serving' and nothing more: a wrong password, a refused
    connection and a hung server read the same. Once per outage, never the password."""
    with RedisProcess(password=PASSWORD) as redis_process:
        wrong = f"redis://:wrong-{PASSWORD}@{redis_process.host}:{redis_process.port}/0"
        log_path = tmp_path / "index-wrong-password.log"
        index = IndexProcess(wrong, INDEX_ARGS, wait_for_redis=False,
                             tls=test_certs.files("index"))
        index.spawn(index.command(), log_path)
        try:
            log = _wait_for_line(log_path, "redis unreachable: not serving (")
            time.sleep(1.0)  # five more failed probes: logged once
            log = log_path.read_text()
        finally:
            index.kill()
        assert "AuthenticationError" in log, log
        assert log.count("redis unreachable") == 1, log
        assert PASSWORD not in log

    nobody = f"redis://127.0.0.1:{free_port()}/0"
    log_path = tmp_path / "index-no-redis.log"
    index = IndexProcess(nobody, INDEX_ARGS, wait_for_redis=False, tls=test_certs.files("index"))
    index.spawn(index.command(), log_path)
    try:
        log = _wait_for_line(log_path, "redis unreachable: not serving (")
    finally:
        index.kill()
    assert "ConnectionError" in log and "connecting to 127.0.0.1" in log, log


class _SlowResetStore:
    """What RedisHealth asks of the store: a ping, and a reset of its connections that takes
    a while (a disconnect of every pooled connection is awaited)."""

    def __init__(self) -> None:
        self.resets = 0

    async def ping(self) -> bool:
        return True

    async def reset_connections(self) -> None:
        self.resets += 1
        await asyncio.sleep(0.05)


def test_an_outage_noticed_twice_at_once_is_logged_and_reset_once(caplog):
    """The probe and a failing call notice the same outage together: it was logged twice and
    the connections reset twice; and Redis back during the reset must end SERVING."""
    from grpc_health.v1 import health_pb2
    from grpc_health.v1.health import aio as health_aio

    from prefix_index.server.health import RedisHealth
    from prefix_index.server.metrics import IndexMetrics

    async def body():
        store, servicer = _SlowResetStore(), health_aio.HealthServicer()
        health = RedisHealth(store, servicer, [""], IndexMetrics(), 0.2, 0.5)
        await health.set_redis_up(True)
        with caplog.at_level(logging.INFO, logger="prefix_index.server.health"):
            await asyncio.gather(health.set_redis_up(False, "probe: refused"),
                                 health.set_redis_up(False, "Apply: refused"))
        assert store.resets == 1
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert [r.getMessage() for r in down] == ["redis unreachable: not serving (probe: refused)"]

        async def status() -> int:
            reply = await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
            return reply.status

        assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
        # Back while the outage's reset is still running: the last word is SERVING.
        going_down = asyncio.create_task(health.set_redis_up(False, "probe: timeout"))
        await asyncio.sleep(0)
        await health.set_redis_up(True)
        await health.set_redis_up(True)
        await going_down  # (it had already started: its reset ran)
        assert health.redis_up is True
        assert await status() == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(body())
