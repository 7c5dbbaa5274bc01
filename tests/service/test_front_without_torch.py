"""The served engine's front process never loads torch (issue 36): the model runs in its core
process, and everything the core sends back (outputs with logprobs and beams, stats, refusals,
pin results) unpickles in the front from modules without torch. An import at module level is
caught by tests/test_light_processes.py; this catches what only arrives at run time, such as a
message naming a class that lives next to torch code. Linux: the front's memory map says which
shared libraries it loaded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedgen_api import generation_pb2 as pb

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/<pid>/maps")


def mapped_libraries(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in maps if ".so" in line}


def test_front_loads_no_torch_while_serving(engine_server, stub):
    front = engine_server.process.proc.pid
    sampled = pb.SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=3, logprobs=2,
                                stop=["zz"])
    chunks = list(stub.GenerateStream(pb.GenerateRequest(text="Hello", sampling=sampled),
                                      timeout=60))
    assert chunks
    beams = pb.SamplingParams(max_tokens=6, beam_width=2, temperature=0)
    reply = stub.Generate(pb.GenerateRequest(text="Hello", sampling=beams), timeout=60)
    assert reply.completions
    assert stub.EngineStats(pb.EngineStatsRequest(), timeout=30).num_blocks > 0
    # A pin's result crosses from the core too (salted: no other test's blocks).
    prefix = pb.TokenIds(ids=list(range(7000, 7040)))
    for unpin in (False, True):
        stub.PinPrefix(pb.PinPrefixRequest(token_ids=prefix, cache_salt="front-without-torch",
                                           unpin=unpin), timeout=120)
    libraries = mapped_libraries(front)
    torch_libraries = {name for name in libraries if name.startswith(("libtorch", "libc10"))}
    assert torch_libraries == set(), f"the front (pid {front}) loaded {sorted(torch_libraries)}"
    # The check can see libraries: the front has grpc's.
    assert any(name.startswith("cygrpc") for name in libraries), sorted(libraries)
