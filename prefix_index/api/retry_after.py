"""When a refused call would pass: the index names it in the trailing metadata of a
RESOURCE_EXHAUSTED it answers for a rate (an engine's Apply ops per second), so a caller waits
that long instead of guessing (the message says it in words too).

Our own key: gRPC reserves the `grpc-` prefix (its retry pushback, grpc-retry-pushback-ms, is
for channels configured with a retry policy, which ours are not).
"""

from __future__ import annotations

import math

RETRY_AFTER_KEY = "pagedgen-retry-after-ms"


def retry_after_metadata(seconds: float) -> tuple[tuple[str, str], ...]:
    # Rounded up: a caller that waits exactly this long finds the rate passed.
    return ((RETRY_AFTER_KEY, str(max(0, math.ceil(seconds * 1000)))),)


def retry_after_s(trailing_metadata) -> float | None:
    """The delay a refusal's trailing metadata names (seconds); None without a usable one."""
    for key, value in trailing_metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                millis = int(value)
            except (TypeError, ValueError):
                return None
            return millis / 1000 if millis >= 0 else None
    return None
