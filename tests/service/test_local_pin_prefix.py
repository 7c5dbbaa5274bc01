"""PinPrefix on a real pagedgen-engine without the prefix index (`--prefix-index none`, issue
34): the engine computes the prefix, pins it in its own cache under its pin budget, fixed here
at 10% of its pool (`--pin-budget-ceiling 0.1`; RESOURCE_EXHAUSTED past it), and the pinned
prefix outlives requests that fill the pool."""

from __future__ import annotations

import grpc
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

BLOCK = 16
HOT = list(range(1000, 1000 + 3 * BLOCK + 5))  # 3 full blocks


@pytest.fixture(scope="module")
def stub(tiny_llama_dir, tmp_path_factory, test_certs):
    log = tmp_path_factory.mktemp("local_pins") / "engine.log"
    args = ["--prefix-index", "none", "--dtype", "float32", "--num-blocks", "40",
            "--block-size", str(BLOCK), "--max-model-len", "600", "--pin-budget-ceiling", "0.1"]
    with EngineProcess(tiny_llama_dir, args, log_path=log,
                       tls=test_certs.files("engine")).start() as engine, \
            test_certs.channel(engine.target) as channel:
        yield pb_grpc.GenerationStub(channel)


def generate(stub, ids: list[int]) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=1)),
        timeout=120)


def flood(stub, start: int) -> None:
    for i in range(3):  # each needs 35 of the 40 blocks: every unpinned idle block goes
        generate(stub, list(range(start + 1000 * i, start + 1000 * i + 35 * BLOCK)))


def test_pin_prefix_computes_and_keeps_a_prefix_without_the_index(stub):
    pinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=HOT)), timeout=120)
    assert (pinned.num_blocks, pinned.num_pinned) == (3, 3)
    flood(stub, 10_000)
    assert generate(stub, HOT).usage.cached_tokens == 3 * BLOCK
    # Past the budget (4 of 40 blocks): refused whole, the pins already held stay.
    with pytest.raises(grpc.RpcError) as caught:
        stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=list(range(5000, 5040)))))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pin budget of 4 blocks" in caught.value.details()
    unpinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=HOT), unpin=True))
    assert unpinned.num_pinned == 3
    flood(stub, 20_000)
    assert generate(stub, HOT).usage.cached_tokens == 0


def test_a_pin_refused_past_the_budget_leaves_nothing_pinned(stub):
    """Its cached part (2 blocks) fits the budget of 4 and is pinned at once; the whole (5
    blocks) does not: refused before its prefill, and the part pinned is given back."""
    prefix = list(range(30_000, 30_000 + 5 * BLOCK + 1))
    generate(stub, prefix[:2 * BLOCK + 1])
    with pytest.raises(grpc.RpcError) as caught:
        stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=prefix)), timeout=120)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # All 4 blocks of the budget are free again: a 4-block prefix pins whole.
    four = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=HOT + [9] * BLOCK)),
                          timeout=120)
    assert (four.num_blocks, four.num_pinned) == (4, 4)
    stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=HOT + [9] * BLOCK), unpin=True))
