"""Section: pinning under pressure (issue #10): a small pool, a hot prefix returning between
cold prompts, five policies (local LRU; the index with automatic pins off, on, and an explicit
PinPrefix, under the fixed 10% pin budget; automatic pins under the budget that follows the
demand, issue 34). The measuring is bench/pinning.py; its runs also go to <out>/pinning.json.
Issue 34's small pool is the pin_budget section's."""

from __future__ import annotations

from bench.harness import RunContext, log
from bench.report_format import load_average, num, pct, taken_separately, verdict

PARTS = ("pinning",)
KEY = "pinning"


def run(ctx: RunContext) -> dict:
    from bench.pinning import FULL_SHAPE, QUICK_SHAPE, pinning_under_pressure

    log("pinning under pressure: small pool, hot prefix between cold prompts, 5 policies")
    return {KEY: pinning_under_pressure(ctx.make_engine,
                                        QUICK_SHAPE if ctx.quick else FULL_SHAPE,
                                        repeats=ctx.sizes.pinning_repeats, seed=ctx.seed)}


def report(r: dict, rel: str) -> list[str]:
    return _report(r[KEY], rel) if KEY in r else []


PINNING_LABELS = {
    "local_lru": "local LRU (no index)",
    "index_no_autopin": "index, automatic pins off (`--hot-threshold 0`)",
    "index_autopin": "index, shipped defaults (automatic pins), fixed 10% budget",
    "index_explicit_pin": "index, auto pins off + PinPrefix once",
    "index_autopin_adaptive": "index, automatic pins, budget follows the demand",
}


