"""The README results section, rendered from bench.json: tables, plot links, the command that
reproduces them, and each target of issue #6 next to the measured figure (met or not)."""

from __future__ import annotations

from pathlib import Path


def _f(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**not met**")


def _peer_table(peers: dict, names: list[str]) -> list[str]:
    rows = [
        "| peer | output tok/s | total tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 ms "
        "| ITL p50 / p99 ms | E2E p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        if n not in peers:
            continue
        e = peers[n]
        rows.append(
            f"| {n} | {_f(e['output_throughput'])} | {_f(e['total_token_throughput'])} "
            f"| {_f(e['request_throughput'], 2)} "
            f"| {_f(e['ttft']['p50_ms'], 0)} / {_f(e['ttft']['p99_ms'], 0)} "
            f"| {_f(e['tpot']['p50_ms'])} | {_f(e['itl']['p50_ms'])} / {_f(e['itl']['p99_ms'])} "
            f"| {_f(e['e2el']['p50_ms'], 0)} |"
        )
    return rows


def _targets(r: dict) -> list[str]:
    peers, ratios = r.get("peers", {}), r.get("ratios", {})
    roof = r.get("roofline", {})
    rows = ["| target | measured | verdict |", "|---|---|---|"]

    def add(target: str, measured: str, ok: bool | None) -> None:
        rows.append(f"| {target} | {measured} | {_verdict(ok)} |")

    eng = peers.get("engine_offline", {}).get("output_throughput")
    if eng is not None and "compute_bound_tok_s" in roof:
        frac = eng / roof["compute_bound_tok_s"]
        add(
            "output tok/s at full concurrency >= 50% of compute roofline",
            f"{_f(eng)} tok/s = {_pct(frac)} of {_f(roof['compute_bound_tok_s'], 0)}",
            frac >= 0.5,
        )
    roof_entry = peers.get("engine_offline", {}).get("roofline")
    if eng is not None and roof_entry and roof_entry["flops_fraction"] > 0:
        # The bound above counts no prompt work; this workload's prompts cost FLOPs too.
        bound = eng / roof_entry["flops_fraction"]
        add(
            "(context) compute bound for this workload's output tokens, prompt FLOPs included",
            f"{_f(bound, 0)} tok/s; engine at {_pct(roof_entry['flops_fraction'])} of it",
            None,
        )
    for peer, goal in (("hf_generate_static", 4), ("hf_generate_batch", 6)):
        key = f"engine_offline/{peer}"
        if key in ratios:
            add(f">= {goal}x {peer}", f"{_f(ratios[key], 2)}x", ratios[key] >= goal)
    b1 = peers.get("engine_offline_b1", {}).get("output_throughput")
    if b1 is not None and "batch1_bound_tok_s" in roof:
        frac = b1 / roof["batch1_bound_tok_s"]
        add(
            "batch 1 >= 60% of weights-over-bandwidth bound",
            f"{_f(b1)} tok/s = {_pct(frac)} of {_f(roof['batch1_bound_tok_s'])}",
            frac >= 0.6,
        )
    mem = r.get("memory")
    if mem:
        runs = mem["runs"]
        paged16 = next(
            (x for x in runs if x["allocator"] == "paged" and x["block_size"] == 16), None
        )
        cmax = next((x for x in runs if x["allocator"] == "contiguous-max"), None)
        if paged16:
            add(
                "KV utilization >= 98% (paged, block 16, simulation)",
                _pct(paged16["utilization"]),
                paged16["utilization"] >= 0.98,
            )
        real = peers.get("engine_offline", {}).get("kv_utilization")
        if real is not None:
            add("KV utilization >= 98% (paged, real model run, block 16)", _pct(real), real >= 0.98)
        if paged16 and cmax:
            ratio = paged16["saturated_concurrent_seqs"] / cmax["saturated_concurrent_seqs"]
            add(
                ">= 3x concurrent sequences vs contiguous max-length reservation",
                f"{_f(ratio, 2)}x ({_f(paged16['saturated_concurrent_seqs'])} vs "
                f"{_f(cmax['saturated_concurrent_seqs'])})",
                ratio >= 3,
            )
    prefix = r.get("prefix")
    if prefix:
        sp = prefix["shared_prefix"]
        add(
            "shared prefix: TTFT p50 >= 5x lower with the cache",
            f"{_f(sp['ttft_p50_speedup'], 2)}x",
            sp["ttft_p50_speedup"] >= 5,
        )
        zero = prefix["zero_hit"]
        cost = zero["throughput_cost_fraction"]
        spreads = [
            (max(runs) - min(runs)) / max(runs)
            for runs in (zero["output_throughput_cache_on"], zero["output_throughput_cache_off"])
            if len(runs) > 1
        ]
        noise = f" (run-to-run spread of one side: up to {_pct(max(spreads))})" if spreads else ""
        add("< 2% throughput cost at 0% hits", _pct(cost) + noise, cost < 0.02)
    return rows


def engine_vs_llamacpp(r: dict, run: dict) -> tuple[float, float] | None:
    """(ours, llama.cpp's) output tok/s for one llama.cpp run of results `r`, as issue #13's
    targets compare them; None where our side is missing."""
    peers = r.get("peers", {})
    sfx = "_bf16" if run["dtype"] == "bf16" else ""
    if run["parallel"] == 1:
        # Decode speed against decode speed: ours from the time per output token (the
        # prompt's prefill is not in it), theirs from the batched bench's decode phase.
        tpot_ms = peers.get("engine_offline_b1" + sfx, {}).get("tpot", {}).get("mean_ms")
        return (1000 / tpot_ms, run["decode_tok_s"]) if tpot_ms else None
    # The whole job against the whole job: the requests' prompts processed and their outputs
    # decoded (llama.cpp's prompt + decode time), output tokens per second.
    mine = peers.get("engine_offline" + sfx, {}).get("output_throughput")
    if mine is None:
        return None
    outputs = run["parallel"] * run["output_len"]
    # (Results from before total_s was recorded: the two phases' times, which add up to
    # llama-batched-bench's total when prompts are not shared.)
    total_s = run.get("total_s") or (run["parallel"] * run["prompt_len"] / run["prompt_tok_s"]
                                     + outputs / run["decode_tok_s"])
    return mine, outputs / total_s


def _cpu_dtype_targets(r: dict) -> list[str]:
    """Issue #13's targets: bf16 against fp32, HF and llama.cpp in the same dtype."""
    peers, ratios, roof = r.get("peers", {}), r.get("ratios", {}), r.get("roofline", {})
    rows = ["| target | measured | verdict |", "|---|---|---|"]

    def add(target: str, measured: str, ok: bool | None) -> None:
        rows.append(f"| {target} | {measured} | {_verdict(ok)} |")

    for key, goal, what in (
        ("engine_offline_bf16/engine_offline", 2, "engine bf16 >= 2x engine fp32 (32 concurrent)"),
        ("engine_offline_bf16/hf_generate_static_bf16", 4, "engine bf16 >= 4x HF static bf16"),
        ("engine_offline/hf_generate_static", 4, "engine fp32 >= 4x HF static fp32"),
    ):
        if key in ratios:
            add(what, f"{_f(ratios[key], 2)}x", ratios[key] >= goal)
    eng = peers.get("engine_offline_bf16", {}).get("output_throughput")
    roof_entry = peers.get("engine_offline_bf16", {}).get("roofline")
    hf = peers.get("hf_generate_static_bf16", {}).get("output_throughput")
    if eng and hf and roof_entry and roof.get("compute_bound_tok_s_bf16"):
        # (Only where the run recorded a bf16 peak.) As for float32: the engine's output rate
        # over its fraction of the bf16 peak = the output rate at that peak with this
        # workload's FLOPs per output token, prompts included (roof's compute_bound_tok_s_bf16
        # counts no prompt work).
        bound = eng / roof_entry["flops_fraction"]
        add("(context) bf16 compute bound for this workload's output tokens, against 4x HF "
            "static bf16", f"{_f(bound, 0)} tok/s against {_f(4 * hf, 0)}; engine at "
            f"{_pct(roof_entry['flops_fraction'])} of it", None)
    b1 = peers.get("engine_offline_b1_bf16", {}).get("output_throughput")
    bound = roof.get("batch1_bound_tok_s_bf16")
    if b1 is not None and bound:
        add("batch 1 bf16 >= 60% of its weights-over-bandwidth bound",
            f"{_f(b1)} tok/s = {_pct(b1 / bound)} of {_f(bound)}", b1 / bound >= 0.6)
    llama = r.get("llamacpp", {})
    for run in llama.get("runs", []):
        pair = engine_vs_llamacpp(r, run)
        if pair is None:
            continue
        mine, theirs = pair
        if run["parallel"] == 1:
            add(f"engine {run['dtype']} decode >= 1.0x llama.cpp's at 1 sequence",
                f"{_f(mine / theirs, 2)}x ({_f(mine)} vs {_f(theirs)} tok/s)", mine >= theirs)
            continue
        add(f"engine {run['dtype']} >= 1.5x llama.cpp at {run['parallel']} concurrent requests "
            "(prompts + outputs)",
            f"{_f(mine / theirs, 2)}x ({_f(mine)} vs {_f(theirs)} output tok/s; llama.cpp "
            f"decode alone {_f(run['decode_tok_s'])})", mine >= 1.5 * theirs)
    if "skipped" in llama:
        add("llama.cpp peer", f"skipped: {llama['skipped']}", None)
    return rows


def _decode_split_table(r: dict) -> list[str]:
    rows = ["| dtype | batch | context | attention kernel | step ms | tok/s | matmul | attention "
            "| other |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for x in r.get("decode_step", []):
        s = x["split"]
        rows.append(
            f"| {x['dtype']} | {x['batch']} | {x['context']} | {x['kernel_backend']} | "
            f"{_f(s['step_ms'])} | {_f(s['tokens_per_s'])} | {_pct(s['matmul_frac'])} | "
            f"{_pct(s['attention_frac'])} | {_pct(s['other_frac'])} |"
        )
    return rows


def _fragmentation_note(workloads: dict, block_size: int) -> str:
    """What last-block fragmentation alone predicts: a sequence wastes (block_size - 1) / 2
    slots on average while it holds prompt + output / 2 tokens on average."""
    w = next((v for k, v in workloads.items() if k.startswith("fixed_random")), None)
    if not w:
        return ""
    mean_held = (w["num_prompt_tokens"] + w["num_output_tokens"] / 2) / w["num_requests"]
    expected = 1 - (block_size - 1) / 2 / mean_held
    return (
        f"Its sequences are short (on average {mean_held:.0f} tokens held), and last-block "
        f"fragmentation alone predicts {_pct(expected)}: the 98% target needs longer "
        "sequences (the ShareGPT-like simulation above) or smaller blocks."
    )


def _repo_relative(out: Path) -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        return out.resolve().relative_to(root).as_posix()
    except ValueError:
        return out.as_posix()


def render_report(r: dict, out: Path) -> str:
    meta = r["meta"]
    # Links relative to the repository root: this section is merged into the top README.
    rel = _repo_relative(out)
    peers = r.get("peers", {})
    lines = [
        "## Benchmark results",
        "",
        f"Reproduce (writes `{rel}/bench.json`, the PNGs and this section):",
        "",
        "```",
        meta.get("command", "pagedgen-bench"),
        "```",
        "",
        f"Machine: {meta['cpu']}, {meta['num_cpus']} CPUs, torch threads "
        f"{meta['torch_num_threads']}"
        + (f", bf16 linears on {meta['cpu_bf16_linear']}" if "cpu_bf16_linear" in meta else "")
        + f"; torch {meta['versions']['torch']}, transformers "
        f"{meta['versions']['transformers']}; commit `{(meta.get('git_commit') or '?')[:10]}`; "
        f"{meta['time_utc']}. Load average at start "
        f"{' / '.join(f'{x:.2f}' for x in meta['load_average_1_5_15'])}, at end "
        f"{' / '.join(f'{x:.2f}' for x in meta.get('finished', {}).get('load_average_1_5_15', []))}"
        " (1 / 5 / 15 min; the machine is shared, so figures move with the load).",
        f"Model: `{Path(meta['model']).name}` in {' and '.join(r.get('dtypes', ['float32']))} "
        "(peer names without a suffix are float32, `_bf16` bfloat16). Greedy, `ignore_eos`: "
        "every peer produces "
        "exactly the same number of tokens for the same prompts.",
        "",
        "### Targets (issue #6)",
        "",
        *_targets(r),
        "",
    ]
    if any(k.endswith("_bf16") for k in r.get("ratios", {})) or r.get("decode_step"):
        lines += ["### CPU dtypes (issue #13)", "", *_cpu_dtype_targets(r), ""]
    if r.get("decode_step"):
        lines += [
            "Where a decode step's time goes (each linear and attention call timed; other = "
            "norms, RoPE, activations, tensor building, sampling, scheduling):",
            "",
            *_decode_split_table(r),
            "",
        ]
    w = r.get("workloads", {})
    if peers:
        lines += [
            "### Throughput and latency, same prompts on every peer",
            "",
            "Workloads: "
            + "; ".join(
                f"`{k}` {v['num_requests']} requests, {v['num_prompt_tokens']} prompt / "
                f"{v['num_output_tokens']} output tokens"
                for k, v in w.items()
            )
            + ".",
            "",
            "All requests at once (offline) and batch 1:",
            "",
            *_peer_table(
                peers,
                [
                    f"{name}{sfx}"
                    for sfx in ("", "_bf16", "_fp16")
                    for name in (
                        "hf_generate_static",
                        "hf_generate_batch",
                        "engine_offline",
                        "engine_grpc",
                        "hf_generate_b1",
                        "engine_offline_b1",
                        "engine_grpc_b1",
                    )
                    if f"{name}{sfx}" in peers
                ],
            ),
            "",
            "Serving: ShareGPT-like lengths (scaled down for a CPU), Poisson arrivals:",
            "",
            *_peer_table(peers, [n for n in peers if "_serving" in n]),
            "",
            "Ratios of output throughput: "
            + ", ".join(f"{k} **{v:.2f}x**" for k, v in r.get("ratios", {}).items())
            + ".",
            "",
            f"![throughput]({rel}/throughput.png)",
            f"![latency]({rel}/latency.png)",
            "",
        ]
    if "peaks" in r:
        pk, roof, cost = r["peaks"], r["roofline"], r["model_cost"]
        bf16_peak = (f" and **{pk['matmul_flops_bf16'] / 1e9:.0f} GFLOP/s** in bf16 "
                     "(the peak a `_bf16` run reads against)" if pk.get("matmul_flops_bf16")
                     else "")
        small_pages = (f" on huge pages, {pk['read_bandwidth_small_pages'] / 1e9:.1f} GB/s on "
                       "4 KiB ones" if pk.get("read_bandwidth_small_pages") else "")
        lines += [
            "### Roofline",
            "",
            f"Measured in the same run: dense matmul **{pk['matmul_flops'] / 1e9:.0f} "
            f"GFLOP/s** in float32{bf16_peak} (best of {', '.join(pk['matmul_shapes'])}), "
            f"streaming read **{pk['read_bandwidth'] / 1e9:.1f} GB/s**{small_pages} (copy "
            f"{pk['copy_bandwidth'] / 1e9:.1f} GB/s). The model multiplies "
            f"{cost['matmul_params'] / 1e6:.1f} M weights per token "
            f"({2 * cost['matmul_params'] / 1e9:.2f} GFLOP) and reads "
            f"{cost['weight_bytes_per_step'] / 1e6:.0f} MB of weights per step: compute bound "
            f"**{roof['compute_bound_tok_s']:.0f} tok/s**, batch-1 bandwidth bound "
            f"**{roof['batch1_bound_tok_s']:.1f} tok/s**"
            + (f" (bf16: **{roof['compute_bound_tok_s_bf16']:.0f}** and "
               f"**{roof['batch1_bound_tok_s_bf16']:.1f} tok/s**)."
               if roof.get("compute_bound_tok_s_bf16") else "."),
            "",
            "| run | achieved GFLOP/s | of peak | achieved GB/s | of bandwidth |",
            "|---|---:|---:|---:|---:|",
        ]
        for n, e in peers.items():
            if "roofline" in e:
                x = e["roofline"]
                lines.append(
                    f"| {n} | {x['achieved_flops'] / 1e9:.1f} | {_pct(x['flops_fraction'])} "
                    f"| {x['achieved_bytes_per_s'] / 1e9:.2f} | {_pct(x['bandwidth_fraction'])} |"
                )
        lines += ["", f"![roofline]({rel}/roofline.png)", ""]
    if "memory" in r:
        m = r["memory"]
        lines += [
            "### KV memory: paged vs contiguous reservation",
            "",
            f"Simulation with the engine's real `BlockPool`, `KVCacheManager` and `Scheduler` "
            f"(no model), {m['workload']['num_requests']} ShareGPT-like requests all queued at "
            f"t=0, KV budget {m['budget_bytes'] / 2**30:.0f} GiB = {m['budget_slots']} token "
            f"slots of the model, max_model_len {m['max_model_len']}. Contiguous baselines "
            "reserve max_model_len (max), the next power of two (pow2) or the exact final length "
            "(oracle) per request; their external fragmentation is ignored (flatters them). "
            "The paper reports 20.4-38.2% utilization for such systems.",
            "",
            "| allocator | block | utilization | concurrent seqs while queue non-empty | peak "
            "| steps | preemptions |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for x in m["runs"]:
            lines.append(
                f"| {x['allocator']} | {x['block_size'] or '-'} | {_pct(x['utilization'])} "
                f"| {_f(x['saturated_concurrent_seqs'])} | {x['max_concurrent_seqs']} "
                f"| {x['num_steps']} | {x['num_preemptions']} |"
            )
        real = peers.get("engine_offline", {}).get("kv_utilization")
        if real is not None:
            lines += [
                "",
                f"Measured during the real `engine_offline` run (block 16): {_pct(real)} of "
                "allocated slots held a computed token. "
                + _fragmentation_note(r.get("workloads", {}), 16),
            ]
        lines += ["", f"![kv memory]({rel}/kv_memory.png)", ""]
    if "prefix" in r:
        sp, zero = r["prefix"]["shared_prefix"], r["prefix"]["zero_hit"]
        wl = r["sizes"]
        lines += [
            "### Prefix caching",
            "",
            *_taken_separately(r["prefix"]),
            f"Shared-prefix workload: {wl['prefix_tenants']} tenants x {wl['prefix_per_tenant']} "
            f"requests, a {wl['prefix_system_len']}-token system prompt + 16-48 token user turn, "
            f"{wl['prefix_output_len']} output tokens, each tenant its own `cache_salt`; "
            f"{wl['prefix_tenants']} requests in flight (closed loop), a fresh engine per "
            "configuration.",
            "",
            "| | TTFT p50 ms | TTFT p90 ms | prefill tokens computed | output tok/s |",
            "|---|---:|---:|---:|---:|",
            f"| cache off | {_f(sp['uncached']['ttft']['p50_ms'], 0)} "
            f"| {_f(sp['uncached']['ttft']['p90_ms'], 0)} | {sp['prefill_tokens_uncached']} "
            f"| {_f(sp['uncached']['output_throughput'])} |",
            f"| cache on | {_f(sp['cached']['ttft']['p50_ms'], 0)} "
            f"| {_f(sp['cached']['ttft']['p90_ms'], 0)} | {sp['prefill_tokens_cached']} "
            f"| {_f(sp['cached']['output_throughput'])} |",
            "",
            f"Hit rate {_pct(sp['hit_rate'])}; TTFT p50 **{sp['ttft_p50_speedup']:.1f}x** lower. "
            f"Zero hits (the throughput workload's unique prompts): output tok/s with the cache "
            f"{', '.join(_f(x) for x in zero['output_throughput_cache_on'])} vs without "
            f"{', '.join(_f(x) for x in zero['output_throughput_cache_off'])} "
            f"(best of each: cost **{_pct(zero['throughput_cost_fraction'])}**).",
            "",
            f"![prefix cache]({rel}/prefix_cache.png)",
            "",
        ]
        if "burst" in r["prefix"]:
            lines += _burst_lines(r["prefix"]["burst"], wl)
    if "index_overhead" in r:
        io = r["index_overhead"]
        link = io.get("link", {})
        lines += [
            "### Prefix index overhead",
            "",
            *_taken_separately(io),
            "Shared-prefix workload, prefix cache on, steered by the prefix index (Redis + "
            "index server on this machine, loopback gRPC) vs the engine's standalone local LRU:",
            "",
            "| policy | output tok/s | TTFT p50 ms |",
            "|---|---:|---:|",
            f"| local LRU | {_f(io['local']['output_throughput'])} "
            f"| {_f(io['local']['ttft']['p50_ms'], 0)} |",
            f"| prefix index | {_f(io['index']['output_throughput'])} "
            f"| {_f(io['index']['ttft']['p50_ms'], 0)} |",
            "",
            "Runs (alternating, best of each compared): local "
            + ", ".join(_f(x) for x in io.get("output_throughput_local", []))
            + " tok/s, index "
            + ", ".join(_f(x) for x in io.get("output_throughput_index", []))
            + f" tok/s. Throughput ratio index / local **{io['throughput_ratio']:.3f}**; link: "
            f"{link.get('applies', 'n/a')} Apply RPCs, {link.get('ops_sent', 'n/a')} ops, "
            f"{link.get('rpc_errors', 'n/a')} errors, degraded at end: "
            f"{link.get('degraded', 'n/a')}; mean RPC ms "
            + ", ".join(f"{k} {v:.2f}" for k, v in link.get("rpc_mean_ms", {}).items())
            + ".",
            "",
        ]
        if "meta" in io:  # issue #10: "no pressure", the index costs <= 1%
            import statistics

            local, index = io["output_throughput_local"], io["output_throughput_index"]
            spread = max(local) / min(local) - 1
            lines += [
                f"No pressure (issue #10): index / local LRU output throughput, best of each "
                f"**{io['throughput_ratio']:.3f}**, median of each "
                f"**{statistics.median(index) / statistics.median(local):.3f}** (target >= "
                f"0.99: {_verdict(io['throughput_ratio'] >= 0.99)} on the best-of; the local "
                f"LRU's own runs differ by {_pct(spread)}, so 1% is below this run's noise).",
                "",
            ]
    if "pinning" in r:
        lines += _pinning(r["pinning"], rel)
    if "beam" in r:
        lines += _beam(r["beam"], rel)
    if "router" in r:
        lines += _router(r["router"], rel)
    return "\n".join(lines) + "\n"


def _load(values) -> str:
    return " / ".join(f"{x:.2f}" for x in values)


def _taken_separately(section: dict) -> list[str]:
    """A section re-taken with `pagedgen-bench --only`: its own command, commit and load."""
    m = section.get("meta")
    if not m:
        return []
    return [
        f"Taken separately: `{m['command']}`, commit `{(m.get('git_commit') or '?')[:10]}`, "
        f"{m['time_utc']}; load average at start {_load(m['load_average_1_5_15'])}, at end "
        f"{_load(m.get('finished', {}).get('load_average_1_5_15', []))} (1 / 5 / 15 min).",
        "",
    ]


PINNING_LABELS = {
    "local_lru": "local LRU (no index)",
    "index_no_autopin": "index, automatic pins off (`--hot-threshold 0`)",
    "index_autopin": "index, shipped defaults (automatic pins)",
    "index_explicit_pin": "index, auto pins off + PinPrefix once",
}


def _pinning(p: dict, rel: str) -> list[str]:
    sh = p["shape"]
    pools = sh["num_blocks"] * sh["block_size"]
    cold = sh["cold_per_visit"] * sh["cold_blocks"]
    lines = [
        "### Pinning under pressure (issue #10)",
        "",
        *_taken_separately(p),
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
        f"{_load(p['load_average_start'])}, at end {_load(p['load_average_end'])}.",
        "",
        "| policy | hot prefix cached, all / settled | hot TTFT p50 / p99 ms, all "
        "| hot TTFT p50 / p99 ms, settled | output tok/s | prompt tok/s "
        "| prefill tokens computed | local evictions / forgets / index pins |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
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
            f"| {_pct(a['hot_hit_rate']['median'])} / {_pct(a['hot_hit_rate_settled']['median'])} "
            f"| {mb(a['hot_ttft_p50_ms'], lambda v: _f(v, 0))} / "
            f"{_f(a['hot_ttft_p99_ms']['median'], 0)} "
            f"| {mb(a['hot_ttft_settled_p50_ms'], lambda v: _f(v, 0))} / "
            f"{_f(a['hot_ttft_settled_p99_ms']['median'], 0)} "
            f"| {mb(a['output_throughput'], lambda v: _f(v, 2))} "
            f"| {mb(a['prompt_throughput'], lambda v: _f(v, 0))} "
            f"| {p['runs'][name][0]['num_prefill_tokens']} | {counts} |"
        )
    t = p.get("targets")
    if t:
        m, b, met = t["median"], t["best"], t["met"]
        lines += [
            "",
            "| target (automatic pinning vs local LRU) | measured: median (best) | verdict |",
            "|---|---|---|",
            f"| settled hot prefix cached >= 90% where LRU < 50% "
            f"| {_pct(m['autopin_hit_rate_settled'])} vs {_pct(m['lru_hit_rate_settled'])} "
            f"| {_verdict(met['hit_rate'])} |",
            f"| hot TTFT p50 (settled) >= 3x lower | {m['hot_ttft_p50_lru_over_autopin']:.2f}x "
            f"({b['hot_ttft_p50_lru_over_autopin']:.2f}x) | {_verdict(met['ttft'])} |",
            f"| output throughput >= LRU's | {m['output_throughput_autopin_over_lru']:.3f}x "
            f"({b['output_throughput_autopin_over_lru']:.3f}x) | {_verdict(met['throughput'])} |",
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
            f"spread {_f(min(lru_tput), 0)}-{_f(max(lru_tput), 0)} prompt tok/s "
            f"({_pct(max(lru_tput) / min(lru_tput) - 1)}) with the load. The deterministic "
            f"part: automatic pinning computes {_pct(1 - auto_prefill / lru_prefill)} fewer "
            f"prefill tokens than LRU ({auto_prefill} vs {lru_prefill}), the most this trace "
            "can gain in throughput.",
        ]
    lines += ["", f"![pinning]({rel}/pinning.png)", ""]
    return lines


def _beam(b: dict, rel: str) -> list[str]:
    sh, t = b["shape"], b["targets"]
    widest, longest = max(sh["memory_widths"]), max(sh["memory_prompt_lens"])
    lines = [
        "### Beam search (issue #14)",
        "",
        *_taken_separately(b),
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
            f"| {_pct(1 - 1 / ratio)} | {m['worst_case_blocks']} |"
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
                f"| {'-' if same is None else _pct(same)} |"
            )
    lines += [
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
        f"| >= 2x fewer blocks than without sharing at beam width {widest}, {longest}-token "
        f"prompt | {t['blocks_unshared_over_shared']:.2f}x (contiguous / shared "
        f"{t['blocks_contiguous_over_shared']:.2f}x) | {_verdict(t['met']['blocks'])} |",
        f"| faster than HF generate(num_beams) | {t['min_speedup_vs_hf_batched']:.2f}x its "
        f"one-batch throughput (worst width) | {_verdict(t['met']['throughput'])} |",
        "",
        f"![beam search]({rel}/beam.png)",
        "",
    ]
    return lines


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
            f"| {name} | {_pct(a['hit_rate'])} | {_f(a.get('prefill_tokens'), 0)} "
            f"| {_f(a['ttft_p50_ms'], 0)} / {_f(a['ttft_p99_ms'], 0)} "
            f"| {_f(a.get('ttft_settled_p50_ms'), 0)} / {_f(a.get('ttft_settled_p99_ms'), 0)} "
            f"| {_f(a['e2el_p50_ms'], 0)} / {_f(a['e2el_p99_ms'], 0)} "
            f"| {_f(a['output_throughput'], 2)} | {_shares(a['replica_shares'])} "
            f"| {_f(a['route_p50_ms'], 2)} / {_f(a['route_p99_ms'], 1)} "
            f"| {sum(a['num_preemptions'])} | {a['num_errors']} |"
        )
    return rows


def _router(x: dict, rel: str) -> list[str]:
    sh, t, o = x["shape"], x["targets"], x["overhead"]
    f, met = t["figures"], t["met"]
    runs = "one run" if sh["repeats"] == 1 else f"{sh['repeats']} runs, alternating, median"
    if sh.get("hot_workloads", 1) > 1:
        runs += (f" (hot: one on each of {sh['hot_workloads']} workloads, other requests and "
                 "arrivals each)")
    lines = [
        "### KV-aware router (issue #11)",
        "",
        *_taken_separately(x),
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
        f"{_pct(sh['system_prompt_len'] / (sh['system_prompt_len'] + sh['user_len']))}: the "
        "user turns are never cached); output tok/s from first send to last token (in an open "
        "loop it equals the offered load while a policy keeps up); replica shares: requests "
        "routed to each replica, largest first; route latency: the router's "
        "`pagedgen_router_route_seconds` (arrival to the upstream call: hashing, the longest "
        "held prefix per replica from the router's copy of the index's residency view, or a "
        "Lookup while the copy is not synced, choice), p50 / p99 interpolated in its buckets; "
        "after warm-up: TTFT of the requests "
        f"after the first {sh.get('warm_up_requests', 0)} (sent while the caches are empty). "
        "Load average at start "
        f"{_load(x['load_average_start'])}, at end {_load(x['load_average_end'])}.",
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
                *(f"| {name} | {p['num_requests']} | {_f(p['ttft_p50_ms'], 0)} "
                  f"| {_f(p['ttft_p99_ms'], 0)} | {_f(p['ttft_settled_p99_ms'], 0)} "
                  f"| {_f(p.get('tenant0_ttft_p99_ms'), 0)} "
                  f"| {_f(p.get('other_tenants_ttft_p99_ms'), 0)} |"
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
            cells = [_pct(runs[n][0]["tenant_hit_rates"].get(key)) for n in names]
            lines.append(f"| {tenant} | {count} | " + " | ".join(cells) + " |")
        lines.append("")
    tol = t["no_worse_tolerance"]
    rows = [
        "| target | measured | verdict |",
        "|---|---|---|",
        f"| kv-aware hit rate >= 2x round-robin's | {_f(f['hit_rate_kv_over_rr'], 2)}x "
        f"| {_verdict(met['hit_rate'])} |",
        f"| kv-aware TTFT p50 >= 2x lower than round-robin's | "
        f"{_f(f['ttft_p50_rr_over_kv'], 2)}x lower | {_verdict(met['ttft_p50'])} |",
        f"| kv-aware output throughput >= round-robin's (open loop: equal within "
        f"{100 * t.get('throughput_tolerance', 0):.0f}% when both keep up) "
        f"| {_f(f['throughput_kv_over_rr'], 4)}x | {_verdict(met['throughput'])} |",
        f"| balanced: kv-aware no worse than prefix-hash (hit rate, TTFT p50, throughput within "
        f"{100 * tol:.0f}%) | hit rate {_f(f['balanced_hit_rate_kv_over_ph'], 2)}x, TTFT p50 "
        f"{_f(f['balanced_ttft_p50_ph_over_kv'], 2)}x lower, throughput "
        f"{_f(f['balanced_throughput_kv_over_ph'], 3)}x "
        f"| {_verdict(met['balanced_vs_prefix_hash'])} |",
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
            f"| {_f(f['hot_ttft_p99_ph_over_kv'], 2)}x lower{within} (after warm-up "
            f"{_f(f.get('hot_ttft_settled_p99_ph_over_kv'), 2)}x; p50 "
            f"{_f(f['hot_ttft_p50_ph_over_kv'], 2)}x{each}) | {_verdict(met['hot_ttft_p99'])} |"
        )
    if "hot_ttft_p99_phb_over_kv" in f:
        interval = f.get("hot_ttft_p99_phb_over_kv_interval")
        level = f.get("hot_ttft_p99_interval_level", 0.9)
        within = (f", {level:.0%} interval {interval[0]:.2f}x-{interval[1]:.2f}x (better: above 1)"
                  if interval else ", no interval (fewer than 5 workloads, or none drawn)")
        rows.append(
            f"| (context, not a target) hot prefix: kv-aware TTFT p99 against "
            f"prefix-hash-bounded's (the same hashing under kv-aware's load cap) "
            f"| {_f(f['hot_ttft_p99_phb_over_kv'], 2)}x lower{within} (after warm-up "
            f"{_f(f.get('hot_ttft_settled_p99_phb_over_kv'), 2)}x) | n/a |")
    rows += [
        f"| routing adds < 2 ms p50 per request (kv-aware, under the balanced load) "
        f"| {_f(f['route_p50_ms'], 2)} ms | {_verdict(met['route_latency'])} |",
        f"| (context) route latency with idle replicas, one request at a time "
        f"| p50 {_f(o.get('route_p50_ms'), 2)} ms, p99 {_f(o.get('route_p99_ms'), 2)} ms | n/a |",
        f"| (context) TTFT through the router vs straight to a replica, idle, "
        f"{o['prompt_len']}-token prompts, {o['pairs']} pairs | {_f(o['ttft_router_p50_ms'], 1)} "
        f"vs {_f(o['ttft_direct_p50_ms'], 1)} ms p50; added p50 {_f(o['added_p50_ms'], 2)} ms, "
        f"mean {_f(o['added_mean_ms'], 2)} ms | n/a |",
    ]
    return lines + rows + ["", f"![router]({rel}/router.png)", ""]


def _burst_lines(burst: dict, wl: dict) -> list[str]:
    """The prefix section's burst: deferring a request whose prefix is being computed."""
    on, off = burst["deferred"], burst["not_deferred"]

    def row(name: str, summary: dict, prefill: int) -> str:
        return (f"| {name} | {_f(summary['ttft']['p50_ms'], 0)} | "
                f"{_f(summary['ttft']['p99_ms'], 0)} | {prefill} | "
                f"{_f(summary['output_throughput'])} |")

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
        f"{', '.join(_f(x) for x in burst['output_throughput_deferred'])}, not deferred "
        f"{', '.join(_f(x) for x in burst['output_throughput_not_deferred'])}.",
        "",
    ]
