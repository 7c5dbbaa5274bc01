"""A step's outputs on the channel from the engine core to the front, cheap to pickle.

Most outputs of a streaming step say one thing: request R's only sequence has these new tokens
(so many in all, so many prompt tokens from the cache). As a RequestOutput holding a
CompletionOutput, each costs pickle two slotted dataclasses, whose state goes through
Python-level __getstate__ / __setstate__: the round trip (pickled in the core, unpickled in
the front) took 6.31 us a streamed token on this CPU, 1.56 as rows, packing and rebuilding
included (bench/README). Such an output travels as a `TokenRow` tuple; the front rebuilds the same
RequestOutput from it and the request's times it already holds. Everything else (a finish,
several sequences, logprobs, text, a request's first tokens, which carry its first-token time)
travels whole, in its place in the list.
"""

from __future__ import annotations

from engine_service.core.outputs import CompletionOutput, RequestOutput

# (request_id, new token ids, num_tokens, num_cached_tokens)
TokenRow = tuple[str, list[int], int, int]


def as_row(output: RequestOutput) -> TokenRow | None:
    """The output as a TokenRow, or None when a row cannot say all it says."""
    if (output.finished or output.prompt is not None or output.prompt_token_ids is not None
            or output.finished_time is not None or len(output.outputs) != 1
            or output.prompt_logprobs is not None):
        return None
    completion = output.outputs[0]
    delta = completion.token_ids_delta
    # num_tokens > the delta: the request's first tokens (and first-token time) went before.
    if (not delta or completion.num_tokens <= len(delta) or completion.index != 0
            or completion.text is not None or completion.token_ids is not None
            or completion.finish_reason is not None or completion.stop_reason is not None
            or completion.logprobs is not None or completion.text_delta
            or completion.logprobs_delta is not None
            or completion.cumulative_logprob is not None):
        return None
    return (output.request_id, delta, completion.num_tokens, output.num_cached_tokens)


def pack(outputs: list[RequestOutput]) -> list[RequestOutput | TokenRow]:
    """The step's outputs as they go on the channel, in order (rows where they can be)."""
    packed: list[RequestOutput | TokenRow] = []
    for output in outputs:
        row = as_row(output)
        packed.append(output if row is None else row)
    return packed


def unpack_row(row: TokenRow, arrival_time: float,
               first_token_time: float | None) -> RequestOutput:
    """The RequestOutput a row stands for; the times are the request's, from its earlier
    outputs (they do not change once its first token is out)."""
    request_id, delta, num_tokens, num_cached_tokens = row
    return RequestOutput(request_id, None, None,
                         [CompletionOutput(0, token_ids_delta=delta, num_tokens=num_tokens)],
                         False, num_cached_tokens, arrival_time, first_token_time)
