"""The Redis that pagedgen-stack starts (prefix_index/tools/redis_process.py): its password given
on redis-server's stdin, not its command line, and the server in a session of its own that dies
with the process that started it. RedisProcess's defaults stay as other callers know them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefix_index.tools.redis_process import RedisProcess, find_redis_server

# '"', '\', a space, '/', '#' and a non-ASCII letter: a config line must carry each as itself.
PASSWORD = 'p"a\\ss w/rd#é'


def redis_says(port: int, *command: str) -> bytes:
    """One command's raw reply, on a connection of its own."""
    parts = [f"*{len(command)}\r\n".encode()]
    for arg in command:
        parts.append(f"${len(arg.encode())}\r\n".encode() + arg.encode() + b"\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"".join(parts))
        return sock.recv(256)


@pytest.fixture
def recording_redis(tmp_path: Path) -> tuple[str, Path]:
    """A redis-server that writes the arguments it was given to a file first (redis-server
    overwrites its own /proc/PID/cmdline with a title once up)."""
    argv = tmp_path / "argv"
    binary = tmp_path / "redis-server"
    binary.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {argv}\n'
                      f'exec {find_redis_server()} "$@"\n')
    binary.chmod(0o755)
    return str(binary), argv


def test_password_on_stdin_is_required_and_on_no_command_line(recording_redis):
    binary, argv = recording_redis
    with RedisProcess(binary=binary, password=PASSWORD, password_on_stdin=True) as redis:
        assert PASSWORD not in argv.read_text()
        assert redis_says(redis.port, "PING").startswith(b"-NOAUTH")
        assert redis_says(redis.port, "AUTH", PASSWORD) == b"+OK\r\n"
        assert redis.url.startswith("redis://:")  # the URL carries it, as with --requirepass
        port = redis.port
        redis.restart()  # fed its config again: same port, the password still asked for
        assert redis.port == port
        assert redis_says(redis.port, "PING").startswith(b"-NOAUTH")
        assert redis_says(redis.port, "AUTH", PASSWORD) == b"+OK\r\n"


def test_password_on_the_command_line_stays_the_default(recording_redis):
    binary, argv = recording_redis
    with RedisProcess(binary=binary, password="plain") as redis:
        assert ["--requirepass", "plain"] == argv.read_text().splitlines()[-2:]
        assert redis_says(redis.port, "PING").startswith(b"-NOAUTH")


def test_a_failed_start_with_the_password_on_stdin_shows_redis_s_log():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="Address already in use"):
            RedisProcess(port=port, password=PASSWORD, password_on_stdin=True).start()


PARENT = """
import sys, time
from prefix_index.tools.redis_process import RedisProcess
redis = RedisProcess(own_session=True).start()
print(redis._proc.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its new parent reaps it)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_own_session_leaves_the_terminal_s_group_and_dies_with_its_parent(tmp_path):
    # (Redis's working folder, which the killed parent cannot remove, under tmp_path.)
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, TMPDIR=str(tmp_path)))
    pid = int(parent.stdout.readline())
    try:
        assert os.getsid(pid) == pid != os.getsid(0)  # a Ctrl-C for our group misses it
        parent.kill()  # nothing it could handle: the kernel tells redis-server
        parent.wait()
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    finally:
        parent.kill()
        parent.stdout.close()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
