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


ABLATION_PLOTS = (plot_parallel_sampling,)
