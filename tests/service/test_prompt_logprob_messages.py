"""A long prompt's logprobs go over several stream messages, each well under gRPC's default
4 MiB receive limit, in order, the output's own message last."""

from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.model.token_logprobs import TokenLogprobs
from engine_service.serving.servicer import _stream_messages
from pagedgen_api import generation_pb2 as pb


def _output(num_prompt_tokens: int, k: int) -> RequestOutput:
    scored = [None] + [TokenLogprobs(i, -1.5, {i + j: -2.0 - j for j in range(k)} | {i: -1.5},
                                     1 + i % 7) for i in range(1, num_prompt_tokens)]
    return RequestOutput("r", None, list(range(num_prompt_tokens)),
                         [CompletionOutput(0, token_ids_delta=[5], num_tokens=1)], False,
                         prompt_logprobs=scored)


def test_a_16k_prompt_at_top_20_goes_in_pieces_under_the_limit():
    output = _output(16_000, 20)
    choices = [pb.Completion(index=0, token_ids=[5])]
    messages = _stream_messages("r", output, choices)
    assert len(messages) > 4
    assert all(m.ByteSize() < 2**21 for m in messages)
    assert [lp.token_id for m in messages for lp in m.prompt_logprobs] == list(range(1, 16_000))
    assert [list(m.choices) for m in messages] == [[]] * (len(messages) - 1) + [choices]
    assert not any(m.finished for m in messages)


def test_short_and_one_token_prompts_go_in_the_output_s_message():
    for num_tokens, expected in ((40, list(range(1, 40))), (1, [])):
        [message] = _stream_messages("r", _output(num_tokens, 2), [])
        assert [lp.token_id for lp in message.prompt_logprobs] == expected