def _report(p: dict, rel: str) -> list[str]:
    sh = p["shape"]
    pools = sh["num_blocks"] * sh["block_size"]
    cold = sh["cold_per_visit"] * sh["cold_blocks"]
    lines = [
        "### Pinning under pressure (issue #10)",
        "",
        *taken_separately(p),
        f"One engine, KV pool {sh['num_blocks']} blocks x {sh['block_size']} tokens "
        f"({pools} tokens). A hot system prompt of {sh['hot_blocks']} blocks "
        f"({sh['hot_prefix_len']} tokens) + a unique {sh['hot_turn_len']}-token turn returns "
        f"{sh['visits']} times; between two visits {sh['cold_per_visit']} unique cold prompts of "
        f"{sh['cold_blocks']} blocks ({cold} blocks, {cold / sh['num_blocks']:.2f}x the pool). "
        f"{sh['output_len']} output token{'s' if sh['output_len'] != 1 else ''} each (output "
        "tok/s is then requests/s), one request at a time; for the index policies "
        "the bench waits, untimed, until the index mirrors the pool before the next request "
        "(bench/pinning.py says why). Each policy "
        f"{p['repeats']}x, alternating, a fresh engine and engine id per run; median (best) of "
        f"the runs. Settled = hot visits after the first {sh['warm_up_visits']} (the shipped hot "
        "threshold is 8 admissions per 60 s). Load average at start "
        f"{load_average(p['load_average_start'])}, at end {load_average(p['load_average_end'])}.",
        "",
        "| policy | hot prefix cached, all / settled | hot TTFT p50 / p99 ms, all "
        "| hot TTFT p50 / p99 ms, settled | output tok/s | prompt tok/s "
        "| prefill tokens computed | local evictions / forgets / index pins | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def mb(stat: dict, fmt) -> str:
        return f"{fmt(stat['median'])} ({fmt(stat['best'])})"

    for name, a in p["policies"].items():
        c = a["counters"]
        counts = (
            f"{c.get('local_evictions', 'n/a')} / {c.get('forgets_sent', '-')} / "
            f"{c.get('index_pins', '-')}"
        )
        lines.append(
            f"| {PINNING_LABELS.get(name, name)} "
            f"| {pct(a['hot_hit_rate']['median'])} / {pct(a['hot_hit_rate_settled']['median'])} "
            f"| {mb(a['hot_ttft_p50_ms'], lambda v: num(v, 0))} / "
            f"{num(a['hot_ttft_p99_ms']['median'], 0)} "
            f"| {mb(a['hot_ttft_settled_p50_ms'], lambda v: num(v, 0))} / "
            f"{num(a['hot_ttft_settled_p99_ms']['median'], 0)} "
            f"| {mb(a['output_throughput'], lambda v: num(v, 2))} "
            f"| {mb(a['prompt_throughput'], lambda v: num(v, 0))} "
            f"| {p['runs'][name][0]['num_prefill_tokens']} | {counts} "
            f"| {num_or_na(a.get('num_preemptions'))} |"
        )
    t = p.get("targets")
    if t:
        m, b, met = t["median"], t["best"], t["met"]
        lines += [
            "",
            "| target (automatic pinning vs local LRU) | measured: median (best) | verdict |",
            "|---|---|---|",
            f"| settled hot prefix cached >= 90% where LRU < 50% "
            f"| {pct(m['autopin_hit_rate_settled'])} vs {pct(m['lru_hit_rate_settled'])} "
            f"| {verdict(met['hit_rate'])} |",
            f"| hot TTFT p50 (settled) >= 3x lower | {m['hot_ttft_p50_lru_over_autopin']:.2f}x "
            f"({b['hot_ttft_p50_lru_over_autopin']:.2f}x) | {verdict(met['ttft'])} |",
            f"| output throughput >= LRU's | {m['output_throughput_autopin_over_lru']:.3f}x "
            f"({b['output_throughput_autopin_over_lru']:.3f}x) | {verdict(met['throughput'])} |",
            f"| (context) prompt throughput | {m['prompt_throughput_autopin_over_lru']:.3f}x "
            f"({b['prompt_throughput_autopin_over_lru']:.3f}x) | n/a |",
        ]
        runs = p["runs"]
        lru_tput = [x["prompt_throughput"] for x in runs["local_lru"]]
        auto_prefill = runs["index_autopin"][0]["num_prefill_tokens"]
        lru_prefill = runs["local_lru"][0]["num_prefill_tokens"]
        lines += [
            "",
            "Throughput is busy-time throughput on a shared machine: the local LRU's own runs "
            f"spread {num(min(lru_tput), 0)}-{num(max(lru_tput), 0)} prompt tok/s "
            f"({pct(max(lru_tput) / min(lru_tput) - 1)}) with the load. The deterministic "
            f"part: automatic pinning computes {pct(1 - auto_prefill / lru_prefill)} fewer "
            f"prefill tokens than LRU ({auto_prefill} vs {lru_prefill}), the most this trace "
            "can gain in throughput.",
        ]
    lines += _adaptive_lines(p)
    lines += ["", f"![pinning]({rel}/pinning.png)", ""]
    return lines


def num_or_na(stat: dict | None) -> str:
    return "n/a" if stat is None else f"{stat['median']:g}"


def _adaptive_lines(p: dict) -> list[str]:
    t = p.get("adaptive_targets")
    if not t:
        return []
    met = t["met"]
    fixed = t["fixed_hit_rate_settled"]
    return [
        "",
        "| target (budget that follows the demand, issue 34) | measured (median) | verdict |",
        "|---|---|---|",
        f"| settled hot prefix cached whole | {pct(t['adaptive_hit_rate_settled'])}"
        + (f" (fixed 10%: {pct(fixed)})" if fixed is not None else "")
        + f" | {verdict(met['whole_prefix'])} |",
        f"| preemptions no more than the local LRU's | {t['adaptive_preemptions']:g} vs "
        f"{t['lru_preemptions']:g} | {verdict(met['preemptions'])} |",
    ]


def budget_table(s: dict, title: str) -> list[str]:
    """Hit rate, prefill, preemptions and the final budget per policy, and the targets."""
    lines = [
        "",
        title,
        "",
        "| policy | hot prefix cached, settled | hot TTFT p50 ms, settled | prompt tok/s "
        "| prefill tokens computed | preemptions | pin budget (blocks) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in s["policies"].items():
        budget = a["counters"].get("pin_budget_blocks", "n/a")
        lines.append(
            f"| {PINNING_LABELS.get(name, name)} "
            f"| {pct(a['hot_hit_rate_settled']['median'])} "
            f"({pct(a['hot_hit_rate_settled']['best'])}) "
            f"| {num(a['hot_ttft_settled_p50_ms']['median'], 0)} "
            f"({num(a['hot_ttft_settled_p50_ms']['best'], 0)}) "
            f"| {num(a['prompt_throughput']['median'], 0)} "
            f"| {s['runs'][name][0]['num_prefill_tokens']} "
            f"| {num_or_na(a.get('num_preemptions'))} | {budget} |")
    return lines + _adaptive_lines(s)
