"""Formatting shared by the report fragments of every section (bench/sections/*.py)."""

from __future__ import annotations

from pathlib import Path


def num(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**not met**")


def target_row(target: str, measured: str, ok: bool | None) -> str:
    """One row of a `| target | measured | verdict |` table."""
    return f"| {target} | {measured} | {verdict(ok)} |"


TARGET_HEADER = ["| target | measured | verdict |", "|---|---|---|"]


def load_average(values) -> str:
    return " / ".join(f"{x:.2f}" for x in values)


def taken_separately(section: dict) -> list[str]:
    """A section re-taken with `pagedgen-bench --only`: its own command, commit and load."""
    m = section.get("meta")
    if not m:
        return []
    return [
        f"Taken separately: `{m['command']}`, commit `{(m.get('git_commit') or '?')[:10]}`, "
        f"{m['time_utc']}; load average at start {load_average(m['load_average_1_5_15'])}, at "
        f"end {load_average(m.get('finished', {}).get('load_average_1_5_15', []))} "
        "(1 / 5 / 15 min).",
        "",
    ]


def repo_relative(out: Path) -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        return out.resolve().relative_to(root).as_posix()
    except ValueError:
        return out.as_posix()
