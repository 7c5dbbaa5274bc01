"""A replica's stream on its way to the router's client: read as it comes, merged while the
client is busy taking the previous message, bounded.

The router reads a replica's stream whether or not its client keeps up, so a replica's work is
never held by a slow client's transport; what the client has not taken yet merges into one
message (a slow reader gets fewer, larger messages, as from an engine). A client that takes
nothing while more than `max_unsent_tokens` tokens (each top logprob one more) pile up is not
reading: the relay stops the request at its replica (freeing its blocks and its place in the
replica's load) and the client's stream ends with RESOURCE_EXHAUSTED when it reads on.
"""

from __future__ import annotations

import asyncio
from collections import deque

from pagedgen_api import generation_pb2 as pb


def message_size(message: pb.GenerateStreamResponse) -> int:
    """Tokens in a message, each top logprob counted as one more; not its prompt logprobs
    (once per request and bounded by the context: the bound is for what grows)."""
    size = 0
    for choice in message.choices:
        size += len(choice.token_ids)
        for logprob in choice.logprobs:
            size += len(logprob.top)
    return size


def merge_messages(older: pb.GenerateStreamResponse, newer: pb.GenerateStreamResponse) -> None:
    """`older` updated in place to say what it and then `newer` said."""
    by_index = {choice.index: choice for choice in older.choices}
    for choice in newer.choices:
        kept = by_index.get(choice.index)
        if kept is None:
            older.choices.append(choice)
            by_index[choice.index] = older.choices[-1]
            continue
        kept.text += choice.text
        kept.token_ids.extend(choice.token_ids)
        kept.logprobs.extend(choice.logprobs)
        if choice.finish_reason:
            kept.finish_reason = choice.finish_reason
        which = choice.WhichOneof("stop_reason")
        if which is not None:
            setattr(kept, which, getattr(choice, which))
        if choice.HasField("cumulative_logprob"):
            kept.cumulative_logprob = choice.cumulative_logprob
    older.usage.CopyFrom(newer.usage)
    older.finished = newer.finished
    older.prompt_logprobs.extend(newer.prompt_logprobs)  # (a unary reply's gathering)


class RelayBuffer:
    """The pending messages and then the stream's end (`end()`'s item). What the client has
    not taken merges into one message, but for a long prompt's logprobs: the replica sends
    them in pieces that each stay under gRPC's default receive limit, and they stay apart
    (merged, a 24k-token prompt's at top-20 made one 5.9 MB message)."""

    __slots__ = ("_pending", "_end", "_ended", "_ready", "_unsent", "max_unsent_tokens")

    def __init__(self, max_unsent_tokens: int) -> None:
        self._pending: deque[pb.GenerateStreamResponse] = deque()
        self._end: object = None
        self._ended = False
        self._ready = asyncio.Event()
        self._unsent = 0  # tokens merged since the client last took a message
        self.max_unsent_tokens = max_unsent_tokens  # 0: no bound

    def put(self, message: pb.GenerateStreamResponse) -> bool:
        """False when the client is not reading: it has a message waiting untaken and more than
        the bound piled up (the caller stops the stream; what waits is dropped)."""
        self._unsent += message_size(message)
        if self._pending:
            if self.max_unsent_tokens and self._unsent > self.max_unsent_tokens and (
                    not message.finished):
                self._pending.clear()
                return False
            last = self._pending[-1]
            if not (last.prompt_logprobs or message.prompt_logprobs):
                merge_messages(last, message)
                self._ready.set()
                return True
        self._pending.append(message)
        self._ready.set()
        return True

    def end(self, item: object = None) -> None:
        """The stream's end: taken after whatever is pending (None: it ended normally)."""
        if not self._ended:
            self._ended, self._end = True, item
            self._ready.set()

    @property
    def unsent_tokens(self) -> int:
        return self._unsent

    async def get(self) -> tuple[pb.GenerateStreamResponse | None, bool, object]:
        """(a message or None, whether the stream ended, its end's item)."""
        await self._ready.wait()
        if self._pending:
            message = self._pending.popleft()
            self._unsent = 0
            if not self._pending and not self._ended:  # (the end is still to take)
                self._ready.clear()
            return message, False, None
        return None, True, self._end
