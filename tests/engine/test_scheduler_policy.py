"""The scheduler's policy, pinned through the engine's public step API.

The policy (DESIGN.md's engine core, issue 36): requests are admitted first come, first served
within `priority` (lower value first, vLLM's convention; ties by arrival), and one that does not
fit yet holds back those behind it; when blocks run out, the last group in (priority, arrival)
order is preempted, whole; nothing is admitted while a group is swapped out; a victim the CPU
pool cannot hold is recomputed instead of swapped. These tests watch only what a caller of
LLMEngine sees, which request gets tokens in which step (the outputs' token deltas) and the
engine's stats, so they hold across rewrites of the engine's insides. Every run also gives
exactly the greedy tokens of a pool where nothing is preempted (float32).

The hand-built scenarios use pools of a few 8-token blocks; the comments give the arithmetic
that makes each preempt where it says. With prompt length L, step 1 computes positions 0..L-1
and step k > 1 position L+k-2: a request writes position 8 (its second block) in step 10-L.
The seeded random runs check the same rules step by step on drawn workloads; a failure names
its seed, and PAGEDGEN_POLICY_SEEDS=7,8 replays those seeds.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.core.config import EngineConfig
from engine_service.core.engine import EngineStats, LLMEngine

BLOCK_SIZE = 8
MAX_STEPS = 400  # every run here ends far sooner: more means the engine livelocked
# Every request here fits in 64 tokens; a short context makes an engine quick to build.
MAX_MODEL_LEN = 64

RANDOM_SEEDS = list(range(10))
OVERRIDE = os.environ.get("PAGEDGEN_POLICY_SEEDS")
if OVERRIDE:
    RANDOM_SEEDS = [int(s) for s in OVERRIDE.split(",")]


@dataclass(frozen=True, slots=True)
class Req:
    request_id: str
    prompt_len: int
    max_tokens: int
    priority: int = 0
    arrives: int = 1  # added just before this step (1: before the first)
    n: int = 1

    @property
    def prompt(self) -> list[int]:
        # Random tokens seeded by the id: no two prompts share a block, so the prefix cache
        # never lets one request wait for another's prefill (that would reorder admission).
        rng = random.Random(self.request_id)
        return [rng.randrange(5, 40_000) for _ in range(self.prompt_len)]

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=0, max_tokens=self.max_tokens,
                              ignore_eos=True)


@dataclass(slots=True)
class Step:
    number: int
    progressed: set[str]  # the requests that got a token in this step
    finished: set[str]
    stats: EngineStats
    num_new_preemptions: int


@dataclass(slots=True)
class Run:
    steps: list[Step] = field(default_factory=list)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)  # tokens by completion
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # (priority, arrival)

    def first_token_step(self) -> dict[str, int]:
        first: dict[str, int] = {}
        for step in self.steps:
            for request_id in step.progressed:
                first.setdefault(request_id, step.number)
        return first

    def start_order(self) -> list[str]:
        first = self.first_token_step()
        return sorted(first, key=first.__getitem__)

    def stalled(self, index: int) -> set[str]:
        """Requests that got a token in the step before steps[index], did not finish there,
        and get none in it: with the budget large enough for every running request, only a
        preemption stops one."""
        if index == 0:
            return set()
        before = self.steps[index - 1]
        return before.progressed - before.finished - self.steps[index].progressed

    def preemptions(self) -> list[tuple[int, set[str], EngineStats]]:
        """(step number, the requests it stalled, stats after it) for each step that preempted."""
        return [
            (step.number, self.stalled(i), step.stats)
            for i, step in enumerate(self.steps)
            if step.num_new_preemptions
        ]


def run(engine: LLMEngine, requests: list[Req], check=None) -> Run:
    """Add each request just before its step, step until everything has finished, and record
    what every step gave. check(run, step, added) runs after each step."""
    pending = sorted(requests, key=lambda r: r.arrives)  # stable: list order within a step
    result = Run()
    number = 0
    while pending or engine.has_unfinished_requests():
        number += 1
        assert number <= MAX_STEPS, f"not finished after {MAX_STEPS} steps"
        added = []
        while pending and pending[0].arrives <= number:
            req = pending.pop(0)
            engine.add_request(req.request_id, req.prompt, req.params, priority=req.priority)
            result.keys[req.request_id] = (req.priority, len(result.keys))
            result.outputs[req.request_id] = [[] for _ in range(req.n)]
            added.append(req.request_id)
        preemptions_before = engine.stats().num_preemptions
        progressed, finished = set(), set()
        for output in engine.step():
            for completion in output.outputs:
                if completion.token_ids_delta:
                    progressed.add(output.request_id)
                    result.outputs[output.request_id][completion.index] += (
                        completion.token_ids_delta
                    )
            if output.finished:
                finished.add(output.request_id)
        stats = engine.stats()
        step = Step(number, progressed, finished, stats,
                    stats.num_preemptions - preemptions_before)
        result.steps.append(step)
        if check is not None:
            check(result, step, added)
    # Nothing is live any more: every block is back in its pool, none counted twice.
    assert engine.check_block_invariants() == []
    return result


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """A step of the tiny model is well under a millisecond of work: a second thread only adds
    synchronisation, which on a busy machine cost ten times the work itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir) -> LLMEngine:
    """The reference: a pool where nothing is ever preempted."""
    return LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), block_size=BLOCK_SIZE, num_blocks=1024, dtype="float32",
            skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
        )
    )


