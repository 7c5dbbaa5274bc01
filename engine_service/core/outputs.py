"""What the engine returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's completions, as one engine step reports it.

    A step reports what is new since the request's previous output (`*_delta`) and a few O(1)
    facts; the whole completion (`text`, `token_ids`, `logprobs`) is filled in only in the
    request's final output (`RequestOutput.finished`) and is None before: copying every
    sequence's output into every step's output made the host's work per step grow with the
    tokens generated so far. `LLM.generate` returns final outputs only, so its users always
    see the whole completion; a stream accumulates the deltas.
    """

    index: int
    text: str | None = None  # the whole text (final output only)
    token_ids: list[int] | None = None  # every output token (final output only)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # One TokenLogprobs per output token when asked for (final output only).
    logprobs: list | None = None
    # Only what is new since the previous output of this request (for streaming).
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list | None = None
    # The sum of the output tokens' logprobs so far: for beam search what beams are ranked by
    # (before the length penalty); for sampled completions only when logprobs are asked (as
    # vLLM), else None.
    cumulative_logprob: float | None = None
    num_tokens: int = 0  # output tokens so far, this output's delta included

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    # params.prompt_logprobs set: one TokenLogprobs per prompt token, None for the first. In
    # one output only: the one with the first token (or the final one, offline or aborted).
    prompt_logprobs: list | None = None


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam, as vLLM's offline beam search returns it."""

    token_ids: list[int]  # generated tokens (a stop token that ended the beam included)
    text: str
    cum_logprob: float
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | None = None  # the stop token id that ended it, if one of stop_token_ids


@dataclass(slots=True)
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt: str | None = None
