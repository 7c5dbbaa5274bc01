"""Two `pagedgen-bench` results side by side, e.g. from two machines: what each machine offers
(matmul peaks, read bandwidth, which bf16 kernel), the engine's throughput ratios to its
peers, and where a decode step's time goes, so a ratio that moves between machines is read
next to what moved under it.

    python -m bench.compare bench/results/bench.json bench/results/xeon_amx/bench.json

Prints a markdown table; `--out FILE` writes it too. Ratios are those of each run's own
results (`ratios`, and the engine over llama.cpp where both ran): nothing is re-measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.sections.peers import engine_vs_llamacpp

# (key in a run's `ratios`, what it compares)
ENGINE_RATIOS = (
    ("engine_offline_bf16/engine_offline", "engine bf16 / engine fp32, 32 concurrent"),
    ("engine_offline/hf_generate_static", "engine fp32 / HF static fp32"),
    ("engine_offline_bf16/hf_generate_static_bf16", "engine bf16 / HF static bf16"),
    ("engine_offline/hf_generate_batch", "engine fp32 / HF generate_batch fp32"),
    ("engine_offline_b1/hf_generate_b1", "engine fp32 / HF, batch 1"),
    ("engine_offline_b1_bf16/hf_generate_b1_bf16", "engine bf16 / HF bf16, batch 1"),
)


def _llamacpp_ratio(run: dict, dtype: str, parallel: int) -> float | None:
    """Ours over llama.cpp's, as the report reads them (bench.report.engine_vs_llamacpp)."""
    runs = (run.get("llamacpp") or {}).get("runs", [])
    match = next((r for r in runs if r["dtype"] == dtype and r["parallel"] == parallel), None)
    pair = None if match is None else engine_vs_llamacpp(run, match)
    return None if pair is None else pair[0] / pair[1]


def _fmt(value: float | None, unit: str = "x") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}"


def rows(runs: list[dict]) -> list[tuple[str, list[str]]]:
    table: list[tuple[str, list[str]]] = []

    def add(name: str, values: list[str]) -> None:
        table.append((name, values))

    add("CPU", [r["meta"]["cpu"] for r in runs])
    add("bf16 linears", [r["meta"].get("cpu_bf16_linear", "(not recorded)") for r in runs])
    add("commit", [f"`{(r['meta'].get('git_commit') or '?')[:10]}`" for r in runs])
    add("matmul peak fp32 / bf16, GFLOP/s", [
        f"{r['peaks']['matmul_flops'] / 1e9:.0f} / "
        f"{r['peaks'].get('matmul_flops_bf16', float('nan')) / 1e9:.0f}" for r in runs])
    add("streaming read, GB/s", [f"{r['peaks']['read_bandwidth'] / 1e9:.1f}" for r in runs])
    for key, label in ENGINE_RATIOS:
        add(label, [_fmt(r.get("ratios", {}).get(key)) for r in runs])
    for dtype, parallel, label in (("f32", 32, "engine / llama.cpp fp32, 32 concurrent"),
                                   ("bf16", 32, "engine / llama.cpp bf16, 32 concurrent"),
                                   ("f32", 1, "engine / llama.cpp fp32 decode, 1 sequence"),
                                   ("bf16", 1, "engine / llama.cpp bf16 decode, 1 sequence")):
        add(label, [_fmt(_llamacpp_ratio(r, dtype, parallel)) for r in runs])
    steps = {}
    for i, r in enumerate(runs):
        for s in r.get("decode_step", []):
            steps.setdefault((s["dtype"], s["batch"]), {})[i] = s["split"]
    for (dtype, batch), by_run in sorted(steps.items()):
        add(f"decode step {dtype} batch {batch}: ms (matmul / attention / other %)", [
            f"{by_run[i]['step_ms']:.1f} ({by_run[i]['matmul_frac']:.0%} / "
            f"{by_run[i]['attention_frac']:.0%} / {by_run[i]['other_frac']:.0%})"
            if i in by_run else "-" for i in range(len(runs))])
    return table


def markdown(paths: list[Path], runs: list[dict]) -> str:
    table = rows(runs)
    lines = ["| | " + " | ".join(f"`{p}`" for p in paths) + " |",
             "|---|" + "---:|" * len(paths)]
    lines += [f"| {name} | " + " | ".join(values) + " |" for name, values in table]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compare",
                                description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="bench.json files")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    runs = []
    for path in args.results:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            p.error(f"results {path}: {error}")
        if not isinstance(run, dict) or not isinstance(run.get("meta"), dict):
            p.error(f"results {path}: not a pagedgen-bench bench.json")
        peaks = run.get("peaks") or {}
        if "matmul_flops" not in peaks or "read_bandwidth" not in peaks:
            p.error(f"results {path}: no matmul peak or read bandwidth (run with --skip "
                    "roofline?): nothing to read its ratios against")
        run.setdefault("peers", {})
        runs.append(run)
    text = markdown(args.results, runs)
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
