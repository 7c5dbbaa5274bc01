"""The docs name the HTTP API's flags for every service that serves it: the engine's table in
README's Configuring section, the router's paragraph in docs/configuration.md (its flags come
from the same openai_api/cli_args) and pagedgen-stack's there, each a flag its real parser
has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from engine_service.tools import stack
from openai_api.cli_args import add_http_args

REPO = Path(__file__).resolve().parents[2]
WHERE = {"pagedgen-engine": REPO / "README.md", "pagedgen-router": REPO / "docs/configuration.md",
         "pagedgen-stack": REPO / "docs/configuration.md"}


def paragraph(script: str) -> str:
    """The part of the docs about `script`'s flags (its table or its paragraph)."""
    text = WHERE[script].read_text()
    start = text.index(f"**`{script}`**")
    end = min((i for i in (text.find("\n**`", start + 1), text.find("\n## ", start))
               if i != -1), default=len(text))
    return text[start:end]


def http_flags() -> list[str]:
    p = argparse.ArgumentParser(add_help=False)
    add_http_args(p, routed=True)
    return [flag for action in p._actions for flag in action.option_strings
            if flag.startswith("--")]


@pytest.mark.parametrize("script", ["pagedgen-engine", "pagedgen-router"])
def test_the_http_flags_are_named(script):
    text = paragraph(script)
    missing = [flag for flag in http_flags() if f"`{flag}`" not in text]
    assert not missing, f"{WHERE[script].name}'s {script} section does not name {missing}"


def test_the_stack_flags_named_are_its_own(capsys):
    text = paragraph("pagedgen-stack")
    named = set(re.findall(r"`(--[a-z-]+)", text))
    assert {"--http-port", "--api-key-file", "--api-key", "--insecure"} <= named
    with pytest.raises(SystemExit):
        stack.parse_args(["--help"])
    has = set(re.findall(r"(--[a-z-]+)", capsys.readouterr().out))
    assert named <= has, f"pagedgen-stack has no {sorted(named - has)}"
