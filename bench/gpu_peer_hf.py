"""The peer on the same GPU and checkpoint: HF transformers `generate` with a static cache
under torch.compile (contiguous KV; gpt-fast's recipe as transformers ships it).

    python -m bench.gpu_peer_hf --model DIR --out DIR [--dry]

`generate` compiles its decode forward (mode "reduce-overhead": CUDA graphs) when the cache
is a static one; the prefill runs eagerly. Each cache is ours (a StaticCache of a fixed
length, reset between calls), so calls of one batch size share one compiled graph:
- batch 1: a 512-token prompt; generate 32 and 256 tokens (after an untimed call that
  compiles). Decode time per token = (t(256) - t(32)) / 224: the prefill and the one-off
  costs cancel, what is left is the steady decode step, read against our batch-1 step;
- 64 at once: the fixed workload (bench/gpu_common.FIXED_WORKLOAD), left-padded to its
  longest prompt, one `generate` of 256 forced tokens (no EOS), after an untimed identical
  call that compiles; output tokens / wall time, read against our offline run of the same
  workload. The padding is what static batching costs, so it is counted.
Greedy; times are wall clock around `generate` with the device synchronized.
"""

from __future__ import annotations

import argparse
import inspect
import random
import time
from pathlib import Path

import torch

from bench.gpu_common import DRY_WORKLOAD, FIXED_WORKLOAD, StageReport, failure, log

B1_PROMPT = 512
B1_SHORT, B1_LONG = 32, 256
DRY_B1 = (16, 4, 12)  # prompt, short, long


def _generation_config(new_tokens: int, pad_token_id: int, dry: bool):
    from transformers import CompileConfig, GenerationConfig

    # eos_token_id None: every row runs to max_new_tokens, like our ignore_eos.
    return GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=pad_token_id,
        compile_config=CompileConfig(mode="reduce-overhead"),
        # The dry run checks the plumbing; compiling on a CPU takes minutes.
        disable_compile=dry,
    )


def _cache_argument(model) -> str:
    """The keyword generate takes a cache under: `cache` in newer transformers (5.2x),
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StaticRunner:
    """`generate` over a batch of token-id prompts with a static cache of `max_cache_len`."""

    def __init__(self, model, max_cache_len: int, pad_token_id: int, dry: bool) -> None:
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.cache_kw = _cache_argument(model)
        self.pad_token_id = pad_token_id
        self.dry = dry

    def seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        device = self.model.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):  # left padding, as batched generate wants
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        self.cache.reset()
        config = _generation_config(new_tokens, self.pad_token_id, self.dry)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        # generate runs under no_grad itself; inference_mode would make the cache's tensors
        # inference tensors, which reset() may not write outside it.
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                  generation_config=config, **{self.cache_kw: self.cache})
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if out.shape != (len(prompts), width + new_tokens):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, expected "
                               f"{(len(prompts), width + new_tokens)}")
        return elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_peer_hf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", type=Path, required=True, help="directory for peer_hf.json")
    p.add_argument("--dry", action="store_true", help="tiny model on the CPU, no compile")
    args = p.parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM

    device = "cpu" if args.dry else "cuda"
    report = StageReport(args.out / "peer_hf.json", "peer_hf", args.dry)
    report.set("transformers", transformers.__version__)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 device_map=device)
    model.eval()
    report.set("load_s", time.perf_counter() - t0)
    report.set("attn_implementation", model.config._attn_implementation)
    log(f"HF model loaded in {time.perf_counter() - t0:.1f} s "
        f"({model.config._attn_implementation} attention)")
    pad = 0
    try:
        report.set("batch1", _batch1(model, pad, args.dry))
    except Exception as error:  # the concurrent run may still go
        report.set("batch1", failure({}, error))
    try:
        report.set("concurrent", _concurrent(model, pad, args.dry))
    except Exception as error:
        report.set("concurrent", failure({}, error))
    report.done()


def _batch1(model, pad: int, dry: bool) -> dict:
    prompt_len, short, long = DRY_B1 if dry else (B1_PROMPT, B1_SHORT, B1_LONG)
    prompt = [random.Random(1).randrange(100, 32000) for _ in range(prompt_len)]
    runner = StaticRunner(model, prompt_len + long, pad, dry)
    compile_s = runner.seconds([prompt], short)
    # Best of two of each length: one slow call (a late recompile, a clock ramp) would
    # otherwise land on the difference.
    t_short = min(runner.seconds([prompt], short) for _ in range(2))
    t_long = min(runner.seconds([prompt], long) for _ in range(2))
    per_token_ms = (t_long - t_short) / (long - short) * 1e3
    log(f"batch 1: {per_token_ms:.2f} ms a token (first call {compile_s:.1f} s)")
    return {"prompt": prompt_len, "short": short, "long": long, "first_call_s": compile_s,
            "short_s": t_short, "long_s": t_long, "decode_ms_per_token": per_token_ms,
            "tok_per_s": 1e3 / per_token_ms if per_token_ms > 0 else None,
            "compiled": getattr(model, "_compiled_call", None) is not None}


def _concurrent(model, pad: int, dry: bool) -> dict:
    from bench.workloads import fixed_random

    spec = DRY_WORKLOAD if dry else FIXED_WORKLOAD
    prompts = [list(r.prompt_token_ids) for r in fixed_random(**spec).requests]
    new = spec["output_len"]
    runner = StaticRunner(model, max(len(x) for x in prompts) + new, pad, dry)
    compile_s = runner.seconds(prompts, new)
    seconds = runner.seconds(prompts, new)
    output_tokens = len(prompts) * new
    log(f"{len(prompts)} at once: {output_tokens / seconds:.0f} output tok/s "
        f"({seconds:.2f} s; first call {compile_s:.1f} s)")
    return {"workload": spec, "first_call_s": compile_s, "seconds": seconds,
            "output_tokens": output_tokens, "output_tok_per_s": output_tokens / seconds}


if __name__ == "__main__":
    main()
