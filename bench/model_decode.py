"""Batch-1 decode on a checkpoint of a real model's shape: our offline `LLM.generate` against
HF transformers' `generate` (greedy, dynamic cache), the same prompt and number of new tokens,
both on the CPU, in float32 and bfloat16. The default checkpoint is a random Qwen3-0.6B-shaped
one (bench/random_checkpoint.py; step times do not depend on the weights' values).

    python -m bench.model_decode [--model DIR | --shape qwen3-0.6b] [--dtypes float32,bfloat16]
                                 [--prompt-tokens 64] [--new-tokens 64] [--runs 2] [--out PATH]

Each side runs a short warm-up, then `--runs` timed runs, alternating, best kept. The figure is
new tokens per second (prompt included in the time: one short prefill) and ours over HF's;
whether the two greedy outputs are the same tokens is recorded too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "model_decode.json"
CHECKPOINTS = Path.home() / ".cache" / "pagedgen" / "bench"


def _timed(run) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


def measure(model_dir: Path, dtype: str, prompt: list[int], new_tokens: int, runs: int
            ) -> dict:
    from transformers import AutoModelForCausalLM

    from engine_service import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, num_blocks=64, max_model_len=2048)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = torch.tensor([prompt])

    def ours() -> list[int]:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def theirs(count: int = new_tokens) -> list[int]:
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False)
        return out[0, len(prompt):].tolist()

    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    theirs(4)
    best_ours = best_hf = float("inf")
    for _ in range(runs):
        elapsed, our_tokens = _timed(ours)
        best_ours = min(best_ours, elapsed)
        elapsed, hf_tokens = _timed(theirs)
        best_hf = min(best_hf, elapsed)
    fused = llm.llm_engine.runner.model.fused_decoder is not None
    llm.close()
    return {"dtype": dtype, "ours_tok_s": new_tokens / best_ours,
            "hf_tok_s": new_tokens / best_hf, "ours_over_hf": best_hf / best_ours,
            "same_tokens": our_tokens == hf_tokens, "fused_cpu_decoder": fused,
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    from bench.random_checkpoint import SHAPES, write_random_checkpoint
    from engine_service.tools.prepare_model import ensure_default_model

    p = argparse.ArgumentParser(prog="python -m bench.model_decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a checkpoint directory")
    p.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b",
                   help="without --model: a random checkpoint of this shape (cached)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    model_dir = args.model or write_random_checkpoint(
        args.shape, ensure_default_model(quiet=True), CHECKPOINTS / f"random-{args.shape}")
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    rows = [measure(model_dir, dtype, prompt, args.new_tokens, args.runs)
            for dtype in args.dtypes.split(",")]
    for row in rows:
        print(f"{row['dtype']:>9}: ours {row['ours_tok_s']:.1f} tok/s, HF {row['hf_tok_s']:.1f} "
              f"tok/s, {row['ours_over_hf']:.2f}x, same tokens {row['same_tokens']}", flush=True)
    result = {"model": str(args.model or args.shape), "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "runs": args.runs, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
