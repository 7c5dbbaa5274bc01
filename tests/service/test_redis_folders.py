"""RedisProcess's work folder (pagedgen-redis-*) after its process is SIGKILLed (which runs no
clean-up): the next RedisProcess removes it once its redis-server is gone too, and never the
folder of a live one (its process alive, or its redis-server running on without it). Swept as
pagedgen-stack's folders are (prefix_index/tools/locked_folders.py,
tests/service/test_stack_folders.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import pytest

from prefix_index.tools.redis_process import RedisProcess

pytestmark = pytest.mark.timeout(120)

# A process holding a started RedisProcess (its redis-server not in a session of its own, as
# tests use it: it outlives this process if this one is killed).
HOLDER = ("import time\n"
          "from prefix_index.tools.redis_process import RedisProcess\n"
          "redis = RedisProcess().start()  # (kept: dropped, it removes its folder)\n"
          "print('up', flush=True)\n"
          "time.sleep(300)\n")


def servers_in(folder: Path) -> list[int]:
    """Pids of the live processes working in `folder` (its redis-server)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (Path(os.readlink(proc / "cwd")) == folder
                    and proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                found.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def gone(pid: int) -> bool:
    """Whether every thread of `pid` has exited: redis-server's leader is a zombie while its
    background threads still exit, holding its descriptors (the folder's lock among them)."""
    try:
        states = [stat.read_text().rsplit(")", 1)[1].split()[0]
                  for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
    except OSError:
        return True
    return all(state == "Z" for state in states)


def start_holder(tmp: Path, holders: list[subprocess.Popen],
                 folders: list[Path]) -> tuple[subprocess.Popen, Path, int]:
    """A holder process (noted in `holders`), its folder (in `folders`) and its redis-server's
    pid."""
    before = set(tmp.glob("pagedgen-redis-*"))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp)))
    holders.append(proc)
    assert proc.stdout.readline() == "up\n"
    [folder] = set(tmp.glob("pagedgen-redis-*")) - before
    folders.append(folder)
    [server] = servers_in(folder)
    return proc, folder, server


def test_a_killed_holder_s_folder_goes_once_its_server_is_gone_and_a_live_one_s_stays(
        tmp_path, monkeypatch, capfd):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # this process's RedisProcess too
    holders: list[subprocess.Popen] = []
    folders: list[Path] = []
    try:
        _live, live_folder, live_server = start_holder(tmp, holders, folders)
        killed, killed_folder, orphan = start_holder(tmp, holders, folders)
        killed.kill()
        killed.wait(timeout=30)
        capfd.readouterr()

        with RedisProcess():  # its redis-server runs on, in its folder: left alone
            pass
        assert killed_folder.exists() and not gone(orphan)
        assert "removed" not in capfd.readouterr().err

        os.kill(orphan, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not gone(orphan):
            assert time.monotonic() < deadline, "the orphaned redis-server did not die"
            time.sleep(0.05)
        with RedisProcess():
            pass
        err = capfd.readouterr().err
        assert not killed_folder.exists()
        assert f"removed {killed_folder}, left by a redis-server whose owner was killed" in err
        # The live holder's folder and server, untouched; nothing else of ours left.
        assert live_folder.exists() and (live_folder / "redis.log").exists()
        assert not gone(live_server)
        assert sorted(tmp.glob("pagedgen-redis-*")) == [live_folder]
    finally:
        for folder in folders:  # their redis-servers first: they outlive their holders
            for pid in servers_in(folder):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in holders:
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
