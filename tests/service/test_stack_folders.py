"""The temporary folders of pagedgen-stack, as the next stack to start sweeps them: it removes
the folder of a stack that was killed (keys and all), and nothing else: not a live stack's in
another pid namespace (a container sharing /tmp), not a symlink or another user's folder.

The stacks here are real ones whose redis-server never answers (a script that sleeps): each
is alive, its folder made, until Redis's start times out (10 s) or it is signalled."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

STACK = [sys.executable, "-m", "engine_service.tools.stack", "--http-port", "0"]


def stack_env(tmp_path: Path, path: str) -> dict[str, str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(tmp), PATH=path)


def swept(tmp_path: Path) -> list[str]:
    """A stack starting on the same TMPDIR (which sweeps it first) says this; with no
    redis-server it stops right after."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    done = subprocess.run(STACK, capture_output=True, text=True, timeout=60,
                          env=stack_env(tmp_path, str(empty)))
    assert "no redis-server found" in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if "left by a stack" in line]


@contextmanager
def waiting_stack(tmp_path: Path, prefix: list[str] = ()):
    """A live stack, waiting for its Redis; yields (its process, its folder)."""
    bin_dir, started = tmp_path / "slow-bin", tmp_path / "redis-started"
    bin_dir.mkdir(exist_ok=True)
    started.unlink(missing_ok=True)
    fake = bin_dir / "redis-server"
    fake.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 30\n")
    fake.chmod(0o755)
    before = set((tmp_path / "tmp").glob("pagedgen-stack-*"))
    proc = subprocess.Popen([*prefix, *STACK, "--model", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=stack_env(tmp_path, f"{bin_dir}:{os.environ['PATH']}"))
    try:
        deadline = time.monotonic() + 30
        while not started.exists():  # its folder is made before Redis starts
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        [folder] = set((tmp_path / "tmp").glob("pagedgen-stack-*")) - before
        yield proc, folder
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


# unshare: a container of its own (user, pid and mount namespaces), sharing /tmp with us; all
# of it killed if the test kills unshare.
IN_NAMESPACE = ["-Urpfm", "--mount-proc", "--kill-child"]


def in_another_pid_namespace(pid: int) -> list[str]:
    """A prefix running a command as `pid` in a new pid namespace, under its init (a shell)."""
    return [shutil.which("unshare"), *IN_NAMESPACE, "sh", "-c",
            f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && {{ "$@" & wait; }}', "sh"]


def can_unshare() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    return subprocess.run([unshare, *IN_NAMESPACE, "true"], capture_output=True,
                          timeout=30).returncode == 0


@pytest.mark.skipif(not can_unshare(), reason="needs unshare -Urpfm (user, pid, mount "
                                               "namespaces)")
def test_a_live_stack_in_another_pid_namespace_keeps_its_folder(tmp_path):
    """Its pid there is no process here (or another one): judged by pid, its keys were
    removed under it as 'left by a stack that was killed'."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    pid = next(p for p in range(pid_max - 1, 300, -1) if not Path(f"/proc/{p}").exists())
    with waiting_stack(tmp_path, in_another_pid_namespace(pid)) as (proc, folder):
        assert swept(tmp_path) == []
        assert (folder / "certs").exists()
        # The namespace's init (unshare -f's child): killed, everything in it dies.
        [init] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(init), signal.SIGKILL)
        proc.wait(timeout=30)
    assert swept(tmp_path) == [f"removed {folder}, left by a stack that was killed"]
    assert not folder.exists()


def test_a_live_stack_s_folder_stays_and_a_killed_one_s_goes(tmp_path):
    with waiting_stack(tmp_path) as (killed, killed_folder):
        killed.kill()
    assert (killed_folder / "certs").exists()  # a SIGKILL runs no clean-up
    with waiting_stack(tmp_path) as (_live, live_folder):
        assert not killed_folder.exists()  # removed by that stack as it started
        assert swept(tmp_path) == []
        assert live_folder.exists()


def killed_stack_folder_named(tmp_path: Path, name: str) -> Path:
    """A killed stack's folder, renamed (so that no sweep would pick it itself)."""
    with waiting_stack(tmp_path) as (proc, folder):
        proc.kill()
    (folder / "ca-key.pem").write_text("key")
    return folder.rename(tmp_path / "tmp" / name)


def test_a_planted_symlink_is_neither_followed_nor_said_removed(tmp_path):
    """rmtree refused the symlink, and the stack said 'removed ...' all the same."""
    victim = killed_stack_folder_named(tmp_path, "victim")
    planted = tmp_path / "tmp" / "pagedgen-stack-planted"
    planted.symlink_to(victim)
    (tmp_path / "tmp" / "pagedgen-stack-file").write_text("not a folder")
    assert swept(tmp_path) == []
    assert planted.is_symlink() and (victim / "ca-key.pem").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_another_user_s_folder_is_left_alone(tmp_path):
    theirs = killed_stack_folder_named(tmp_path, "pagedgen-stack-theirs")
    os.chown(theirs, os.getuid() + 4242, os.getgid())
    assert swept(tmp_path) == []
    assert (theirs / "ca-key.pem").exists()
