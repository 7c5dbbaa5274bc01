"""The engine's prefix cache steered by the prefix index: real redis-server, the real index server
as a subprocess, the real engine on a tiny model, all over loopback. Nothing is mocked: outages
are real SIGKILLs and restarts on the same port. The index runs at its shipped defaults
(automatic pinning on) and the link at its shipped options (a 30 s lease): a test that must see
something happen waits for the condition, or makes it happen, instead of a short lease."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_service import SamplingParams
from engine_service.index.link import (
    IndexLinkOptions,
    PinRefusedError,
    PrefixIndexLink,
    connect_prefix_index,
)
from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Evict
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import free_port
from tests.service.index_fixtures import (
    BLOCK_SIZE,
    DEADLINE_S,
    INDEX_ARGS,
    Driver,
    call_pumping,
    index_matches_pool,
    index_stats,
    link_options,
    local_view,
    make_engine,
    prompt_ids,
    wait_until,
)
from tests.support.tls import SessionCerts

pytestmark = pytest.mark.timeout(120)

SHARED = prompt_ids(seed=1, length=4 * BLOCK_SIZE)  # 4 full blocks every request starts with


def wave(name: str, count: int, seed: int) -> dict[str, list[int]]:
    """Requests sharing SHARED, each with its own tail (not block aligned)."""
    return {f"{name}{i}": SHARED + prompt_ids(seed * 100 + i, 5 + i) for i in range(count)}


def split_last(requests: dict[str, list[int]]) -> tuple[dict, dict]:
    *first, last = requests.items()
    return dict(first), dict([last])


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama_dir) -> dict[str, list[int]]:
    """The outage script's outputs from an engine with no index (the local LRU only), on the
    same schedule: a0-a4, a5 after 3 steps, the b wave after one more."""
    driver = Driver(make_engine(tiny_llama_dir))
    first, last = split_last(wave("a", 6, seed=2))
    driver.add(first)
    driver.step(3)
    driver.add(last)
    driver.step()
    driver.add(wave("b", 4, seed=3))
    driver.run_to_completion()
    return driver.tokens()


def connect(certs: SessionCerts, engine, index: IndexProcess, engine_id: str,
            options: IndexLinkOptions | None = None) -> PrefixIndexLink:
    """A link on the session's engine certificate (`options`: the shipped ones by default)."""
    link = connect_prefix_index(engine, index.target, engine_id, options or link_options(certs))
    assert link is not None
    wait_until(lambda: not link.degraded, DEADLINE_S, "first registration", engine=engine)
    return link


def test_none_keeps_the_local_policy(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    policy = engine.pool.policy
    assert connect_prefix_index(engine, "none", "engine-x") is None
    assert engine.pool.policy is policy
    with pytest.raises(ValueError, match="HOST:PORT"):
        connect_prefix_index(engine, "no-port", "engine-x")
    with pytest.raises(ValueError, match="engine_id"):
        connect_prefix_index(engine, "127.0.0.1:1", "bad id")


def test_shared_prefix_is_served_through_the_index(tiny_llama_dir, index, test_certs):
    engine = make_engine(tiny_llama_dir)
    link = connect(test_certs, engine, index, "engine-hit")
    try:
        driver = Driver(engine)
        first = SHARED + prompt_ids(10, 5)
        second = SHARED + prompt_ids(11, 5)
        driver.add({"first": first})
        driver.run_to_completion()
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-hit", engine),
                   DEADLINE_S,
                   "index holds the first request's blocks")
        held_after_first = index_stats(test_certs, index.target, "engine-hit")
        assert held_after_first.blocks >= 4 and held_after_first.hits == 0

        driver.add({"second": second})
        driver.step()  # admission: the shared blocks are acquired (refcount 1 in the index)
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-hit", engine),
                   DEADLINE_S,
                   "index mirrors the second request's acquire")
        running = index_stats(test_certs, index.target, "engine-hit")
        assert running.evictable == local_view(engine)[1] < local_view(engine)[0]
        driver.run_to_completion()

        assert driver.finished["second"].num_cached_tokens == 4 * BLOCK_SIZE
        assert driver.finished["first"].num_cached_tokens == 0
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-hit", engine),
                   DEADLINE_S,
                   "index holds both requests' blocks, all idle")
        stats = index_stats(test_certs, index.target, "engine-hit")
        # Each admission asks for the prompt's 4 cacheable blocks; the second finds all 4.
        assert (stats.queries, stats.hits) == (8, 4)
        assert link.stats().registrations == 1 and not link.degraded
        assert link.policy.counters.mismatches == 0
        assert link.stats().rpc_calls["Apply"] >= 2
    finally:
        link.close()
    assert engine.check_block_invariants() == []


