"""A flood of Tokenize calls as large as the context allows is bounded: past
text_worker.MAX_WAITING calls on the text worker, more are RESOURCE_EXHAUSTED at once, and the
engine serves on. Before, every call queued (1,000 calls of 130,000 characters: +370 MB in the
front, and another client's one-word Tokenize, or an HTTP chat call that counts its prompt
first, waited 50 s behind them)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_service.serving.text_worker import MAX_WAITING
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

CONTEXT = 4096
FLOOD = 3 * MAX_WAITING


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory, test_certs):
    process = EngineProcess(
        tiny_llama_dir,
        ["--num-blocks", "300", "--block-size", "16", "--max-model-len", str(CONTEXT),
         "--prefix-index", "none", "--log-level", "WARNING"],
        log_path=tmp_path_factory.mktemp("abuse_text") / "engine.log",
        tls=test_certs.files("engine"))
    with process:
        yield process


def test_a_tokenize_flood_is_refused_past_the_bound(engine, test_certs):
    largest = ("hello world " * CONTEXT * 3)[:32 * CONTEXT]  # the most characters taken

    async def flood() -> tuple[list, pb.TokenizeResponse]:
        async with test_certs.aio_channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            outcomes = await asyncio.gather(
                *[stub.Tokenize(pb.TokenizeRequest(text=largest), timeout=120)
                  for _ in range(FLOOD)], return_exceptions=True)
            after = await stub.Tokenize(pb.TokenizeRequest(text="Hi"), timeout=30)
            return outcomes, after

    outcomes, after = asyncio.run(flood())
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    served = [o for o in outcomes if isinstance(o, pb.TokenizeResponse)]
    assert len(refused) + len(served) == FLOOD, [o for o in outcomes if o not in refused]
    assert refused, "no call refused: the worker's queue took the whole flood"
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert error.details() == (
            f"Tokenize and Detokenize calls waiting on this engine must be at most "
            f"{MAX_WAITING}, got {MAX_WAITING + 1}: retry later")
    assert all(len(o.token_ids) > CONTEXT for o in served)
    assert len(after.token_ids) >= 1  # served on once the flood is over
