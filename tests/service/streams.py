"""Assemble a GenerateStream's deltas into whole completions, to compare with Generate."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedgen_api import generation_pb2 as pb


@dataclass
class Assembled:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    stop_reason: str | int | None = None
    num_finish_messages: int = 0
    # The latest sent: a sum of floats, whose last bits depend on how the front merged the
    # core's outputs; compared with approx, not by ==.
    cumulative_logprob: float | None = field(default=None, compare=False)


@dataclass
class AssembledRequest:
    request_id: str
    completions: dict[int, Assembled]
    usage: pb.Usage
    num_messages: int
    num_finished_messages: int


def stop_reason_of(c: pb.Completion) -> str | int | None:
    which = c.WhichOneof("stop_reason")
    return None if which is None else getattr(c, which)


def assemble(messages: Iterable[pb.GenerateStreamResponse]) -> AssembledRequest:
    completions: dict[int, Assembled] = {}
    last = None
    num_messages = num_finished = 0
    for message in messages:
        num_messages += 1
        num_finished += message.finished
        last = message
        for choice in message.choices:
            acc = completions.setdefault(choice.index, Assembled())
            acc.text += choice.text
            acc.token_ids += list(choice.token_ids)
            acc.logprobs += list(choice.logprobs)
            if choice.HasField("cumulative_logprob"):
                acc.cumulative_logprob = choice.cumulative_logprob
            if choice.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                acc.finish_reason = choice.finish_reason
                acc.stop_reason = stop_reason_of(choice)
                acc.num_finish_messages += 1
    assert last is not None, "the stream sent no message"
    return AssembledRequest(last.request_id, completions, last.usage, num_messages, num_finished)


def from_unary(reply: pb.GenerateResponse) -> dict[int, Assembled]:
    return {
        c.index: Assembled(c.text, list(c.token_ids), list(c.logprobs), c.finish_reason,
                           stop_reason_of(c), 1,
                           c.cumulative_logprob if c.HasField("cumulative_logprob") else None)
        for c in reply.completions
    }
