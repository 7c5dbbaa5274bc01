"""Beam search: the KV blocks a beam search request holds with block sharing and without, and
the throughput of beam requests against HF transformers' `generate(num_beams=...)`.

Memory. One beam search request at a time, alone on the engine, stepped by hand. After each
step (its beam step done) the bench reads the request's block tables:
    shared      distinct blocks its beams hold, plus what the next step's growth takes (new
                blocks and the copies-on-write of shared partial blocks, counted exactly by the
                KV cache manager): the blocks held at the step's peak;
    unshared    the same beams with nothing shared (each holds all of its own tokens): what a
                paged system without copy-on-write sharing would hold;
    contiguous  beam_width x (prompt + max_tokens) slots, reserved up front per beam, as
                pre-PagedAttention systems do (in blocks of the same size).
Each figure is the peak over the request's steps. The prompts are random token ids; EOS is
masked until max_tokens (min_tokens = max_tokens), so every beam runs the whole length.

Throughput. The same prompts through our offline `LLM.beam_search` (all requests in one
continuous batch) and through HF `generate(num_beams=k, do_sample=False, min_new_tokens=
max_new_tokens)`, all prompts in one left-padded batch and one prompt at a time. Both sides do
the same work: k beams x max_tokens steps per request. Ours and HF's one-batch runs alternate
(`repeats` times, best of each), so load on the shared machine hits both. Our beams are also
compared with HF's one-prompt-at-a-time beams, token for token.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import asdict, dataclass

from tqdm import tqdm

from bench.workloads import Workload, fixed_random


@dataclass(frozen=True, slots=True)
class BeamShape:
    memory_prompt_lens: tuple[int, ...]  # swept at the widest beam
    memory_widths: tuple[int, ...]  # swept at the longest prompt
    memory_max_tokens: int
    throughput_prompts: int
    throughput_widths: tuple[int, ...]
    throughput_max_tokens: int
    repeats: int  # timed runs of ours and HF's one-batch generate, alternated; best of each


FULL_SHAPE = BeamShape((128, 512, 2048), (2, 4, 8), 64, 8, (4, 8), 32, 2)
QUICK_SHAPE = BeamShape((64, 256), (2, 8), 16, 3, (4,), 8, 1)


@dataclass(slots=True)
class BeamMemory:
    prompt_len: int
    beam_width: int
    max_tokens: int
    block_size: int
    shared_peak_blocks: int
    unshared_peak_blocks: int
    contiguous_blocks: int
    worst_case_blocks: int  # what the engine's admission reserves room for (no sharing past
    # the prompt): the peak can never exceed it
    num_steps: int


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def measure_memory(engine, prompt: list[int], beam_width: int, max_tokens: int) -> BeamMemory:
    from engine_service.model.sampling_params import SamplingParams

    bs = engine.config.block_size
    params = SamplingParams(
        temperature=0, beam_width=beam_width, n=beam_width, max_tokens=max_tokens,
        min_tokens=max_tokens,
    )
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    [group] = [g for g in engine.scheduler.waiting if g.request_id == request_id]
    shared_peak = unshared_peak = _blocks(len(prompt), bs)  # the first step: the prompt alone
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        beams = group.live_seqs()
        if group.is_finished or not beams:
            continue
        tables = [engine.kv.block_table(b) for b in beams]
        distinct = len({block for table in tables for block in table})
        growth = engine.kv.blocks_to_grow([(b, b.num_tokens - b.num_computed_tokens)
                                           for b in beams])
        shared_peak = max(shared_peak, distinct + growth)
        unshared_peak = max(unshared_peak, sum(_blocks(b.num_tokens, bs) for b in beams))
    if engine.check_block_invariants():
        raise RuntimeError(f"block invariants broken: {engine.check_block_invariants()}")
    return BeamMemory(
        prompt_len=len(prompt),
        beam_width=beam_width,
        max_tokens=max_tokens,
        block_size=bs,
        shared_peak_blocks=shared_peak,
        unshared_peak_blocks=unshared_peak,
        contiguous_blocks=beam_width * _blocks(len(prompt) + max_tokens, bs),
        worst_case_blocks=engine.blocks_for_request(len(prompt), params),
        num_steps=steps,
    )


def memory_sweep(engine, shape: BeamShape, seed: int, progress: bool = True) -> list[dict]:
    widest, longest = max(shape.memory_widths), max(shape.memory_prompt_lens)
    jobs = [(n, widest) for n in shape.memory_prompt_lens]
    jobs += [(longest, k) for k in shape.memory_widths if k != widest]
    runs = []
    for prompt_len, width in tqdm(jobs, desc="beam memory", disable=not progress):
        [request] = fixed_random(1, prompt_len, prompt_len, 1, seed + prompt_len).requests
        runs.append(asdict(measure_memory(
            engine, list(request.prompt_token_ids), width, shape.memory_max_tokens)))
    return runs


@dataclass(slots=True)
class BeamThroughput:
    name: str
    beam_width: int
    num_requests: int
    max_tokens: int
    duration_s: float
    requests_per_s: float
    beam_tokens_per_s: float  # beam_width x max_tokens per request, over the duration
    load_1min: float  # the machine's load average when the run started (it is shared)


def _throughput(name: str, width: int, workload: Workload, max_tokens: int,
                duration: float) -> BeamThroughput:
    num = len(workload.requests)
    return BeamThroughput(name, width, num, max_tokens, duration, num / duration,
                          num * width * max_tokens / duration, os.getloadavg()[0])


def run_engine_beams(llm, workload: Workload, width: int, max_tokens: int):
    from engine_service import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, min_tokens=max_tokens)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    duration = time.perf_counter() - start
    beams = [[s.token_ids for s in out.sequences] for out in outputs]
    return _throughput(f"engine_beam_k{width}", width, workload, max_tokens, duration), beams


def _hf_config(width: int, max_tokens: int, eos: list[int], pad: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False, num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
        min_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=pad,
        return_dict_in_generate=True,
    )


def run_hf_beams(model, workload: Workload, width: int, max_tokens: int, eos: list[int],
                 pad: int, batch: bool):
    """HF generate(num_beams=width): all prompts in one left-padded batch, or one at a time
    (then its beams are returned too, to compare with ours)."""
    import torch

    requests = list(workload.requests)
    config = _hf_config(width, max_tokens, eos, pad)
    groups = [requests] if batch else [[r] for r in requests]
    beams = []
    start = time.perf_counter()
    for group in groups:
        longest = max(r.prompt_len for r in group)
        input_ids = torch.full((len(group), longest), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, r in enumerate(group):
            input_ids[row, longest - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, longest - r.prompt_len :] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=config)
        if not batch:
            beams.append([row[longest:].tolist() for row in out.sequences])
    duration = time.perf_counter() - start
    name = f"hf_generate_beam_k{width}" + ("" if batch else "_b1")
    return _throughput(name, width, workload, max_tokens, duration), beams


def beam_search_bench(model_path: str, shape: BeamShape, seed: int, log=print,
                      **engine_args) -> dict:
    """Both parts in float32 (what HF's CPU beam search runs and what token-exactness
    needs); the engine with its default pool (1 GiB of KV on the CPU) and block size 16 unless
    engine_args say otherwise."""
    import gc

    from bench.peers_hf import load_hf_model
    from engine_service import LLM

    log("beam search memory: shared vs unshared vs contiguous blocks (one request at a time)")
    llm = LLM(model=model_path, dtype="float32", **engine_args)
    engine = llm.llm_engine
    memory = memory_sweep(engine, shape, seed)

    workload = fixed_random(shape.throughput_prompts, 16, 200, shape.throughput_max_tokens,
                            seed + 7)
    eos = sorted(engine.eos_token_ids)
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else eos[0]
    log("beam search throughput: engine offline and HF generate(num_beams), alternated")
    model = load_hf_model(model_path, "float32")
    # Untimed warm-ups: one-off costs of the first large forward and the first beam steps.
    warm = fixed_random(2, 64, 64, 4, seed + 99)
    run_engine_beams(llm, warm, 2, 4)
    run_hf_beams(model, warm, 2, 4, eos, pad, batch=True)
    runs, ours = [], {}
    # The machine is shared: ours and HF's alternate, so a burst of load hits both sides.
    for _ in range(shape.repeats):
        for width in shape.throughput_widths:
            run, ours[width] = run_engine_beams(llm, workload, width,
                                                shape.throughput_max_tokens)
            runs.append(asdict(run))
            run, _ = run_hf_beams(model, workload, width, shape.throughput_max_tokens, eos, pad,
                                  batch=True)
            runs.append(asdict(run))
    matches = {}
    for width in shape.throughput_widths:
        run, hf_beams = run_hf_beams(model, workload, width, shape.throughput_max_tokens, eos,
                                     pad, batch=False)
        runs.append(asdict(run))
        same = sum(a == b for a, b in zip(ours[width], hf_beams, strict=True))
        matches[str(width)] = same / len(hf_beams)
    del llm, engine, model
    gc.collect()
    best: dict[str, dict] = {}
    for run in runs:
        if run["name"] not in best or run["requests_per_s"] > best[run["name"]]["requests_per_s"]:
            best[run["name"]] = run
    ratios = {}
    for width in shape.throughput_widths:
        ours_rps = best[f"engine_beam_k{width}"]["requests_per_s"]
        for peer in (f"hf_generate_beam_k{width}", f"hf_generate_beam_k{width}_b1"):
            ratios[f"engine_beam_k{width}/{peer}"] = ours_rps / best[peer]["requests_per_s"]
    long = [m for m in memory if m["beam_width"] == max(shape.memory_widths)
            and m["prompt_len"] == max(shape.memory_prompt_lens)][0]
    saving = long["unshared_peak_blocks"] / long["shared_peak_blocks"]
    worst_speedup = min(v for k, v in ratios.items() if not k.endswith("_b1"))
    return {
        "shape": asdict(shape),
        "dtype": "float32",
        "memory": memory,
        "throughput": {"workload": {"name": workload.name, "seed": workload.seed,
                                    "num_requests": len(workload.requests),
                                    "num_prompt_tokens": workload.num_prompt_tokens},
                       "runs": list(best.values()), "all_runs": runs, "ratios": ratios,
                       "matches_hf_b1": matches},
        "targets": {
            "blocks_unshared_over_shared": saving,
            "blocks_contiguous_over_shared": long["contiguous_blocks"] / long["shared_peak_blocks"],
            "min_speedup_vs_hf_batched": worst_speedup,
            "met": {"blocks": saving >= 2.0, "throughput": worst_speedup > 1.0},
        },
    }
