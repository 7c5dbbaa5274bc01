"""PinPrefix and EngineStats' pin counts for the service tests (a served engine, `stub`)."""

from __future__ import annotations

import itertools
import time

from pagedgen_api import generation_pb2 as pb

BLOCK = 16
DEADLINE_S = 60.0
_STEPS = itertools.count()


def prompt_ids(seed: int, num_tokens: int) -> list[int]:
    return [(i * seed) % 4000 + 100 for i in range(num_tokens)]


def pin(stub, ids: list[int], salt: str, ttl_s: float = 0.0, unpin: bool = False):
    return stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
                                              ttl_s=ttl_s, unpin=unpin))


def pinned(stub) -> int:
    return stub.EngineStats(pb.EngineStatsRequest()).num_pinned_blocks


def step(stub) -> None:
    """One engine step (a one-token request on a full block): pins lapse between steps, its
    admission is an Apply (whose reply carries the index's pin changes), and the stats the
    server reads are the last step's. A new salt each time: a block asked for again and
    again would earn an automatic pin."""
    stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids(61, BLOCK + 1)),
                                     cache_salt=f"step-{next(_STEPS)}",
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=1)))


def wait_pinned(stub, expected: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while (now := pinned(stub)) != expected:
        assert time.monotonic() < deadline, f"pinned blocks stayed {now}, expected {expected}"
        time.sleep(0.05)
        step(stub)
