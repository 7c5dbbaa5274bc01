"""The engine's steps on the 8B-shaped checkpoint: decode, mixed, and the offline workload.

    python -m bench.gpu_decode --model DIR --out DIR [--dry]

One engine (bench/gpu_common.ENGINE_SETTINGS, as served) runs, in this order:
- the fixed workload (bench/gpu_common.FIXED_WORKLOAD) through the offline API's engine loop,
  all 64 requests at once: output tokens per second, the figure the served run and the HF
  peer are read against (first: two targets need it, and a stage cut short by its time limit
  loses what comes last);
- decode at batch 1, 64 and 256 with 512-token prompts, and 1 and 64 with 4,096: the batch is
  prefilled, then 3 untimed and 20 timed pure decode steps. Per step: the whole step's wall
  time (schedule, upload, forward, sampling, the tokens back on the host: what a stream
  sees), and the CUDA graph replay's time alone (CUDA events around `replay`). Each step's
  bytes: the weights a forward reads plus the K/V of every sequence's context (summed from
  each sequence's length at that step);
- at batch 64 / 512, mixed steps: one new prompt of 256 (then 2,048) tokens arrives and its
  whole prompt runs in the same step as the 64 decodes (1 untimed, 5 timed); bytes as above
  plus the chunk's K/V written and read once, FLOPs of every token through the linears, the
  LM head's sampling rows and the attention pairs. Its forward's CUDA-event time is kept too,
  and the mixed-step graph's replay time (CUDA events around `replay`,
  engine_service/model/mixed_graphs.py). Each chunk size runs twice: through the graphs
  (the target's row) and then eagerly, the mixed graphs set aside (a row named "... eager"),
  so the two are read on the same GPU, engine and batch.
Ratios are taken in bench/gpu_summary.py against the limits measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from bench.gpu_common import (
    DRY_WORKLOAD,
    ENGINE_SETTINGS,
    FIXED_WORKLOAD,
    DecoderShape,
    StageReport,
    causal_pairs,
    failure,
    log,
    median,
)

CASES = ((1, 512), (64, 512), (256, 512), (1, 4096), (64, 4096))
DRY_CASES = ((1, 32), (4, 32))
# The cases the targets are set on (bench/gpu_summary.py reads the role), full and dry.
ROLES = {(1, 512): "batch1", (64, 512): "batch64", (1, 32): "batch1", (4, 32): "batch64"}
MIXED_AT = (64, 512)
DRY_MIXED_AT = (4, 32)
MIXED_CHUNKS = (256, 2048)
DRY_MIXED_CHUNKS = (16, 48)
WARM_STEPS = 3
TIMED_STEPS = 20
MIXED_REPEATS = 5
# Enough for the steps above plus the decode tokens early sequences make while later ones of
# the batch still prefill (at most batch x context / budget steps).
MAX_TOKENS = 512
TOKEN_LOW, TOKEN_HIGH = 100, 32000  # inside every vocabulary we run


class _TimedGraph:
    """A captured CUDA graph whose replays are bracketed by CUDA events."""

    def __init__(self, graph, sink: list) -> None:
        self.graph = graph
        self.sink = sink

    def replay(self) -> None:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.sink.append((start, end))

    def __getattr__(self, name: str):
        return getattr(self.graph, name)


class StepTimer:
    """CUDA events around every graph replay and every forward (runner.execute) of the
    engine's runner; `take()` returns the milliseconds since the last take (the step ended
    with a device-to-host copy, so its events have completed)."""

    def __init__(self, runner) -> None:
        self.on_cuda = runner.device.type == "cuda"
        self.replays: list = []
        self.forwards: list = []
        if not self.on_cuda:
            return
        for owner in (runner.decode_graphs, getattr(runner, "mixed_graphs", None)):
            graphs = getattr(owner, "graphs", None) or {}
            for size, graph in list(graphs.items()):
                graphs[size] = _TimedGraph(graph, self.replays)
        plain_execute = runner.execute

        def execute(scheduled):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            logits = plain_execute(scheduled)
            end.record()
            self.forwards.append((start, end))
            return logits

        runner.execute = execute  # an instance attribute: the engine calls it in place

    def take(self) -> tuple[float | None, float | None]:
        def total(events: list) -> float | None:
            if not events:
                return None
            events[-1][1].synchronize()  # in stream order: every earlier event is done too
            ms = sum(start.elapsed_time(end) for start, end in events)
            events.clear()
            return ms

        return total(self.replays), total(self.forwards)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


class Batch:
    """Requests the engine decodes, with the number of tokens each has produced."""

    def __init__(self, engine, tag: str, batch: int, context: int, rng: random.Random) -> None:
        from engine_service.model.sampling_params import SamplingParams

        self.engine = engine
        self.context = context
        self.generated: dict[str, int] = {}
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(batch):
            request_id = f"{tag}-{i}"
            engine.add_request(request_id, _prompt(rng, context), params)
            self.generated[request_id] = 0
        while not all(self.generated.values()):  # every prompt computed, one token out
            self.record(engine.step())

    def record(self, outputs) -> None:
        for out in outputs:
            if out.request_id in self.generated:
                self.generated[out.request_id] += len(out.outputs[0].token_ids_delta)

    def kv_tokens(self) -> int:
        """K/V entries the next decode step reads: each sequence's prompt and generated
        tokens (the newest one's K/V is written in that step, then read)."""
        return sum(self.context + g for g in self.generated.values())


def _step(engine, timer: StepTimer) -> dict:
    before = engine.num_computed_tokens
    t0 = time.perf_counter()
    outputs = engine.step()
    wall_ms = (time.perf_counter() - t0) * 1e3
    replay_ms, forward_ms = timer.take()
    return {"outputs": outputs, "wall_ms": wall_ms, "replay_ms": replay_ms,
            "forward_ms": forward_ms, "tokens": engine.num_computed_tokens - before}


def decode_case(engine, timer: StepTimer, shape: DecoderShape, batch: int, context: int,
                rng: random.Random) -> tuple[dict, Batch]:
    running = Batch(engine, f"decode-{batch}x{context}", batch, context, rng)
    steps = []
    for i in range(WARM_STEPS + TIMED_STEPS):
        kv_tokens = running.kv_tokens()
        step = _step(engine, timer)
        running.record(step.pop("outputs"))
        if i >= WARM_STEPS:
            steps.append({**step, "kv_tokens": kv_tokens})
    kv_tokens = sum(s["kv_tokens"] for s in steps) / len(steps)
    weights = shape.weight_bytes_read
    kv_bytes = kv_tokens * shape.kv_bytes_per_token
    replays = [s["replay_ms"] for s in steps if s["replay_ms"] is not None]
    return {
        "name": f"decode b{batch} ctx{context}",
        "role": ROLES.get((batch, context)),
        "batch": batch,
        "context": context,
        "mean_kv_tokens": kv_tokens,
        "pure_decode_steps": sum(s["tokens"] == batch for s in steps),
        "steps": len(steps),
        "wall_ms": [s["wall_ms"] for s in steps],
        "step_ms": median([s["wall_ms"] for s in steps]),
        "replay_ms": median(replays),
        "graph_steps": len(replays),
        "forward_event_ms": median([s["forward_ms"] for s in steps
                                    if s["forward_ms"] is not None]),
        "weight_bytes": weights,
        "kv_bytes": kv_bytes,
        "bytes": weights + kv_bytes,
        "flops": shape.forward_flops(batch, batch, kv_tokens),
    }, running


def mixed_case(engine, timer: StepTimer, shape: DecoderShape, running: Batch, chunk: int,
               rng: random.Random, graphs: bool = True) -> dict:
    """Steps of the running decodes plus one whole new prompt of `chunk` tokens (it samples
    its first token in that step and finishes: max_tokens=1). graphs=False: the mixed-step
    graphs set aside for these steps (they run eagerly; the decode graphs stay)."""
    from engine_service.model.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    batch = len(running.generated)
    steps = []
    runner = engine.runner
    mixed_graphs = getattr(runner, "mixed_graphs", None)
    if not graphs:
        runner.mixed_graphs = None
    mode = "graphs" if graphs else "eager"
    try:
        for i in range(1 + MIXED_REPEATS):
            engine.add_request(f"mixed-{chunk}-{mode}-{i}", _prompt(rng, chunk), params)
            kv_tokens = running.kv_tokens()
            step = _step(engine, timer)
            running.record(step.pop("outputs"))
            if i >= 1:
                steps.append({**step, "decode_kv_tokens": kv_tokens})
    finally:
        if mixed_graphs is not None:
            runner.mixed_graphs = mixed_graphs
    decode_kv = sum(s["decode_kv_tokens"] for s in steps) / len(steps)
    weights = shape.weight_bytes_read
    # The chunk's own K/V: written once, read once (its tiles read each key block again per
    # query tile, from L2 at best: the ideal counts it once).
    kv_bytes = (decode_kv + 2 * chunk) * shape.kv_bytes_per_token
    pairs = decode_kv + causal_pairs(chunk)
    replays = [s["replay_ms"] for s in steps if s["replay_ms"] is not None]
    return {
        "name": f"mixed {batch} decodes + {chunk} chunk" + ("" if graphs else " eager"),
        "mode": mode,
        "decodes": batch,
        "chunk": chunk,
        "expected_tokens": batch + chunk,
        "tokens": [s["tokens"] for s in steps],
        "wall_ms": [s["wall_ms"] for s in steps],
        "step_ms": median([s["wall_ms"] for s in steps]),
        "forward_event_ms": median([s["forward_ms"] for s in steps
                                    if s["forward_ms"] is not None]),
        "replay_ms": median(replays),
        "graph_steps": len(replays),
        "mean_decode_kv_tokens": decode_kv,
        "weight_bytes": weights,
        "kv_bytes": kv_bytes,
        "bytes": weights + kv_bytes,
        "flops": shape.forward_flops(batch + chunk, batch + 1, pairs),
    }


def offline_workload(engine, dry: bool) -> dict:
    from bench.metrics import summarize
    from bench.peers_engine import drive
    from bench.workloads import fixed_random

    spec = DRY_WORKLOAD if dry else FIXED_WORKLOAD
    workload = fixed_random(**spec)
    run = drive(engine, workload, "offline", track_kv=False, progress=False)
    summary = summarize(run.records, run.duration_s)
    return {"workload": spec, "duration_s": run.duration_s,
            "output_tokens": sum(r.output_len for r in run.records),
            "output_tok_per_s": summary.output_throughput, "num_steps": run.num_forward_passes,
            "ttft_p50_ms": summary.ttft["p50_ms"], "tpot_p50_ms": summary.tpot["p50_ms"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", type=Path, required=True, help="directory for decode.json")
    p.add_argument("--dry", action="store_true", help="tiny model on the CPU (plumbing only)")
    args = p.parse_args(argv)
    from engine_service import LLM

    device = "cpu" if args.dry else "cuda"
    report = StageReport(args.out / "decode.json", "decode", args.dry)
    config = json.loads((Path(args.model) / "config.json").read_text())
    shape = DecoderShape.from_config(config)
    settings = dict(ENGINE_SETTINGS, device=device, dtype="bfloat16")
    if args.dry:
        settings.update(dtype="auto", num_blocks=1024)
    report.set("engine", settings)
    report.set("model", {"path": str(args.model), "params": shape.num_params,
                         "weight_bytes_read": shape.weight_bytes_read,
                         "kv_bytes_per_token": shape.kv_bytes_per_token,
                         "vocab": shape.vocab, "layers": shape.layers})
    t0 = time.perf_counter()
    engine = LLM(model=args.model, **settings).llm_engine
    graphs = engine.runner.decode_graphs
    report.set("engine_start_s", time.perf_counter() - t0)
    report.set("graph_sizes", None if graphs is None else list(graphs.sizes))
    log(f"engine up in {time.perf_counter() - t0:.1f} s; {engine.stats().num_blocks} blocks")
    offline = offline_workload(engine, args.dry)
    report.set("offline", offline)
    log(f"offline: {offline['output_tok_per_s']:.0f} output tok/s over "
        f"{offline['duration_s']:.1f} s")
    timer = StepTimer(engine.runner)
    rng = random.Random(0)
    mixed_at = DRY_MIXED_AT if args.dry else MIXED_AT
    for batch, context in DRY_CASES if args.dry else CASES:
        name = f"decode b{batch} ctx{context}"
        try:
            row, running = decode_case(engine, timer, shape, batch, context, rng)
        except Exception as error:  # the engine may still run the next case
            report.append("decode", failure({"name": name, "role": ROLES.get((batch, context)),
                                             "batch": batch, "context": context}, error))
            _abort_all(engine)
            continue
        report.append("decode", row)
        log(f"{name}: step {row['step_ms']:.2f} ms, replay {row['replay_ms']} ms, "
            f"{row['bytes'] / 1e9:.2f} GB")
        if (batch, context) == mixed_at:
            for chunk in DRY_MIXED_CHUNKS if args.dry else MIXED_CHUNKS:
                for graphed in (True, False):
                    name = f"mixed {batch} decodes + {chunk} chunk" + ("" if graphed
                                                                       else " eager")
                    try:
                        mixed = mixed_case(engine, timer, shape, running, chunk, rng, graphed)
                        log(f"{mixed['name']}: step {mixed['step_ms']:.2f} ms, replay "
                            f"{mixed['replay_ms']} ms, tokens {mixed['tokens']} (expected "
                            f"{mixed['expected_tokens']})")
                    except Exception as error:
                        mixed = failure({"name": name, "mode": "graphs" if graphed else "eager",
                                         "decodes": batch, "chunk": chunk}, error)
                    report.append("mixed", mixed)
        _abort_all(engine)
    report.done()


def _abort_all(engine) -> None:
    """Every live request of a case ended, so the next starts from an idle engine."""
    for request_id in list(engine._groups):
        engine.abort_request(request_id)


if __name__ == "__main__":
    main()
