"""Lower-precision outputs compared with a reference the way vLLM compares them
(`check_logprobs_close` in vLLM's tests/models/utils.py), with the logprobs bounded too.

Exact token equality is the wrong test in bf16: two correct bf16 implementations round
differently, and where the top candidates are nearly tied either may win. vLLM's rule, per pair
of outputs of one prompt: the tokens agree up to the first difference; there, each side's token
must be among the other's top-k logprobs; nothing after it is compared (the contexts differ from
then on).

That rule alone never looks at the logprobs' values, and a model with a subtly wrong RoPE or
attention scale still puts the right token first most of the time. So every logprob compared at
an identical context (the matched positions before the first difference, and the first
difference itself) must agree within `LogprobTolerance.max_diff`, and their mean within
`mean_diff`: rounding noise is mostly far below its worst case, a systematic error is not.
"""

from dataclasses import dataclass, field

import torch

Step = tuple[int, dict[int, float]]  # (chosen token id, {top-k token id: logprob})


@dataclass(frozen=True, slots=True)
class LogprobTolerance:
    max_diff: float  # any one |ours - reference| logprob at an identical context
    mean_diff: float  # the mean of those over everything one test compared
    # |ours - reference| of one sequence's mean logprob (a beam's score): the per-token
    # differences have both signs and mostly cancel, so this is far below mean_diff.
    score_diff: float


@dataclass(slots=True)
class LogprobDiffs:
    """Every |ours - reference| logprob a test compared, each checked against the tolerance as
    it comes in; `check_mean` at the end."""

    tolerance: LogprobTolerance
    values: list[float] = field(default_factory=list)

    def add(self, ours: float, reference: float, where: str) -> None:
        diff = abs(ours - reference)
        if not diff <= self.tolerance.max_diff:  # also catches NaN
            raise AssertionError(
                f"{where}: logprob {ours:.4f} vs reference {reference:.4f}, |diff| {diff:.4f} "
                f"> {self.tolerance.max_diff}"
            )
        self.values.append(diff)

    @property
    def max(self) -> float:
        return max(self.values, default=0.0)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0

    def check_mean(self, min_count: int) -> None:
        """The mean is within the tolerance, over at least `min_count` values (not vacuous)."""
        if len(self.values) < min_count:
            raise AssertionError(f"only {len(self.values)} logprobs compared, want {min_count}")
        if not self.mean <= self.tolerance.mean_diff:
            raise AssertionError(
                f"mean |logprob diff| {self.mean:.4f} over {len(self.values)} logprobs > "
                f"{self.tolerance.mean_diff} (max {self.max:.4f})"
            )


def check_logprobs_close(
    ours: list[Step], reference: list[Step], diffs: LogprobDiffs, where: str = ""
) -> int | None:
    """vLLM's rule on one pair of outputs, with every logprob both sides report at an identical
    context added to (and bounded by) `diffs`. The position of the first difference, or None
    when the tokens agree throughout (then the lengths must agree too: one side stopping early
    with the same tokens is a difference vLLM's zip would miss). AssertionError names the
    position, both tokens and both top-k."""
    # Not strict: after a difference the lengths may differ (checked below otherwise).
    for i, ((a, a_top), (b, b_top)) in enumerate(zip(ours, reference, strict=False)):
        here = f"{where} position {i}"
        # The context is identical up to and including the first difference: compare it too.
        for token in a_top.keys() & b_top.keys():
            diffs.add(a_top[token], b_top[token], f"{here}, token {token}")
        if a != b:
            if a not in b_top or b not in a_top:
                raise AssertionError(
                    f"{here}: token {a} vs reference {b}, not each in the other's top-k; "
                    f"ours {a_top}, reference {b_top}"
                )
            return i
    if len(ours) != len(reference):
        raise AssertionError(
            f"{where}: same tokens, but {len(ours)} of them vs {len(reference)} in the reference"
        )
    return None


def check_top_logprobs(
    ours_top: dict[int, float], reference: torch.Tensor, k: int, diffs: LogprobDiffs,
    where: str = "",
) -> None:
    """Our top-k logprobs at one position against the reference's whole distribution there
    (`reference`: [vocab] logprobs at the same context): each of ours within the tolerance of
    the reference's logprob of that token, and the same top-k set up to near-ties: a token in
    the reference's top-k that is not in ours must be within `max_diff` of our k-th logprob
    (otherwise our logprob of it, at most our k-th, is that far off). `ours_top` may hold more
    than k entries (the sampled token is always added): its k best are our top-k."""
    if len(ours_top) < k:
        raise AssertionError(f"{where}: {len(ours_top)} top logprobs, want at least {k}")
    for token, logprob in ours_top.items():
        diffs.add(logprob, reference[token].item(), f"{where}, token {token}")
    ours_kth = sorted(ours_top.values(), reverse=True)[k - 1]
    values, ids = reference.topk(k)
    for token, logprob in zip(ids.tolist(), values.tolist(), strict=True):
        if token not in ours_top and logprob > ours_kth + diffs.tolerance.max_diff:
            raise AssertionError(
                f"{where}: reference top-{k} token {token} (logprob {logprob:.4f}) is missing "
                f"from ours, whose k-th is {ours_kth:.4f}; ours {ours_top}"
            )