@pytest.fixture
def make_engine(tiny_llama_dir, roomy):
    """An engine on the tiny Llama with blocks of 8; swap_blocks sizes its CPU pool in blocks."""

    def factory(num_blocks: int, swap_blocks: int | None = None, **engine_args) -> LLMEngine:
        if swap_blocks is not None:
            engine_args.update(preemption_mode="swap",
                               swap_space=swap_blocks * roomy.kv_bytes_per_block)
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir), block_size=BLOCK_SIZE, num_blocks=num_blocks,
                dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
                **engine_args,
            )
        )
        return engine

    return factory


def unpreempted_outputs(roomy: LLMEngine, requests: list[Req]) -> dict[str, list[list[int]]]:
    result = run(roomy, [Req(r.request_id, r.prompt_len, r.max_tokens, n=r.n)
                         for r in requests])
    assert roomy.stats().num_preemptions == 0
    return result.outputs


# ---- admission order ----------------------------------------------------------------------
# One admission per step: either one sequence at a time, or a token budget of one 8-token
# prompt (the next request's prefill gets what the running decodes leave).
ONE_AT_A_TIME = {
    "seq_limit": {"max_num_seqs": 1},
    "token_budget": {"max_num_batched_tokens": 8},
}


@pytest.mark.parametrize("limit", sorted(ONE_AT_A_TIME))
def test_admission_is_first_come_first_served(limit, make_engine, roomy):
    requests = [Req(f"r{i}", 8, 3) for i in range(4)] + [Req("late", 8, 3, arrives=2)]
    engine = make_engine(num_blocks=64, **ONE_AT_A_TIME[limit])
    result = run(engine, requests)
    assert result.start_order() == ["r0", "r1", "r2", "r3", "late"]
    first = result.first_token_step()
    assert len(set(first.values())) == len(first), f"two requests started together: {first}"
    assert result.outputs == unpreempted_outputs(roomy, requests)


@pytest.mark.parametrize("limit", sorted(ONE_AT_A_TIME))
def test_lower_priority_value_is_admitted_first_ties_by_arrival(limit, make_engine, roomy):
    priorities = [2, 0, 1, 0, 1]
    requests = [Req(f"r{i}", 8, 3, priority=p) for i, p in enumerate(priorities)]
    # Arrives while r1 runs and goes ahead of everything still waiting. (Whether it may
    # preempt r1 is not pinned here: r1's first token comes first either way.)
    requests.append(Req("urgent", 8, 3, priority=-1, arrives=2))
    engine = make_engine(num_blocks=64, **ONE_AT_A_TIME[limit])
    result = run(engine, requests)
    assert result.start_order() == ["r1", "urgent", "r3", "r2", "r4", "r0"]
    assert result.outputs == unpreempted_outputs(roomy, requests)


def test_the_offline_api_admits_by_priority(tiny_llama_dir, roomy):
    """LLM.generate(priority=...) reaches the scheduler: one sequence at a time, the first
    tokens come in (priority, arrival) order."""
    llm = LLM(str(tiny_llama_dir), block_size=BLOCK_SIZE, num_blocks=64, dtype="float32",
              skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=1)
    requests = [Req(f"r{i}", 8, 3) for i in range(4)]
    outputs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests],
                           [r.params for r in requests], priority=[1, 0, 1, 0])
    started = sorted(range(len(outputs)), key=lambda i: outputs[i].first_token_time)
    assert started == [1, 3, 0, 2]
    expected = unpreempted_outputs(roomy, requests)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [
        expected[r.request_id] for r in requests
    ]


