"""A burst beside pinned blocks (issue 34): does the pin budget give way to running requests?

A 64-block pool; three 8-block prefixes requested 8 times each (the index's shipped hot
threshold) earn 24 automatic pins; then four requests whose prompts fit at once but that grow
to 12 blocks each (48 together) run concurrently. Pins are idle blocks nobody may evict, so
under a budget that does not move the burst has 64 - 24 = 40 blocks for 48 and a request is
preempted; the budget that follows the demand drops to 64 - 48 = 16 as they are admitted, the
index unpins 8 automatic pins (the least hot), and they all fit. The local LRU (no pins) is the
baseline. The engine thread is this one; between the admission step and the next steps the
bench waits (untimed) until the index's budget and pin changes reached the engine, so the count
is the policy's, not the machine's.
"""

from __future__ import annotations

import random
import time

from bench.pinning import _index_matches_pool, _index_stats, _pump_until

POOL = 64
BLOCK = 16
PREFIX_BLOCKS = 8
NUM_PREFIXES = 3
HEAT = 8  # the index's shipped hot threshold (admissions within 60 s)
BURST = 4
BURST_PROMPT_BLOCKS = 2
BURST_OUTPUT_BLOCKS = 10
POLICIES = {
    "local_lru": None,
    "index_fixed_50": {"pin_budget_floor": 0.5, "pin_budget_ceiling": 0.5},
    "index_fixed_10": {"pin_budget_floor": 0.1, "pin_budget_ceiling": 0.1},
    "index_adaptive": {},
}


def _ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(length)]


def burst_run(make_engine, policy: str, target: str | None, engine_id: str,
              timeout_s: float = 30.0) -> dict:
    from engine_service.index.link import connect_prefix_index
    from engine_service.model.sampling_params import SamplingParams

    overrides = POLICIES[policy]
    engine = make_engine(dtype="float32", block_size=BLOCK, num_blocks=POOL,
                         enable_prefix_caching=True, pin_budget_window_s=0.0,
                         **(overrides or {}))
    link = connect_prefix_index(engine, target, engine_id) if overrides is not None else None
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    grow = SamplingParams(temperature=0, max_tokens=BURST_OUTPUT_BLOCKS * BLOCK,
                          ignore_eos=True)
    out: dict = {"policy": policy}

    def run_all() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    def synced() -> bool:
        return link is None or _index_matches_pool(target, engine_id, engine)

    try:
        if link is not None and not _pump_until(engine, lambda: not link.degraded, timeout_s):
            raise RuntimeError(f"{policy}: no registration with the index at {target}")
        prefixes = [_ids(10 + p, PREFIX_BLOCKS * BLOCK) for p in range(NUM_PREFIXES)]
        for n in range(HEAT):
            for p, prefix in enumerate(prefixes):
                engine.add_request(f"heat{p}-{n}", prefix + [7, 8, 9], one)
                run_all()
                _pump_until(engine, synced, timeout_s)
        _pump_until(engine, lambda: synced() and (
            link is None or engine.pool.policy.num_pinned_idle == min(
                NUM_PREFIXES * PREFIX_BLOCKS, engine.pin_budget.blocks)), timeout_s)
        out["pinned_before"] = engine.pool.policy.num_pinned_idle
        for i in range(BURST):
            engine.add_request(f"burst{i}", _ids(900 + i, BURST_PROMPT_BLOCKS * BLOCK), grow)
        started = time.monotonic()
        engine.step()  # the four are admitted: their prompts fit
        out["admitted_at_once"] = engine.stats().num_running
        if link is not None:
            _pump_until(engine, lambda: synced() and _index_stats(target, engine_id).pin_budget
                        == engine.pin_budget.reported, timeout_s)
        out["pin_budget_during"] = engine.pin_budget.blocks
        out["pinned_during"] = engine.pool.policy.num_pinned_idle
        run_all()
        out["burst_s"] = time.monotonic() - started
        out["num_preemptions"] = engine.stats().num_preemptions
        out["num_pins_released"] = engine.stats().num_pins_released
        engine.step()  # idle: the budget the finished burst leaves (a 0 s window)
        if link is not None:
            _pump_until(engine, lambda: synced() and _index_stats(target, engine_id).pin_budget
                        == engine.pin_budget.reported, timeout_s)
            out["index_pin_budget_after"] = _index_stats(target, engine_id).pin_budget
        out["pin_budget_after"] = engine.pin_budget.blocks
        problems = engine.check_block_invariants()
        if problems:
            raise RuntimeError(f"{policy}: block invariants broken: {problems[:3]}")
    finally:
        if link is not None:
            link.close()
    return out


def burst_bench(make_engine, seed_tag: str) -> dict:
    """Every policy once against one Redis and an index at its shipped defaults (the counts
    are exact: one run each)."""
    from contextlib import ExitStack

    from prefix_index.tools.launch import IndexProcess
    from prefix_index.tools.redis_process import RedisProcess

    with ExitStack() as stack:
        redis = stack.enter_context(RedisProcess())
        index = stack.enter_context(IndexProcess(redis.url, ["--log-level", "WARNING",
                                                             "--insecure"]))
        runs = {policy: burst_run(make_engine, policy,
                                  index.target if POLICIES[policy] is not None else None,
                                  f"burst-{policy}-{seed_tag}")
                for policy in POLICIES}
    return {"shape": {"num_blocks": POOL, "block_size": BLOCK, "prefix_blocks": PREFIX_BLOCKS,
                      "num_prefixes": NUM_PREFIXES, "burst": BURST,
                      "burst_blocks_each": BURST_PROMPT_BLOCKS + BURST_OUTPUT_BLOCKS},
            "runs": runs}

