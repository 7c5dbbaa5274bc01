"""Lower-precision greedy outputs compared the way vLLM compares them (check_logprobs_close).

Exact token equality is the wrong test in bf16: two correct bf16 implementations round
differently, and where the top-2 candidates are nearly tied, either may win. So: the greedy
sequences must agree token for token until the first near-tie (top-1 minus top-2 logprob under
`tie_margin`, on either side); from there, until the sequences part (after which their contexts
differ and nothing more can be compared), each side's token must be in the other's top-k.
"""

from dataclasses import dataclass

Step = tuple[int, dict[int, float]]  # (chosen token id, {top-k token id: logprob})


@dataclass(frozen=True, slots=True)
class Comparison:
    num_compared: int  # positions with identical context on both sides
    first_near_tie: int | None  # position of the first near-tie, if any
    diverged_at: int | None  # first position where the chosen tokens differ, if any
    max_logprob_diff: float  # largest |ours - reference| logprob of a shared chosen token


def _top2_gap(top: dict[int, float]) -> float:
    first, second = sorted(top.values(), reverse=True)[:2]
    return first - second


def compare_greedy(ours: list[Step], reference: list[Step], tie_margin: float) -> Comparison:
    """Raise AssertionError (naming the position and both tokens) unless `ours` is close to
    `reference` in the sense above."""
    if len(ours) != len(reference):
        raise AssertionError(f"lengths differ: {len(ours)} vs {len(reference)} tokens")
    first_tie = None
    max_diff = 0.0
    for i, ((a, a_top), (b, b_top)) in enumerate(zip(ours, reference, strict=True)):
        if first_tie is None and min(_top2_gap(a_top), _top2_gap(b_top)) < tie_margin:
            first_tie = i
        if first_tie is not None and (a not in b_top or b not in a_top):
            raise AssertionError(
                f"position {i} (after the near-tie at {first_tie}): token {a} vs reference "
                f"{b}; ours top-k {a_top}, reference top-k {b_top}"
            )
        if a != b:
            if first_tie is None:
                raise AssertionError(
                    f"position {i}: token {a} vs reference {b} with no near-tie before it "
                    f"(top-2 gaps {_top2_gap(a_top):.3f} ours, {_top2_gap(b_top):.3f} "
                    f"reference; margin {tie_margin})"
                )
            return Comparison(i + 1, first_tie, i, max_diff)
        if a in a_top and a in b_top:
            max_diff = max(max_diff, abs(a_top[a] - b_top[a]))
    return Comparison(len(ours), first_tie, None, max_diff)