HEAD_OF_LINE = {
    # max_num_seqs 3: r0 runs one sequence; r1 (n=3) needs three slots and waits for r0 to end.
    "sequence_slots": ({"num_blocks": 64, "max_num_seqs": 3}, Req("r1", 8, 3, n=3, arrives=2)),
    # 4 blocks: r0 holds 2 for 8 steps; r1's 20-token prompt needs 3 and waits for r0 to end.
    "blocks": ({"num_blocks": 4}, Req("r1", 20, 3, arrives=2)),
}


@pytest.mark.parametrize("limit", sorted(HEAD_OF_LINE))
def test_a_waiting_request_that_does_not_fit_is_not_overtaken(limit, make_engine, roomy):
    """r2 arrives after r1 and would fit beside r0 at once, but first come, first served: it
    starts no earlier than r1."""
    engine_args, r1 = HEAD_OF_LINE[limit]
    requests = [Req("r0", 8, 8), r1, Req("r2", 5, 3, arrives=3)]
    result = run(make_engine(**engine_args), requests)
    first = result.first_token_step()
    assert first["r1"] > 3, f"r1 did not have to wait: {first}"
    assert first["r2"] >= first["r1"], f"r2 overtook r1: {first}"
    assert result.outputs == unpreempted_outputs(roomy, requests)


def sequences_per_step(engine: LLMEngine, requests: list[Req]) -> list[int]:
    """Runs requests (all added before the first step); how many sequences got a token in
    each step."""
    for req in requests:
        engine.add_request(req.request_id, req.prompt, req.params)
    counts = []
    while engine.has_unfinished_requests():
        assert len(counts) < MAX_STEPS, f"not finished after {MAX_STEPS} steps"
        counts.append(sum(1 for output in engine.step() for completion in output.outputs
                          if completion.token_ids_delta))
    return counts


@pytest.mark.parametrize("chunked", [False, True])
def test_max_num_seqs_counts_the_samples_a_request_will_fork(chunked, make_engine):
    """max_num_seqs bounds the sequences in a step, and a request of n samples holds n of them
    from its admission on: while it prefills it runs one sequence, and forks into n after. A
    request admitted beside it meanwhile would make n + 1 in its steps. Chunked: a 3-token
    budget makes the n = 3 request prefill over several steps, the window in which the second
    was admitted."""
    engine_args = {"max_num_seqs": 3}
    if chunked:
        engine_args["max_num_batched_tokens"] = 3
    engine = make_engine(num_blocks=64, **engine_args)
    counts = sequences_per_step(engine, [Req("a", 9, 4, n=3), Req("b", 3, 4)])
    assert max(counts) <= 3, counts
    assert sum(counts) == 3 * 4 + 4  # every sample and b got all their tokens


# ---- the preemption victim ----------------------------------------------------------------
VICTIM_SCENARIOS = {
    # Order b, c, a (a arrived first but has the larger priority value). 3 blocks, one each
    # after step 1. Step 3: a writes position 8 with no block free and, last in order,
    # preempts itself (whole group). Step 4: b takes the block a freed (so a swapped-out a
    # cannot come straight back) and finishes; a returns beside c.
    "last_group_needs_the_block": (
        3,
        [Req("a", 7, 9, priority=1), Req("b", 6, 4), Req("c", 3, 6)],
        "a",
    ),
    # Order b, c, a. 5 blocks: b 1, c 1, a 2 after step 1, one free. Step 3: b takes it,
    # c needs one more: a, last in order, is preempted though c is the one growing; a's two
    # blocks come back only when b and c finish (they need nothing more).
    "another_group_needs_the_block": (
        5,
        [Req("a", 15, 12, priority=1), Req("b", 7, 10), Req("c", 7, 10)],
        "a",
    ),
}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("scenario", sorted(VICTIM_SCENARIOS))
def test_victim_is_the_last_group_in_priority_then_arrival_order(scenario, mode, make_engine,
                                                                  roomy):
    num_blocks, requests, victim = VICTIM_SCENARIOS[scenario]
    swap_blocks = 4 if mode == "swap" else None  # room for any of these groups
    engine = make_engine(num_blocks=num_blocks, swap_blocks=swap_blocks)
    result = run(engine, requests)
    preemptions = result.preemptions()
    assert preemptions, "nothing was preempted"
    step, stalled, stats = preemptions[0]
    assert stalled == {victim}, f"step {step} preempted {stalled}, expected {victim}"
    assert len(preemptions) == 1, f"preempted again: {preemptions[1:]}"
    assert stats.num_preemptions == 1
    if mode == "swap":
        assert (stats.num_swapped, stats.num_waiting) == (1, 0)
    else:
        assert (stats.num_swapped, stats.num_waiting) == (0, 1)
    assert result.outputs == unpreempted_outputs(roomy, requests)


