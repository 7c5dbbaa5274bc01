"""The engine's own work per step, with the model taken out (issue 36).

    python -m bench.step_loop_stub                      # 64 sequences, 100 and 1,000 tokens

`bench.step_loop --host-time` measures host time as what is left of `LLM.generate` after the
model's forward, LM head and argmax: a remainder of a figure ten times its size, so it carries
the model's noise, and the model's effect on the caches (attention over a long context
evicts what the next step's Python reads). Here the forward, the LM head and the greedy
reduction return ready tensors (random tokens from a seeded generator, so the detokenizer sees
ordinary text), and each decode step's thread CPU time is taken alone: what is left is only
the engine's code. Reported per sequence: the 10th percentile and the median of the decode
steps (the prefill and the last two steps aside: the last detokenizes deferred text), and
`generate` as a whole (every step, the prefill and the deferred text included).

Same model files, requests and one torch thread as `bench.step_loop`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.step_loop import PROMPT_LEN, bench_llm, model_len, prompts, tiny_llama

VOCAB_LOW, VOCAB_HIGH = 100, 49000  # ordinary tokens of SmolLM2's vocabulary


def stub_model(llm, batch: int) -> None:
    """Replace the forward, the LM head and the greedy reduction with ready tensors."""
    from engine_service.model import sampler as sampler_module

    runner = llm.llm_engine.runner
    hidden = torch.zeros(batch * PROMPT_LEN, runner.config.hidden_size)
    logits = torch.zeros(batch, runner.config.vocab_size)
    runner.model.forward = lambda input_ids, *args, **kwargs: hidden[: input_ids.shape[0]]
    runner.model.compute_logits = lambda h, out=None: logits[: h.shape[0]]
    generator = torch.Generator().manual_seed(0)
    sampler_module._greedy = lambda rows: torch.randint(
        VOCAB_LOW, VOCAB_HIGH, (rows.shape[0],), generator=generator)


def run(llm, batch: int, max_tokens: int) -> dict:
    from engine_service import SamplingParams

    engine = llm.llm_engine
    step = engine.step
    times: list[float] = []

    def timed_step():
        start = time.thread_time()
        try:
            return step()
        finally:
            times.append(time.thread_time() - start)

    engine.step = timed_step
    try:
        start = time.thread_time()
        llm.generate(prompts(batch),
                     SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        total = time.thread_time() - start
    finally:
        engine.step = step
    decode = sorted(times[1:-2])
    per_seq_us = 1e6 / batch
    return {
        "generate_us_per_seq_step": total / (batch * max_tokens) * 1e6,
        "step_p10_us_per_seq": decode[len(decode) // 10] * per_seq_us,
        "step_median_us_per_seq": statistics.median(decode) * per_seq_us,
    }


def main(argv: list[str] | None = None) -> None:
    from engine_service import SamplingParams

    p = argparse.ArgumentParser(prog="python -m bench.step_loop_stub",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", default="100,1000", help="output lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="runs of each, all printed")
    p.add_argument("--model-dir", type=Path,
                   default=Path.home() / ".cache" / "pagedgen" / "bench" / "step-loop-llama")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.tokens.split(",")]
    torch.set_num_threads(1)
    max_model_len = model_len(lengths)
    tiny_llama(args.model_dir, max_model_len)
    llm = bench_llm(args.model_dir, args.batch, max_model_len)
    stub_model(llm, args.batch)
    llm.generate(prompts(args.batch),
                 SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    print(f"batch {args.batch}, model stubbed, thread CPU us per sequence per step")
    for _ in range(args.repeats):
        for n in lengths:
            r = run(llm, args.batch, n)
            print(f"{n:>5} tokens: decode step p10 {r['step_p10_us_per_seq']:6.2f}, median "
                  f"{r['step_median_us_per_seq']:6.2f}; generate "
                  f"{r['generate_us_per_seq_step']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
