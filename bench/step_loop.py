"""Host work per engine step, on a model whose compute is tiny (issue 36).

    python -m bench.step_loop --host-time                  # 64 sequences, 100 and 1,000 tokens
    python -m bench.step_loop --host-time --repeats 2 --json out.json

The model is a random Llama of one layer, hidden 32 (4 heads of 8, 2 KV heads, MLP 64), with
SmolLM2's tokenizer and its 49,152-token vocabulary, written once into a cache directory. One
torch thread. What is measured:

- **offline**: `batch` greedy `ignore_eos` requests of 8-token prompts through `LLM.generate`,
  for each output length. Host time per sequence per step = (time of `generate` - time inside
  the model's forward and LM head - time of the sampler's greedy reduction over the vocabulary)
  / (batch x output tokens). The forward, the LM head and the reduction are wrapped in timers
  (torch's CPU ops are synchronous, so the time around a call is its cost); they are device
  work on a GPU and grow with context (attention) and vocabulary, not with the engine's
  bookkeeping. What remains is the Python around them: scheduling, step inputs, sampling rows,
  outputs, detokenization, `generate`'s own loop. The model runner's share (building and
  uploading the step's inputs, in `ModelRunner.execute` outside the model) is shown apart.
- **alternated steps**: the same requests stepped with `LLMEngine.step` (an output per request
  per step, as a streaming caller gets) in two engines, one at the shortest output length
  (moved to a whole number of 16-token blocks below the longest: 100 -> 104) and one at the
  longest, in alternated windows of 16 steps, so the machine's drift falls on both alike: the
  host time per sequence per step of each (median of the windows) and the median ratio of the
  pairs. Then what a step of each executes over one more window, counted exactly
  (`bench/step_work.py`: Python and C calls, and bytecode instructions): equal counts are host
  work that does not grow with the output, whatever the timings; the functions whose counts
  differ are named.

Times are thread CPU time (`time.thread_time`: with one torch thread every op runs on the
calling thread), so a busy shared machine inflates them less than wall time would; wall time
is printed beside them. Each figure is the best of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.step_work import count_step_work, differences

MODEL_SHAPE = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=64)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPT_LEN = 8
DIRECT_WINDOW = 16  # steps per window of the alternated figures: one block of 16 tokens
BLOCK = 16  # the engine's default block size: window starts a multiple of it apart
ALTERNATED_ROUNDS = 6


def tiny_llama(out_dir: Path, max_model_len: int) -> Path:
    """The random one-layer Llama (written once; kept while its config is the same)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine_service.tools.prepare_model import ensure_default_model

    config = LlamaConfig(vocab_size=49152, max_position_embeddings=max_model_len,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=False, **MODEL_SHAPE)
    marker = out_dir / "step_loop.json"
    # As JSON gives it back (int keys become strings), taken before saving adds fields to it.
    wanted = json.loads(json.dumps(config.to_dict()))
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return out_dir
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer_dir = ensure_default_model(quiet=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    marker.write_text(json.dumps(wanted))
    return out_dir


class ComputeTimer:
    """Thread CPU and wall time spent inside the wrapped calls; `inputs`: the thread CPU time
    of the model runner's `execute` outside the model (building and uploading step inputs)."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.inputs = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.thread_time() - c
                self.wall += time.perf_counter() - w
        return timed


def instrument(llm) -> ComputeTimer:
    """Time the model's forward, its LM head and the sampler's greedy reduction."""
    from engine_service.model import sampler as sampler_module

    timer = ComputeTimer()
    runner = llm.llm_engine.runner
    model = runner.model
    model.forward = timer.wrap(model.forward)
    model.compute_logits = timer.wrap(model.compute_logits)
    sampler_module._greedy = timer.wrap(sampler_module._greedy)
    execute = runner.execute

    def timed_execute(*args, **kwargs):
        c, inside = time.thread_time(), timer.cpu
        try:
            return execute(*args, **kwargs)
        finally:
            timer.inputs += time.thread_time() - c - (timer.cpu - inside)

    runner.execute = timed_execute
    return timer


def prompts(batch: int, vocab: int = 49152) -> list[dict]:
    """Distinct 8-token prompts (no prefix sharing between them)."""
    gen = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()}
            for _ in range(batch)]


def offline_host_us(llm, timer: ComputeTimer, batch: int, max_tokens: int) -> dict:
    from engine_service import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = prompts(batch)
    timer.cpu = timer.wall = timer.inputs = 0.0
    c, w = time.thread_time(), time.perf_counter()
    outputs = llm.generate(requests, params)
    cpu, wall = time.thread_time() - c, time.perf_counter() - w
    if any(len(o.outputs[0].token_ids) != max_tokens for o in outputs):
        raise RuntimeError("a request did not produce max_tokens tokens")
    seq_steps = batch * max_tokens
    return {
        "host_us_per_seq_step": (cpu - timer.cpu) / seq_steps * 1e6,
        "host_wall_us_per_seq_step": (wall - timer.wall) / seq_steps * 1e6,
        "total_us_per_seq_step": cpu / seq_steps * 1e6,
        "compute_us_per_seq_step": timer.cpu / seq_steps * 1e6,
        "runner_inputs_us_per_seq_step": timer.inputs / seq_steps * 1e6,
    }


def bench_llm(model_dir: Path, batch: int, max_model_len: int):
    """The offline API on the random model as every figure here (and bench.step_loop_stub)
    runs it: CPU, float32, no prefix caching."""
    from engine_service import LLM

    return LLM(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=batch,
               max_model_len=max_model_len, enable_prefix_caching=False)


def _stepped_engine(model_dir: Path, batch: int, max_model_len: int, tokens: int):
    """An engine of its own (instrumented) with `batch` requests stepped to `tokens` output
    tokens each, with room left for the measured windows."""
    from engine_service import SamplingParams

    llm = bench_llm(model_dir, batch, max_model_len)
    timer = instrument(llm)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_model_len - PROMPT_LEN,
                            ignore_eos=True)
    for i, request in enumerate(prompts(batch)):
        engine.add_request(f"direct-{i}", request["prompt_token_ids"], params)
    for _ in range(tokens):  # the first step is the prefill, which samples each first token
        engine.step()
    return engine, timer


def alternated_steps(model_dir: Path, batch: int, early: int, late: int,
                     rounds: int, max_model_len: int) -> dict:
    """Host time per sequence per step of two engines, one at `early` output tokens and one at
    `late`, stepped in alternated windows of DIRECT_WINDOW steps (the order swapped each
    round), so that the machine's drift falls on both alike; then what one more window of
    each executes (bench/step_work.py). Windows start a multiple of 16 steps apart, so both
    cross the same number of block boundaries."""
    engines = {"early": _stepped_engine(model_dir, batch, max_model_len, early),
               "late": _stepped_engine(model_dir, batch, max_model_len, late)}
    host: dict[str, list[float]] = {"early": [], "late": []}
    order = ["early", "late"]
    for _ in range(rounds):
        for name in order:
            engine, timer = engines[name]
            timer.cpu = 0.0
            c = time.thread_time()
            for _ in range(DIRECT_WINDOW):
                engine.step()
            cpu = time.thread_time() - c
            host[name].append((cpu - timer.cpu) / (DIRECT_WINDOW * batch) * 1e6)
        order.reverse()
    work = {name: count_step_work(engine, DIRECT_WINDOW)
            for name, (engine, _timer) in engines.items()}
    early_work, late_work = work["early"], work["late"]
    ratios = [b / a for a, b in zip(host["early"], host["late"], strict=True)]
    return {
        "early_tokens": early, "late_tokens": late, "window_steps": DIRECT_WINDOW,
        # The counted window follows the timed ones.
        "counted_from_tokens": [early + rounds * DIRECT_WINDOW, late + rounds * DIRECT_WINDOW],
        "early_host_us": host["early"], "late_host_us": host["late"],
        "early_median_us": statistics.median(host["early"]),
        "late_median_us": statistics.median(host["late"]),
        "median_late_over_early": statistics.median(ratios),
        "early_calls_per_step": early_work.total_calls() / DIRECT_WINDOW,
        "late_calls_per_step": late_work.total_calls() / DIRECT_WINDOW,
        "early_instructions_per_step": early_work.total_instructions() / DIRECT_WINDOW,
        "late_instructions_per_step": late_work.total_instructions() / DIRECT_WINDOW,
        # Over the window, per function: (early, late).
        "calls_that_differ": differences(early_work.calls, late_work.calls),
        "instructions_that_differ": differences(early_work.instructions,
                                                late_work.instructions),
    }


def model_len(lengths: list[int]) -> int:
    """The random model's context for these output lengths: the alternated windows' tokens on
    top of the longest (bench.step_loop_stub uses the same, so neither rewrites the model)."""
    return PROMPT_LEN + max(lengths) + DIRECT_WINDOW * (ALTERNATED_ROUNDS + 1) + 8


def early_length(lengths: list[int]) -> int | None:
    """The alternated engines' early start: the shortest length, moved up so the two start a
    whole number of blocks apart (100 and 1,000 -> 104 and 1,000), or down one block where
    they are less than a block apart (50 and 60 -> 44); None for a single length."""
    shortest, longest = min(lengths), max(lengths)
    if shortest == longest:
        return None
    early = longest - max(1, (longest - shortest) // BLOCK) * BLOCK
    return early if early >= 1 else None


def host_time(batch: int, lengths: list[int], repeats: int, model_dir: Path) -> dict:
    from engine_service import SamplingParams

    torch.set_num_threads(1)
    longest = max(lengths)
    max_model_len = model_len(lengths)
    tiny_llama(model_dir, max_model_len)
    llm = bench_llm(model_dir, batch, max_model_len)
    timer = instrument(llm)
    llm.generate(prompts(batch), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    result: dict = {"batch": batch, "offline": {}, "alternated": None}
    for _ in range(repeats):  # alternated lengths, best of each
        for n in lengths:
            run = offline_host_us(llm, timer, batch, n)
            best = result["offline"].get(n)
            if best is None or run["host_us_per_seq_step"] < best["host_us_per_seq_step"]:
                result["offline"][n] = run
    del llm
    early = early_length(lengths)
    if early is not None:
        result["alternated"] = alternated_steps(model_dir, batch, early, longest,
                                                ALTERNATED_ROUNDS, max_model_len)
    return result


def report(result: dict) -> str:
    lines = [f"batch {result['batch']}, thread CPU time (wall in brackets), best of runs"]
    for n, r in result["offline"].items():
        lines.append(
            f"offline, {n:>5} tokens: host {r['host_us_per_seq_step']:6.2f} us/seq/step "
            f"[{r['host_wall_us_per_seq_step']:6.2f}] (runner's step inputs "
            f"{r['runner_inputs_us_per_seq_step']:5.2f}); total {r['total_us_per_seq_step']:6.2f}"
            f", of which model + LM head + argmax {r['compute_us_per_seq_step']:6.2f}"
        )
    a = result["alternated"]
    if a is None:
        lines.append("engine.step, alternated: needs two output lengths (--tokens A,B)")
        return "\n".join(lines)
    lines.append(
        f"engine.step, alternated windows of {a['window_steps']} steps, host us/seq/step: "
        f"{a['early_tokens']} tokens {a['early_median_us']:.2f} (median of "
        f"{', '.join(f'{x:.2f}' for x in a['early_host_us'])}), {a['late_tokens']} tokens "
        f"{a['late_median_us']:.2f} (of {', '.join(f'{x:.2f}' for x in a['late_host_us'])});"
        f" late / early, median of the pairs: {a['median_late_over_early']:.3f}")
    lines.append(
        f"per step, from {a['counted_from_tokens'][0]} / {a['counted_from_tokens'][1]} tokens:"
        f" calls "
        f"{a['early_calls_per_step']:.2f} / {a['late_calls_per_step']:.2f}, bytecode "
        f"instructions {a['early_instructions_per_step']:.2f} / "
        f"{a['late_instructions_per_step']:.2f}")
    for kind in ("calls", "instructions"):
        for fn, (early, late) in a[f"{kind}_that_differ"].items():
            lines.append(f"  {kind} over the window differ: {fn} {early} -> {late}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.step_loop",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--host-time", action="store_true", required=True,
                   help="host time per sequence per step (the only measurement so far)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", default="100,1000", help="output lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="runs of each; the best is kept")
    p.add_argument("--model-dir", type=Path,
                   default=Path.home() / ".cache" / "pagedgen" / "bench" / "step-loop-llama")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.tokens.split(",")]
    result = host_time(args.batch, lengths, args.repeats, args.model_dir)
    print(report(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
