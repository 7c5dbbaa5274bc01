"""Sequences (one stream of tokens) and sequence groups (one request: n sequences).

A sequence carries its tokens and its progress; its KV blocks belong to the KV cache manager.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_service.model.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_service.core.beam_search import BeamSearch


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
    # Output text/token ids already handed to the caller (for streaming deltas).
    num_streamed_tokens: int = 0
    num_streamed_chars: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

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

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_prompt_tokens(self) -> int:
        return self.seqs[0].num_prompt_tokens

    def num_shared_prompt_blocks(self, block_size: int) -> int:
        """Full prompt blocks every sequence of a forked group holds in common."""
        return self.num_prompt_tokens // block_size if self.has_forked else 0
