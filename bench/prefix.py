"""Prefix caching: what the cache buys on the shared-prefix workload (TTFT, prefill tokens
computed), what it costs when nothing hits (throughput on unique prompts, cache on vs off), and
what deferring a request whose prefix is being computed buys when requests for new prefixes
arrive together (a burst, deferral on vs off). Each configuration gets a fresh engine, so no
run starts with another's cache."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass

from bench.metrics import RunSummary, summarize
from bench.peers_engine import EngineRun, drive, warm_up
from bench.workloads import Workload

EngineFactory = Callable[..., object]  # (**engine_overrides) -> LLMEngine


@dataclass(slots=True)
class PrefixFigures:
    cached: dict  # RunSummary as a dict, cache on
    uncached: dict  # cache off
    prefill_tokens_cached: int  # prompt tokens actually computed
    prefill_tokens_uncached: int
    hit_rate: float  # prompt tokens served from the cache / prompt tokens, cache on
    ttft_p50_speedup: float  # uncached TTFT p50 / cached TTFT p50


def _prefill_tokens(run: EngineRun) -> int:
    return sum(r.prompt_len - r.num_cached_tokens for r in run.records)


def _run(
    make_engine: EngineFactory,
    workload: Workload,
    name: str,
    enable_prefix_caching: bool,
    max_concurrency: int | None,
    rate: float,
    progress: bool,
    **engine_overrides,
) -> tuple[EngineRun, RunSummary]:
    from engine_service.model.sampling_params import SamplingParams

    engine = make_engine(enable_prefix_caching=enable_prefix_caching, **engine_overrides)
    warm_up(engine, SamplingParams)
    run = drive(
        engine, workload, name, rate=rate, max_concurrency=max_concurrency, progress=progress
    )
    run.stats["num_prefill_deferrals"] = engine.scheduler.counters.num_prefill_deferrals
    del engine
    gc.collect()
    return run, summarize(run.records, run.duration_s)


def prefix_benefit(
    make_engine: EngineFactory,
    workload: Workload,
    max_concurrency: int | None = 4,
    rate: float = float("inf"),
    progress: bool = True,
) -> tuple[PrefixFigures, list[EngineRun]]:
    on, on_summary = _run(
        make_engine, workload, "prefix_cache_on", True, max_concurrency, rate, progress
    )
    off, off_summary = _run(
        make_engine, workload, "prefix_cache_off", False, max_concurrency, rate, progress
    )
    figures = PrefixFigures(
        cached=asdict(on_summary),
        uncached=asdict(off_summary),
        prefill_tokens_cached=_prefill_tokens(on),
        prefill_tokens_uncached=_prefill_tokens(off),
        hit_rate=on_summary.num_cached_tokens / max(1, on_summary.num_prompt_tokens),
        ttft_p50_speedup=off_summary.ttft["p50_ms"] / on_summary.ttft["p50_ms"],
    )
    return figures, [on, off]


def zero_hit_cost(
    make_engine: EngineFactory, workload: Workload, repeats: int = 1, progress: bool = True
) -> dict:
    """Output throughput with the cache on and off on unique prompts (no hits possible):
    the cost of hashing, committing and looking up blocks that are never reused. Runs
    alternate on/off `repeats` times; the best of each side is compared, which discounts
    interference from other work on the machine."""
    best = {True: 0.0, False: 0.0}
    all_runs = {True: [], False: []}
    for _ in range(repeats):
        for enabled in (True, False):
            name = f"zero_hit_cache_{'on' if enabled else 'off'}"
            run, summary = _run(make_engine, workload, name, enabled, None, float("inf"), progress)
            if summary.num_cached_tokens:
                raise RuntimeError(
                    f"{name}: {summary.num_cached_tokens} cache hits on unique prompts"
                )
            all_runs[enabled].append(summary.output_throughput)
            best[enabled] = max(best[enabled], summary.output_throughput)
    return {
        "output_throughput_cache_on": all_runs[True],
        "output_throughput_cache_off": all_runs[False],
        "throughput_cost_fraction": 1 - best[True] / best[False],
    }


def burst_deferral(
    make_engine: EngineFactory, workload: Workload, repeats: int = 1, progress: bool = True
) -> dict:
    """Every request of `workload` at once (each tenant's requests next to each other, so
    several arrive for a prefix no one has computed yet), with the scheduler's deferral on
    and off (`defer_shared_prefill`), alternating; the first run of each side is reported, the
    others are kept for their spread."""
    sides: dict[bool, list[tuple[EngineRun, RunSummary]]] = {True: [], False: []}
    for _ in range(repeats):
        for defer in (True, False):
            name = f"burst_{'deferred' if defer else 'not_deferred'}"
            sides[defer].append(_run(make_engine, workload, name, True, None, float("inf"),
                                     progress, defer_shared_prefill=defer))
    (on, on_summary), (off, off_summary) = sides[True][0], sides[False][0]
    return {
        "deferred": asdict(on_summary),
        "not_deferred": asdict(off_summary),
        "prefill_tokens_deferred": _prefill_tokens(on),
        "prefill_tokens_not_deferred": _prefill_tokens(off),
        "num_prefill_deferrals": on.stats["num_prefill_deferrals"],
        "ttft_p50_speedup": off_summary.ttft["p50_ms"] / on_summary.ttft["p50_ms"],
        "ttft_p99_speedup": off_summary.ttft["p99_ms"] / on_summary.ttft["p99_ms"],
        "output_throughput_deferred": [s.output_throughput for _, s in sides[True]],
        "output_throughput_not_deferred": [s.output_throughput for _, s in sides[False]],
    }
