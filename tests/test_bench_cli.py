"""pagedgen-bench's command line only dispatches: each command reaches its module's entry
point with the user's arguments, the main benchmark is the default, and the sections stand on
their own (one entry point and one report fragment each, nothing from the command line)."""

import json
import shutil
from pathlib import Path

import pytest

from bench import cli
from bench.sections import SECTIONS

BENCH = Path(cli.__file__).resolve().parent


def test_every_command_reaches_a_main():
    import importlib

    commands = cli.available()
    assert {"run", "router", "pinning", "step-loop", "compare"} <= set(commands)
    for name, command in commands.items():
        assert callable(importlib.import_module(command.module).main), name


def test_help_lists_the_commands(capsys):
    cli.main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in cli.available())


def test_no_command_is_the_main_benchmark_and_a_section_command_is_its_only_run(
        tmp_path, capsys):
    """`pagedgen-bench --render-only` and `pagedgen-bench run --render-only` render the same
    report; a section command refuses what `--only` refuses, naming the flag."""
    for args in (["--render-only"], ["run", "--render-only"]):
        out = tmp_path / args[0].strip("-")
        shutil.copytree(BENCH / "results", out, ignore=shutil.ignore_patterns("*.png"))
        cli.main([*args, "--out", str(out)])
    assert (tmp_path / "render-only" / "README_results.md").read_text().replace(
        "render-only", "run") == (tmp_path / "run" / "README_results.md").read_text()
    with pytest.raises(SystemExit):
        cli.main(["router", "--skip", "beam"])
    assert "--only and --skip do not go together" in capsys.readouterr().err


def test_compare_through_the_dispatch(capsys):
    results = BENCH / "results"
    cli.main(["compare", str(results / "bench.json"), str(results / "xeon_amx" / "bench.json")])
    assert "| engine bf16 / engine fp32, 32 concurrent |" in capsys.readouterr().out


def test_sections_have_one_entry_point_and_their_own_fragment():
    committed = json.loads((BENCH / "results" / "bench.json").read_text())
    for section in SECTIONS:
        assert callable(section.run) and callable(section.report), section.__name__
        assert section.report({}, "bench/results") == [], section.__name__  # nothing taken
        fragment = section.report(committed, "bench/results")
        assert fragment and fragment[0].startswith("### "), section.__name__


def test_no_section_imports_the_command_line():
    for path in BENCH.rglob("*.py"):
        if path.name == "cli.py":
            continue
        text = path.read_text()
        assert "bench.cli" not in text and "from bench import cli" not in text, path