# ---- no admissions while a group is swapped out ---------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_nothing_is_admitted_while_a_group_is_swapped_out(mode, make_engine, roomy):
    """The second victim scenario (a preempted in step 3, one block left free), then d, a
    one-block request ahead of everything in priority, arrives before step 4. It fits: with a
    recomputed a it starts at once. With a swapped out it waits until a is back."""
    _, requests, _ = VICTIM_SCENARIOS["another_group_needs_the_block"]
    requests = requests + [Req("d", 5, 4, priority=-1, arrives=4)]
    engine = make_engine(num_blocks=5, swap_blocks=4 if mode == "swap" else None)
    result = run(engine, requests)
    assert [p[:2] for p in result.preemptions()] == [(3, {"a"})]
    started = result.first_token_step()["d"]
    if mode == "recompute":
        assert started == 4
    else:
        swapped_out = [s.number for s in result.steps if s.stats.num_swapped]
        assert swapped_out and swapped_out[0] < 4, swapped_out
        assert started > max(swapped_out), (
            f"d started in step {started}; a group was swapped out after steps {swapped_out}"
        )
    assert result.outputs == unpreempted_outputs(roomy, requests)


# ---- swap falls back to recompute -----------------------------------------------------------
@pytest.mark.parametrize("swap_blocks", [1, 2])
def test_a_victim_larger_than_the_cpu_pool_is_recomputed(swap_blocks, make_engine, roomy):
    """a holds 2 blocks when it is preempted: a CPU pool of 2 takes it, one of 1 cannot."""
    num_blocks, requests, victim = VICTIM_SCENARIOS["another_group_needs_the_block"]
    engine = make_engine(num_blocks=num_blocks, swap_blocks=swap_blocks)
    result = run(engine, requests)
    preemptions = result.preemptions()
    assert [p[1] for p in preemptions] == [{victim}]
    stats = preemptions[0][2]
    swapped = int(swap_blocks == 2)
    assert (stats.num_swapped, stats.num_waiting) == (swapped, 1 - swapped)
    if not swapped:
        assert all(s.stats.num_swapped == 0 for s in result.steps)
    assert result.outputs == unpreempted_outputs(roomy, requests)


def test_a_victim_is_recomputed_once_the_cpu_pool_is_full(make_engine, roomy):
    """Order b, c, x, y; 4 blocks, one each after step 1; a CPU pool of 1 block. Step 3: b
    writes position 8, y is preempted and swapped out (the CPU pool is now full). Step 4: c
    writes position 8, x is preempted and, with no CPU block left, recomputed. Both come back
    when b and c finish."""
    requests = [
        Req("y", 3, 6, priority=2),
        Req("x", 3, 6, priority=1),
        Req("b", 7, 10),
        Req("c", 6, 10),
    ]
    engine = make_engine(num_blocks=4, swap_blocks=1)
    result = run(engine, requests)
    events = [(step, stalled, (stats.num_swapped, stats.num_waiting))
              for step, stalled, stats in result.preemptions()]
    assert events == [(3, {"y"}, (1, 0)), (4, {"x"}, (1, 1))]
    assert result.outputs == unpreempted_outputs(roomy, requests)


