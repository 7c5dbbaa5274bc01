"""Scoring prompts (lm-eval's loglikelihood requests: every prompt token's logprob): our
offline `LLM.generate` with `prompt_logprobs=0` and `max_tokens=1`, all prompts in one
continuous batch, against HF transformers' forward over each prompt (log-softmax of its
logits), one prompt at a time and as one right-padded batch, on SmolLM2.

    python -m bench.prompt_scoring [--prompts 32] [--min-len 64] [--max-len 512]
                                   [--dtype float32] [--runs 2] [--out PATH]

The prompts are seeded random token ids, lengths uniform in [min-len, max-len]. Both sides do
the same work: one forward over every prompt token and a log-softmax over the vocabulary at
each position (ours also samples one token per prompt, which HF does not). Runs alternate
(ours, HF batch, HF one by one) and the best of each is kept, so load on the shared machine hits
all three. The figures are prompt tokens scored per second and ours over each; the largest
difference between our logprobs and HF's on the same tokens is recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "prompt_scoring.json"


def _ours(llm, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    from engine_service import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [[lp.logprob for lp in out.prompt_logprobs[1:]] for out in outputs]


@torch.inference_mode()
def _hf_one_by_one(model, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    start = time.perf_counter()
    scores = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        logprobs = model(ids).logits[0, :-1].float().log_softmax(dim=-1)
        scores.append(logprobs.gather(1, ids[0, 1:, None]).squeeze(1).tolist())
    return time.perf_counter() - start, scores


@torch.inference_mode()
def _hf_batch(model, prompts: list[list[int]]) -> float:
    longest = max(map(len, prompts))
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
        mask[row, : len(prompt)] = 1
    start = time.perf_counter()
    logprobs = model(ids, attention_mask=mask).logits[:, :-1].float().log_softmax(dim=-1)
    logprobs.gather(2, ids[:, 1:, None])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.prompt_scoring",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from engine_service import LLM

    model_dir = args.model
    if model_dir is None:
        from engine_service.tools.prepare_model import ensure_default_model

        model_dir = str(ensure_default_model())
    rng = random.Random(0)
    llm = LLM(model=model_dir, dtype=args.dtype)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.prompts)]
    num_tokens = sum(len(p) - 1 for p in prompts)  # the scored ones
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, args.dtype))
    hf.eval()
    _ours(llm, prompts[:2])  # warm-up: first compiles and allocations on both sides
    _hf_one_by_one(hf, prompts[:2])
    times: dict[str, list[float]] = {"ours": [], "hf_batch": [], "hf_one_by_one": []}
    max_diff = 0.0
    for run in range(args.runs):
        elapsed, ours = _ours(llm, prompts)
        times["ours"].append(elapsed)
        times["hf_batch"].append(_hf_batch(hf, prompts))
        elapsed, theirs = _hf_one_by_one(hf, prompts)
        times["hf_one_by_one"].append(elapsed)
        max_diff = max(max_diff, max(abs(a - b) for o, t in zip(ours, theirs, strict=True)
                                     for a, b in zip(o, t, strict=True)))
        print(f"run {run}: " + ", ".join(f"{name} {num_tokens / t[-1]:,.0f} tok/s"
                                         for name, t in times.items()), flush=True)
    best = {name: min(t) for name, t in times.items()}
    result = {
        "model": Path(model_dir).name, "dtype": args.dtype, "num_prompts": args.prompts,
        "prompt_len_range": [args.min_len, args.max_len], "scored_tokens": num_tokens,
        "threads": torch.get_num_threads(), "runs": args.runs,
        "tokens_per_s": {name: num_tokens / t for name, t in best.items()},
        "ours_over_hf_batch": best["hf_batch"] / best["ours"],
        "ours_over_hf_one_by_one": best["hf_one_by_one"] / best["ours"],
        "max_abs_logprob_diff": max_diff, "all_runs_s": times, "load_end": os.getloadavg(),
    }
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "ours_over_hf_batch",
                                              "ours_over_hf_one_by_one",
                                              "max_abs_logprob_diff")}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
