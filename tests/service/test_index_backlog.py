"""The ops an engine keeps while the index refuses its Apply rate are bounded: past
max_backlog_batches steps of unsent ops the policy drops them and the link re-syncs (one op per
cached block, whatever the backlog was), so an index that keeps refusing cannot grow the
engine's memory without end. Serving never fails, and once traffic stops the index's view is
the pool's. Real redis-server, the real index server as a subprocess at a tiny Apply rate, the
real engine on a tiny model over loopback; the test thread is the engine's thread."""

from __future__ import annotations

import pytest

from engine_service import SamplingParams
from engine_service.index.link import connect_prefix_index
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.service.index_fixtures import (
    BLOCK_SIZE,
    INDEX_ARGS,
    Driver,
    index_matches_pool,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

ENGINE_ID = "engine-backlog"
MAX_BACKLOG = 4  # steps of ops the link may hold unsent
# The index's bucket holds 2 ops per pool block plus one largest Apply (128 ops for 32 blocks),
# refilled at 5 ops a second: the traffic below records several times that (commits, acquires,
# releases, evictions), so the index refuses Apply after Apply while it runs.
NUM_BLOCKS = 32
INDEX_RATE_ARGS = ["--apply-ops-per-s", "5", "--max-ops", "64"]
NUM_REQUESTS = 40
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
CATCH_UP_S = 90.0  # the last backlog drains at the index's rate; a loaded machine is slower


def test_a_refused_backlog_is_dropped_for_a_resync_and_the_index_catches_up(
        tiny_llama_dir, test_certs):
    engine = make_engine(tiny_llama_dir, num_blocks=NUM_BLOCKS)
    with RedisProcess() as redis, \
            IndexProcess(redis.url, [*INDEX_ARGS, *INDEX_RATE_ARGS],
                         tls=test_certs.files("index")) as index:
        link = connect_prefix_index(engine, index.target, ENGINE_ID,
                                    link_options(test_certs, max_backlog_batches=MAX_BACKLOG))
        assert link is not None
        try:
            wait_until(lambda: not link.degraded, 30.0, "first registration", engine=engine)
            policy = engine.pool.policy
            driver = Driver(engine, step_pause_s=0.01)
            most_unsent = 0
            for i in range(NUM_REQUESTS):
                driver.add({f"r{i}": prompt_ids(900 + i, 3 * BLOCK_SIZE + 1)}, PARAMS)
                while engine.has_unfinished_requests():
                    driver.step()
                    most_unsent = max(most_unsent, policy.outbox.qsize())
            # Serving never failed: every request ran to its last token.
            assert [len(t) for t in driver.tokens().values()] == [3] * NUM_REQUESTS
            # The backlog stayed within its bound, and was dropped for a re-sync at least once
            # (the index refused for longer than MAX_BACKLOG steps).
            assert most_unsent <= MAX_BACKLOG
            assert policy.counters.backlog_resyncs >= 1
            details = link.health_details()
            assert int(details["backlog_resyncs"]) == policy.counters.backlog_resyncs
            # Each drop re-registers and re-syncs, on the link's thread, which may still be in
            # its back-off from a refused Apply when the last request ends; the re-sync's ops
            # are read on the engine's thread (this one, while it waits).
            wait_until(lambda: int(link.health_details()["registrations"]) >= 2, CATCH_UP_S,
                       "a re-registration after the backlog's drop", engine=engine)
            # Once idle, the index's view is the pool's: nothing was lost by the drop.
            wait_until(lambda: index_matches_pool(test_certs, index.target, ENGINE_ID, engine),
                       CATCH_UP_S, "the index's view of the engine equals its pool",
                       engine=engine)
            assert not link.degraded
        finally:
            link.close()
