"""PinPrefix on a served engine computes a prefix that fits the pin budget and pins it: its
own prefill is not counted as demand against the budget (issue 34 review; the offline API's
case is tests/engine/test_pin_prefill_budget.py). A real pagedgen-engine process (its core in
a second process, the front sending the prefill over the core channel) without the index,
over TLS."""

from __future__ import annotations

import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

BLOCK = 16
PREFIX_BLOCKS = 24  # within 80% of 40 blocks; 40 - 25 = 15 if its prefill counted as demand
PREFIX = list(range(1000, 1000 + PREFIX_BLOCKS * BLOCK))


@pytest.fixture(scope="module")
def stub(tiny_llama_dir, tmp_path_factory, test_certs):
    log = tmp_path_factory.mktemp("pin_prefill_budget") / "engine.log"
    # Prefill in chunks of 64 tokens: the prefix takes several steps, as a real one does.
    args = ["--prefix-index", "none", "--dtype", "float32", "--num-blocks", "40",
            "--block-size", str(BLOCK), "--max-model-len", "600",
            "--max-num-batched-tokens", "64", "--pin-budget-ceiling", "0.8"]
    with EngineProcess(tiny_llama_dir, args, log_path=log,
                       tls=test_certs.files("engine")).start() as engine, \
            test_certs.channel(engine.target) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_pin_prefix_pins_a_computed_prefix_within_the_budget(stub):
    pinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PREFIX)), timeout=120)
    assert (pinned.num_blocks, pinned.num_pinned) == (PREFIX_BLOCKS, PREFIX_BLOCKS)
    unpinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PREFIX),
                                                  unpin=True), timeout=120)
    assert unpinned.num_pinned == PREFIX_BLOCKS  # all of them were held by the pin