# ---- seeded random workloads ----------------------------------------------------------------
def draw(seed: int) -> tuple[dict, list[Req]]:
    """A workload and an engine for it. Even seeds recompute; odd seeds swap to a CPU pool of
    0-4 blocks, often too small for a victim, so swap-outs and recomputes mix."""
    rng = random.Random(seed)
    requests = [
        Req(f"s{seed}-{i}", rng.randrange(1, 25), rng.randrange(1, 20),
            priority=rng.choice([0, 0, 1, 2]), arrives=rng.randrange(1, 7))
        for i in range(rng.randrange(6, 12))
    ]
    # As tight as validation allows: the largest request fills the pool on its own.
    largest = max(-(-(r.prompt_len + r.max_tokens) // BLOCK_SIZE) for r in requests)
    engine_args = {"num_blocks": max(2, largest), "max_num_seqs": rng.choice([3, 4, 256])}
    if seed % 2:
        engine_args["swap_blocks"] = rng.randrange(0, 5)
    return engine_args, requests


class PolicyModel:
    """Checks each step of a run against the policy, from outputs and stats alone.

    The default token budget (2048) holds every running request, so a running request without
    a token was preempted. Always checked: admission (a request's first token) takes a prefix of the
    waiting requests in (priority, arrival) order, never in a step that preempted or that
    ends with a group swapped out; the stalled requests of a preempting step come after every
    request that got a token in it; each victim is swapped out or waits to be recomputed. With
    recompute only (no swap-ins unseen in the outputs), running and waiting are tracked
    exactly: the victims are exactly the stalled requests, and re-admissions follow the order
    too."""

    def __init__(self, seed: int, exact: bool) -> None:
        self.seed = seed
        self.exact = exact
        self.running: set[str] = set()
        self.waiting: set[str] = set()  # exact mode: fresh and recompute victims
        self.fresh: set[str] = set()  # never had a token
        self.live: set[str] = set()
        self.previous: EngineStats | None = None

    def __call__(self, result: Run, step: Step, added: list[str]) -> None:
        where = f"seed {self.seed}, step {step.number}"
        key = result.keys.__getitem__
        self.fresh.update(added)
        self.waiting.update(added)
        self.live.update(added)
        got = step.progressed
        assert got <= self.live, f"{where}: tokens for {got - self.live}"
        stalled = result.stalled(len(result.steps) - 1)
        preempted = step.num_new_preemptions
        assert len(stalled) <= preempted, f"{where}: {stalled} stalled, {preempted} preempted"
        if stalled and got:
            assert max(map(key, got)) < min(map(key, stalled)), (
                f"{where}: preempted {sorted(stalled)} but kept {sorted(got)} "
                f"(keys {result.keys})"
            )
        admitted = got & self.fresh
        if admitted:
            assert not preempted, f"{where}: admitted {admitted} in a step that preempted"
            assert step.stats.num_swapped == 0, (
                f"{where}: admitted {admitted} with a group swapped out"
            )
        self._check_prefix(admitted, self.fresh, key, where)
        if preempted and self.previous is not None:
            # No admission, no swap-in in a preempting step: every victim is either swapped
            # out or back in the waiting queue.
            moved = (step.stats.num_swapped - self.previous.num_swapped
                     + step.stats.num_waiting - self.previous.num_waiting - len(added))
            assert moved == preempted, f"{where}: {preempted} preempted, {moved} moved"
        if self.exact:
            assert len(stalled) == preempted, f"{where}: {stalled} stalled, {preempted} preempted"
            readmitted = got - self.running
            assert readmitted <= self.waiting, f"{where}: {readmitted - self.waiting} appeared"
            self._check_prefix(readmitted, self.waiting, key, where)
            self.waiting = (self.waiting - readmitted) | stalled
            self.running = ((self.running & got) | readmitted) - step.finished
            assert (step.stats.num_running, step.stats.num_waiting, step.stats.num_swapped) == (
                len(self.running), len(self.waiting), 0), f"{where}: {step.stats}"
        self.fresh -= got
        self.live -= step.finished
        stats = step.stats
        assert stats.num_running + stats.num_waiting + stats.num_swapped == len(self.live), (
            f"{where}: {stats} for {len(self.live)} live requests"
        )
        self.previous = stats

    @staticmethod
    def _check_prefix(admitted: set[str], candidates: set[str], key, where: str) -> None:
        if not admitted:
            return
        last = max(map(key, admitted))
        skipped = {r for r in candidates - admitted if key(r) < last}
        assert not skipped, (
            f"{where}: admitted {sorted(admitted)} before {sorted(skipped)}, which came first "
            f"in (priority, arrival) order"
        )


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_workloads_follow_the_policy(seed, make_engine, roomy):
    engine_args, requests = draw(seed)
    print(f"seed {seed}: {engine_args}, {len(requests)} requests")
    engine = make_engine(**engine_args)
    model = PolicyModel(seed, exact="swap_blocks" not in engine_args)
    result = run(engine, requests, check=model)
    stats = engine.stats()
    print(f"seed {seed}: {stats.num_preemptions} preemptions in {len(result.steps)} steps")
    # Distinct prompts: nobody waited for another's prefill (the order checks assume it).
    assert stats.num_prefill_deferrals == 0
    assert stats.num_preemptions > 0, f"seed {seed} preempted nothing: draw a tighter pool"
    assert result.outputs == unpreempted_outputs(roomy, requests), f"seed {seed}"
