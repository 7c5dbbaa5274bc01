"""A long prompt waits for the text worker to tokenize it (servicer.py, INLINE_TOKENIZE_CHARS):
it counts among its tenant's live requests while it waits, or a tenant allowed one request held
every slot of the engine's queue with long prompts, and other tenants were refused."""

from __future__ import annotations

import asyncio
import time

import grpc

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from engine_service.serving.servicer import INLINE_TOKENIZE_CHARS
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tenancy.door import TenantDoor
from tenancy.gate import Gate
from tenancy.keyring import KeyRing
from tests.tenants.conftest import bearer, write_keys


class SlowLongPrompts:
    """The text worker's tokenizer, a second slower on long text: the wait made visible."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text, **kwargs):
        if len(text) > INLINE_TOKENIZE_CHARS:
            time.sleep(1.0)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_tenant_s_long_prompts_count_against_its_limit_while_they_wait(tiny_llama_dir,
                                                                        test_certs, tmp_path):
    keys = write_keys(tmp_path / "keys.toml", {"greedy": {"max_live_requests": 1}, "other": {}})
    door = TenantDoor(Gate(KeyRing.from_file(keys.path)), b"s" * 32)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=512,
                                    max_model_len=4096))
    long_text = "hello " * (INLINE_TOKENIZE_CHARS // 6 + 100)
    one = pb.SamplingParams(max_tokens=1)

    async def body():
        server = EngineServer(engine, ServerOptions(port=0, tls=test_certs.material("engine"),
                                                    door=door, max_live_requests=4))
        port = await server.start()
        worker = server.servicer.text_worker
        worker.validator.tokenizer = SlowLongPrompts(worker.validator.tokenizer)
        try:
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                greedy = [asyncio.ensure_future(stub.Generate(
                    pb.GenerateRequest(text=long_text, sampling=one),
                    metadata=bearer(keys["greedy"]), timeout=60)) for _ in range(4)]
                await asyncio.sleep(0.3)  # the first one waits on the worker
                other = await stub.Generate(pb.GenerateRequest(text="Hi", sampling=one),
                                            metadata=bearer(keys["other"]), timeout=30)
                results = await asyncio.gather(*greedy, return_exceptions=True)
        finally:
            await server.stop(0)
        return other, results

    other, results = asyncio.run(body())
    assert other.usage.completion_tokens == 1  # not refused: the queue was not greedy's
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 3 and len(results) - len(refused) == 1
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
               and "live requests of tenant 'greedy' must be at most 1" in r.details()
               for r in refused)