@pytest.mark.parametrize("outage", ["redis", "redis-hang", "index"])
def test_outage_fails_no_request_and_recovers(tiny_llama_dir, redis, index, reference_tokens,
                                             outage, test_certs):
    engine = make_engine(tiny_llama_dir)
    engine_id = f"engine-{outage}-outage"
    link = connect(test_certs, engine, index, engine_id)
    replacement: IndexProcess | None = None
    try:
        first_epoch = link.epoch
        driver = Driver(engine)
        first, last = split_last(wave("a", 6, seed=2))
        driver.add(first)
        driver.step(3)
        assert engine.has_unfinished_requests()
        if outage == "redis":
            redis.kill()
        elif outage == "redis-hang":
            redis.pause()  # SIGSTOP: sockets open, no answers; calls hit their deadlines
        else:
            index.kill()
        # An admission: its Acquire is the link's next call (an idle link's next one would be
        # a heartbeat, a third of the 30 s lease away).
        driver.add(last)
        driver.step()
        # The step never waits on the index: the link notices on its own thread.
        wait_until(lambda: link.degraded, DEADLINE_S, f"degraded after the {outage} was killed",
                   engine=engine)
        assert link.health_details()["state"] == "degraded"
        assert engine.has_unfinished_requests()

        # New admissions while degraded still share the prefix through the local mirror.
        driver.add(wave("b", 4, seed=3))
        driver.run_to_completion()
        assert link.degraded
        assert driver.tokens() == reference_tokens
        assert all(driver.finished[f"b{i}"].num_cached_tokens == 4 * BLOCK_SIZE
                   for i in range(4))

        if outage == "redis":
            redis.start()
        elif outage == "redis-hang":
            redis.resume()
        else:
            replacement = IndexProcess(redis.url, INDEX_ARGS, port=index.port,
                                       tls=test_certs.files("index")).start()
        wait_until(lambda: not link.degraded, DEADLINE_S, f"recovery after the {outage} restart",
                   engine=engine)
        assert link.epoch > first_epoch
        assert link.stats().registrations >= 2
        # The re-sync gave the index every block the engine still caches, all idle.
        wait_until(lambda: index_matches_pool(test_certs, index.target, engine_id, engine),
                   DEADLINE_S,
                   "index re-synced with the pool")
        assert local_view(engine)[0] > 0
    finally:
        link.close()
        redis.resume()
        if replacement is not None:
            replacement.kill()
    assert engine.check_block_invariants() == []


