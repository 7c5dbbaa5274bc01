"""What the HTTP API needs of the front it is mounted on: the engine's or the router's gRPC
servicer (called in-process, with openai_api/call_context.HttpCallContext), whether it serves,
the models it serves, and the text of single tokens (for logprobs)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine_service.core.request_limits import longest_prompt_that_fits


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # what clients put in `model` (ModelInfo.served_model_name)
    max_model_len: int
    kv_blocks: int  # the KV pool, which all the sequences of one request must fit in
    block_size: int
    # Behind a router, the largest context among the replicas serving it (max_model_len is
    # the smallest): the longest prompt a request may carry, as the router's gRPC door allows.
    # 0: max_model_len.
    widest_context: int = 0

    @property
    def prompt_context(self) -> int:
        """The context a prompt's length is checked against before its ids are read."""
        return self.widest_context or self.max_model_len

    def longest_prompt(self, num_seqs: int, max_tokens: int | None) -> int:
        """The most prompt tokens a request of `num_seqs` sequences and `max_tokens` runs
        (truncate_prompt_tokens -1's cut, as the engine makes it; 0: not known yet)."""
        if not self.max_model_len or not self.kv_blocks:
            return 0
        return longest_prompt_that_fits(self.max_model_len, self.kv_blocks, self.block_size,
                                        num_seqs, max_tokens)

    def longest_sequence(self, num_seqs: int) -> int:
        """The most tokens each of a request's `num_seqs` sequences can reach: the context, or
        their share of the KV pool when smaller (the engine refuses a request whose sequences
        could outgrow the pool). The default max_tokens of a chat request runs to it."""
        return min(self.max_model_len, self.kv_blocks // max(1, num_seqs) * self.block_size)


@dataclass(frozen=True, slots=True)
class Backend:
    # pagedgen.generation.v1.Generation's servicer: GenerateStream, Generate, Tokenize,
    # Detokenize, taking (request, context) as gRPC calls them
    servicer: object
    serving: Callable[[], bool]  # /health: True only while new requests are accepted
    models: Callable[[], list[ServedModel]]  # empty: not known yet (no replica up)
    token_texts: Callable[[list[int]], Awaitable[list[str]]]  # one text per token id
    # One token's raw bytes per id (chat logprobs' `bytes`; openai_api/token_bytes.py makes
    # it from a tokenizer); None: the UTF-8 of token_texts', which loses a partial character.
    token_bytes: Callable[[list[int]], Awaitable[list[bytes]]] | None = None


def model_of(info) -> ServedModel:
    """A ModelInfoResponse (or the engine's fixed facts) as a served model."""
    return ServedModel(info.served_model_name, info.max_model_len, info.num_blocks,
                       info.block_size)
