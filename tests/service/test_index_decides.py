"""The prefix index's own decisions reach the engine, with the index's shipped defaults (no
test-only --hot-threshold 0) and the link's (a 30 s lease): a hot prefix that LRU would drop
between visits is pinned by the index and stays cached; a second live process with the same
engine id is refused, not fought.

The pinning trace is deterministic (one request at a time, each run to completion and mirrored
in the index before the next), so the win is checked on every run; bench/ measures it under load.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_service import SamplingParams
from engine_service.index.link import PrefixIndexLink, connect_prefix_index
from prefix_index.api.client import PrefixIndexClientError
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.service.index_fixtures import (
    BLOCK_SIZE,
    DEADLINE_S,
    INDEX_ARGS,
    Driver,
    index_matches_pool,
    index_stats,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)
from tests.support.tls import SessionCerts
from trust.identity import ENGINE_ROLE

pytestmark = pytest.mark.timeout(240)

NUM_BLOCKS = 128  # the index's default pin budget is 10% of it: 12 blocks
HOT = prompt_ids(seed=7, length=10 * BLOCK_SIZE)  # a 10-block system prompt
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
HOT_VISITS = 20
WARM_UP_VISITS = 10  # the default hot threshold is 8 admissions


@pytest.fixture(scope="module")
def index_target(test_certs):
    with RedisProcess() as redis:
        index = IndexProcess(redis.url, INDEX_ARGS, tls=test_certs.files("index")).start()
        try:
            yield index.target
        finally:
            index.kill()


def hot_hit_rates(certs: SessionCerts, tiny_llama_dir, index_target: str | None,
                  engine_id: str) -> list[float]:
    """Per hot visit, the share of the hot prefix served from the cache. Between visits, four
    cold 40-block prompts (160 blocks) flush a 128-block pool under plain LRU."""
    engine = make_engine(tiny_llama_dir, num_blocks=NUM_BLOCKS)
    link = None
    if index_target is not None:
        link = connect_prefix_index(engine, index_target, engine_id, link_options(certs))
        wait_until(lambda: not link.degraded, DEADLINE_S, "registration", engine=engine)
    driver = Driver(engine)
    rates = []
    try:
        for visit in range(HOT_VISITS):
            requests = {f"hot{visit}": HOT + prompt_ids(1000 + visit, 5)}
            requests |= {f"cold{visit}-{i}": prompt_ids(5000 + 10 * visit + i, 40 * BLOCK_SIZE)
                         for i in range(4)}
            for request_id, ids in requests.items():
                driver.add({request_id: ids}, ONE_TOKEN)
                driver.run_to_completion()
                if link is not None:
                    wait_until(lambda: index_matches_pool(certs, index_target, engine_id, engine),
                               DEADLINE_S, "the index mirrors the pool", engine=engine)
            cached = driver.finished[f"hot{visit}"].num_cached_tokens
            rates.append(cached / len(HOT))
    finally:
        if link is not None:
            assert link.stats().registrations == 1 and not link.degraded
            link.close()
    assert engine.check_block_invariants() == []
    return rates


def test_hot_prefix_is_pinned_by_the_index_where_lru_drops_it(tiny_llama_dir, index_target,
                                                              test_certs):
    lru = hot_hit_rates(test_certs, tiny_llama_dir, None, "")
    index = hot_hit_rates(test_certs, tiny_llama_dir, index_target, "engine-hot")
    settled_lru = sum(lru[WARM_UP_VISITS:]) / (HOT_VISITS - WARM_UP_VISITS)
    settled_index = sum(index[WARM_UP_VISITS:]) / (HOT_VISITS - WARM_UP_VISITS)
    print(f"hot prefix cached per visit: LRU {lru}\nindex {index}")
    assert settled_lru < 0.5, lru
    assert settled_index >= 0.9, index


async def register_again(certs: SessionCerts, target: str, link: PrefixIndexLink) -> int:
    """The Register a link sends on each retry (same identity, pool, lease and nonce)."""
    async with certs.index_client(target, 5.0, ENGINE_ROLE) as client:
        return await client.register(link.engine_id, link.model_identity, link.block_size,
                                     link.num_blocks, link.options.lease_s, nonce=link.nonce)


def test_second_live_process_with_the_same_engine_id_is_refused(tiny_llama_dir, index_target,
                                                                test_certs):
    first_engine = make_engine(tiny_llama_dir)
    first = connect_prefix_index(first_engine, index_target, "engine-twin",
                                 link_options(test_certs))
    wait_until(lambda: not first.degraded, DEADLINE_S, "first registration", engine=first_engine)
    epoch = first.epoch
    second_engine = make_engine(tiny_llama_dir)
    second = connect_prefix_index(second_engine, index_target, "engine-twin",
                                  link_options(test_certs))
    try:
        wait_until(lambda: second.refused, DEADLINE_S, "the twin refused", engine=second_engine)
        details = second.health_details()
        assert details["state"] == "refused"
        assert "engine-twin" in details["last_error"]
        # The twin retries every third of its 30 s lease; each retry is this call, refused
        # again for as long as the first lives (sent now rather than waited for).
        with pytest.raises(PrefixIndexClientError) as again:
            asyncio.run(register_again(test_certs, index_target, second))
        assert again.value.code == grpc.StatusCode.ALREADY_EXISTS
        # The first one is never disturbed: its epoch stands and its writes still land.
        driver = Driver(first_engine)
        driver.add({"first": HOT}, ONE_TOKEN)
        driver.run_to_completion()
        wait_until(lambda: index_matches_pool(test_certs, index_target, "engine-twin",
                                              first_engine),
                   DEADLINE_S, "the first one's blocks reach the index", engine=first_engine)
        assert index_stats(test_certs, index_target, "engine-twin").epoch == first.epoch == epoch
        assert first.health_details()["state"] == "ok"
        assert first.stats().registrations == 1
        assert second.refused
        # Serving goes on for the twin, on its local LRU.
        driver = Driver(second_engine)
        driver.add({"twin": HOT}, ONE_TOKEN)
        driver.run_to_completion()
        assert driver.finished["twin"].outputs[0].finish_reason == "length"
    finally:
        second.close()
        first.close()
