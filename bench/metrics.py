"""Per-request latency records and the summary vLLM's serving benchmark reports:
TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), request / output-token /
total-token throughput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """Times are seconds on one monotonic clock; `arrival` is when the request was sent."""

    prompt_len: int
    output_len: int = 0
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2el(self) -> float:
        end = self.finish if self.finish is not None else self.token_times[-1]
        return end - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with a single output token."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens. Tokens that arrive together (a peer that
        only reports the end of a batch) show up as zero gaps, which is the truth."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Mean and percentiles, in milliseconds (inputs are seconds)."""
    summary = {"mean_ms": (sum(values) / len(values) * 1e3) if values else math.nan}
    for q in PERCENTILES:
        summary[f"p{q}_ms"] = percentile(values, q) * 1e3
    return summary


@dataclass(slots=True)
class RunSummary:
    num_requests: int
    duration_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    ttft: dict[str, float]
    tpot: dict[str, float]
    itl: dict[str, float]
    e2el: dict[str, float]


def summarize(records: Sequence[RequestRecord], duration_s: float) -> RunSummary:
    """Throughput over the whole run's wall time (first send to last token), latencies per
    request; ITL pools the gaps of every request, as vLLM's benchmark does."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.token_times]
    prompt_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(len(r.token_times) for r in done)
    return RunSummary(
        num_requests=len(done),
        duration_s=duration_s,
        num_prompt_tokens=prompt_tokens,
        num_output_tokens=output_tokens,
        num_cached_tokens=sum(r.num_cached_tokens for r in done),
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s,
        ttft=distribution([r.ttft for r in done]),
        tpot=distribution([t for r in done if (t := r.tpot) is not None]),
        itl=distribution([gap for r in done for gap in r.itls]),
        e2el=distribution([r.e2el for r in done]),
    )


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First arrival to last token (or finish) across the run."""
    start = min(r.arrival for r in records)
    end = max(r.finish if r.finish is not None else r.token_times[-1] for r in records)
    return end - start
