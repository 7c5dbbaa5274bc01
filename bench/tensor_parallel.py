"""Tensor parallelism on the CPU (issue 33): TP=2 with one torch thread a rank against TP=1
with two threads, the same two cores.

    nice python -m bench.tensor_parallel                      # best of 2, alternated
    nice python -m bench.tensor_parallel --repeats 2 --json bench/results/tensor_parallel.json

The model is a random one of SmolLM2-135M's size whose heads split over two ranks (30 layers,
hidden 576, 8 query / 2 KV heads of 64, MLP 1536, 49,152-token vocabulary, tied;
bench/random_checkpoint.py shape smollm2-8h2kv), run in float32. The workload: `--concurrency`
requests of `--prompt-len` random token ids, each generating `--output-len` tokens (greedy,
ignore_eos), submitted at once through `LLM.generate` after a short warm-up. Each run is a
fresh process (thread settings are per process), the configurations alternate within each
repeat, and each figure is the best of `--repeats`.

Configurations:
- tp1-2t: one rank, two torch threads, the fused C++ decoder (the engine's default path);
- tp1-2t-per-layer: the same with the Python layer loop, the path the TP ranks run
  (engine_service/model/parallel/layers.py says why), so the cost of that choice shows;
- tp2-1t: two ranks of one thread each (gloo over loopback);
- tp1-1t (asked for by --configs): one rank, one thread: what a rank does alone, without
  the OpenMP barriers two threads meet at in every op.

Per run: output tokens/s; ms per engine step; on rank 0, the ms per step spent in the forward's
collectives (2 all-reduces a layer, the embedding's and the logits' gather; waiting for the
other rank included) and in the step's broadcast, with the message's size; and, on the
run's own machine, pickling a 32-sequence decode step's inputs against packing the same
lists into one int64 array (the alternative to one pickled object).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "tp1-2t": {"tp": 1, "threads": 2, "per_layer": False},
    "tp1-2t-per-layer": {"tp": 1, "threads": 2, "per_layer": True},
    "tp2-1t": {"tp": 2, "threads": 1, "per_layer": False},
    "tp1-1t": {"tp": 1, "threads": 1, "per_layer": False},  # not in the default set
}
DEFAULT_CONFIGS = ("tp1-2t", "tp1-2t-per-layer", "tp2-1t")
VOCAB = 49152


def model_dir() -> Path:
    from bench.random_checkpoint import write_random_checkpoint
    from engine_service.model.paths import cache_dir
    from engine_service.tools.prepare_model import ensure_default_model

    return write_random_checkpoint("smollm2-8h2kv", ensure_default_model(quiet=True),
                                   cache_dir() / "bench" / "random-smollm2-8h2kv")


def serialization_us(num_seqs: int = 32, context: int = 128, repeats: int = 200) -> dict:
    """Pickling one decode step's inputs against packing their lists into one int64 array."""
    import numpy as np

    from engine_service.model.step_inputs import decode_batch

    inputs = decode_batch(num_seqs, context, 16).inputs
    inputs.block_tables = np.asarray(inputs.block_tables, dtype=np.int32)
    lists = (inputs.input_ids, inputs.positions, inputs.slots, inputs.seq_lens,
             inputs.query_start_loc, inputs.sample_rows)

    def pack() -> np.ndarray:
        parts = [np.asarray(p, dtype=np.int64) for p in lists]
        parts.append(inputs.block_tables.reshape(-1).astype(np.int64))
        return np.concatenate(parts)

    out = {}
    for name, fn in (("pickle", lambda: pickle.dumps(inputs, protocol=5)), ("pack", pack)):
        start = time.perf_counter()
        for _ in range(repeats):
            data = fn()
        out[f"{name}_us"] = (time.perf_counter() - start) / repeats * 1e6
        out[f"{name}_bytes"] = len(data) if name == "pickle" else data.nbytes
    return out


def run_one(name: str, model: str, concurrency: int, prompt_len: int, output_len: int) -> dict:
    import torch

    from engine_service import LLM, SamplingParams

    config = CONFIGS[name]
    torch.set_num_threads(config["threads"])
    os.environ["PAGEDGEN_TP_THREADS"] = str(config["threads"])
    llm = LLM(model, dtype="float32", tensor_parallel_size=config["tp"], num_blocks=2048,
              max_num_seqs=concurrency, skip_tokenizer_init=True)
    try:
        engine = llm.llm_engine
        if config["per_layer"]:
            engine.runner.model.fused_decoder = None
        generator = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (prompt_len,),
                                                      generator=generator).tolist()}
                   for _ in range(concurrency)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        group = getattr(engine.runner, "group", None)
        channel = getattr(engine.runner, "channel", None)
        if group is not None:
            group.collective_s, group.num_collectives = 0.0, 0
            channel.pickle_s = channel.broadcast_s = 0.0
            channel.num_sent = channel.bytes_sent = 0
        steps_before = engine.num_steps
        start = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True,
                                                       temperature=0))
        wall = time.perf_counter() - start
        steps = engine.num_steps - steps_before
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {"config": name, **config, "output_tok_s": tokens / wall, "wall_s": wall,
                  "steps": steps, "step_ms": wall / steps * 1e3}
        if group is not None:
            result.update(
                collective_ms_per_step=group.collective_s / steps * 1e3,
                collectives_per_step=group.num_collectives / steps,
                broadcast_ms_per_step=channel.broadcast_s / channel.num_sent * 1e3,
                pickle_us_per_step=channel.pickle_s / channel.num_sent * 1e6,
                message_bytes=channel.bytes_sent / channel.num_sent,
            )
        return result
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--one", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = (args.concurrency, args.prompt_len, args.output_len)
    if args.one:
        print(json.dumps(run_one(args.one, args.model, *shape)), flush=True)
        return
    model = str(model_dir())
    names = args.configs.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:  # alternated
            done = subprocess.run(
                [sys.executable, "-m", "bench.tensor_parallel", "--one", name, "--model", model,
                 "--concurrency", str(args.concurrency), "--prompt-len", str(args.prompt_len),
                 "--output-len", str(args.output_len)],
                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS":
                                                     str(CONFIGS[name]["threads"])})
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(f"repeat {repeat + 1} {name}: {run['output_tok_s']:.1f} tok/s, "
                  f"{run['step_ms']:.1f} ms/step"
                  + (f", collectives {run['collective_ms_per_step']:.2f} ms/step, broadcast "
                     f"{run['broadcast_ms_per_step']:.3f} ms ({run['message_bytes']:.0f} B)"
                     if "collective_ms_per_step" in run else ""), flush=True)
    best = {n: max(r, key=lambda x: x["output_tok_s"]) for n, r in runs.items()}
    summary = {"shape": dict(zip(("concurrency", "prompt_len", "output_len"), shape,
                                 strict=True)),
               "best": best, "runs": runs, "serialization": serialization_us()}
    if "tp1-2t" in best and "tp2-1t" in best:
        summary["tp2_over_tp1"] = best["tp2-1t"]["output_tok_s"] / best["tp1-2t"]["output_tok_s"]
        print(f"TP=2 / TP=1 output throughput: {summary['tp2_over_tp1']:.3f}")
    print(json.dumps(summary["serialization"]))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
