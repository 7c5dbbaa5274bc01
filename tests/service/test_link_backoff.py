"""An engine's link retries registering with a growing, jittered wait while the index is
down, back to the shortest once it answers. It retried every 0.5 s, every engine in step: 126
failed Registers in 35 s from two engines, each a WARNING at the index."""

from __future__ import annotations

import random

import pytest

from engine_service.index.link import RETRY_MAX_S, RetryBackoff, connect_prefix_index
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import free_port
from tests.service.index_fixtures import (
    DEADLINE_S,
    INDEX_ARGS,
    Driver,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)
BASE_S = 0.2


def test_waits_grow_from_the_base_to_the_cap_and_start_over_after_a_success():
    backoff = RetryBackoff(BASE_S, rng=random.Random(1))
    waits = [backoff.next_s() for _ in range(30)]
    assert waits[0] == BASE_S  # the first retry as soon as before
    assert all(BASE_S <= w <= RETRY_MAX_S for w in waits)
    assert max(waits) > RETRY_MAX_S / 2  # not every BASE_S: they grow towards the cap
    assert sum(waits) > 30 * BASE_S * 5
    backoff.reset()
    assert backoff.next_s() == BASE_S


def test_two_engines_do_not_retry_in_step():
    first, second = (RetryBackoff(BASE_S, rng=random.Random(seed)) for seed in (1, 2))
    waits = [(first.next_s(), second.next_s()) for _ in range(10)]
    assert sum(1 for a, b in waits[1:] if a != b) == 9


def retry_wait(link) -> float:
    return float(link.health_details().get("retry_wait_s", "0"))


def test_a_link_backs_off_while_the_index_is_down_and_starts_over_once_it_is_back(
        tiny_llama_dir, redis, test_certs):
    """A real link to a port nobody serves, then a real index there: the link's waits grow
    while every Register fails, the index is reached (within the cap of the last wait), and
    after the next outage the link waits the base first again."""
    engine = make_engine(tiny_llama_dir)
    port = free_port()
    link = connect_prefix_index(engine, f"127.0.0.1:{port}", "engine-backoff",
                                link_options(test_certs, retry_interval_s=BASE_S))
    index: IndexProcess | None = None
    try:
        seen: list[float] = []

        def registers_failed(count: int) -> bool:
            seen.append(retry_wait(link))
            return link.stats().rpc_calls.get("Register", 0) >= count

        wait_until(lambda: registers_failed(6), DEADLINE_S, "six failed Registers",
                   engine=engine)
        assert link.degraded
        assert min(w for w in seen if w) == BASE_S
        assert max(seen) > BASE_S  # it did not retry every BASE_S
        assert max(seen) <= RETRY_MAX_S

        index = IndexProcess(redis.url, INDEX_ARGS, port=port,
                             tls=test_certs.files("index")).start()
        wait_until(lambda: not link.degraded, DEADLINE_S, "registration once the index is up",
                   engine=engine)
        assert "retry_wait_s" not in link.health_details()

        index.kill()
        index = None
        driver = Driver(engine)  # an admission: its Acquire is the link's next call
        driver.add({"r": prompt_ids(7, 40)})
        driver.step()
        wait_until(lambda: retry_wait(link) > 0, DEADLINE_S, "the link failing again",
                   engine=engine)
        # Its first wait after a success is the base again, not where the last outage was.
        assert retry_wait(link) <= 3 * BASE_S
        driver.run_to_completion()
    finally:
        link.close()
        if index is not None:
            index.kill()
