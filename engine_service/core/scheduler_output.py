"""The plain data a scheduled step hands to the model runner and back to the engine.

The runner imports these types only: it never sees the scheduler or the KV cache manager, and it
reads block tables from here, never from a sequence.
"""

from dataclasses import dataclass, field

from engine_service.core.sequence import Sequence, SequenceGroup

# Prompt tokens a step computes for requests scoring their prompt (prompt_logprobs): each is a
# logits row (vocabulary-sized, float32) beside the sampled ones, which the profiled forward
# counts too (ModelRunner.profile_run), so the KV plan leaves room for them.
MAX_SCORED_TOKENS_PER_STEP = 256


@dataclass(slots=True)
class BlockMoves:
    """Block copies the model runner performs before the step's forward, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on device (CoW)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int
    samples: bool  # this chunk reaches the end of the sequence: sample a token from it
    # The KV cache manager's table for seq (logical -> physical block ids), read-only here.
    block_table: list[int] = field(default_factory=list)
    # Prompt logprobs: the positions whose logits score the prompt token after each (set by
    # the engine; None for most steps, whose runner computes the sampling rows' logits only).
    prompt_positions: range | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    moves: BlockMoves = field(default_factory=BlockMoves)
    preempted: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
