"""PNG plots from a results dict (bench.json): throughput by peer against the roofline,
latency percentiles, KV memory, prefix caching, and a roofline chart. Each plot is skipped when
its section was not run."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def _with_dtypes(names: tuple[str, ...]) -> tuple[str, ...]:
    """Each peer in float32 (no suffix), then in bf16: the two dtypes side by side."""
    return tuple(f"{n}{sfx}" for sfx in ("", "_bf16") for n in names)


THROUGHPUT_PEERS = _with_dtypes(
    ("hf_generate_static", "hf_generate_batch", "engine_offline", "engine_grpc")
)
BATCH1_PEERS = _with_dtypes(("hf_generate_b1", "engine_offline_b1", "engine_grpc_b1"))
SERVING_PEERS = _with_dtypes(("engine_offline_serving", "engine_grpc_serving"))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, labels, values, title, ylabel):
    bars = ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(
            f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8
        )


def plot_throughput(results: dict, out: Path) -> Path | None:
    peers = results.get("peers", {})
    groups = [
        (
            [p for p in THROUGHPUT_PEERS if p in peers],
            "all requests at once",
            "compute_bound_tok_s",
        ),
        ([p for p in BATCH1_PEERS if p in peers], "batch 1", "batch1_bound_tok_s"),
    ]
    groups = [g for g in groups if g[0]]
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    roofline = results.get("roofline", {})
    for ax, (names, title, bound_key) in zip(axes[0], groups, strict=True):
        _bars(
            ax,
            names,
            [peers[n]["output_throughput"] for n in names],
            f"Output throughput, {title}",
            "output tokens / s",
        )
        if bound_key in roofline:
            bound = roofline[bound_key]
            ax.axhline(bound, color="tab:red", ls="--", lw=1, label=f"bound {bound:.0f}")
            ax.axhline(
                bound * (0.5 if "compute" in bound_key else 0.6),
                color="tab:orange",
                ls=":",
                lw=1,
                label="target",
            )
            ax.legend(fontsize=8)
    return _save(fig, out / "throughput.png")


def plot_latency(results: dict, out: Path) -> Path | None:
    peers = results.get("peers", {})
    names = [p for p in SERVING_PEERS + THROUGHPUT_PEERS if p in peers]
    if not names:
        return None
    metrics = ("ttft", "tpot", "itl", "e2el")
    fig, axes = plt.subplots(1, len(metrics), figsize=(16, 4))
    width = 0.8 / len(names)
    for ax, metric in zip(axes, metrics, strict=True):
        for i, name in enumerate(names):
            d = peers[name][metric]
            values = [d.get(f"p{q}_ms") or 0.0 for q in (50, 90, 99)]
            ax.bar([x + i * width for x in range(3)], values, width, label=name)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(3)], ["p50", "p90", "p99"])
        ax.set_title(metric.upper(), fontsize=10)
        ax.set_ylabel("ms")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    return _save(fig, out / "latency.png")


def plot_memory(results: dict, out: Path) -> Path | None:
    memory = results.get("memory")
    if not memory:
        return None
    runs = memory["runs"]
    labels = [
        f"paged bs{r['block_size']}" if r["allocator"] == "paged" else r["allocator"] for r in runs
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    _bars(
        axes[0],
        labels,
        [100 * r["utilization"] for r in runs],
        "KV utilization (real token slots / allocated)",
        "%",
    )
    _bars(
        axes[1],
        labels,
        [r["saturated_concurrent_seqs"] for r in runs],
        "Concurrent sequences while requests wait",
        "sequences",
    )
    for r, label in zip(runs, labels, strict=True):
        if label in ("paged bs16", "contiguous-max", "contiguous-oracle"):
            steps = [t[0] for t in r["trace"]]
            axes[2].plot(steps, [t[3] for t in r["trace"]], label=label, lw=1)
    axes[2].set_title("Running sequences over the run (same KV budget)", fontsize=10)
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=8)
    return _save(fig, out / "kv_memory.png")


def plot_prefix(results: dict, out: Path) -> Path | None:
    prefix = results.get("prefix")
    if not prefix:
        return None
    sp = prefix["shared_prefix"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    qs = ("p50", "p90", "p99")
    for i, (key, label) in enumerate((("uncached", "cache off"), ("cached", "cache on"))):
        values = [sp[key]["ttft"][f"{q}_ms"] for q in qs]
        axes[0].bar([x + i * 0.4 for x in range(3)], values, 0.4, label=label)
    axes[0].set_xticks([x + 0.2 for x in range(3)], qs)
    axes[0].set_ylabel("TTFT, ms")
    axes[0].set_title(f"Shared prefix: TTFT (p50 {sp['ttft_p50_speedup']:.1f}x lower)", fontsize=10)
    axes[0].legend(fontsize=8)
    _bars(
        axes[1],
        ["cache off", "cache on"],
        [sp["prefill_tokens_uncached"], sp["prefill_tokens_cached"]],
        f"Prefill tokens computed (hit rate {100 * sp['hit_rate']:.0f}%)",
        "tokens",
    )
    return _save(fig, out / "prefix_cache.png")


def plot_roofline(results: dict, out: Path) -> Path | None:
    peaks = results.get("peaks")
    peers = results.get("peers", {})
    points = [(n, e["roofline"]) for n, e in peers.items() if "roofline" in e]
    if not peaks or not points:
        return None
    flops, bw = peaks["matmul_flops"], peaks["read_bandwidth"]
    ridge = flops / bw
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [ridge / 100, ridge, ridge * 100]
    ax.plot(
        xs,
        [min(flops, x * bw) / 1e9 for x in xs],
        color="black",
        lw=1.5,
        label=f"roofline: {flops / 1e9:.0f} GFLOP/s, {bw / 1e9:.1f} GB/s",
    )
    if flops_bf16 := peaks.get("matmul_flops_bf16"):  # the roof a `_bf16` run reads against
        xs16 = [flops_bf16 / bw / 100, flops_bf16 / bw, flops_bf16 / bw * 100]
        ax.plot(xs16, [min(flops_bf16, x * bw) / 1e9 for x in xs16], color="gray", lw=1.2,
                ls="--", label=f"bf16 roofline: {flops_bf16 / 1e9:.0f} GFLOP/s")
    for i, (name, r) in enumerate(points):  # labels alternate sides: equal shapes overlap
        intensity = r["achieved_flops"] / r["achieved_bytes_per_s"]
        ax.scatter(intensity, r["achieved_flops"] / 1e9, s=30)
        ax.annotate(
            name,
            (intensity, r["achieved_flops"] / 1e9),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 4 if i % 2 else -10),
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (model FLOPs / byte moved)")
    ax.set_ylabel("achieved model GFLOP/s")
    ax.set_title("Roofline (this machine, measured in the same run)", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out / "roofline.png")


PINNING_LABELS = {
    "local_lru": "local LRU",
    "index_no_autopin": "index, auto pins off",
    "index_autopin": "index, shipped defaults",
    "index_explicit_pin": "index + PinPrefix",
}


def plot_pinning(results: dict, out: Path) -> Path | None:
    """Per hot visit, each policy's first run: share of the hot prefix cached, and TTFT."""
    pinning = results.get("pinning")
    if not pinning:
        return None
    warm_up = pinning["shape"]["warm_up_visits"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (policy, runs) in enumerate(pinning["runs"].items()):
        run = runs[0]
        label = PINNING_LABELS.get(policy, policy)
        visits = range(1, len(run["hot_hit_rate_per_visit"]) + 1)
        # Offset so equal lines stay visible.
        axes[0].plot(
            visits,
            [100 * x + 1.5 * i for x in run["hot_hit_rate_per_visit"]],
            marker="o",
            ms=3,
            lw=1,
            label=label,
        )
        axes[1].plot(visits, run["hot_ttft_per_visit_ms"], marker="o", ms=3, lw=1, label=label)
    for ax in axes:
        ax.axvline(warm_up + 0.5, color="grey", ls=":", lw=1)
        ax.set_xlabel("hot visit (dotted: end of warm-up)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("hot prefix cached, % (lines offset 1.5 pt apart)")
    axes[0].set_title("Hot prefix served from the cache", fontsize=10)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("TTFT, ms")
    axes[1].set_title("Hot request TTFT", fontsize=10)
    return _save(fig, out / "pinning.png")


def plot_beam(results: dict, out: Path) -> Path | None:
    """Peak KV blocks of one beam search request (shared / unshared / contiguous) by prompt
    length at the widest beam, and beam requests per second against HF by beam width."""
    beam = results.get("beam")
    if not beam:
        return None
    widest = max(beam["shape"]["memory_widths"])
    memory = sorted((m for m in beam["memory"] if m["beam_width"] == widest),
                    key=lambda m: m["prompt_len"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    kinds = [("shared_peak_blocks", "paged, shared (ours)", "tab:blue"),
             ("unshared_peak_blocks", "paged, no sharing", "tab:orange"),
             ("contiguous_blocks", "contiguous reservation", "tab:grey")]
    width = 0.27
    for i, (key, label, color) in enumerate(kinds):
        xs = [j + (i - 1) * width for j in range(len(memory))]
        values = [m[key] for m in memory]
        bars = axes[0].bar(xs, values, width, label=label, color=color)
        for bar, v in zip(bars, values, strict=True):
            axes[0].annotate(str(v), (bar.get_x() + bar.get_width() / 2, v), ha="center",
                             va="bottom", fontsize=7)
    axes[0].set_xticks(range(len(memory)), [f"prompt {m['prompt_len']}" for m in memory])
    axes[0].set_ylabel(f"peak KV blocks of {memory[0]['block_size']} tokens")
    axes[0].set_title(f"One beam search request, beam width {widest}, "
                      f"{beam['shape']['memory_max_tokens']} tokens", fontsize=10)
    axes[0].legend(fontsize=8)
    runs = {r["name"]: r for r in beam["throughput"]["runs"]}
    widths = beam["shape"]["throughput_widths"]
    peers = [("engine_beam_k{}", "engine (ours)", "tab:blue"),
             ("hf_generate_beam_k{}", "HF generate, one batch", "tab:orange"),
             ("hf_generate_beam_k{}_b1", "HF generate, one prompt at a time", "tab:grey")]
    for i, (pattern, label, color) in enumerate(peers):
        xs = [j + (i - 1) * width for j in range(len(widths))]
        values = [runs[pattern.format(k)]["requests_per_s"] for k in widths]
        axes[1].bar(xs, values, width, label=label, color=color)
    axes[1].set_xticks(range(len(widths)), [f"beam width {k}" for k in widths])
    axes[1].set_ylabel("beam search requests / s")
    axes[1].set_title(f"{beam['throughput']['workload']['num_requests']} requests, "
                      f"{beam['shape']['throughput_max_tokens']} tokens per beam", fontsize=10)
    axes[1].legend(fontsize=8)
    return _save(fig, out / "beam.png")


def plot_router(results: dict, out: Path) -> Path | None:
    """Per policy and scenario: hit rate, TTFT p50 / p99, and the replicas' shares."""
    router = results.get("router")
    if not router:
        return None
    bars = [(f"{scenario}\n{policy}", figures)
            for scenario, by_policy in router["policies"].items()
            for policy, figures in by_policy.items()]
    labels = [label for label, _ in bars]
    xs = range(len(bars))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _bars(axes[0], labels, [100 * f["hit_rate"] for _, f in bars], "Prefix-cache hit rate",
          "cached / prompt tokens, %")
    width = 0.4
    for i, q in enumerate(("p50", "p99")):
        axes[1].bar([x + i * width for x in xs], [f[f"ttft_{q}_ms"] for _, f in bars], width,
                    label=f"TTFT {q}")
    axes[1].set_xticks([x + width / 2 for x in xs], labels, rotation=20, ha="right", fontsize=8)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("ms")
    axes[1].set_title("Time to first token", fontsize=10)
    axes[1].legend(fontsize=8)
    bottoms = [0.0] * len(bars)
    for rank in range(max(len(f["replica_shares"]) for _, f in bars)):
        heights = [100 * f["replica_shares"][rank] if rank < len(f["replica_shares"]) else 0.0
                   for _, f in bars]
        axes[2].bar(xs, heights, bottom=bottoms, label=f"replica #{rank + 1}")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axes[2].set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    axes[2].set_ylabel("% of requests")
    axes[2].set_title("Share of each replica (largest first)", fontsize=10)
    axes[2].legend(fontsize=8)
    return _save(fig, out / "router.png")


def make_plots(results: dict, out: Path) -> list[Path]:
    from bench.plots_ablations import ABLATION_PLOTS

    plotters = (
        plot_throughput,
        plot_latency,
        plot_memory,
        plot_prefix,
        plot_roofline,
        plot_pinning,
        plot_beam,
        plot_router,
        *ABLATION_PLOTS,
    )
    return [path for plot in plotters if (path := plot(results, out)) is not None]
