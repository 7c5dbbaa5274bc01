"""PNG plots of the paper's ablations (issue 34): parallel sampling's KV saving, the cost of
preemption by swap and by recompute across block sizes, and throughput / TTFT across block
sizes. Each is skipped when its section was not run."""

from __future__ import annotations

from pathlib import Path

from bench.plots import _save, plt


def plot_parallel_sampling(results: dict, out: Path) -> Path | None:
    """Saving by n, one line per workload, beside the paper's range for that workload."""
    p = results.get("parallel_sampling")
    if not p:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(sorted({r["workload"] for r in p["runs"]})):
        runs = sorted((r for r in p["runs"] if r["workload"] == name), key=lambda r: r["n"])
        color = f"C{i}"
        ax.plot([r["n"] for r in runs], [100 * r["saving"] for r in runs], "o-", color=color,
                label=f"{name} (ours)")
        if name in p["paper_saving"]:
            low, high = p["paper_saving"][name]
            ax.axhspan(100 * low, 100 * high, color=color, alpha=0.15,
                       label=f"{name.removesuffix('_like')} (paper, n = 2-6)")
    ax.set_xticks(sorted({r["n"] for r in p["runs"]}))
    ax.set_xlabel("samples per request (n)")
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_title("Parallel sampling: blocks saved over blocks unshared", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out / "parallel_sampling.png")


def plot_preemption(results: dict, out: Path) -> Path | None:
    """Per block size: ms to restore the same KV by swap (out + in) and by recompute (log
    scale), and output throughput under pressure for each mode against no pressure."""
    p = results.get("preemption")
    if not p:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    costs = p["block_costs"]
    sizes = [c["block_size"] for c in costs]
    axes[0].plot(sizes, [c["swap_out_ms"] + c["swap_in_ms"] for c in costs], "o-",
                 label="swap out + in (host memory)")
    axes[0].plot(sizes, [c["recompute_ms"] for c in costs], "s-", label="recompute (prefill)")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xticks(sizes, [str(b) for b in sizes])
    axes[0].set_xlabel("block size")
    axes[0].set_ylabel("ms")
    axes[0].set_title(f"Restoring {p['shape']['tokens']} tokens of KV", fontsize=10)
    axes[0].legend(fontsize=8)
    width = 0.27
    for i, mode in enumerate(("none", "recompute", "swap")):
        runs = [r for r in p["pressure"] if r["mode"] == mode]
        xs = [j + (i - 1) * width for j in range(len(runs))]
        axes[1].bar(xs, [r["output_throughput"] for r in runs], width,
                    label="no pressure" if mode == "none" else mode)
    axes[1].set_xticks(range(len(sizes)), [str(b) for b in sizes])
    axes[1].set_xlabel("block size")
    axes[1].set_ylabel("output tokens / s")
    axes[1].set_title("Under the same memory pressure", fontsize=10)
    axes[1].legend(fontsize=8)
    return _save(fig, out / "preemption.png")


def plot_block_sizes(results: dict, out: Path) -> Path | None:
    """Per block size: output throughput, TTFT p50 and KV utilization."""
    b = results.get("block_sizes")
    if not b:
        return None
    runs = b["best"]
    labels = [str(r["block_size"]) for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("output_throughput", "output tokens / s", 1),
              ("ttft_p50_ms", "TTFT p50 (ms)", 1),
              ("kv_utilization", "KV utilization (%)", 100)]
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        ax.bar(labels, [scale * r[key] for r in runs], color="tab:blue")
        ax.set_xlabel("block size")
        ax.set_title(title, fontsize=10)
    return _save(fig, out / "block_sizes.png")


ABLATION_PLOTS = (plot_parallel_sampling, plot_preemption, plot_block_sizes)
