"""The pipe between the serving front and the engine core: both directions full at once must not
stall either side. A final output with 20 logprobs per token for 400 tokens is ~250 KB, a burst
of 150 prompts of 900 tokens ~400 KB: more than a pipe holds each way. With two blocking
writers the front (mid-send, reading nothing) and the core (mid-send, reading no command)
waited for each other for good."""

from __future__ import annotations

import asyncio

from engine_service.core.config import EngineConfig
from engine_service.model.sampling_params import SamplingParams
from engine_service.serving.core_client import CoreClient
from engine_service.serving.core_process import CoreOptions

NUM_LONG = 4
MAX_TOKENS = 400
BURST = 150
BURST_PROMPT = 900


def test_full_pipes_both_ways_do_not_stall(tiny_llama_dir):
    async def body() -> tuple[list, int]:
        config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_blocks=12000,
                              max_num_seqs=256, max_num_batched_tokens=4096)
        client = CoreClient(CoreOptions(config, torch_threads=1, log_level="WARNING"))
        await client.start()
        try:
            long = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=20,
                                  ignore_eos=True)
            buffers = [client.add(f"long-{i}", [100 + i] * 8, long) for i in range(NUM_LONG)]
            burst: list = []

            async def read(buffer) -> object:
                while True:
                    output = await buffer.get()
                    if isinstance(output, BaseException) or output.finished:
                        return output
                    done = output.outputs[0].num_tokens
                    if done >= MAX_TOKENS - 1 and not burst:  # the finals are next
                        one = SamplingParams(max_tokens=1, temperature=0)
                        burst.extend(client.add(f"burst-{k}", [(k * 7 + j) % 40000 + 1000
                                                               for j in range(BURST_PROMPT)], one)
                                     for k in range(BURST))

            finals = await asyncio.wait_for(
                asyncio.gather(*(read(b) for b in buffers)), timeout=600)
            burst_finals = await asyncio.wait_for(
                asyncio.gather(*(read(b) for b in burst)), timeout=600)
            return finals + burst_finals, len(burst)
        finally:
            await client.stop()

    finals, num_burst = asyncio.run(body())
    assert num_burst == BURST
    assert all(not isinstance(o, BaseException) and o.finished for o in finals)
    for output in finals[:NUM_LONG]:
        [completion] = output.outputs
        assert len(completion.token_ids) == MAX_TOKENS
        assert len(completion.logprobs) == MAX_TOKENS


def _late_loop_core(channel, options) -> None:
    """The real core, whose step loop (and so its first stats message) starts 3 s after it
    said ready: as a slow first iteration would."""
    import time

    from engine_service.serving import core_process

    run = core_process.CoreLoop.run

    def late_run(self) -> None:
        time.sleep(3.0)
        run(self)

    core_process.CoreLoop.run = late_run
    core_process.run_core(channel, options)


def test_the_front_has_the_engines_stats_as_soon_as_it_started(tiny_llama_dir):
    """EngineStats is answered from the front's copy of the core's stats: the first comes with
    'ready' (it came with the first step message, so a call between the two failed UNKNOWN,
    AttributeError on None)."""
    async def body():
        config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_blocks=64)
        client = CoreClient(CoreOptions(config, torch_threads=1, log_level="WARNING"),
                            core_target=_late_loop_core)
        await client.start()
        try:
            return client.snapshot
        finally:
            await client.stop()

    stats = asyncio.run(body())
    assert stats is not None and stats.num_blocks == 64 and stats.num_running == 0
