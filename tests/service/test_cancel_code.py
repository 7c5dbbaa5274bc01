"""How a call its client side ended counts (status.cancel_code): the client's cancel at its
deadline is the deadline's end. The server's deadline comes after the client's (the header is
read later, and gRPC rounds the timeout it sends up: by up to 1 s at 120 s), so a 120 s
call its deadline ended was seen with ~1 s left and counted CANCELLED."""

from __future__ import annotations

import grpc
import pytest

from engine_service.serving.status import cancel_code

DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
CANCELLED = grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("remaining_s, timeout_s, code", [
    (0.0, 0.5, DEADLINE),  # gRPC's own timer, or the client's, past the deadline
    (0.1, 0.5, DEADLINE),  # the header held 0.1 s on the way
    (0.098, 10.0, DEADLINE),  # 10 s: rounded up to 10.1 s on the wire
    (0.34, 10.1, DEADLINE),  # 10.1 s: by up to 100 ms, past the 0.25 s of latency
    (0.997, 100.0, DEADLINE),  # ~100 s: rounded up to the next second
    (9.99, 3600.0, DEADLINE),  # an hour: rounded up to the next 10 s
    (0.4, 10.0, CANCELLED),  # the client left 0.4 s before a 10 s deadline
    (1.5, 100.0, CANCELLED),  # ... 1.5 s before a 100 s one
    (12.0, 9000.0, CANCELLED),  # ... 12 s before a 9,000 s one (rounded by 10 s at most)
    (5.0, 10.0, CANCELLED),
    (0.2, 0.3, CANCELLED),  # in the first half of a short deadline: the client's cancel
    (0.1, 0.3, DEADLINE),
    (None, None, CANCELLED),  # no deadline
    (0.0, None, CANCELLED),
])
def test_a_cancel_counts_the_deadline_only_when_it_had_all_but_passed(remaining_s, timeout_s,
                                                                      code):
    assert cancel_code(remaining_s, timeout_s) == code
