"""Chat logprobs' `bytes` are each token's raw UTF-8 bytes, as OpenAI's are: joined, they
rebuild the text even where a token holds part of a character. They were the UTF-8 of the
token's decoded text, which for such a token is U+FFFD alone ([239, 191, 189]), so '日本語'
could not be rebuilt. Served over loopback by the HTTP API on a servicer that answers with
SmolLM2's tokens of the text, the backend's token texts and bytes from that tokenizer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import openai
import pytest
from transformers import AutoTokenizer

from openai_api.backend import Backend, ServedModel
from openai_api.server import HttpServer
from openai_api.token_bytes import token_bytes
from pagedgen_api import generation_pb2 as pb

TEXT = "日本語 ok"


class _Answering:
    """Answers every generation with TEXT's tokens (each its own top alternative)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.completion = pb.Completion(
            text=TEXT, token_ids=token_ids, finish_reason=pb.FINISH_REASON_STOP,
            logprobs=[pb.TokenLogprob(token_id=t, logprob=-0.5, rank=1,
                                      top=[pb.TopLogprob(token_id=t, logprob=-0.5)])
                      for t in token_ids])

    async def Generate(self, request, context):  # noqa: N802 - gRPC's method names
        return pb.GenerateResponse(completions=[self.completion])

    async def GenerateStream(self, request, context):  # noqa: N802
        yield pb.GenerateStreamResponse(choices=[self.completion], finished=True)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[str]:
    ids = tokenizer.encode(TEXT)
    assert "\ufffd" in [tokenizer.decode([t]) for t in ids]  # a token holds part of a char
    of = token_bytes(tokenizer)

    async def texts(token_ids: list[int]) -> list[str]:
        return [tokenizer.decode([t]) for t in token_ids]

    async def raw(token_ids: list[int]) -> list[bytes]:
        return of(token_ids)

    loop = asyncio.new_event_loop()
    http = HttpServer("127.0.0.1", 0)
    backend = Backend(_Answering(ids), lambda: True,
                      lambda: [ServedModel("m", 2048, 64, 16)], texts, raw)
    loop.run_until_complete(http.start(backend))
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    yield f"http://127.0.0.1:{http.port}/v1"
    asyncio.run_coroutine_threadsafe(http.stop(0.1), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    runner.join(timeout=30)
    loop.close()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprob_bytes_rebuild_the_text(server, stream):
    with openai.OpenAI(base_url=server, api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            logprobs=True, top_logprobs=1, stream=stream)
        if stream:
            content = [e for chunk in reply if chunk.choices and chunk.choices[0].logprobs
                       for e in chunk.choices[0].logprobs.content]
        else:
            content = reply.choices[0].logprobs.content
    assert "\ufffd" in [e.token for e in content]
    assert b"".join(bytes(e.bytes) for e in content).decode() == TEXT
    assert b"".join(bytes(e.top_logprobs[0].bytes) for e in content).decode() == TEXT


def test_token_bytes_of_special_and_plain_tokens(tokenizer):
    of = token_bytes(tokenizer)
    eos, space_hi = tokenizer.convert_tokens_to_ids(["<|im_end|>", "Ġhi"])
    assert of([eos, space_hi]) == [b"<|im_end|>", b" hi"]


def test_the_engine_s_chat_logprob_bytes_rebuild_its_text(smollm2_dir, tmp_path, test_certs):
    """End to end on SmolLM2 (greedy, float32): the engine's HTTP front hands its tokenizer's
    raw bytes to the API, and the bytes of the reply's tokens, joined, are its text and then
    the end-of-turn token (which vLLM lists too)."""
    from tests.http.conftest import API_KEY, start_engine

    engine = start_engine(smollm2_dir, tmp_path / "engine.log", test_certs,
                          ["--api-key", API_KEY, "--dtype", "float32"])
    try:
        with engine.openai(API_KEY, max_retries=0, timeout=120) as client:
            reply = client.chat.completions.create(
                model=engine.model, temperature=0, max_tokens=40, logprobs=True,
                messages=[{"role": "user", "content": "Write the word 日本語 and nothing else."}])
    finally:
        engine.process.terminate()
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert any("\ufffd" in entry.token for entry in content), "no token split a character"
    joined = b"".join(bytes(entry.bytes) for entry in content).decode()
    ending = "<|im_end|>" if choice.finish_reason == "stop" else ""
    assert joined == choice.message.content + ending


def test_sentencepiece_pieces_keep_their_word_start_space():
    """A Llama-2-style tokenizer (SentencePiece BPE with byte fallback, built here): a '▁word'
    piece's bytes carry its space (decoding the token alone strips it), byte pieces are their
    byte, and the joined bytes are the text with the one leading space SentencePiece adds."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    words = ["▁Hello", "▁world"]
    merges = []
    for word in words:
        for end in range(1, len(word)):
            merges.append((word[:end], word[end]))
            for piece in (word[:end], word[end], word[:end + 1]):
                vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=list(dict.fromkeys(merges)), unk_token="<unk>",
                       byte_fallback=True, fuse_unk=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    text = "Hello world 日"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[:2] == words
    pieces = token_bytes(tokenizer)(ids)
    assert pieces[:2] == [b" Hello", b" world"]
    assert b"".join(pieces).decode() == " " + text
