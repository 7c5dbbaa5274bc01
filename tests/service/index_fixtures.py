"""Helpers for the engine <-> prefix index tests: real processes, an engine driven step by step.

Not a conftest (tests/service/conftest.py belongs to the gRPC server tests): the test module
imports what it needs from here.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_service import SamplingParams
from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.core.outputs import RequestOutput
from engine_service.index.link import IndexLinkOptions
from prefix_index.api.ops import EngineStats
from tests.support.tls import SessionCerts
from trust.identity import ENGINE_ROLE, ROUTER_ROLE

BLOCK_SIZE = 8
NUM_BLOCKS = 256  # large enough that nothing is evicted: runs with and without an index match
# The index as it ships: automatic pinning on at the default hot threshold, window and pin
# budget, the default lease, Redis timeout and probe interval. A test about another setting
# adds that flag itself, by name. It serves on the session's index certificate (mutual TLS):
# engines link with `link_options(certs)`, tests read it with `index_stats(certs, ...)`.
INDEX_ARGS = ["--log-level", "WARNING"]
# How long a test waits for something the link or the index does on its own (a re-sync, a
# mirror catching up): generous, since both cores may be busy; a condition ends it early.
DEADLINE_S = 30.0


def make_engine(model_dir: object, **overrides: object) -> LLMEngine:
    # float32: runs with and without the index are compared token for token.
    args: dict = dict(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_num_batched_tokens=256,
                      dtype="float32")
    return LLMEngine(EngineConfig(model=str(model_dir), **(args | overrides)))


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(length)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@dataclass
class Driver:
    """Adds requests and steps the engine, keeping every output (no request may fail)."""

    engine: LLMEngine
    finished: dict[str, RequestOutput] = field(default_factory=dict)
    num_steps: int = 0
    # Idle time after each step: a tiny model's step takes about a millisecond, far less than
    # a real one, and a test that needs the index's answers between steps says how long.
    step_pause_s: float = 0.0

    def add(self, requests: dict[str, list[int]], params: SamplingParams = GREEDY) -> None:
        for request_id, ids in requests.items():
            self.engine.add_request(request_id, ids, params)

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            for output in self.engine.step():
                if output.finished:
                    self.finished[output.request_id] = output
            self.num_steps += 1
            if self.step_pause_s:
                time.sleep(self.step_pause_s)

    def run_to_completion(self, max_steps: int = 2000) -> None:
        while self.engine.has_unfinished_requests():
            if self.num_steps >= max_steps:
                raise AssertionError(f"requests still running after {max_steps} steps")
            self.step()

    def tokens(self) -> dict[str, list[int]]:
        return {rid: out.outputs[0].token_ids for rid, out in sorted(self.finished.items())}


def wait_until(predicate: Callable[[], bool], timeout_s: float,
               what: str | Callable[[], str], engine: LLMEngine | None = None) -> float:
    """Polls predicate; the seconds it took. Raises naming `what` on timeout (a callable: the
    state it describes, read at the timeout). With `engine`,
    the test thread is that engine's thread: it runs the commands other threads (the index
    link) post to it while it waits, as the serving loop does between steps."""
    start = time.monotonic()
    while True:
        if engine is not None:
            engine.run_commands()
        if predicate():
            break
        if time.monotonic() - start > timeout_s:
            said = what() if callable(what) else what
            raise AssertionError(f"{said}: not within {timeout_s}s")
        time.sleep(0.02)
    return time.monotonic() - start


def link_options(certs: SessionCerts, **overrides: object) -> IndexLinkOptions:
    """An engine's link options with its session certificate (mutual TLS to the index)."""
    return IndexLinkOptions(tls=certs.material(ENGINE_ROLE), **overrides)


def index_stats(certs: SessionCerts, target: str, engine_id: str) -> EngineStats | None:
    """The index's view of one engine, read as a router (None when it holds nothing for it or
    is unreachable)."""

    async def fetch() -> list[EngineStats]:
        async with certs.index_client(target, 2.0, ROUTER_ROLE) as client:
            return await client.stats(engine_id)

    try:
        found = asyncio.run(fetch())
    except Exception:  # noqa: BLE001 - unreachable reads as "no view"
        return None
    return found[0] if found else None


def local_view(engine: LLMEngine) -> tuple[int, int]:
    """(cached blocks, cached blocks with refcount 0) in the engine's own pool."""
    cached = [b for b in engine.pool.blocks if b.block_hash is not None]
    return len(cached), sum(1 for b in cached if b.ref_count == 0)


def index_matches_pool(certs: SessionCerts, target: str, engine_id: str,
                       engine: LLMEngine) -> bool:
    """The index's view of this engine equals the pool: the same cached blocks, and the same
    evictable ones (idle and not pinned). The caller is the engine's thread: the link's results
    are applied first."""
    engine.run_commands()
    stats = index_stats(certs, target, engine_id)
    cached = local_view(engine)[0]
    return stats is not None and (stats.blocks, stats.evictable) == (
        cached, engine.pool.policy.num_evictable)


def call_pumping(engine: LLMEngine, fn: Callable[[], object], timeout_s: float = 10.0) -> object:
    """fn() on another thread (as the servicer calls the link) while this thread, the engine's,
    runs the commands it posts; fn's result."""
    result: list[object] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as error:  # noqa: BLE001 - re-raised on the test thread
            errors.append(error)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    wait_until(lambda: not worker.is_alive(), timeout_s, "the call", engine=engine)
    if errors:
        raise errors[0]
    return result[0]
