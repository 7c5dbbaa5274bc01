"""A step's outputs between the engine core and the front (serving/output_wire.py): a plain
token output travels as a tuple and comes back as the same RequestOutput; anything a tuple
cannot say travels whole. Seeded random outputs (the seed is printed on failure), then a real
core streaming to a CoreClient."""

from __future__ import annotations

import asyncio
import pickle
import random

import pytest

from engine_service.core.config import EngineConfig
from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.model.sampling_params import SamplingParams
from engine_service.model.token_logprobs import TokenLogprobs
from engine_service.serving import core_client
from engine_service.serving.core_client import CoreClient
from engine_service.serving.core_process import CoreOptions
from engine_service.serving.output_wire import as_row, pack, unpack_row


def _random_output(rng: random.Random, index: int) -> RequestOutput:
    """An output as the core sends it (no prompt), each field drawn to be usual or not."""
    def maybe(value, p=0.06):
        return value if rng.random() < p else None

    completions = []
    for c in range(1 if rng.random() < 0.8 else rng.randint(2, 3)):
        delta = [rng.randrange(50000) for _ in range(rng.choice((0, 1, 1, 1, 2)))]
        completions.append(CompletionOutput(
            index=c if rng.random() < 0.95 else c + 1,
            text=maybe("whole text"), token_ids=maybe([1, 2]),
            finish_reason=maybe("length"), stop_reason=maybe(7),
            logprobs=maybe([]), text_delta=rng.choice(("", "", "", " word")),
            token_ids_delta=delta,
            logprobs_delta=maybe([TokenLogprobs(5, -0.5, {5: -0.5})]),
            cumulative_logprob=maybe(-1.25),
            num_tokens=rng.choice((len(delta), len(delta) + rng.randint(1, 900)))))
    return RequestOutput(
        request_id=f"req-{index}", prompt=None, prompt_token_ids=None, outputs=completions,
        finished=rng.random() < 0.1, num_cached_tokens=rng.choice((0, 16, 48)),
        arrival_time=1000.0 + index, first_token_time=maybe(1001.5 + index, 0.9),
        finished_time=maybe(1002.0 + index, 0.05))


@pytest.mark.parametrize("seed", range(5))
def test_rows_come_back_as_the_same_output_and_the_rest_travels_whole(seed):
    rng = random.Random(seed)
    outputs = [_random_output(rng, i) for i in range(400)]
    expected = pickle.loads(pickle.dumps(outputs))  # what the front got before rows
    received = pickle.loads(pickle.dumps(pack(outputs)))
    rows = 0
    for sent, got in zip(expected, received, strict=True):
        if type(got) is tuple:
            rows += 1
            # The request's earlier outputs gave the front these times (first tokens go whole).
            assert got == as_row(sent), f"seed {seed}"
            assert unpack_row(got, sent.arrival_time, sent.first_token_time) == sent, (
                f"seed {seed}: {sent}")
            [completion] = sent.outputs
            assert not sent.finished and completion.num_tokens > len(
                completion.token_ids_delta) > 0
        else:
            assert got == sent, f"seed {seed}"
    assert 20 < rows < len(outputs), f"seed {seed}: {rows} rows"  # both kinds were drawn


def test_a_first_token_finish_logprobs_or_several_sequences_go_whole():
    def output(**changes) -> RequestOutput:
        completion = dict(index=0, token_ids_delta=[9], num_tokens=5)
        completion.update(changes.pop("completion", {}))
        fields = dict(request_id="r", prompt=None, prompt_token_ids=None,
                      outputs=[CompletionOutput(**completion)], finished=False,
                      num_cached_tokens=16, arrival_time=1.0, first_token_time=2.0)
        fields.update(changes)
        return RequestOutput(**fields)

    assert as_row(output()) == ("r", [9], 5, 16)
    whole = [
        output(completion={"num_tokens": 1}),  # the first token: its first_token_time
        output(completion={"token_ids_delta": []}),
        output(finished=True, finished_time=3.0),
        output(completion={"finish_reason": "stop", "stop_reason": "x"}),
        output(completion={"logprobs_delta": [TokenLogprobs(9, -0.1, {9: -0.1})]}),
        output(completion={"text_delta": "hi"}),
        output(completion={"cumulative_logprob": -2.0}),
        output(completion={"index": 1}),
        output(outputs=[CompletionOutput(0, token_ids_delta=[9], num_tokens=5),
                        CompletionOutput(1, token_ids_delta=[8], num_tokens=5)]),
        output(prompt="a prompt"),
    ]
    for item in whole:
        assert as_row(item) is None, item
    assert pack(whole) == whole


def test_a_real_core_streams_rows_and_the_front_rebuilds_every_token(tiny_llama_dir,
                                                                     monkeypatch):
    """Through the real pipe: after each request's first tokens the steps' outputs are rows,
    and what the streams read is every token in order, with its times and counts."""
    kinds: list[str] = []
    unpack = core_client.unpack_row

    def counting_unpack(row, *times):
        kinds.append("row")
        return unpack(row, *times)

    monkeypatch.setattr(core_client, "unpack_row", counting_unpack)

    async def body() -> list[list[RequestOutput]]:
        config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_blocks=256)
        config.detokenize = False  # as pagedgen-engine's core: the front makes the text
        client = CoreClient(CoreOptions(config, torch_threads=1, log_level="WARNING"))
        await client.start()
        try:
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            buffers = [client.add(f"r{i}", [100 + i, 7, 9], params) for i in range(3)]

            async def read(buffer) -> list[RequestOutput]:
                got = []
                while True:
                    item = await buffer.get()
                    assert not isinstance(item, BaseException), item
                    got.append(item)
                    if item.finished:
                        return got

            return await asyncio.wait_for(asyncio.gather(*(read(b) for b in buffers)), 300)
        finally:
            await client.stop()

    streams = asyncio.run(body())
    assert kinds.count("row") >= 3 * 10  # most of the 24 steps of each request
    for outputs in streams:
        tokens = [t for o in outputs for t in o.outputs[0].token_ids_delta]
        assert len(tokens) == 24 and outputs[-1].outputs[0].token_ids == tokens
        counts = [o.outputs[0].num_tokens for o in outputs]
        assert counts == sorted(counts) and counts[-1] == 24
        first = outputs[0].first_token_time
        assert first is not None
        assert all(o.first_token_time == first for o in outputs)
        assert all(o.arrival_time == outputs[0].arrival_time for o in outputs)
