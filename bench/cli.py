"""pagedgen-bench: one command for every benchmark. This module only dispatches: the first
argument names a command, the rest goes to that command's entry point unchanged; without a
command, `run` (every section of the main benchmark, bench/suite.py).

    pagedgen-bench [run] [--quick] [--skip ...] [--only ...]   the main benchmark
    pagedgen-bench router [--quick]     one section, merged into bench.json (= run --only router)
    pagedgen-bench step-loop --host-time                       a single-purpose benchmark
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    module: str  # whose main(argv) runs the command
    help: str
    leading_args: tuple[str, ...] = ()  # put before the user's arguments


# The sections that stand alone run through the suite (which merges them into bench.json).
SECTION_COMMANDS = {
    "memory": "KV memory: paged vs contiguous reservation (simulation, no model)",
    "prefix": "prefix caching: shared prefix on / off, zero-hit cost, a burst",
    "index": "prefix index overhead against the local LRU",
    "pinning": "pinning under pressure: four policies on a small pool",
    "beam": "beam search: blocks with and without sharing, against HF num_beams",
    "router": "the KV-aware router against its baselines on engine replicas",
}
COMMANDS = {
    "run": Command("bench.suite", "every section of the main benchmark (the default)"),
    **{name: Command("bench.suite", f"{text} (= run --only {name})", ("--only", name))
       for name, text in SECTION_COMMANDS.items()},
    "step-loop": Command("bench.step_loop", "host work per sequence per step"),
    "decode-step": Command("bench.decode_step", "where a decode step's time goes"),
    "front-overhead": Command("bench.front_overhead", "the gRPC front's CPU per token"),
    "linear": Command("bench.linear", "our packed linears against oneDNN"),
    "kernels": Command("bench.kernels", "paged attention and cache kernels"),
    "index-latency": Command("bench.prefix_index", "prefix index RPC latency and throughput"),
    "llamacpp": Command("bench.peers_llamacpp", "llama.cpp's batched bench on our model"),
    "compare": Command("bench.compare", "two bench.json side by side"),
    "random-checkpoint": Command("bench.random_checkpoint", "a random-weight checkpoint"),
    "http-vs-grpc": Command("bench.http_vs_grpc", "the HTTP API against gRPC"),
    "engine-restart": Command("bench.engine_restart", "pagedgen-engine's start and stop"),
    "structured-outputs": Command("bench.structured_outputs",
                                  "JSON replies valid with and without a schema, and the cost"),
    "grammar-cancel": Command("bench.grammar_cancel",
                              "a constrained request's wait behind a cancelled slow compile"),
    "prompt-scoring": Command("bench.prompt_scoring",
                              "prompts scored (prompt_logprobs) against HF's forward"),
    "model-decode": Command("bench.model_decode",
                            "batch-1 decode on a real model's shape (Qwen3-0.6B) against HF"),
}


def available() -> dict[str, Command]:
    """The commands whose module is in this checkout (one may land later than this table)."""
    return {name: c for name, c in COMMANDS.items() if importlib.util.find_spec(c.module)}


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedgen-bench",
        description="pagedgen-bench: one command for every benchmark; without a COMMAND, run.",
        epilog="`pagedgen-bench COMMAND --help` shows a command's own flags; bench/README.md "
        "has the method and history.")
    commands_group = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in commands.items():
        commands_group.add_parser(name, help=command.help, add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = available()
    if argv[:1] in (["-h"], ["--help"]):
        build_parser(commands).print_help()
        return
    if argv and argv[0] in commands:
        name, rest = argv[0], argv[1:]
    else:  # `pagedgen-bench --quick` and the like: the main benchmark, as it always was
        name, rest = "run", argv
    command = commands[name]
    importlib.import_module(command.module).main([*command.leading_args, *rest])


if __name__ == "__main__":
    main()
