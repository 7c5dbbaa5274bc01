"""An engine whose Applies the index refuses for their rate (RESOURCE_EXHAUSTED past
--apply-ops-per-s) keeps the ops, waits the delay the index names and sends them later: serving
never fails, the link never re-registers, and once the burst ends the index's view is the
engine's. Real processes on the session's certificates: Redis, the index, pagedgen-engine."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_service.core.block_hash import BlockHasher
from engine_service.index.link import REFUSED_LOG_INTERVAL_S, RefusedApplies
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess, free_port
from tests.service.index_fixtures import prompt_ids, wait_until
from trust.identity import ROUTER_ROLE

pytestmark = pytest.mark.timeout(300)
ENGINE_ID = "apply-rate"
BLOCK_SIZE = 16
# The index's bucket holds 2 ops per pool block plus one largest Apply (--max-ops): 128 ops
# here, refilled at 25 a second. The burst records several times that: commits, acquires,
# releases and the evictions of a 32-block pool.
NUM_BLOCKS = 32
INDEX_RATE_ARGS = ["--apply-ops-per-s", "25", "--max-ops", "64"]
# At most 8 sequences a step keep one step's ops under the index's 64 per Apply.
ENGINE_ARGS = ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
               "--max-model-len", "256", "--max-num-seqs", "8", "--dtype", "float32",
               "--engine-id", ENGINE_ID, "--log-level", "WARNING", "--grace-s", "1"]
BURST = 64  # requests, all sent at once
PROMPT_TOKENS = 2 * BLOCK_SIZE + 1  # two full blocks each
DEADLINE_S = 180.0  # the backlog drains at the index's rate; a loaded machine is slower


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text page (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def test_an_engine_past_its_apply_rate_backs_off_and_the_index_catches_up(tiny_llama_dir,
                                                                         tmp_path, test_certs):
    index_metrics_port = free_port()
    log_path = tmp_path / "engine.log"
    with RedisProcess() as redis, \
            IndexProcess(redis.url, ["--log-level", "WARNING", *INDEX_RATE_ARGS,
                                     "--metrics-port", str(index_metrics_port),
                                     "--metrics-host", "127.0.0.1"],
                         tls=test_certs.files("index")) as index, \
            EngineProcess(tiny_llama_dir, [*ENGINE_ARGS, "--prefix-index", index.target],
                          log_path=log_path, tls=test_certs.files("engine")) as engine, \
            test_certs.channel(engine.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        prompts = [prompt_ids(seed, PROMPT_TOKENS) for seed in range(BURST)]

        def generate(ids: list[int]) -> pb.GenerateResponse:
            return stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
                timeout=120)

        started = time.monotonic()
        with ThreadPoolExecutor(BURST) as pool:
            replies = list(pool.map(generate, prompts))
        # Serving never failed: every request of the burst is answered whole.
        assert [r.usage.completion_tokens for r in replies] == [4] * BURST

        def index_view() -> tuple[int, int]:
            async def read():
                async with test_certs.index_client(index.target, 5.0, ROUTER_ROLE) as reader:
                    return await reader.stats(ENGINE_ID)
            [held] = asyncio.run(read())
            return held.blocks, held.evictable

        def engine_stats() -> pb.EngineStatsResponse:
            return stub.EngineStats(pb.EngineStatsRequest(), timeout=10)

        def caught_up() -> bool:
            stats = engine_stats()
            cached = stats.num_cached_blocks
            return stats.num_running == 0 and index_view() == (cached, cached)

        # The backlog reaches the index at its rate: its view becomes the engine's pool.
        wait_until(caught_up, DEADLINE_S, "the index's view of the engine equals its pool")
        assert engine_stats().index_details["registrations"] == "1"  # no re-sync

        # A prompt served alone after the burst stays resident (nothing runs after it to take
        # its blocks), so Lookup finds them once its ops reach the index. (The burst's own last
        # prompt need not be resident: 64 threads reach the engine in no set order.) Its commits
        # may come with as many evictions, which leave the counts equal: both are waited for.
        last = prompt_ids(BURST, PROMPT_TOKENS)
        assert generate(last).usage.completion_tokens == 4
        info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
        chain = BlockHasher.for_identity(info.model_identity, info.block_size).chain(last, None)

        def lookup_last() -> dict[str, int]:
            async def lookup():
                async with test_certs.index_client(index.target, 5.0, ROUTER_ROLE) as reader:
                    return await reader.lookup(chain)
            return {m.engine_id: m.matched_blocks for m in asyncio.run(lookup())}

        wait_until(lambda: lookup_last() == {ENGINE_ID: 2} and caught_up(), DEADLINE_S,
                   "the index holds the last prompt and its view equals the engine's pool")
        # Read once no more ops are owed: the last Apply too may have waited for the bucket.
        details = engine_stats().index_details
        assert details["state"] == "ok" and details["registrations"] == "1"

        elapsed_s = time.monotonic() - started
        # The index refused Applies, and the engine waited each time before sending again:
        # one back-off per refusal, each long enough that the Apply after it passed.
        page = urllib.request.urlopen(f"http://127.0.0.1:{index_metrics_port}/metrics",
                                      timeout=10).read().decode()
        rpcs = "pagedgen_prefix_index_rpcs_total"
        refused = metric(page, rpcs, code="RESOURCE_EXHAUSTED", method="Apply")
        accepted = metric(page, rpcs, code="OK", method="Apply")
        assert refused >= 1, "the burst never reached the index's Apply rate"
        assert int(details["apply_backoffs"]) == refused
        assert refused <= accepted
        # Logged as a WARNING when the refusals began, then at most once an interval with the
        # count refused meanwhile (a line each buried the log); the rest of the count comes
        # with the next line (an INFO, not logged here, once Applies are taken again).
        backoffs = [line for line in log_path.read_text().splitlines()
                    if "backing off" in line]
        assert 1 <= len(backoffs) <= 1 + elapsed_s / REFUSED_LOG_INTERVAL_S
        assert len(backoffs) + more_refused(backoffs) <= refused
        assert all("--apply-ops-per-s 25" in line for line in backoffs)


def more_refused(lines: list[str]) -> int:
    """The refusals lines say were not logged on lines of their own."""
    return sum(int(n) for line in lines
               for n in re.findall(r"(\d+) more refused since the last such line", line))


def test_a_flood_of_refused_applies_is_a_few_lines_that_count_every_refusal(caplog):
    refusals = RefusedApplies("index:50061", interval_s=3600.0)
    with caplog.at_level(logging.INFO, logger="engine_service.index.link"):
        for _ in range(500):  # refused and taken by turns, as under the index's Apply rate
            refusals.refused(64, "past --apply-ops-per-s 25", 0.1)
            refusals.taken()
        refusals.interval_s = 0.0  # the interval past: one line, with the count meanwhile
        refusals.refused(64, "past --apply-ops-per-s 25", 0.1)
        refusals.interval_s = 3600.0
        for _ in range(200):
            refusals.refused(64, "past --apply-ops-per-s 25", 0.1)
        refusals.interval_s = 0.0  # taken again, the interval past: said with the count
        refusals.taken()
        refusals.interval_s = 3600.0
        refusals.refused(64, "redis full", 0.1)  # a new run: said at once
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.name == "engine_service.index.link"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.WARNING, logging.INFO,
                                             logging.WARNING]
    warnings = [text for level, text in lines if level == logging.WARNING]
    assert len(warnings) + more_refused([text for _, text in lines]) == 500 + 1 + 200 + 1
    assert "(499 more refused since the last such line)" in lines[1][1]
    assert lines[2][1] == ("prefix index index:50061: Applies taken again; 200 more refused "
                           "since the last such line")
    assert "more refused" not in lines[3][1] and "(redis full)" in lines[3][1]
