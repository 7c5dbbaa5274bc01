"""A long prompt's logprobs reach a slow client in the pieces the replica sent (each under
gRPC's default receive limit), never merged into one message; and a stream resumed between two
pieces sends the client each prompt token's logprob once."""

from __future__ import annotations

import asyncio

from pagedgen_api import generation_pb2 as pb
from router.proxy import RoutedRequest
from router.relay_buffer import RelayBuffer


def _piece(start: int, count: int) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(prompt_logprobs=[
        pb.TokenLogprob(token_id=i, logprob=-1.0, rank=1) for i in range(start, start + count)])


def _token(token: int, finished: bool = False) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(choices=[pb.Completion(index=0, token_ids=[token])],
                                     finished=finished)


def test_pieces_stay_apart_and_tokens_still_merge():
    buffer = RelayBuffer(max_unsent_tokens=1000)
    first_token = _token(7)
    first_token.prompt_logprobs.extend(_piece(20, 5).prompt_logprobs)
    for message in (_piece(1, 10), _piece(11, 9), first_token, _token(8), _token(9, True)):
        assert buffer.put(message)  # nobody takes anything meanwhile
    buffer.end()

    async def drain() -> list[pb.GenerateStreamResponse]:
        taken = []
        while True:
            message, ended, _ = await buffer.get()
            if ended:
                return taken
            taken.append(message)

    taken = asyncio.run(drain())
    assert [len(m.prompt_logprobs) for m in taken] == [10, 9, 5, 0]
    assert [list(c.token_ids) for m in taken for c in m.choices] == [[7], [8, 9]]
    assert taken[-1].finished


def test_a_resume_between_pieces_sends_each_prompt_logprob_once():
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(30))),
                                 sampling=pb.SamplingParams(max_tokens=4, prompt_logprobs=0))
    # (no router or call: only its record of what the client took is used)
    routed = RoutedRequest(None, request, None)
    routed._record(_piece(1, 12))  # the first replica's first piece, then it fails
    resume = routed._resume_request(pb.GenerateRequest(request_id="r"), list(range(30)))
    assert resume.sampling.HasField("prompt_logprobs")  # no token yet: the same prompt again
    relayed = [routed._record(m) for m in (_piece(1, 20), _piece(21, 9))]
    assert [lp.token_id for m in relayed for lp in m.prompt_logprobs] == list(range(13, 30))
