"""Overlapping PinPrefix calls on a served engine with the prefix index (issue 34 review).

Pins are whole, at the index and in the engine's mirror of it: a pin is named by its chain's
last hash, a block stays pinned while any pin covers it, and each pin keeps its own expiry.
Before, a longer pin refused after its prefill was undone by unpinning its chain, which
unpinned an earlier shorter pin's blocks too; and a longer pin with a TTL gave the shared
blocks its expiry, so a shorter pin made without one lapsed with it. Observed through
EngineStats.num_pinned_blocks (the engine's mirror) and the index's unpin count.
"""

from __future__ import annotations

import time

import grpc
import pytest

from tests.service.pin_stats import BLOCK, pin, pinned, prompt_ids, step, wait_pinned


def test_a_refused_longer_pin_leaves_the_shorter_pin_whole(stub):
    salt = "overlap-refused"
    before = pinned(stub)
    short = prompt_ids(43, 2 * BLOCK + 3)
    assert pin(stub, short, salt).num_pinned == 2
    # The same 2 blocks, then 128 more: past any budget of this engine (at most 120 blocks).
    # Its cached part is pinned at once, the rest computed, the pin refused, and undone.
    longer = short[: 2 * BLOCK] + prompt_ids(47, 128 * BLOCK + 3)
    with pytest.raises(grpc.RpcError) as caught:
        pin(stub, longer, salt)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The short pin's blocks stay pinned, in the engine and at the index (whose unpin of them
    # counts them), and only its pin holds them.
    wait_pinned(stub, before + 2)
    assert pin(stub, short, salt, unpin=True).num_pinned == 2
    wait_pinned(stub, before)


def test_a_longer_timed_pin_leaves_the_shorter_untimed_pin(stub):
    salt = "overlap-ttl"
    before = pinned(stub)
    short = prompt_ids(53, 2 * BLOCK + 3)
    longer = short[: 2 * BLOCK] + prompt_ids(59, 2 * BLOCK + 3)
    assert pin(stub, short, salt).num_pinned == 2  # until unpinned
    assert pin(stub, longer, salt, ttl_s=1.0).num_pinned == 4
    # The longer pin lapses (within the deadline: no wall-clock assertion); its own 2 blocks
    # are unpinned, the short pin's stay.
    wait_pinned(stub, before + 2)
    time.sleep(1.5)  # past the lapse: still 2
    step(stub)
    assert pinned(stub) == before + 2
    assert pin(stub, short, salt, unpin=True).num_pinned == 2
    wait_pinned(stub, before)
