"""The scheduler's decode fast path (KVCacheManager.table_for_decode) decides exactly what the
general path decides: seeded random request streams (n > 1 forks, beam search, shared prefixes
and salts, preemption by recompute and swap, small token budgets and sequence limits, aborts,
local pins) run through two engines alike but for the fast path, which one of them has off.
Every step must schedule the same sequences with the same token counts and block tables, move
the same blocks (copy-on-write copies, swaps), preempt the same requests, and pass
engine_service/core/invariants.py; the outputs must be the same tokens.

A failure names its seed; replay it with
    PAGEDGEN_FAST_PATH_SEEDS=7 pytest tests/engine/test_decode_fast_path.py
"""

from __future__ import annotations

import os
import random

import pytest

from engine_service import SamplingParams
from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.core.errors import RequestTooLargeError
from engine_service.index.link import PinRefusedError
from engine_service.serving.local_pins import pin_locally
from tests.engine.test_core_stress import Draw, draw_requests

# Three seeds in CI (each a fresh random mix and engine shape); more with the variable below.
SEEDS = list(range(3))
OVERRIDE = os.environ.get("PAGEDGEN_FAST_PATH_SEEDS")
if OVERRIDE:
    SEEDS = [int(s) for s in OVERRIDE.split(",")]

pytestmark = pytest.mark.timeout(600)


def step_record(engine: LLMEngine, sched) -> tuple:
    """What a step decided, by request and sequence index (seq ids are engine-wide)."""
    index = {s.seq_id: (g.request_id, i) for g in engine._groups.values()
             for i, s in enumerate(g.seqs)}
    scheduled = [(index[s.seq.seq_id], s.num_new_tokens, s.samples, tuple(s.block_table))
                 for s in sched.scheduled]
    moves = sched.moves
    return (scheduled, tuple(moves.copies), tuple(moves.swap_out), tuple(moves.swap_in),
            sorted(g.request_id for g in sched.preempted))


def run(config: EngineConfig, draws, seed: int, general_only: bool) -> tuple[list, dict, int]:
    engine = LLMEngine(config)
    records: list = []
    fast_hits = 0
    schedule = engine.scheduler.schedule
    # With the fast path off, every step takes the general path.
    table_for_decode = (lambda seq: None) if general_only else engine.kv.table_for_decode

    def recorded_schedule():
        sched = schedule()
        records.append(step_record(engine, sched))
        return sched

    def counted_table_for_decode(seq):
        nonlocal fast_hits
        table = table_for_decode(seq)
        fast_hits += table is not None
        return table

    engine.scheduler.schedule = recorded_schedule
    engine.kv.table_for_decode = counted_table_for_decode
    rng = random.Random(seed * 7919)  # aborts and pins: the same in both runs
    pending = sorted(enumerate(draws), key=lambda item: item[1].arrival_step)
    finished: dict[str, list] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_step <= step:
            i, draw = pending.pop(0)
            try:
                engine.add_request(f"r{i}", draw.prompt, draw.params, cache_salt=draw.salt)
            except RequestTooLargeError as error:  # refused alike in both runs
                finished[f"r{i}"] = [str(error)]
        if rng.random() < 0.03 and engine._groups:
            request_id = rng.choice(sorted(engine._groups))
            output = engine.abort_request(request_id)
            if output is not None:
                finished[request_id] = [c.token_ids for c in output.outputs]
        if rng.random() < 0.05:
            draw = rng.choice(draws)
            chain = engine.kv.hasher.chain(draw.prompt, draw.salt)
            try:
                pin_locally(engine, chain, 0.0, unpin=rng.random() < 0.3)
            except PinRefusedError:
                pass  # over the local budget, or no prefix cache: the same in both runs
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [list(c.token_ids) for c in output.outputs]
        problems = engine.check_block_invariants()
        assert problems == [], f"seed {seed} (general only: {general_only}), step {step}: " \
                               f"{problems}"
        step += 1
        assert step < 4000, f"seed {seed}: no end after {step} steps"
    return records, finished, fast_hits


def draw_long_decodes(rng: random.Random, block_size: int) -> list[Draw]:
    """Mostly lone sequences decoding for many blocks (the fast path's steps) beside a few
    forks, in a pool they outgrow: preemptions land in steps the fast path scheduled."""
    prefix = [rng.randrange(5, 2000) for _ in range(2 * block_size + rng.randrange(block_size))]
    draws = []
    for _ in range(rng.randrange(8, 16)):
        tail = [rng.randrange(5, 2000) for _ in range(rng.randrange(1, 2 * block_size))]
        prompt = prefix + tail if rng.random() < 0.5 else tail
        greedy = rng.random() < 0.5
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 1, 2]), temperature=0.0 if greedy else 1.0,
            seed=None if greedy else rng.randrange(99),
            max_tokens=rng.randrange(block_size, 6 * block_size), ignore_eos=True)
        draws.append(Draw(arrival_step=rng.randrange(0, 30), prompt=prompt, params=params,
                          salt=rng.choice([None, "tenant-a"]), abort_at_step=None))
    return draws


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mix", ["stress", "long_decodes"])
def test_fast_path_decides_what_the_general_path_decides(seed, mix, tiny_llama_dir):
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    if mix == "stress":
        draws = draw_requests(rng, block_size, 100)
    else:
        draws = draw_long_decodes(rng, block_size)
    config = EngineConfig(
        model=str(tiny_llama_dir), block_size=block_size,
        num_blocks=rng.choice([16, 24, 40]),
        preemption_mode=rng.choice(["recompute", "swap"]),
        swap_space=rng.choice([0, 1 << 16, 1 << 22]),
        max_num_batched_tokens=rng.choice([16, 64, 2048]),
        max_num_seqs=rng.choice([4, 6, 256]),
        enable_prefix_caching=rng.random() < 0.85,
        seed=rng.randrange(1000),
    )
    fast, fast_out, fast_hits = run(config, draws, seed, general_only=False)
    general, general_out, general_hits = run(config, draws, seed, general_only=True)
    print(f"seed {seed} ({mix}): {len(fast)} steps, fast path taken {fast_hits} times, "
          f"{sum(bool(r[4]) for r in fast)} steps preempted, {sum(bool(r[1]) for r in fast)} "
          f"with copy-on-write, {sum(bool(r[2] or r[3]) for r in fast)} with swaps")
    assert general_hits == 0
    for step, (a, b) in enumerate(zip(fast, general, strict=False)):
        assert a == b, f"seed {seed}: step {step} differs:\nfast    {a}\ngeneral {b}"
    assert len(fast) == len(general), f"seed {seed}"
    assert fast_out == general_out, f"seed {seed}"
