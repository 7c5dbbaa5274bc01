"""Section: prefix caching (issue #6): a shared-prefix workload with the cache on and off, the
cost at zero hits, and a burst where several requests arrive for a prefix being computed."""

from __future__ import annotations

from dataclasses import asdict

from bench.harness import RunContext, log
from bench.report_format import num, pct, taken_separately, target_row

PARTS = ("prefix",)
KEY = "prefix"


def run(ctx: RunContext) -> dict:
    from bench.prefix import burst_deferral, prefix_benefit, zero_hit_cost

    sizes = ctx.sizes
    log("prefix caching: shared-prefix workload, cache on vs off")
    # As many in flight as tenants: the first wave computes each tenant's prefix, later
    # waves can hit it.
    figures, _ = prefix_benefit(ctx.make_engine, ctx.shared_prefix_workload(),
                                max_concurrency=sizes.prefix_tenants)
    log("prefix caching: zero-hit cost on unique prompts")
    zero = zero_hit_cost(ctx.make_engine, ctx.throughput_workload(),
                         repeats=sizes.zero_hit_repeats)
    log("prefix caching: a burst, each tenant's requests together, deferral on vs off")
    burst = burst_deferral(ctx.make_engine, ctx.shared_prefix_workload(grouped=True),
                           repeats=sizes.zero_hit_repeats)
    return {KEY: {"shared_prefix": asdict(figures), "zero_hit": zero, "burst": burst}}


def target_rows(r: dict) -> list[str]:
    prefix = r.get(KEY)
    if not prefix:
        return []
    sp, zero = prefix["shared_prefix"], prefix["zero_hit"]
    cost = zero["throughput_cost_fraction"]
    spreads = [
        (max(runs) - min(runs)) / max(runs)
        for runs in (zero["output_throughput_cache_on"], zero["output_throughput_cache_off"])
        if len(runs) > 1
    ]
    noise = f" (run-to-run spread of one side: up to {pct(max(spreads))})" if spreads else ""
    return [
        target_row("shared prefix: TTFT p50 >= 5x lower with the cache",
                   f"{num(sp['ttft_p50_speedup'], 2)}x", sp["ttft_p50_speedup"] >= 5),
        target_row("< 2% throughput cost at 0% hits", pct(cost) + noise, cost < 0.02),
    ]


def report(r: dict, rel: str) -> list[str]:
    if KEY not in r:
        return []
    sp, zero = r[KEY]["shared_prefix"], r[KEY]["zero_hit"]
    wl = r["sizes"]
    lines = [
        "### Prefix caching",
        "",
        *taken_separately(r[KEY]),
        f"Shared-prefix workload: {wl['prefix_tenants']} tenants x {wl['prefix_per_tenant']} "
        f"requests, a {wl['prefix_system_len']}-token system prompt + 16-48 token user turn, "
        f"{wl['prefix_output_len']} output tokens, each tenant its own `cache_salt`; "
        f"{wl['prefix_tenants']} requests in flight (closed loop), a fresh engine per "
        "configuration.",
        "",
        "| | TTFT p50 ms | TTFT p90 ms | prefill tokens computed | output tok/s |",
        "|---|---:|---:|---:|---:|",
        f"| cache off | {num(sp['uncached']['ttft']['p50_ms'], 0)} "
        f"| {num(sp['uncached']['ttft']['p90_ms'], 0)} | {sp['prefill_tokens_uncached']} "
        f"| {num(sp['uncached']['output_throughput'])} |",
        f"| cache on | {num(sp['cached']['ttft']['p50_ms'], 0)} "
        f"| {num(sp['cached']['ttft']['p90_ms'], 0)} | {sp['prefill_tokens_cached']} "
        f"| {num(sp['cached']['output_throughput'])} |",
        "",
        f"Hit rate {pct(sp['hit_rate'])}; TTFT p50 **{sp['ttft_p50_speedup']:.1f}x** lower. "
        f"Zero hits (the throughput workload's unique prompts): output tok/s with the cache "
        f"{', '.join(num(x) for x in zero['output_throughput_cache_on'])} vs without "
        f"{', '.join(num(x) for x in zero['output_throughput_cache_off'])} "
        f"(best of each: cost **{pct(zero['throughput_cost_fraction'])}**).",
        "",
        f"![prefix cache]({rel}/prefix_cache.png)",
        "",
    ]
    if "burst" in r[KEY]:
        lines += _burst_lines(r[KEY]["burst"], wl)
    return lines


def _burst_lines(burst: dict, wl: dict) -> list[str]:
    """Deferring a request whose prefix is being computed."""
    on, off = burst["deferred"], burst["not_deferred"]

    def row(name: str, summary: dict, prefill: int) -> str:
        return (f"| {name} | {num(summary['ttft']['p50_ms'], 0)} | "
                f"{num(summary['ttft']['p99_ms'], 0)} | {prefill} | "
                f"{num(summary['output_throughput'])} |")

    return [
        f"A burst: the same {wl['prefix_tenants'] * wl['prefix_per_tenant']} requests all at "
        "once, each tenant's next to each other, so several arrive for a prefix nobody has "
        "computed yet. With deferral (the default) a request whose next prompt block a running "
        "request is computing waits one step and finds it cached; without it, those requests "
        "compute it again in the same step.",
        "",
        "| | TTFT p50 ms | TTFT p99 ms | prefill tokens computed | output tok/s |",
        "|---|---:|---:|---:|---:|",
        row("not deferred", off, burst["prefill_tokens_not_deferred"]),
        row("deferred", on, burst["prefill_tokens_deferred"]),
        "",
        f"{burst['num_prefill_deferrals']} admissions deferred; TTFT p50 "
        f"**{burst['ttft_p50_speedup']:.2f}x** and p99 **{burst['ttft_p99_speedup']:.2f}x** "
        f"lower; output tok/s per run deferred "
        f"{', '.join(num(x) for x in burst['output_throughput_deferred'])}, not deferred "
        f"{', '.join(num(x) for x in burst['output_throughput_not_deferred'])}.",
        "",
    ]
