"""Watching a test's child processes through /proc."""

import time
from collections.abc import Callable
from pathlib import Path


def process_state(pid: int) -> str:
    """The process's state letter (T: stopped, Z: exited, not reaped), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Polls `condition` until it holds; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s"
        time.sleep(0.05)
