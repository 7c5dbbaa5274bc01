"""Sequences (one stream of tokens) and sequence groups (one request: n sequences).

A sequence carries its tokens and its progress; its KV blocks belong to the KV cache manager.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_service.model.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_service.core.beam_search import BeamSearch
    from engine_service.model.sampler import SamplingRow


class TokenView(SequenceABC):
    """tokens[start:] (or [start:stop]) read in place: O(1) to make and to len(), where a slice
    copies. Each step hands the sampler one per sequence (its prompt and its output so far)."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int | None = None) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        stop = len(self._tokens) if self._stop is None else self._stop
        return max(0, stop - self._start)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._tokens[self._start : self._start + len(self)][index]
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"token index {index} out of range for {size} tokens")
        return self._tokens[self._start + index % size]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, self._start + len(self))

    def __repr__(self) -> str:
        return f"TokenView({list(self)!r})"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted by recompute
    RUNNING = "running"
    # In a running group re-admitted after recompute: holds nothing until its leader has
    # recomputed the prompt blocks the group shares, then shares them (so they exist once).
    PARKED = "parked"
    SWAPPED = "swapped"  # preempted by swapping its blocks to the CPU pool
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    index: int  # position among the request's n outputs
    token_ids: list[int]  # prompt followed by the output so far
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache; the scheduler catches this up with len(token_ids).
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    detokenizer: object | None = None
    logprobs: list | None = None
    # The sum of the sampled tokens' logprobs, kept as they come (when logprobs are asked).
    cumulative_logprob: float = 0.0
    # Output tokens already handed to the caller, and the text the detokenizer released since
    # the last output, in pieces (streaming deltas: nothing is re-read from the start).
    num_streamed_tokens: int = 0
    unstreamed_text: list[str] = field(default_factory=list)
    # The sampler's row of penalty counts for this sequence (Sampler.token_counts), kept up
    # to date with every sampled token; None until its first penalized step.
    penalty_slot: int | None = None
    # What the sampler reads of this sequence each step (a SamplingRow of views), made once.
    sampling_row: SamplingRow | None = None
    # A step's stop check is one set lookup and one comparison: the full check runs only for a
    # token in `ending_token_ids` (EOS unless ignore_eos, and stop_token_ids) or at
    # `max_num_tokens` (max_tokens or the model's length, whichever comes first).
    ending_token_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0
    # Output tokens not given to the detokenizer yet: nothing reads this sequence's text
    # before it ends (no stop strings, final output only), so it is decoded then, in one go.
    text_deferred: bool = False
    # Structured outputs: the xgrammar matcher that follows this sequence's output tokens.
    matcher: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """A copy (O(tokens)): off the per-step path; a step reads `output_view`."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy (O(prompt)): off the per-step path; a step reads `prompt_view`."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_view(self) -> TokenView:
        return TokenView(self.token_ids, self.num_prompt_tokens)

    @property
    def prompt_view(self) -> TokenView:
        return TokenView(self.token_ids, 0, self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request. Starts as one sequence; with n > 1 it forks after the prompt is computed.
    With beam search, `seqs` are the live beams, reshaped by every beam step."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    prompt: str | None
    cache_salt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = 0
    # Prompt tokens found in the prefix cache when the request was first admitted.
    num_cached_tokens: int | None = None
    first_token_time: float | None = None
    has_forked: bool = False
    beam: BeamSearch | None = None  # the search state of a beam search request
    # Outputs only when the request ends (the offline API): no output is built per step.
    final_output_only: bool = False
    # Greedy with no penalties, logprobs or min_tokens: its next token is the argmax alone
    # (a batch of such rows skips the sampler's per-row work).
    plain_greedy: bool = False
    # A PinPrefix's prefill: its blocks are the pin's, counted by the pin budget as pins once
    # pinned, so they are not demand the budget must leave room for (core/pin_budget.py).
    pin_prefill: bool = False
    # Structured outputs: the request's compiled grammar (each sequence has a matcher of it).
    grammar: object | None = None
    # Every token allowed_token_ids allows stops the output: min_tokens cannot hold them back
    # (the sampler lets them through), so the first one ends it.
    only_stops_allowed: bool = False
    # params.prompt_logprobs set: a TokenLogprobs per prompt token scored so far, None first
    # (nothing comes before it); sent once, in the first output after it is whole.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    _prompt_token_ids: list[int] | None = field(default=None, repr=False)

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        # Read for every scheduled group every step: a loop, not all() over a generator.
        for seq in self.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    @property
    def num_prompt_tokens(self) -> int:
        return self.seqs[0].num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt, copied once: every output of the request shares this list."""
        if self._prompt_token_ids is None:
            self._prompt_token_ids = self.seqs[0].prompt_token_ids
        return self._prompt_token_ids

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs asked and not all computed yet: the prompt runs whole, its cached
        blocks not read (a cached block has no logits)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    def num_shared_prompt_blocks(self, block_size: int) -> int:
        """Full prompt blocks every sequence of a forked group holds in common."""
        return self.num_prompt_tokens // block_size if self.has_forked else 0