def test_forks_and_pins_stay_mirrored(tiny_llama_dir, index, test_certs):
    """n=3 sampling shares blocks by fork (refcounts the index must follow); blocks evicted
    locally are reported one by one (Forget), with no re-sync; a pinned prefix survives a local
    eviction of everything idle."""
    engine = make_engine(tiny_llama_dir)
    link = connect(test_certs, engine, index, "engine-pins")
    try:
        driver = Driver(engine)
        driver.add({"filler": prompt_ids(41, 30)})
        driver.run_to_completion()
        driver.add({"forked": SHARED + prompt_ids(40, 8)},
                   SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))
        driver.step()
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-pins", engine),
                   DEADLINE_S,
                   "index follows the forked refcounts")
        # Evicting the filler's idle blocks locally while the forks hold the prompt blocks 3
        # times: the index forgets exactly those blocks and keeps the forks' refcounts.
        engine.pool.reset_prefix_cache()
        driver.run_to_completion()
        assert len(driver.finished["forked"].outputs) == 3
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-pins", engine),
                   DEADLINE_S,
                   "every fork released in the index")
        assert link.policy.counters.forgets_sent > 0
        assert link.stats().registrations == 1
        assert link.policy.counters.mismatches == 0

        chain = engine.hasher.chain(SHARED, None)  # as the servicer computes them
        assert call_pumping(engine, lambda: asyncio.run(link.pin_prefix(chain, 0.0, False))) == 4
        engine.pool.reset_prefix_cache()  # the local LRU evicts every idle block but the pins
        assert engine.pool.num_cached_blocks == 4
        assert [engine.pool.lookup(h, tuple(SHARED[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
                is not None for i, h in enumerate(chain)] == [True] * 4
        engine.step()  # idle step: sends the Forget ops of that eviction

        def held() -> tuple[int, int, int]:
            stats = index_stats(test_certs, index.target, "engine-pins")
            return (-1, -1, -1) if stats is None else (stats.blocks, stats.pinned, stats.evictable)

        # Pinned idle blocks are not evictable in the index either.
        wait_until(lambda: held() == (4, 4, 0), DEADLINE_S,
                   "index forgot all but the 4 pinned blocks", engine=engine)
        assert link.stats().registrations == 1
        assert call_pumping(engine, lambda: asyncio.run(link.pin_prefix(chain, 0.0, True))) == 4
        # The index refusing a pin is an answer, not an outage: no degraded link, no re-sync.
        registrations = link.stats().registrations
        for bad_chain, ttl_s in ((chain, 31 * 86400.0), ([b"short"], 0.0)):
            with pytest.raises(PinRefusedError, match="refused the pin") as refused:
                call_pumping(engine, lambda c=bad_chain, t=ttl_s:
                             asyncio.run(link.pin_prefix(c, t, False)))
            assert refused.value.reason == "invalid"
        assert not link.degraded and link.stats().registrations == registrations
        engine.pool.reset_prefix_cache()
        assert engine.pool.num_cached_blocks == 0
    finally:
        link.close()
    assert engine.check_block_invariants() == []


def test_engine_started_before_the_index_serves_then_registers(tiny_llama_dir, redis, test_certs):
    engine = make_engine(tiny_llama_dir)
    port = free_port()
    link = connect_prefix_index(engine, f"127.0.0.1:{port}", "engine-early",
                                link_options(test_certs))
    index: IndexProcess | None = None
    try:
        driver = Driver(engine)
        for request_id, ids in wave("early", 2, seed=50).items():
            driver.add({request_id: ids})
            driver.run_to_completion()
        assert link.degraded and link.epoch == 0
        assert link.health_details()["state"] == "degraded"
        # The local LRU shares the prefix meanwhile.
        assert driver.finished["early1"].num_cached_tokens == 4 * BLOCK_SIZE
        index = IndexProcess(redis.url, INDEX_ARGS, port=port,
                             tls=test_certs.files("index")).start()
        wait_until(lambda: not link.degraded, DEADLINE_S, "registration once the index is up",
                   engine=engine)
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-early", engine),
                   DEADLINE_S,
                   "the blocks cached while degraded reach the index")
    finally:
        link.close()
        if index is not None:
            index.kill()
    assert engine.check_block_invariants() == []


SMALL_POOL = dict(num_blocks=64, max_num_batched_tokens=64)  # low-water mark 8, high 16


def eviction_script(driver: Driver) -> None:
    """16 distinct 30-token prompts in waves of 4: ~75 blocks cached into a 64-block pool."""
    for w in range(4):
        driver.add({f"e{w}{i}": prompt_ids(500 + 10 * w + i, 30) for i in range(4)},
                   SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        driver.run_to_completion()


def test_index_chooses_the_victims_ahead_of_need(tiny_llama_dir, index, test_certs):
    reference = Driver(make_engine(tiny_llama_dir, **SMALL_POOL))
    eviction_script(reference)

    engine = make_engine(tiny_llama_dir, **SMALL_POOL)
    link = connect(test_certs, engine, index, "engine-evict")
    try:
        # The victims the index chooses come back one round trip after the engine asks (a
        # millisecond or two); a step of the tiny model with the fused CPU ops takes about as
        # long, so a burst could use up the reserve before they arrive. Steps of 5 ms more,
        # still far shorter than a real model's, let them in.
        driver = Driver(engine, step_pause_s=0.005)
        eviction_script(driver)
        assert driver.tokens() == reference.tokens()
        counters = link.policy.counters
        assert counters.index_victims_applied > 0
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-evict", engine),
                   DEADLINE_S,
                   "index and pool agree after the evictions")
        stats = index_stats(test_certs, index.target, "engine-evict")
        assert stats.evictions >= counters.index_victims_applied
        # The reserve is small (at most 1/32 of the pool, issue 10), so a burst can outrun the
        # index's victims: the engine then evicts on its own and reports each block with a
        # Forget. Either way the index stays exact without a re-sync.
        assert counters.forgets_sent == counters.local_evictions
        assert link.stats().registrations == 1
    finally:
        link.close()
    assert engine.check_block_invariants() == []


def test_engine_restart_fences_the_old_epoch(tiny_llama_dir, index, test_certs):
    """A restarted engine under the same id, at the shipped 30 s lease: the old process
    registered where it served and its instance id, as pagedgen-engine does; dead, nothing
    answers there, so the index hands the lease to the new process at once (no lapse to wait
    for) and fences the old epoch."""
    first_engine = make_engine(tiny_llama_dir)
    dead_address = f"127.0.0.1:{free_port()}"  # where the first process served, now nobody
    first = connect(test_certs, first_engine, index, "engine-restarted",
                    link_options(test_certs, serving_address=dead_address,
                                 instance_id="first-instance"))
    driver = Driver(first_engine)
    driver.add({"before": SHARED + prompt_ids(20, 3)})
    driver.run_to_completion()
    wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-restarted",
                                          first_engine),
               DEADLINE_S, "the first instance's blocks reach the index")
    old_epoch = first.epoch
    first.close()  # the process "dies"; a new instance comes up under the same id

    second_engine = make_engine(tiny_llama_dir)
    second = connect(test_certs, second_engine, index, "engine-restarted",
                     link_options(test_certs, instance_id="second-instance"))
    try:
        assert second.stats().rpc_calls["Register"] == 1  # taken over at once, not refused
        assert second.epoch > old_epoch
        stats = index_stats(test_certs, index.target, "engine-restarted")
        assert stats.epoch == second.epoch
        assert stats.blocks == 0  # never told it holds the blocks the old instance had

        async def apply_with_old_epoch() -> None:
            async with test_certs.index_client(index.target, timeout_s=2.0) as client:
                client.attach("engine-restarted", old_epoch)
                await client.apply([Evict(0)])

        with pytest.raises(PrefixIndexClientError) as refused:
            asyncio.run(apply_with_old_epoch())
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION

        driver = Driver(second_engine)
        driver.add({"after": SHARED + prompt_ids(21, 3)})
        driver.run_to_completion()
        assert driver.finished["after"].num_cached_tokens == 0  # a fresh pool: nothing shared
        wait_until(lambda: index_matches_pool(test_certs, index.target, "engine-restarted",
                                              second_engine),
                   DEADLINE_S, "the second instance's blocks reach the index")
    finally:
        second.close()


