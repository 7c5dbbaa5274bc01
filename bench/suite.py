"""pagedgen-bench run: every section of the main benchmark (issue #6), or some of them.

    pagedgen-bench                 # full run, SmolLM2-135M in float32 and bfloat16
    pagedgen-bench --quick         # smoke run, same sections, tiny sizes
    pagedgen-bench --model DIR --out DIR --skip hf,grpc
    pagedgen-bench --only pinning,index   # re-take sections, merged into <out>/bench.json
    pagedgen-bench --skip router,beam     # the rest re-taken; skipped sections kept from it

The sections, in bench/sections/: peers (roofline peaks, the decode-step split, our engine
offline and over gRPC, HF generate, llama.cpp: throughput at full concurrency and batch 1,
serving latency under Poisson arrivals), memory (KV memory simulation, paged vs contiguous),
prefix (prefix caching), index (prefix-index overhead), pinning (pinning under pressure, also
<out>/pinning.json), beam (beam search), router (the KV-aware router against its baselines,
every request in <out>/router.json). Writes <out>/bench.json, PNG plots and README_results.md:
bench/README_results.md for the default <out> (bench/results), <out>/README_results.md for any
other (a run elsewhere never overwrites the committed report).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
from dataclasses import asdict
from pathlib import Path

from bench.harness import DTYPE_SUFFIX, RunContext, workload_info
from bench.outputs import DEFAULT_OUT, carry_over, merge, write_outputs
from bench.sections import PART_NAMES, SECTIONS, STANDALONE


def build_parser(prog: str = "pagedgen-bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="2-3 minute smoke run")
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--skip", default="", help=f"comma-separated sections from {PART_NAMES}")
    p.add_argument(
        "--only",
        default="",
        help=f"comma-separated sections from {tuple(STANDALONE)}: run only these and merge "
        "them into <out>/bench.json (the other sections' figures are kept)",
    )
    p.add_argument("--rate", type=float, default=2.0, help="Poisson rate of the serving run")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="dtypes the engine and HF peers run in, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every peer, the gRPC server included (default: torch's)",
    )
    p.add_argument(
        "--router-shape",
        default="",
        help="the router section's shape with some fields replaced, e.g. "
        "num_engines=2,rate=2.0 (fields of bench.router.RouterShape)",
    )
    p.add_argument("--no-report", action="store_true", help="do not write README_results.md")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="re-render the plots and README_results.md from <out>/bench.json, run nothing",
    )
    return p


def main(argv: list[str] | None = None, prog: str = "pagedgen-bench") -> None:
    p = build_parser(prog)
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if unknown := skip - set(PART_NAMES):
        p.error(f"--skip takes sections from {PART_NAMES}, got {sorted(unknown)}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or set(dtypes) - set(DTYPE_SUFFIX):
        p.error(f"--dtypes takes dtypes from {tuple(DTYPE_SUFFIX)}, got {args.dtypes!r}")
    only = {s for s in args.only.split(",") if s}
    if unknown := only - set(STANDALONE):
        p.error(f"--only takes sections from {tuple(STANDALONE)}, got {sorted(unknown)}")
    if only and skip:
        p.error("--only and --skip do not go together")
    if only:
        skip = set(PART_NAMES) - only
    if args.out.resolve() == DEFAULT_OUT.parent:
        p.error(f"--out {args.out} is where the committed report lives; results go to "
                f"{DEFAULT_OUT} or a directory of their own")
    router_shape = None
    if args.router_shape and (args.render_only or "router" in skip):
        p.error("--router-shape shapes the router section, which this run does not take")
    if args.router_shape:
        from bench.router import shape_with
        from bench.sections.router import default_shape

        try:
            router_shape = shape_with(default_shape(args.quick), args.router_shape)
        except ValueError as error:
            p.error(str(error))
    if args.render_only:
        write_outputs(json.loads((args.out / "bench.json").read_text()), args.out)
        return
    logging.basicConfig(level=logging.WARNING)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the gRPC server subprocess
    if args.model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        args.model = str(ensure_default_model())
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(model=args.model, quick=args.quick, seed=args.seed, rate=args.rate,
                     dtypes=tuple(dtypes), skip=frozenset(skip), router_shape=router_shape)
    results = run_sections(ctx)
    command = _command(args, router_shape)
    if only:
        command += f" --only {','.join(sorted(only))}"
        results = merge(results, args.out / "bench.json", {STANDALONE[s].KEY for s in only},
                        command)
    else:
        results["meta"]["command"] = command + (f" --skip {args.skip}" if skip else "")
        skipped = {section.KEY for name, section in STANDALONE.items() if name in skip}
        results = carry_over(results, args.out / "bench.json", skipped)
    write_outputs(results, args.out, report=not args.no_report)


def run_sections(ctx: RunContext) -> dict:
    """Every section ctx does not skip, each through its one entry point, in report order."""
    from bench.metadata import machine_metadata
    from bench.roofline import model_cost

    results: dict = {"meta": machine_metadata(ctx.model), "sizes": asdict(ctx.sizes),
                     "dtypes": list(ctx.dtypes)}
    throughput, serving = ctx.throughput_workload(), ctx.serving_workload()
    results["workloads"] = {throughput.name: workload_info(throughput),
                            "batch1": workload_info(ctx.batch1_workload()),
                            serving.name: workload_info(serving)}
    results["model_cost"] = asdict(model_cost(ctx.model))
    results["model_cost_by_dtype"] = {
        d: asdict(model_cost(ctx.model, 2 if sfx else 4))
        for d, sfx in DTYPE_SUFFIX.items() if d in ctx.dtypes
    }
    for section in SECTIONS:
        if any(ctx.takes(part) for part in section.PARTS):
            results.update(section.run(ctx))
    results["meta"]["finished"] = machine_metadata(ctx.model, light=True)
    return results


def _command(args: argparse.Namespace, router_shape) -> str:
    """The command that reproduces this run, as the report shows it."""
    command = "pagedgen-bench" + (" --quick" if args.quick else "")
    if args.threads is not None:
        command += f" --threads {args.threads}"
    if router_shape is not None:
        changed = {name: getattr(router_shape, name) for name in
                   (part.partition("=")[0].strip() for part in args.router_shape.split(",")
                    if part.strip())}
        command += " --router-shape " + shlex.quote(
            ",".join(f"{name}={value}" for name, value in changed.items()))
    if args.out.resolve() != DEFAULT_OUT:
        command += f" --out {shlex.quote(str(args.out))}"
    return command
