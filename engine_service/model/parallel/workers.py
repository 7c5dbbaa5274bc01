"""Rank 0's worker processes: started, watched, and stopped (never left behind).

Workers are plain subprocesses (`python -m engine_service.model.parallel.worker`), not
multiprocessing children: they need no `if __name__ == "__main__"` guard in the user's
script, and a daemonic serving process may start them. They meet rank 0 at a TCPStore that
rank 0 serves on the rendezvous host (127.0.0.1 unless PAGEDGEN_TP_HOST says otherwise) and a
port the OS picks (PAGEDGEN_TP_PORT to fix one). The store is open to every local process, so
each worker gets the engine's secret on its stdin and checks what it loads (auth.py).
"""

import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine_service.model.parallel.auth import new_secret, seal
from engine_service.model.parallel.errors import TensorParallelError
from engine_service.model.parallel.group import TensorParallelGroup, connect_group, rendezvous_keys

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # from spawn to the rendezvous (imports, on a loaded machine)
STOP_GRACE_S = 5.0
WATCH_INTERVAL_S = 0.1
MAX_ERROR_BYTES = 2000  # of a worker's message on its report pipe
# How long a failed collective waits for a worker's exit before blaming the collective: a
# killed rank's sockets close before its exit can be reaped, so rank 0 often sees the closed
# connection first (seen: 'Connection reset by peer ... a remote worker hanging').
EXIT_GRACE_S = 0.5


TERM_GRACE_S = 2.0


def _stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to grace_s for the workers to exit (they were told to stop), then SIGTERM the
    rest (a worker exits cleanly on it, worker.py says why), then SIGKILL what is left (a
    stopped or hung process)."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    deadline = time.monotonic() + TERM_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_report(fd: int) -> str:
    """What an exited worker wrote on its report pipe (nothing: ''). Never blocks."""
    try:
        return os.read(fd, MAX_ERROR_BYTES).decode(errors="replace")
    except (BlockingIOError, OSError):
        return ""


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _stop_and_close(procs: list[subprocess.Popen], fds: list[int]) -> None:
    _stop_processes(procs, 0.0)
    _close_all(fds)