def test_grpc_server_reports_cached_tokens_through_the_index(tiny_llama_dir, index, tmp_path,
                                                             test_certs):
    """End to end: pagedgen-engine --prefix-index HOST:PORT, two Generate calls sharing a
    prefix; the second's usage counts the shared blocks and the index counts the hit."""
    from engine_service.tools.launch import EngineProcess
    from pagedgen_api import generation_pb2 as gen_pb
    from pagedgen_api import generation_pb2_grpc as gen_grpc

    args = ["--num-blocks", "64", "--block-size", "16", "--max-model-len", "512",
            "--prefix-index", index.target, "--engine-id", "engine-e2e", "--log-level",
            "WARNING", "--grace-s", "1"]
    shared = prompt_ids(seed=30, length=32)  # 2 full blocks of 16
    params = gen_pb.SamplingParams(temperature=0, max_tokens=4)
    with EngineProcess(tiny_llama_dir, args, log_path=tmp_path / "engine.log",
                       tls=test_certs.files("engine")) as engine:
        with test_certs.channel(engine.target) as channel:
            stub = gen_grpc.GenerationStub(channel)

            # Health says SERVING once the link has registered (EngineProcess waited for
            # it): the first requests' blocks reach the index as they are cached, and count.
            first = stub.EngineStats(gen_pb.EngineStatsRequest(), timeout=10)
            assert first.index_details["state"] == "ok", dict(first.index_details)
            assert first.index_details["registrations"] == "1"
            replies = [
                stub.Generate(gen_pb.GenerateRequest(
                    token_ids=gen_pb.TokenIds(ids=shared + prompt_ids(seed, 7)),
                    sampling=params), timeout=60)
                for seed in (31, 32)
            ]
            assert [r.usage.cached_tokens for r in replies] == [0, 32]

            def index_hits() -> int:
                held = index_stats(test_certs, index.target, "engine-e2e")
                return -1 if held is None else held.hits

            wait_until(lambda: index_hits() == 2, DEADLINE_S,
                       "the index counts the second request's 2 shared blocks")
            stats = stub.EngineStats(gen_pb.EngineStatsRequest(), timeout=10)
            assert not stats.degraded
            assert stats.index_details["state"] == "ok"
            held = index_stats(test_certs, index.target, "engine-e2e")
            assert int(stats.index_details["epoch"]) == held.epoch
