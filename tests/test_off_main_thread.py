"""run_off_main_thread (engine_service/tools/off_main_thread.py): the stack's blocking calls on
a thread of their own, so that a stop signal's exception lands in the main thread's wait and
not inside grpc's code (where it left a channel that never closed)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine_service.tools.off_main_thread import run_off_main_thread
from engine_service.tools.stack import off_main_thread
from prefix_index.tools.redis_process import free_port
from prefix_index.tools.server_process import wait_serving


class Stop(Exception):
    pass


def test_the_result_and_the_exception_of_the_work_come_back():
    assert run_off_main_thread(lambda: 42, lambda: None, "t") == 42

    def fails() -> None:
        raise ValueError("from the work")

    with pytest.raises(ValueError, match="from the work"):
        run_off_main_thread(fails, lambda: None, "t")


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers run in the main thread")
def test_a_signal_raises_in_the_waiting_thread_and_stop_ends_the_work():
    """The handler's exception propagates from the wait; stop() ran, from the main thread, and
    the work (blocked until stopped) ended on its own thread, never seeing the exception."""
    stopped = threading.Event()
    work_saw: list[BaseException] = []
    stopped_from: list[threading.Thread] = []

    def work() -> str:
        try:
            if not stopped.wait(30):
                return "never stopped"
            return "ended by stop"
        except BaseException as error:  # (it must not come here)
            work_saw.append(error)
            raise

    def stop() -> None:
        stopped_from.append(threading.current_thread())
        stopped.set()

    def handler(_signum, _frame):
        raise Stop()

    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        started = time.monotonic()
        with pytest.raises(Stop):
            run_off_main_thread(work, stop, "t")
        assert time.monotonic() - started < 10
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert stopped_from == [threading.main_thread()]
    assert work_saw == []
    assert not [t for t in threading.enumerate() if t.name == "t"]  # it ended, joined


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers run in the main thread")
def test_a_signal_during_a_service_s_start_ends_its_health_polls():
    """The stack waits for each service's health off the main thread: a stop signal there
    ends the polling (gRPC Checks on that thread) at once, the thread joined, not left
    polling a server that never comes for its whole start timeout."""
    def handler(_signum, _frame):
        raise Stop()

    nobody = f"127.0.0.1:{free_port()}"
    previous = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Stop):
            off_main_thread(lambda stopped: wait_serving(nobody, 60, stopped=stopped),
                            "wait-nobody")
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert not [t for t in threading.enumerate() if t.name == "wait-nobody"]
