"""Redis's readiness probe in deploy/kubernetes, run as written against a redis-server with a
password: ready only when Redis answers PONG to the password the pod's Secret holds, which the
probe takes from REDISCLI_AUTH, not from its command line. (`redis-cli ping` alone exits 0 on an
error reply such as NOAUTH too: it would only check the port.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from prefix_index.tools.redis_process import RedisProcess
from tests.deploy.kustomize_render import render
from tests.deploy.pods import Pod, container_env, pods, secret_placeholder

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base"
PASSWORD = secret_placeholder("pagedgen-redis", "password")


@pytest.fixture(scope="module")
def redis_pod() -> tuple[Pod, dict]:
    [pod] = [p for p in pods(render(BASE)) if p.workload == "redis"]
    [container] = pod.spec["containers"]
    return pod, container


@pytest.fixture(scope="module")
def server():
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed: the probe runs it")
    try:
        redis = RedisProcess(password=PASSWORD)
    except FileNotFoundError as error:  # no redis-server
        pytest.skip(str(error))
    with redis:
        yield redis


def probe(redis_pod, server, tmp_path: Path, env: dict[str, str]) -> int:
    """The probe's command as written, in env; redis-cli reaches this server's port through a
    wrapper on PATH (in the pod it dials its default, 6379, on localhost)."""
    wrapper = tmp_path / "redis-cli"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("redis-cli")} -p {server.port} "$@"\n')
    wrapper.chmod(0o755)
    _, container = redis_pod
    command = container["readinessProbe"]["exec"]["command"]
    done = subprocess.run(command, env={**env, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
                          capture_output=True, text=True, timeout=30)
    return done.returncode


def test_ready_only_on_pong_to_the_secrets_password(redis_pod, server, tmp_path):
    pod, container = redis_pod
    env = container_env(pod, container)
    assert env["REDISCLI_AUTH"] == PASSWORD, "the probe's password is not the Secret's"
    assert probe(redis_pod, server, tmp_path, env) == 0
    # An error reply is not ready: a wrong password, or none (NOAUTH).
    assert probe(redis_pod, server, tmp_path, {**env, "REDISCLI_AUTH": "wrong"}) != 0
    without = {name: value for name, value in env.items() if name != "REDISCLI_AUTH"}
    assert probe(redis_pod, server, tmp_path, without) != 0


def test_the_password_is_not_on_the_probes_command_line(redis_pod):
    _, container = redis_pod
    command = " ".join(container["readinessProbe"]["exec"]["command"])
    assert "REDIS_PASSWORD" not in command and "REDISCLI_AUTH" not in command \
        and "-a " not in command, command
