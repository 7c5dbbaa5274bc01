"""Section: the KV-aware router against its baselines (issue #11): engine replicas behind
pagedgen-router and one prefix index, a balanced and a hot-prefix scenario. The measuring is
bench/router.py; every request also goes to <out>/router.json."""

from __future__ import annotations

from bench.harness import RunContext, log
from bench.report_format import load_average, num, pct, taken_separately, verdict

PARTS = ("router",)
KEY = "router"


def default_shape(quick: bool):
    from bench.router import FULL_SHAPE, QUICK_SHAPE

    return QUICK_SHAPE if quick else FULL_SHAPE


def run(ctx: RunContext) -> dict:
    from bench.router import router_benchmark

    log("KV-aware router: engine replicas behind pagedgen-router, 4 policies, 2 scenarios")
    shape = ctx.router_shape if ctx.router_shape is not None else default_shape(ctx.quick)
    return {KEY: router_benchmark(ctx.model, shape, seed=ctx.seed, log=log)}


def report(r: dict, rel: str) -> list[str]:
    return _report(r[KEY], rel) if KEY in r else []


def _shares(values: list[float]) -> str:
    return " / ".join(f"{100 * v:.0f}" for v in values)


def _router_table(policies: dict) -> list[str]:
    rows = [
        "| policy | hit rate | prefill tokens computed | TTFT p50 / p99 ms "
        "| after warm-up | E2E p50 / p99 ms | output tok/s "
        "| replica shares % | route p50 / p99 ms | preemptions | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in policies.items():
        rows.append(
            f"| {name} | {pct(a['hit_rate'])} | {num(a.get('prefill_tokens'), 0)} "
            f"| {num(a['ttft_p50_ms'], 0)} / {num(a['ttft_p99_ms'], 0)} "
            f"| {num(a.get('ttft_settled_p50_ms'), 0)} / {num(a.get('ttft_settled_p99_ms'), 0)} "
            f"| {num(a['e2el_p50_ms'], 0)} / {num(a['e2el_p99_ms'], 0)} "
            f"| {num(a['output_throughput'], 2)} | {_shares(a['replica_shares'])} "
            f"| {num(a['route_p50_ms'], 2)} / {num(a['route_p99_ms'], 1)} "
            f"| {sum(a['num_preemptions'])} | {a['num_errors']} |"
        )
    return rows


def _report(x: dict, rel: str) -> list[str]:
    sh, t, o = x["shape"], x["targets"], x["overhead"]
    f, met = t["figures"], t["met"]
    runs = "one run" if sh["repeats"] == 1 else f"{sh['repeats']} runs, alternating, median"
    if sh.get("hot_workloads", 1) > 1:
        runs += (f" (hot: one on each of {sh['hot_workloads']} workloads, other requests and "
                 "arrivals each)")
    lines = [
        "### KV-aware router (issue #11)",
        "",
        *taken_separately(x),
        f"{sh['num_engines']} engine replicas on this machine (one torch thread each, default "
        f"dtype), each with a KV pool of {sh['num_blocks']} blocks x {sh['block_size']} tokens, "
        f"behind `pagedgen-router`, one shared prefix index. {sh['num_tenants']} tenants, each "
        f"a distinct {sh['system_prompt_len']}-token system prompt (its own `cache_salt`): the "
        f"working set is {sh['working_set_blocks']} blocks, "
        f"{sh['working_set_blocks'] / sh['num_blocks']:.1f}x one pool. Each request: a "
        f"tenant's system prompt + a unique {sh['user_len']}-token user turn, "
        f"{sh['output_len']} output tokens (greedy, `ignore_eos`); {sh['num_requests']} "
        f"requests per run, Poisson arrivals at {sh['rate']:g}/s (hot: "
        f"{sh.get('hot_rate', sh['rate']):g}/s), the same requests and "
        f"arrival times for every policy, fresh engines (empty caches) for every run; {runs}. "
        f"Balanced: tenants by Zipf popularity (s = {sh['zipf_s']:g}); hot: one tenant takes "
        f"{100 * sh['hot_share']:.0f}% of the requests, the rest Zipf. Hit rate = cached / "
        "prompt tokens over all requests (at most "
        f"{pct(sh['system_prompt_len'] / (sh['system_prompt_len'] + sh['user_len']))}: the "
        "user turns are never cached); output tok/s from first send to last token (in an open "
        "loop it equals the offered load while a policy keeps up); replica shares: requests "
        "routed to each replica, largest first; route latency: the router's "
        "`pagedgen_router_route_seconds` (arrival to the upstream call: hashing, the longest "
        "held prefix per replica from the router's copy of the index's residency view, or a "
        "Lookup while the copy is not synced, choice), p50 / p99 interpolated in its buckets; "
        "after warm-up: TTFT of the requests "
        f"after the first {sh.get('warm_up_requests', 0)} (sent while the caches are empty). "
        "Load average at start "
        f"{load_average(x['load_average_start'])}, at end {load_average(x['load_average_end'])}.",
        "",
        *([] if x.get("prefix_hash") == "stateless" else [
            "These results are older than the stateless prefix-hash: their prefix-hash ran "
            "under the bounded-load guard (today's prefix-hash-bounded).", ""]),
        "Balanced (Zipf):",
        "",
        *_router_table(x["policies"]["balanced"]),
        "",
    ]
    if x["policies"].get("hot"):
        hot = x["policies"]["hot"]
        lines += ["One hot prefix:", "", *_router_table(hot), ""]
        pooled = {name: a.get("pooled") for name, a in hot.items()}
        if all(pooled.values()):
            num_runs = next(iter(pooled.values()))["num_runs"]
            lines += [
                f"One hot prefix, {num_runs} workloads (other requests and arrivals each; the "
                "table above gives each figure's median over them), every request pooled:",
                "",
                "| policy | requests | TTFT p50 ms | TTFT p99 ms | p99 after warm-up ms "
                "| p99 hot tenant ms | p99 other tenants ms |",
                "|---|---:|---:|---:|---:|---:|---:|",
                *(f"| {name} | {p['num_requests']} | {num(p['ttft_p50_ms'], 0)} "
                  f"| {num(p['ttft_p99_ms'], 0)} | {num(p['ttft_settled_p99_ms'], 0)} "
                  f"| {num(p.get('tenant0_ttft_p99_ms'), 0)} "
                  f"| {num(p.get('other_tenants_ttft_p99_ms'), 0)} |"
                  for name, p in pooled.items()),
                "",
            ]
    runs = x["runs"]["balanced"]
    if runs:
        counts = x["workloads"]["balanced"]["tenant_requests"]
        names = list(runs)
        lines += [
            "Hit rate by tenant (balanced, tenant 0 the most popular):",
            "",
            "| tenant | requests | " + " | ".join(names) + " |",
            "|---|---:|" + "---:|" * len(names),
        ]
        for tenant, count in enumerate(counts):
            key = f"tenant-{tenant}"
            cells = [pct(runs[n][0]["tenant_hit_rates"].get(key)) for n in names]
            lines.append(f"| {tenant} | {count} | " + " | ".join(cells) + " |")
        lines.append("")
    tol = t["no_worse_tolerance"]
    rows = [
        "| target | measured | verdict |",
        "|---|---|---|",
        f"| kv-aware hit rate >= 2x round-robin's | {num(f['hit_rate_kv_over_rr'], 2)}x "
        f"| {verdict(met['hit_rate'])} |",
        f"| kv-aware TTFT p50 >= 2x lower than round-robin's | "
        f"{num(f['ttft_p50_rr_over_kv'], 2)}x lower | {verdict(met['ttft_p50'])} |",
        f"| kv-aware output throughput >= round-robin's (open loop: equal within "
        f"{100 * t.get('throughput_tolerance', 0):.0f}% when both keep up) "
        f"| {num(f['throughput_kv_over_rr'], 4)}x | {verdict(met['throughput'])} |",
        f"| balanced: kv-aware no worse than prefix-hash (hit rate, TTFT p50, throughput within "
        f"{100 * tol:.0f}%) | hit rate {num(f['balanced_hit_rate_kv_over_ph'], 2)}x, TTFT p50 "
        f"{num(f['balanced_ttft_p50_ph_over_kv'], 2)}x lower, throughput "
        f"{num(f['balanced_throughput_kv_over_ph'], 3)}x "
        f"| {verdict(met['balanced_vs_prefix_hash'])} |",
    ]
    if "hot_ttft_p99" in met:
        per_run = f.get("hot_ttft_p99_ph_over_kv_per_run") or []
        shown = (f"{v:.2f}x" if v is not None else "n/a" for v in per_run)
        each = f"; each workload {', '.join(shown)}" if per_run else ""
        if per_run and f.get("hot_ttft_p99_ph_over_kv_geomean") is not None:
            each += (f", geometric mean {f['hot_ttft_p99_ph_over_kv_geomean']:.2f}x, lower on "
                     f"{sum(v is not None and v > 1 for v in per_run)} of {len(per_run)}")
        pooled = " (requests pooled)" if per_run else ""  # (older results: one run's p99)
        interval = f.get("hot_ttft_p99_ph_over_kv_interval")
        level = f.get("hot_ttft_p99_interval_level", 0.9)
        if interval and None not in interval:
            within = (f", {level:.0%} interval {interval[0]:.2f}x-{interval[1]:.2f}x over the "
                      "workloads (better: above 1)")
        elif "hot_ttft_p99_ph_over_kv_interval" in f:  # (older results have no interval)
            within = ", no interval (fewer than 5 workloads, or none could be drawn): not shown"
        else:
            within = ""
        rows.append(
            f"| hot prefix: kv-aware TTFT p99 lower than prefix-hash's{pooled} "
            f"| {num(f['hot_ttft_p99_ph_over_kv'], 2)}x lower{within} (after warm-up "
            f"{num(f.get('hot_ttft_settled_p99_ph_over_kv'), 2)}x; p50 "
            f"{num(f['hot_ttft_p50_ph_over_kv'], 2)}x{each}) | {verdict(met['hot_ttft_p99'])} |"
        )
    if "hot_ttft_p99_phb_over_kv" in f:
        interval = f.get("hot_ttft_p99_phb_over_kv_interval")
        level = f.get("hot_ttft_p99_interval_level", 0.9)
        within = (f", {level:.0%} interval {interval[0]:.2f}x-{interval[1]:.2f}x (better: above 1)"
                  if interval else ", no interval (fewer than 5 workloads, or none drawn)")
        rows.append(
            f"| (context, not a target) hot prefix: kv-aware TTFT p99 against "
            f"prefix-hash-bounded's (the same hashing under kv-aware's load cap) "
            f"| {num(f['hot_ttft_p99_phb_over_kv'], 2)}x lower{within} (after warm-up "
            f"{num(f.get('hot_ttft_settled_p99_phb_over_kv'), 2)}x) | n/a |")
    rows += [
        f"| routing adds < 2 ms p50 per request (kv-aware, under the balanced load) "
        f"| {num(f['route_p50_ms'], 2)} ms | {verdict(met['route_latency'])} |",
        f"| (context) route latency with idle replicas, one request at a time "
        f"| p50 {num(o.get('route_p50_ms'), 2)} ms, p99 {num(o.get('route_p99_ms'), 2)} ms | n/a |",
        f"| (context) TTFT through the router vs straight to a replica, idle, "
        f"{o['prompt_len']}-token prompts, {o['pairs']} pairs | {num(o['ttft_router_p50_ms'], 1)} "
        f"vs {num(o['ttft_direct_p50_ms'], 1)} ms p50; added p50 {num(o['added_p50_ms'], 2)} ms, "
        f"mean {num(o['added_mean_ms'], 2)} ms | n/a |",
    ]
    return lines + rows + ["", f"![router]({rel}/router.png)", ""]
