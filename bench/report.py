"""README_results.md, rendered from bench.json: the run's command and machine, issue #6's
targets (each section's rows), then each section's own fragment in order."""

from __future__ import annotations

from pathlib import Path

from bench.report_format import TARGET_HEADER, load_average, repo_relative
from bench.sections import SECTIONS


def render_report(r: dict, out: Path) -> str:
    meta = r["meta"]
    # Links relative to the repository root: this section is merged into the top README.
    rel = repo_relative(out)
    finished = meta.get("finished", {}).get("load_average_1_5_15", [])
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
        f"{load_average(meta['load_average_1_5_15'])}, at end {load_average(finished)}"
        " (1 / 5 / 15 min; the machine is shared, so figures move with the load).",
        f"Model: `{Path(meta['model']).name}` in {' and '.join(r.get('dtypes', ['float32']))} "
        "(peer names without a suffix are float32, `_bf16` bfloat16). Greedy, `ignore_eos`: "
        "every peer produces "
        "exactly the same number of tokens for the same prompts.",
        "",
        "### Targets (issue #6)",
        "",
        *TARGET_HEADER,
        *(row for section in SECTIONS if hasattr(section, "target_rows")
          for row in section.target_rows(r)),
        "",
    ]
    for section in SECTIONS:
        lines += section.report(r, rel)
    return "\n".join(lines) + "\n"
