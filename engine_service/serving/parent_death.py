"""A child process that must not outlive the process that started it (the engine core, the
grammar compiler): on Linux the kernel kills it when its parent dies, even mid model load or
mid compile. Strictly, when the parent's thread that started it ends."""

import signal


def die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the child still exits when its end of the pipes closes
