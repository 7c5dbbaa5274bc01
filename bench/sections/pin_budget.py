"""Section: the pin budget that follows the demand against the fixed 10% (issue 34), on issue
34's small pool (64 blocks, 25-block requests one at a time, an 8-block hot prefix every
fourth request) and on the pinning section's trace, under the local LRU, the index's automatic
pins with the fixed budget and with the adaptive one. What it compares are counts (hot prefix
tokens cached, prefill tokens computed, preemptions), exact for a trace run one request at a
time, so it runs on the random one-layer Llama the parallel-sampling counts use: minutes, not
the best part of an hour on a loaded 2-core machine, and the index's 60 s hot window holds
(its visits must come within it). TTFT and throughput there say nothing of a real model; the
pinning section times SmolLM2. The measuring is bench/pinning.py."""

from __future__ import annotations

import time

from bench.harness import RunContext, log
from bench.report_format import load_average, taken_separately

PARTS = ("pin_budget",)
KEY = "pin_budget"


def run(ctx: RunContext) -> dict:
    from bench.parallel_sampling import counting_model
    from bench.pin_budget import burst_bench
    from bench.pinning import (
        FULL_SHAPE,
        QUICK_SHAPE,
        SMALL_POOL_POLICIES,
        SMALL_POOL_QUICK,
        SMALL_POOL_SHAPE,
        pinning_under_pressure,
    )
    from engine_service import LLM

    model = counting_model()

    def make_engine(**overrides):
        return LLM(model=model, **overrides).llm_engine

    repeats = ctx.sizes.pinning_repeats
    log("pin budget: issue 34's small pool (64 blocks, 25-block requests), fixed vs adaptive")
    small = pinning_under_pressure(make_engine, SMALL_POOL_QUICK if ctx.quick
                                   else SMALL_POOL_SHAPE, repeats=repeats, seed=ctx.seed,
                                   policies=SMALL_POOL_POLICIES)
    log("pin budget: the pinning section's trace, fixed vs adaptive")
    pinning = pinning_under_pressure(make_engine, QUICK_SHAPE if ctx.quick else FULL_SHAPE,
                                     repeats=repeats, seed=ctx.seed,
                                     policies=SMALL_POOL_POLICIES)
    log("pin budget: a burst of concurrent requests beside 24 pinned blocks")
    burst = burst_bench(make_engine, f"{ctx.seed}-{int(time.time())}")
    return {KEY: {"model": "random one-layer Llama (bench.parallel_sampling.counting_model)",
                  "small_pool": small, "pinning_trace": pinning, "burst": burst}}


def report(r: dict, rel: str) -> list[str]:
    from bench.sections.pinning import budget_table

    if KEY not in r:
        return []
    p = r[KEY]
    small, trace = p["small_pool"], p["pinning_trace"]
    sh, tr = small["shape"], trace["shape"]
    return [
        "### Pin budget: following the demand against the fixed 10% (issue 34)",
        "",
        *taken_separately(p),
        f"Counts on a {p['model']}: hit rates, prefill tokens and preemptions are exact for a "
        "trace run one request at a time (the TTFT column is context only). Each policy "
        f"{small['repeats']}x, alternating; median (best). Load average "
        f"{load_average(small['load_average_start'])} at start, "
        f"{load_average(trace['load_average_end'])} at end.",
        *budget_table(small, (
            f"Issue 34's small pool: {sh['num_blocks']} blocks, {sh['cold_blocks'] + 1}-block "
            f"requests one at a time, the {sh['hot_blocks']}-block hot prefix every "
            f"{sh['cold_per_visit'] + 1}th request, {sh['visits']} visits (settled: after "
            f"{sh['warm_up_visits']}).")),
        *budget_table(trace, (
            f"The pinning section's trace: {tr['num_blocks']} blocks, {tr['cold_per_visit']} "
            f"cold prompts of {tr['cold_blocks']} blocks between visits of the "
            f"{tr['hot_blocks']}-block hot prefix (the fixed 10% is 8 blocks here: both keep "
            "it).")),
        *_burst(p.get("burst")),
        "",
    ]


BURST_LABELS = {
    "local_lru": "local LRU (no pins)",
    "index_fixed_50": "index, automatic pins, fixed 50% budget",
    "index_fixed_10": "index, automatic pins, fixed 10% budget",
    "index_adaptive": "index, automatic pins, budget follows the demand",
}


def _burst(b: dict | None) -> list[str]:
    if not b:
        return []
    sh = b["shape"]
    lines = [
        "",
        f"A burst (bench/pin_budget.py): {sh['num_prefixes']} prefixes of "
        f"{sh['prefix_blocks']} blocks earn automatic pins on a {sh['num_blocks']}-block pool, "
        f"then {sh['burst']} requests that each grow to {sh['burst_blocks_each']} blocks run at "
        "once; one run per policy (exact counts).",
        "",
        "| policy | pinned before | budget / pinned during the burst | preemptions "
        "| pins broken for a lone request | budget after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in b["runs"].items():
        lines.append(
            f"| {BURST_LABELS.get(name, name)} | {r['pinned_before']} "
            f"| {r['pin_budget_during']} / {r['pinned_during']} | {r['num_preemptions']} "
            f"| {r['num_pins_released']} | {r['pin_budget_after']} |")
    return lines
