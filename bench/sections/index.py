"""Section: the prefix index's overhead (issues #6, #10): the shared-prefix workload with the
cache steered by the index (Redis + index server on this machine) against the engine's own
local LRU, alternating runs."""

from __future__ import annotations

import statistics

from bench.harness import RunContext, log
from bench.report_format import num, pct, taken_separately, verdict

PARTS = ("index",)
KEY = "index_overhead"


def run(ctx: RunContext) -> dict:
    from bench.index_overhead import index_overhead

    log("prefix index overhead: index-steered vs local LRU")
    return {KEY: index_overhead(ctx.make_engine, ctx.shared_prefix_workload(),
                                ctx.sizes.prefix_tenants, repeats=ctx.sizes.zero_hit_repeats)}


def report(r: dict, rel: str) -> list[str]:
    if KEY not in r:
        return []
    io = r[KEY]
    link = io.get("link", {})
    lines = [
        "### Prefix index overhead",
        "",
        *taken_separately(io),
        "Shared-prefix workload, prefix cache on, steered by the prefix index (Redis + "
        "index server on this machine, loopback gRPC) vs the engine's standalone local LRU:",
        "",
        "| policy | output tok/s | TTFT p50 ms |",
        "|---|---:|---:|",
        f"| local LRU | {num(io['local']['output_throughput'])} "
        f"| {num(io['local']['ttft']['p50_ms'], 0)} |",
        f"| prefix index | {num(io['index']['output_throughput'])} "
        f"| {num(io['index']['ttft']['p50_ms'], 0)} |",
        "",
        "Runs (alternating, best of each compared): local "
        + ", ".join(num(x) for x in io.get("output_throughput_local", []))
        + " tok/s, index "
        + ", ".join(num(x) for x in io.get("output_throughput_index", []))
        + f" tok/s. Throughput ratio index / local **{io['throughput_ratio']:.3f}**; link: "
        f"{link.get('applies', 'n/a')} Apply RPCs, {link.get('ops_sent', 'n/a')} ops, "
        f"{link.get('rpc_errors', 'n/a')} errors, degraded at end: "
        f"{link.get('degraded', 'n/a')}; mean RPC ms "
        + ", ".join(f"{k} {v:.2f}" for k, v in link.get("rpc_mean_ms", {}).items())
        + ".",
        "",
    ]
    if "meta" in io:  # issue #10: "no pressure", the index costs <= 1%
        local, index = io["output_throughput_local"], io["output_throughput_index"]
        spread = max(local) / min(local) - 1
        lines += [
            f"No pressure (issue #10): index / local LRU output throughput, best of each "
            f"**{io['throughput_ratio']:.3f}**, median of each "
            f"**{statistics.median(index) / statistics.median(local):.3f}** (target >= "
            f"0.99: {verdict(io['throughput_ratio'] >= 0.99)} on the best-of; the local "
            f"LRU's own runs differ by {pct(spread)}, so 1% is below this run's noise).",
            "",
        ]
    return lines
