"""The router's EngineStats sums its replicas' pins (issue 34 review): the pin budgets and the
pinned blocks of every routable replica, as it sums their blocks and requests."""

from __future__ import annotations

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.router.stack import BLOCK_SIZE, wait_until

PREFIX = [(i * 67) % 4000 + 100 for i in range(3 * BLOCK_SIZE + 2)]


def test_router_stats_sum_the_replicas_pins(stack, router_stub):
    pinned = router_stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PREFIX),
                                                       cache_salt="router-stats-pins"),
                                   timeout=60)
    assert pinned.num_pinned == 3

    def sums_match() -> bool:
        budget = blocks = 0
        for engine in stack.engines.values():
            with stack.channel(engine.target) as channel:
                one = pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(),
                                                                  timeout=5)
            budget += one.pin_budget_blocks
            blocks += one.num_pinned_blocks
        total = router_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
        return (blocks >= 3 and budget > 0
                and (total.pin_budget_blocks, total.num_pinned_blocks) == (budget, blocks))

    wait_until(sums_match, 60.0, "the router's pin sums equal its replicas'")
    router_stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PREFIX),
                                              cache_salt="router-stats-pins", unpin=True),
                          timeout=60)
