"""How the HTTP API reads the servicer's streams behind one streamed completion of a list of
prompts (openai_api/app.py _messages), against a stand-in servicer whose streams yield as
fast as they are asked:

- a prompt's next message is asked for only once its last was handed on, so a reader that
  pauses holds every stream where it is (before, each ran to its end into an unbounded queue);
- the prompts are served in turn (a stream that never pauses does not starve the others);
- closing the response closes every prompt's stream before the close returns (before, a stream
  paused between messages was left to the garbage collector: its abort came later)."""

from __future__ import annotations

import asyncio
import types

from openai_api.app import _Api
from openai_api.call_context import StreamCalls

MESSAGES = 20


class EagerServicer:
    """Each stream yields MESSAGES messages without pausing, and its closing takes a moment."""

    def __init__(self) -> None:
        self.asked = {}  # prompt -> messages asked for
        self.closed = set()

    async def GenerateStream(self, prompt, context):
        try:
            for k in range(MESSAGES):
                self.asked[prompt] = k + 1
                yield prompt, k
        finally:
            await asyncio.sleep(0.05)
            self.closed.add(prompt)


def _messages(servicer: EagerServicer, prompts: int):
    api = _Api(types.SimpleNamespace(servicer=servicer), body_timeout_s=60.0,
               send_stall_timeout_s=0.0)
    call = types.SimpleNamespace(requests=list(range(prompts)), field_names=[{}] * prompts)
    return api._messages(call, StreamCalls())


def test_a_paused_reader_holds_every_stream_where_it_is():
    async def run() -> None:
        servicer = EagerServicer()
        messages = _messages(servicer, 4)
        await anext(messages)
        await asyncio.sleep(0.1)  # the reader pauses
        # Each stream has handed on one message at most, and waits: none ran on.
        assert max(servicer.asked.values()) == 1, servicer.asked
        assert not servicer.closed
        await messages.aclose()

    asyncio.run(run())


def test_the_prompts_are_served_in_turn():
    async def run() -> None:
        servicer = EagerServicer()
        order = [prompt async for (_, (prompt, _)) in _messages(servicer, 4)]
        assert len(order) == 4 * MESSAGES
        for start in range(0, len(order), 4):  # every prompt once in each round
            assert sorted(order[start:start + 4]) == [0, 1, 2, 3], order

    asyncio.run(run())


def test_closing_the_response_closes_every_stream_before_it_returns():
    async def run(prompts: int) -> None:
        servicer = EagerServicer()
        messages = _messages(servicer, prompts)
        for _ in range(3):
            await anext(messages)
        await messages.aclose()
        assert servicer.closed == set(range(prompts))

    for prompts in (1, 8):
        asyncio.run(run(prompts))
