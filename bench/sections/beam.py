"""Section: beam search (issue #14): KV blocks held with block sharing against without, and
throughput against HF generate(num_beams). The measuring is bench/beam.py."""

from __future__ import annotations

from bench.harness import RunContext, log
from bench.report_format import pct, taken_separately, verdict

PARTS = ("beam",)
KEY = "beam"


def run(ctx: RunContext) -> dict:
    from bench.beam import FULL_SHAPE, QUICK_SHAPE, beam_search_bench

    log("beam search: blocks with and without sharing, throughput vs HF num_beams")
    return {KEY: beam_search_bench(ctx.model, QUICK_SHAPE if ctx.quick else FULL_SHAPE,
                                   ctx.seed, log=log)}


def report(r: dict, rel: str) -> list[str]:
    return _report(r[KEY], rel) if KEY in r else []


def _report(b: dict, rel: str) -> list[str]:
    sh, t = b["shape"], b["targets"]
    widest, longest = max(sh["memory_widths"]), max(sh["memory_prompt_lens"])
    lines = [
        "### Beam search (issue #14)",
        "",
        *taken_separately(b),
        f"KV blocks held at peak by one beam search request ({sh['memory_max_tokens']} tokens "
        "per beam, EOS masked so every beam runs the whole length, random-token prompts, "
        f"block size {b['memory'][0]['block_size']}, {b['dtype']}): the beams share every "
        "common block (copy-on-write), against the same beams with nothing shared and against "
        "a contiguous reservation of prompt + max_tokens per beam. Measured at each step's "
        "peak (the step's copies-on-write included).",
        "",
        "| prompt | beam width | shared (ours) | no sharing | contiguous | no sharing / shared "
        "| saving | worst case reserved |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in sorted(b["memory"], key=lambda m: (m["beam_width"], m["prompt_len"])):
        ratio = m["unshared_peak_blocks"] / m["shared_peak_blocks"]
        lines.append(
            f"| {m['prompt_len']} | {m['beam_width']} | {m['shared_peak_blocks']} "
            f"| {m['unshared_peak_blocks']} | {m['contiguous_blocks']} | {ratio:.2f}x "
            f"| {pct(1 - 1 / ratio)} | {m['worst_case_blocks']} |"
        )
    tp = b["throughput"]
    runs = {r["name"]: r for r in tp["runs"]}
    lines += [
        "",
        f"Throughput: {tp['workload']['num_requests']} prompts of 16-200 tokens "
        f"({tp['workload']['num_prompt_tokens']} prompt tokens), "
        f"{sh['throughput_max_tokens']} tokens per beam, EOS masked on both sides; our offline "
        "`LLM.beam_search` (one continuous batch) vs HF `generate(num_beams=k, "
        "do_sample=False)` on all prompts in one left-padded batch and one prompt at a time; "
        f"float32. Ours and HF's one-batch runs alternate, {sh.get('repeats', 1)}x each, best "
        "of each shown (every run, with the load when it started, is in bench.json).",
        "",
        "| beam width | peer | requests/s | beam tok/s | ours / peer | beams equal HF's (one at "
        "a time) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for k in sh["throughput_widths"]:
        for name in (f"engine_beam_k{k}", f"hf_generate_beam_k{k}", f"hf_generate_beam_k{k}_b1"):
            run = runs[name]
            ratio = tp["ratios"].get(f"engine_beam_k{k}/{name}")
            same = tp["matches_hf_b1"].get(str(k)) if name.startswith("engine") else None
            lines.append(
                f"| {k} | {name} | {run['requests_per_s']:.3f} | {run['beam_tokens_per_s']:.1f} "
                f"| {'-' if ratio is None else f'{ratio:.2f}x'} "
                f"| {'-' if same is None else pct(same)} |"
            )
    lines += [
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
        f"| >= 2x fewer blocks than without sharing at beam width {widest}, {longest}-token "
        f"prompt | {t['blocks_unshared_over_shared']:.2f}x (contiguous / shared "
        f"{t['blocks_contiguous_over_shared']:.2f}x) | {verdict(t['met']['blocks'])} |",
        f"| faster than HF generate(num_beams) | {t['min_speedup_vs_hf_batched']:.2f}x its "
        f"one-batch throughput (worst width) | {verdict(t['met']['throughput'])} |",
        "",
        f"![beam search]({rel}/beam.png)",
        "",
    ]
    return lines
