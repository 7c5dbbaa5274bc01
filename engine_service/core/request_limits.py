"""What an engine accepts, as plain data: the checks a request must pass before it is queued.

The engine holds one; so does the serving front when the engine core runs in a process of its
own (engine_service/serving/core_process.py), so a bad request is refused before it crosses.
Without torch (the front runs no model): nothing here imports the engine's torch modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_service.core.block_pool import blocks_for
from engine_service.core.errors import InvalidRequestError, RequestTooLargeError
from engine_service.model.sampling_params import MAX_BEAM_WIDTH, ModelFieldError, SamplingParams

# Bound on length ** length_penalty (and its inverse): beams are scored in float32, as in HF
# (core/beam_search.py), and a finished beam's score must stay finite (past about 1e38 it is
# -inf, or Python's pow raises).
MAX_LENGTH_NORM = 1.0e30


def max_abs_length_penalty(max_new_tokens: int) -> float:
    """The largest |length_penalty| whose length normalization stays within
    [1 / MAX_LENGTH_NORM, MAX_LENGTH_NORM] for beams of up to max_new_tokens tokens."""
    if max_new_tokens <= 1:
        return math.inf  # 1 ** anything is 1
    return math.log(MAX_LENGTH_NORM) / math.log(max_new_tokens)


def longest_prompt_that_fits(max_model_len: int, num_blocks: int, block_size: int,
                             num_seqs: int, max_tokens: int | None) -> int:
    """The most prompt tokens a request of `num_seqs` sequences and `max_tokens` (None: one
    at least) can run: within the context with its output, and its blocks within the KV
    pool as RequestLimits.blocks_for_request counts them (truncate_prompt_tokens -1's)."""
    new = max_tokens or 1

    def fits(num_prompt: int) -> bool:
        per_seq = blocks_for(min(num_prompt + new, max_model_len), block_size)
        shared = num_prompt // block_size if num_seqs > 1 else 0
        return (num_prompt + new <= max_model_len
                and shared + num_seqs * (per_seq - shared) <= num_blocks)

    low, high = 0, max_model_len  # fits(low); not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    while low > 0 and not fits(low):  # (nearly monotonic: step down to be sure)
        low -= 1
    return max(1, low)


def truncated_prompt(prompt_token_ids: list[int], params: SamplingParams,
                     limits: RequestLimits) -> list[int]:
    """The prompt's tokens that run: its last truncate_prompt_tokens (all of them unset;
    -1: the most that let the request run, RequestLimits.longest_prompt_for)."""
    keep = params.truncate_prompt_tokens
    longest = limits.longest_prompt_for(params) if keep == -1 else 0
    kept = params.prompt_tokens_kept(len(prompt_token_ids), longest)
    if kept == len(prompt_token_ids):
        return prompt_token_ids
    return list(prompt_token_ids[len(prompt_token_ids) - kept:])


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int  # in the device KV pool
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    has_tokenizer: bool  # stop strings need one

    @property
    def max_beam_width(self) -> int:
        """The widest beam search this engine runs: all beams step in one forward."""
        return min(MAX_BEAM_WIDTH, self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def longest_prompt(self) -> int:
        """The most prompt tokens a request may run: its context, and the KV pool, less one
        token for the output."""
        return min(self.max_model_len, self.num_blocks * self.block_size) - 1

    def longest_prompt_for(self, params: SamplingParams) -> int:
        """The most prompt tokens this request can run, with its sequences and max_tokens."""
        return longest_prompt_that_fits(self.max_model_len, self.num_blocks, self.block_size,
                                        params.num_sequences, params.max_tokens)

    def blocks_for_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most blocks the request's group ever holds: its sequences (n samples or
        beam_width beams) share the prompt's full blocks and hold the rest (the partial prompt
        block copied on write) each. Beams share more than the prompt while they agree; this
        counts the worst case, where they share nothing else."""
        max_len = num_prompt_tokens + (params.max_tokens or self.max_model_len)
        per_seq = blocks_for(min(max_len, self.max_model_len), self.block_size)
        num_seqs = params.num_sequences
        shared = num_prompt_tokens // self.block_size if num_seqs > 1 else 0
        return shared + num_seqs * (per_seq - shared)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (RequestTooLargeError when it can never fit) naming the
        field."""
        if not prompt_token_ids:
            raise InvalidRequestError(
                "prompt", "prompt must contain at least one token, got an empty prompt"
            )
        vocab = self.vocab_size
        bad = next(
            (t for t in prompt_token_ids
             if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab),
            None,
        )
        if bad is not None:
            raise InvalidRequestError(
                "prompt", f"prompt_token_ids must be ints in [0, {vocab}), got {bad!r}"
            )
        try:
            params.check_for_model(vocab)
        except ModelFieldError as error:
            raise InvalidRequestError(error.field, str(error)) from None
        if not self.has_tokenizer and params.stop:
            raise InvalidRequestError(
                "stop", f"stop must be empty when the engine has no tokenizer "
                f"(skip_tokenizer_init), got {params.stop!r}: use stop_token_ids"
            )
        if params.bad_words and (params.bad_words_token_ids is None or not self.has_tokenizer):
            raise InvalidRequestError(
                "bad_words", f"bad_words must be empty when the engine has no tokenizer "
                f"(skip_tokenizer_init), got {len(params.bad_words)} words: use logit_bias")
        if not self.has_tokenizer and params.structured_outputs is not None:
            raise InvalidRequestError(
                "structured_outputs", "structured_outputs must be unset when the engine has no "
                "tokenizer (skip_tokenizer_init): a grammar is compiled against its vocabulary, "
                f"got a {params.structured_outputs.kind} constraint"
            )
        num_prompt = len(prompt_token_ids)
        if params.structured_outputs is not None and (
                params.structured_outputs.resumed_tokens >= num_prompt):
            raise InvalidRequestError(
                "structured_outputs", f"structured_outputs.resumed_tokens must be less than "
                f"the prompt's {num_prompt} tokens, got "
                f"{params.structured_outputs.resumed_tokens}")
        if num_prompt >= self.max_model_len:
            raise RequestTooLargeError(
                "prompt",
                f"prompt must be at most {self.max_model_len - 1} tokens (the "
                f"{self.max_model_len}-token context keeps one for the output), "
                f"got {num_prompt} tokens",
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise RequestTooLargeError(
                "max_tokens",
                f"max_tokens must be at most {self.max_model_len - num_prompt} for this "
                f"{num_prompt}-token prompt (context {self.max_model_len}), "
                f"got {params.max_tokens}",
            )
        if params.use_beam_search:
            self._check_beams(num_prompt, params)
        if params.n > self.max_num_seqs:
            raise RequestTooLargeError(
                "n", f"n must be at most {self.max_num_seqs} (max_num_seqs: the "
                f"sequences one step runs), got {params.n}"
            )
        self._check_pool(num_prompt, params)

    def _check_beams(self, num_prompt: int, params: SamplingParams) -> None:
        if params.beam_width > self.max_beam_width:
            raise RequestTooLargeError(
                "beam_width", f"beam_width must be at most {self.max_beam_width} on this engine "
                f"(every beam takes its step in the same forward: max_num_seqs "
                f"{self.max_num_seqs}, max_num_batched_tokens "
                f"{self.max_num_batched_tokens}), got {params.beam_width}"
            )
        max_new = self.max_model_len - num_prompt
        if params.max_tokens is not None:
            max_new = min(max_new, params.max_tokens)
        bound = max_abs_length_penalty(max_new)
        if abs(params.length_penalty) > bound:
            shown = math.floor(bound * 100) / 100  # rounded down: every value shown is fine
            raise InvalidRequestError(
                "length_penalty", f"length_penalty must be between {-shown} and "
                f"{shown} for beams of up to {max_new} tokens (beams are scored "
                f"cum_logprob / length ** length_penalty in float32, which must stay "
                f"finite), got {params.length_penalty}"
            )

    def _check_pool(self, num_prompt: int, params: SamplingParams) -> None:
        prompt_blocks = blocks_for(num_prompt + 1, self.block_size)
        if prompt_blocks > self.num_blocks:
            raise RequestTooLargeError(
                "prompt",
                f"prompt must fit this engine's KV pool of {self.num_blocks} blocks of "
                f"{self.block_size} tokens with one output token "
                f"({prompt_blocks} blocks), got {num_prompt} tokens",
            )
        needed = self.blocks_for_request(num_prompt, params)
        if needed > self.num_blocks:
            num_seqs = params.num_sequences
            shared = num_prompt // self.block_size if num_seqs > 1 else 0
            width = "beam_width" if params.use_beam_search else "n"
            raise RequestTooLargeError(
                "max_tokens",
                f"max_tokens and {width} must fit this engine's KV pool: the request needs up "
                f"to {needed} KV blocks but the pool has {self.num_blocks} blocks of "
                f"{self.block_size} tokens ({num_seqs} sequences of {num_prompt} prompt "
                f"tokens + max_tokens, {shared} full prompt blocks shared); got "
                f"max_tokens={params.max_tokens}, {width}={num_seqs}: lower max_tokens or "
                f"{width}",
            )
