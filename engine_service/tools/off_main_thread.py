"""Blocking calls that a stop signal must not cut half way, run on a thread of their own.

The stack stops on SIGINT, SIGTERM or SIGHUP by raising an exception from the signal handler
(stack.py's Stopped), and Python runs handlers in the main thread, between any two of its
bytecodes. Raised inside grpc's code in the middle of a call, that exception left the call
behind in the channel's state, and closing the channel waited for it for good: the stack hung
after a Ctrl-C during its completion, about one start in 30 under load (py-spy: the main thread
in Channel.close, in Condition.wait). Here the call runs on a thread of its own while the main
thread waits on a plain lock, which the exception leaves whole; `stop` then ends the call from
the main thread the ordinary way (cancelling the call: closing the channel from the main
thread while the stream's thread read from it ended the stack with SIGSEGV once in a suite
run), and the exception goes on.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
JOIN_S = 10.0  # for the call to end once stopped
# The stack's stop signals (stack.py), and SIGUSR1, which its test raises with.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def run_off_main_thread(work: Callable[[], T], stop: Callable[[], object], name: str) -> T:
    """work()'s result, or its exception, with work() run on a thread of its own. An exception
    raised in this thread meanwhile (a signal handler's) calls stop(), waits up to JOIN_S for
    work() to end, and propagates."""
    outcome: list[tuple[bool, object]] = []
    finished = threading.Lock()
    finished.acquire()

    def body() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            outcome.append((False, error))
        finally:
            finished.release()

    thread = threading.Thread(target=body, name=name, daemon=True)
    try:
        # Thread.start's own bookkeeping must not be cut either (an exception there left the
        # started thread failing with a KeyError): the stop signals wait until it is done,
        # then arrive here, in the try. (The thread keeps them blocked: it never handles any.)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        while not finished.acquire(timeout=0.5):
            pass
    except BaseException:
        stop()
        try:
            thread.join(JOIN_S)
        except RuntimeError:  # the exception came before the thread started
            pass
        raise
    ok, value = outcome[0]
    if not ok:
        raise value  # (its own traceback, from the thread)
    return value  # type: ignore[return-value]
