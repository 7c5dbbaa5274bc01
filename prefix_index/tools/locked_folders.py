"""Temporary folders locked by their maker for its whole life: pagedgen-stack's (removed on exit,
its logs kept after a failure, without keys) and RedisProcess's work folders. SIGKILL runs no
clean-up, so the next stack (or Redis) sweeps the folders, under its own prefix, whose lock
nobody holds."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path

TEMPORARY_PREFIX = "pagedgen-stack-"
# In a temporary folder, flock()ed by its stack for the stack's whole life. A lock, not a pid:
# a live stack in another pid namespace (a container sharing /tmp) has a pid that is no
# process here, and a dead stack's pid may be reused. The kernel drops the lock when the stack
# dies, however it dies. Folders without the file (a failed run's kept logs) are never swept.
# (The same name in a RedisProcess's folder.)
LOCK_FILE = "stack.lock"


def make_temporary(prefix: str = TEMPORARY_PREFIX) -> tuple[Path, int]:
    """A new temporary folder named `prefix`... and the descriptor holding its lock (kept open
    until the folder is removed or kept). O_CLOEXEC: a service that inherited it would hold the
    lock too (an flock belongs to the open file, shared by every copy of the descriptor), and
    the folder of a killed stack would stay for as long as that service ran. (A child that
    works in the folder may be handed it on purpose: Popen's pass_fds.)"""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    # Locked under another name, then renamed: a stack starting meanwhile never finds the
    # file there unlocked.
    making = folder / (LOCK_FILE + ".new")
    fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    making.rename(folder / LOCK_FILE)
    return folder, fd


def remove_temporary(log_dir: Path, lock_fd: int, keep_logs: bool) -> None:
    """The temporary log folder goes on exit: it holds the CA's and services' private keys, the
    API keys and the tenant secret. A failed run keeps the logs (its message points at them),
    without its lock file: the next stack leaves them alone."""
    try:
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
            return
        shutil.rmtree(log_dir / "certs", ignore_errors=True)
        for name in ("api-keys.toml", "tenant-secret", LOCK_FILE):
            (log_dir / name).unlink(missing_ok=True)
        print(f"logs kept in {log_dir} (its keys and certificates removed)", file=sys.stderr)
    finally:
        os.close(lock_fd)  # unlocked once the folder is gone or holds no lock file


def _abandoned(folder: Path) -> bool:
    """Whether `folder` is this user's real folder (not a symlink, followed nowhere) whose lock
    file no stack holds."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # a symlink, a file, gone
    try:
        if os.fstat(dir_fd).st_uid != os.getuid():
            return False
        try:
            lock_fd = os.open(LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                              | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False  # no lock file: kept logs, or not a stack's
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its stack is alive, in whatever pid namespace
        finally:
            os.close(lock_fd)
        # (A stack that kept its logs unlinks the file before it lets the lock go.)
        return os.path.lexists(folder / LOCK_FILE)
    finally:
        os.close(dir_fd)


def remove_abandoned_folders(prefix: str = TEMPORARY_PREFIX,
                             left_by: str = "a stack that was killed") -> None:
    """The temporary folders (named `prefix`...) of stacks that were killed (SIGKILL runs no
    clean-up: their services die with them, their folders stay): each holds private keys, API
    keys and the tenant secret. Only this user's real folders, named as ours, whose lock no
    process holds. `left_by`: who left them, in the line that says each was removed."""
    for folder in Path(tempfile.gettempdir()).glob(prefix + "*"):
        if not _abandoned(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.lexists(folder):
            print(f"could not remove {folder}, left by {left_by}", file=sys.stderr)
        else:
            print(f"removed {folder}, left by {left_by}", file=sys.stderr)