def _kill_processes(procs: list[subprocess.Popen]) -> None:
    """SIGKILL, at once: the group has failed, and a worker that hangs (or is stopped) would
    not act on SIGTERM within any grace worth waiting. What a killed worker may hold is let
    go by the kernel (the C++ extension's build lock is an flock: kernels/cpu_extension.py)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def serve_store(host: str, port: int) -> dist.TCPStore:
    """The rendezvous store, listening on `host` only. Given a host and no socket, torch's
    TCPStore server listens on every interface (the host names only where clients connect):
    the spec and every key would be open to the network. So the socket is bound here and
    handed over (the store closes it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        store = dist.TCPStore(host, listener.getsockname()[1], None, True,
                              wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's now
    return store


def _hand_secret(proc: subprocess.Popen, secret: str) -> None:
    """One line on the worker's stdin, then closed (a pipe's buffer holds it: no wait). A
    worker that is gone already is seen by the waits that follow."""
    try:
        proc.stdin.write(secret.encode() + b"\n")
        proc.stdin.close()
    except BrokenPipeError:
        pass


class Workers:
    def __init__(self, spec: object, world_size: int, host: str, port: int,
                 extra_env: dict[str, str] | None = None) -> None:
        """extra_env: set in the workers' environment beside this process's."""
        self.world_size = world_size
        self.host = host
        self.stopped = False
        self.store: dist.TCPStore | None = serve_store(host, port)
        self.store_port = self.store.port
        self.secret = new_secret()  # this engine's: on the workers' stdin only
        self.store.set("spec", seal(self.secret.encode(), b"spec", pickle.dumps(spec)))
        address = f"{host}:{self.store.port}"
        env = {**os.environ, **(extra_env or {}), "OMP_NUM_THREADS": str(spec.threads)}
        # Each worker's error, as text, on a pipe of its own (the store is open to every local
        # process, and closes once the ranks are ready): read when the worker has exited.
        self._reports: list[int] = []
        self.procs = []
        for rank in range(1, world_size):
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            self._reports.append(read_end)
            try:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "engine_service.model.parallel.worker",
                     "--rank", str(rank), "--world-size", str(world_size), "--store", address,
                     "--parent-pid", str(os.getpid()), "--report-fd", str(write_end)],
                    env=env, stdin=subprocess.PIPE, pass_fds=(write_end,)))
            finally:
                os.close(write_end)
        for proc in self.procs:
            _hand_secret(proc, self.secret)
        # Stopped with the engine, or at the latest when this object goes or the process exits.
        self._finalizer = weakref.finalize(self, _stop_and_close, self.procs, self._reports)
        log.info("tensor parallel: %d worker processes (pids %s), rendezvous at %s",
                 world_size - 1, [p.pid for p in self.procs], address)

    def wait_up(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until every worker has reached the store; a worker that exits first fails it."""
        self._wait_for("up", "start", timeout_s)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until every worker has loaded its shards and waits for rank 0's first call (whose
        send is bounded by the collective timeout: a worker may load for longer than that);
        a worker that exits first fails it at once."""
        self._wait_for("ready", "load the model", timeout_s)

    def _wait_for(self, key: str, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        keys = [f"{key}/{rank}" for rank in range(1, self.world_size)]
        while not self.store.check(keys):
            if not self.all_alive():
                raise self.error(None)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not {what} within "
                                          f"{timeout_s:.0f} s")
            time.sleep(0.05)

    def close_store(self) -> None:
        """The rendezvous is over: close the store. It takes any local client's keys into this
        process's memory (8 MiB a value, no bound on their number), so it is not left open for
        the engine's life. (gloo needs it only to connect; NCCL's communicator is made during
        the start too, group.connect_group, and launch.py keeps the store for the NCCL
        features that would still use it.)"""
        self.store = None

    def connect(self, device: torch.device, timeout_s: float) -> TensorParallelGroup:
        """Rank 0's side of the rendezvous. A worker that dies before it has left its address
        would keep rank 0 waiting for the store's timeout: a watcher writes a value that is
        no address under that worker's keys, which fails the wait at once. Rank 0 connects
        on a connection of its own: one TCPStore object serves one call at a time, and the
        watcher needs this one."""
        own = dist.TCPStore(self.host, self.store.port, is_master=False,
                            timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        connected = threading.Event()

        def watch() -> None:
            while not connected.wait(WATCH_INTERVAL_S):
                if not self.all_alive():
                    for rank, proc in enumerate(self.procs, start=1):
                        if proc.poll() is not None:
                            for key in rendezvous_keys(rank):
                                self.store.set(key, b"(this rank exited)")
                    return

        threading.Thread(target=watch, name="tp-connect-watch", daemon=True).start()
        try:
            return connect_group(own, 0, self.world_size, device, self.host, timeout_s)
        except Exception as error:  # noqa: BLE001 (gloo's errors are of several kinds)
            raise self.error(error) from error
        finally:
            connected.set()

    def all_alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)

    def error(self, cause: BaseException | None) -> TensorParallelError:
        """What went wrong, naming the rank: its exit and its own message when it died, else
        the collective's error (a timeout: a rank that hangs)."""
        if cause is not None:
            deadline = time.monotonic() + EXIT_GRACE_S
            while self.all_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
        dead = []
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is None:
                continue
            reason = f"rank {rank} (pid {proc.pid}) exited with status {proc.returncode}"
            text = _read_report(self._reports[rank - 1]) if self._reports else ""
            if text:
                reason += ": " + text
            dead.append(reason)
        if dead:
            return TensorParallelError("tensor-parallel worker failed: " + "; ".join(dead))
        return TensorParallelError(f"tensor-parallel collective failed: {cause}")

    def watch(self, on_failure: Callable[[TensorParallelError], None]) -> None:
        """Call on_failure once, from a thread of its own, when a worker exits unasked (the
        engine may be idle, with no collective to fail)."""

        def run() -> None:
            while not self.stopped:
                if not self.all_alive():
                    if not self.stopped:
                        on_failure(self.error(None))
                    return
                time.sleep(WATCH_INTERVAL_S)

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self.stopped = True
        _stop_processes(self.procs, grace_s)
        self._finalizer.detach()
        _close_all(self._reports)

    def kill(self) -> None:
        """Stop a failed group's workers now (milliseconds: the engine's failure is reported
        after this, and its process may be killed right after that)."""
        self.stopped = True
        _kill_processes(self.procs)
        self._finalizer.detach()
        _close_all(self._reports)
