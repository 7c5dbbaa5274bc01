"""EngineStats over gRPC reports the pins (issue 34 review): the pin budget in blocks (what
the pool can spare beside the running requests, engine_service/core/pin_budget.py) and the
blocks pinned now, idle or in use (what the budget counts)."""

from __future__ import annotations

from pagedgen_api import generation_pb2 as pb
from tests.service.pin_stats import BLOCK, pin, prompt_ids, wait_pinned


def test_engine_stats_report_the_pin_budget_and_the_pinned_blocks(stub):
    stats = stub.EngineStats(pb.EngineStatsRequest())
    # 240 blocks: the budget lies between its floor (10%) and its ceiling (50%).
    assert 24 <= stats.pin_budget_blocks <= 120, stats
    before = stats.num_pinned_blocks
    prefix = prompt_ids(41, 3 * BLOCK + 5)
    assert pin(stub, prefix, "stats-pins").num_pinned == 3
    wait_pinned(stub, before + 3)
    assert pin(stub, prefix, "stats-pins", unpin=True).num_pinned == 3
    wait_pinned(stub, before)
