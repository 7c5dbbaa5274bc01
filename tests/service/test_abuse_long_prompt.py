"""A generation's long text prompt is tokenized on the text worker, not on the event loop: while
it is, the server answers other clients (servicer.INLINE_TOKENIZE_CHARS). Before, every such
prompt held the loop as long as its tokenizing took (a 131,000-character prompt ~0.1 s; a
flood of them put 0.3 s gaps in another client's stream).

The tokenizers are made slow here (2 s for a long text) so that the difference is not a
matter of timing: on the loop, the short request waited the 2 s out."""

from __future__ import annotations

import asyncio
import threading
import time

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from engine_service.serving.servicer import INLINE_TOKENIZE_CHARS
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

SLOW_S = 2.0


class _SlowTokenizer:
    """The real tokenizer, taking SLOW_S for each text longer than the inline bound."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, **kwargs):
        if len(text) > INLINE_TOKENIZE_CHARS:
            time.sleep(SLOW_S)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def _short_call(test_certs, port: int, connected: threading.Event,
                timed: list[float]) -> None:
    with test_certs.channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        stub.Generate(pb.GenerateRequest(text="connect", sampling=pb.SamplingParams(
            max_tokens=1)), timeout=30)
        connected.set()  # the long prompt goes now
        time.sleep(0.5)  # its tokenizing has begun
        started = time.monotonic()
        stub.Generate(pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=1)),
                      timeout=30)
        timed.append(time.monotonic() - started)


def test_a_long_prompt_does_not_hold_other_clients(tiny_llama_dir, test_certs):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=512,
                                    max_model_len=4096))
    long_text = "hello " * (INLINE_TOKENIZE_CHARS // 6 + 100)
    one_token = pb.SamplingParams(max_tokens=1)

    async def body() -> tuple[float, pb.GenerateResponse]:
        server = EngineServer(engine, ServerOptions(port=0, tls=test_certs.material("engine")))
        port = await server.start()
        servicer = server.servicer
        for validator in (servicer.validator, servicer.text_worker.validator):
            validator.tokenizer = _SlowTokenizer(validator.tokenizer)
        try:
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                await stub.Generate(pb.GenerateRequest(text="warm up", sampling=one_token))
                # The other client on a thread of its own: its clock does not wait for the
                # server's loop (this test's coroutines share that loop).
                timed: list[float] = []
                connected = threading.Event()
                other = threading.Thread(target=_short_call,
                                         args=(test_certs, port, connected, timed))
                other.start()
                assert await asyncio.to_thread(connected.wait, 30)
                reply = await stub.Generate(pb.GenerateRequest(text=long_text,
                                                               sampling=one_token))
                await asyncio.to_thread(other.join, 60)
                return timed[0], reply
        finally:
            await server.stop(1.0)

    short_s, long_reply = asyncio.run(body())
    assert short_s < SLOW_S / 2, f"the short request waited {short_s:.2f}s for the long prompt"
    assert long_reply.usage.prompt_tokens > INLINE_TOKENIZE_CHARS // 6
    assert engine.check_block_invariants() == []
