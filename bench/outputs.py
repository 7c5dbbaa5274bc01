"""Where a run's figures go: <out>/bench.json, the sections kept in files of their own, the
PNGs and README_results.md; and how a partial run (--skip, --only) combines with the bench.json
it replaces."""

from __future__ import annotations

import json
from pathlib import Path

from bench.harness import log, machine
from bench.results_json import write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
# Sections also kept in a file of their own, <out>/<section>.json.
OWN_FILES = ("pinning", "router")
# Sections whose per-request records go only to the file of their own, not into bench.json:
# the router's are ~500 KB a run, and nothing rendered from bench.json reads them.
RECORDS_APART = {"router"}
RUN_META = ("time_utc", "load_average_1_5_15", "git_commit", "torch_num_threads")


def report_path(out: Path) -> Path:
    """Where the report of a run into `out` goes: beside the default results directory (the
    committed bench/README_results.md), inside any other."""
    if out.resolve() == DEFAULT_OUT:
        return DEFAULT_OUT.parent / "README_results.md"
    return out / "README_results.md"


def carry_over(taken: dict, path: Path, skipped_keys: set[str]) -> dict:
    """A run that skips standalone sections keeps their figures from the bench.json it
    replaces, each stamped with the run that took it (so `--skip router` re-takes the peers
    without losing a 25-minute section)."""
    if not path.exists():
        return taken
    previous = json.loads(path.read_text())
    old_meta = {k: previous.get("meta", {}).get(k) for k in (*RUN_META, "command")}
    for key in skipped_keys:
        if key in previous and key not in taken:
            kept = previous[key]
            taken[key] = kept if "meta" in kept else kept | {"meta": old_meta}
    return taken


def merge(taken: dict, path: Path, keys: set[str], command: str) -> dict:
    """The sections just taken, each stamped with its own run's metadata, over the figures
    already in bench.json (a fresh file when there is none)."""
    merged = (
        json.loads(path.read_text())
        if path.exists()
        else {k: taken[k] for k in ("meta", "sizes", "workloads", "model_cost")}
    )
    meta = {k: taken["meta"][k] for k in (*RUN_META, "finished") if k in taken["meta"]}
    meta["machine"] = machine(taken["meta"])
    for key in keys:
        merged[key] = taken[key] | {"meta": meta | {"command": command}}
    merged.setdefault("meta", taken["meta"]).setdefault("command", command)
    return merged


def write_outputs(results: dict, out: Path, report: bool = True) -> None:
    from bench.plots import make_plots

    path = out / "bench.json"
    write_results(path, {key: _without_records(key, value) for key, value in results.items()})
    log(f"wrote {path}")
    for section in OWN_FILES:
        if section not in results:
            continue
        if section in RECORDS_APART and _records_left_out(results[section]):
            continue  # carried over from bench.json: its records are in the file already
        # Taken by this run (no meta of its own), or stamped with the machine that took it.
        own = results[section].get("meta")
        section_machine = own.get("machine") if own is not None else machine(results["meta"])
        if section_machine is None:  # carried over from a run that did not stamp its
            continue  # machine: the file of its own already says which one took it
        path = out / f"{section}.json"
        write_results(path, results[section] | {"machine": section_machine})
        log(f"wrote {path}")
    for png in make_plots(results, out):
        log(f"wrote {png}")
    if report:
        from bench.report import render_report

        md = report_path(out)
        text = render_report(results, out)
        md.write_text(text)
        log(f"wrote {md}")
        # The targets table on the console too: the one thing to read after a run.
        start = text.find("### Targets")
        print(text[start : text.find("###", start + 3)], flush=True)


def _runs_of(section: dict) -> list[dict]:
    by_scenario = section.get("runs")
    if not isinstance(by_scenario, dict):
        return []
    return [run for by_policy in by_scenario.values() for runs in by_policy.values()
            for run in runs]


def _records_left_out(section: dict) -> bool:
    runs = _runs_of(section)
    return bool(runs) and not any("requests" in run for run in runs)


def _without_records(key: str, value):
    """A section of RECORDS_APART with each run's summary kept, its "requests" left out."""
    if key not in RECORDS_APART or not any("requests" in run for run in _runs_of(value)):
        return value
    runs = {scenario: {policy: [{k: v for k, v in run.items() if k != "requests"}
                                for run in runs]
                       for policy, runs in by_policy.items()}
            for scenario, by_policy in value["runs"].items()}
    return value | {"runs": runs}
