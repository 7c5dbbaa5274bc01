"""Section: preemption by swap and by recompute across block sizes (issue 34, the paper's
Fig. 19): the cost per block of each, and throughput / TTFT under the same memory pressure.
The measuring is bench/preemption.py."""

from __future__ import annotations

from bench.harness import RunContext, log
from bench.report_format import num, taken_separately

PARTS = ("preemption",)
KEY = "preemption"


def run(ctx: RunContext) -> dict:
    from bench.preemption import FULL_SHAPE, QUICK_SHAPE, preemption_bench

    log("preemption: swap vs recompute per block, and under pressure, across block sizes")
    result = preemption_bench(ctx.make_engine, QUICK_SHAPE if ctx.quick else FULL_SHAPE,
                              ctx.seed, log=log)
    return {KEY: {**result, "dtype": ctx.dtypes[0]}}


def report(r: dict, rel: str) -> list[str]:
    return _report(r[KEY], rel) if KEY in r else []


def _report(p: dict, rel: str) -> list[str]:
    sh = p["shape"]
    lines = [
        "### Preemption: swap against recompute across block sizes (issue 34; the paper's "
        "Fig. 19)",
        "",
        *taken_separately(p),
        f"Cost per block: the same {sh['tokens']} tokens of KV preempted and restored at each "
        "block size, by the model runner's swap-out and swap-in of those blocks and by a "
        f"prefill of {sh['tokens']} tokens (recompute); medians of {sh['repeats']}, "
        f"{p['dtype']}. **On this CPU-only machine both pools are host memory: a swap is a copy "
        "within RAM, not a PCIe transfer**, so swap is far cheaper here than on a GPU and does "
        "not show the paper's penalty for small blocks (many small transfers). Run this "
        "section on a lent GPU for the paper's comparison.",
        "",
        "| block size | blocks | swap out ms | swap in ms | recompute ms | swap us / block "
        "| recompute us / block | recompute / swap |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in p["block_costs"]:
        swap = c["swap_out_ms"] + c["swap_in_ms"]
        lines.append(
            f"| {c['block_size']} | {c['num_blocks']} | {num(c['swap_out_ms'], 2)} "
            f"| {num(c['swap_in_ms'], 2)} | {num(c['recompute_ms'])} "
            f"| {num(c['swap_us_per_block'])} | {num(c['recompute_us_per_block'])} "
            f"| {c['recompute_ms'] / swap:.0f}x |"
        )
    lines += [
        "",
        f"Under pressure: {sh['num_requests']} requests ({sh['prompt_range'][0]}-"
        f"{sh['prompt_range'][1]}-token random prompts, {sh['output_len']} tokens each, EOS "
        "ignored) sent at once to a pool of "
        f"{100 * sh['pool_fraction']:.0f}% of their peak demand in tokens (the same memory at "
        "every block size), preempting by recompute and by swap, and to a pool that holds "
        "them all. One run each on a shared 2-core machine: read the throughput columns as "
        "noisy; the preemption counts are exact.",
        "",
        "| block size | pool | preemptions | output tok/s | TTFT p50 ms | TTFT p90 ms |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in p["pressure"]:
        pool = "all fit" if r["mode"] == "none" else f"{r['pool_tokens']} tokens, {r['mode']}"
        lines.append(
            f"| {r['block_size']} | {pool} | {r['num_preemptions']} "
            f"| {num(r['output_throughput'])} | {num(r['ttft_p50_ms'], 0)} "
            f"| {num(r['ttft_p90_ms'], 0)} |"
        )
    lines += ["", f"![preemption]({rel}/preemption.png)", ""]
    return lines
