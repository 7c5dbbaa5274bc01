"""Parallel sampling: the KV blocks n samples of one prompt hold when they share the prompt's
blocks (copy-on-write), against the same samples each holding all of its own tokens.

The vLLM paper (section 6.3, Fig. 15) reports the saving as blocks saved by sharing over the
blocks held without sharing: 6.1-9.8% on Alpaca and 16.2-30.5% on ShareGPT for n = 2, 4, 6.
Here: a ShareGPT-like and an Alpaca-like workload (random token ids, the datasets' length
distributions, bench/workloads.py), every request with n samples, all sent at once to one
engine whose pool holds them all (no preemption: checked), stepped by hand. After every step
the bench reads the engine's block tables:
    shared      distinct blocks held by the live samples of the running requests;
    unshared    the sum over those samples of the blocks in each one's table (each holding
                all of its own computed tokens: what a paged system without sharing holds).
The saving is 1 - sum(shared) / sum(unshared) over the steps (block-steps: a time average, as
memory is held over time) and at the step where unshared peaks. EOS is ignored and every
sample runs its request's output length, so the counts do not depend on the model's weights:
they are exact for the workload, not measurements with noise. They are taken on the random
one-layer Llama of bench/step_loop.py (SmolLM2's tokenizer and vocabulary): the same counts as
SmolLM2 would give (checked in tests/test_bench_ablations.py), in seconds instead of
minutes on a CPU.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass

from bench.workloads import Workload, alpaca_like, sharegpt_like


@dataclass(frozen=True, slots=True)
class ParallelShape:
    num_requests: int  # per workload
    widths: tuple[int, ...]  # n
    sharegpt_scale: float  # ShareGPT-like lengths scaled (1.0: the dataset's means)


FULL_SHAPE = ParallelShape(16, (2, 4, 6), 1.0)
QUICK_SHAPE = ParallelShape(4, (2, 4), 0.25)


@dataclass(slots=True)
class ParallelMemory:
    workload: str
    n: int
    num_requests: int
    block_size: int
    num_steps: int
    shared_block_steps: int  # sum over steps of the distinct blocks held
    unshared_block_steps: int  # the same samples with nothing shared
    saving: float  # 1 - shared / unshared over the block-steps
    peak_unshared_blocks: int
    shared_at_peak: int  # distinct blocks held at the step where unshared peaks
    num_preemptions: int  # 0: the pool held every sample throughout


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def measure(engine, workload: Workload, n: int) -> ParallelMemory:
    from engine_service.model.sampling_params import SamplingParams

    bs = engine.config.block_size
    before = engine.stats().num_preemptions
    for r in workload.requests:
        params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=r.output_len,
                                min_tokens=r.output_len, ignore_eos=True)
        engine.add_request(uuid.uuid4().hex, list(r.prompt_token_ids), params)
    shared_sum = unshared_sum = steps = 0
    peak_unshared = shared_at_peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        tables = [engine.kv.block_table(s) for g in engine.scheduler.running
                  for s in g.live_seqs()]
        shared = len({b for table in tables for b in table})
        unshared = sum(len(table) for table in tables)
        shared_sum += shared
        unshared_sum += unshared
        if unshared > peak_unshared:
            peak_unshared, shared_at_peak = unshared, shared
    if problems := engine.check_block_invariants():
        raise RuntimeError(f"block invariants broken: {problems}")
    return ParallelMemory(
        workload=workload.name,
        n=n,
        num_requests=len(workload.requests),
        block_size=bs,
        num_steps=steps,
        shared_block_steps=shared_sum,
        unshared_block_steps=unshared_sum,
        saving=1 - shared_sum / unshared_sum if unshared_sum else 0.0,
        peak_unshared_blocks=peak_unshared,
        shared_at_peak=shared_at_peak,
        num_preemptions=engine.stats().num_preemptions - before,
    )


def workloads(shape: ParallelShape, seed: int) -> list[Workload]:
    return [
        sharegpt_like(shape.num_requests, 2048, seed, scale=shape.sharegpt_scale),
        alpaca_like(shape.num_requests, 2048, seed),
    ]


def counting_model() -> str:
    """The tiny random Llama the counts are taken on (written once under the cache)."""
    from bench.step_loop import tiny_llama
    from engine_service.model.paths import cache_dir

    return str(tiny_llama(cache_dir() / "bench" / "parallel-sampling-llama", 2048))


def parallel_sampling_bench(model_path: str, shape: ParallelShape, seed: int, log=print,
                            **engine_args) -> dict:
    """Every (workload, n) on one engine in float32, the default block size (16), a pool
    large enough that nothing is preempted (checked: num_preemptions is reported), and prefix
    caching off so requests share nothing with each other or with earlier runs."""
    from engine_service import LLM

    engine_args.setdefault("dtype", "float32")
    engine_args.setdefault("enable_prefix_caching", False)
    block_size = engine_args.setdefault("block_size", 16)
    sets = workloads(shape, seed)
    # Room for every sample of every request at its full length, unshared, and then some.
    most = max(sum(_blocks(r.prompt_len + r.output_len, block_size) + 1 for r in w.requests)
               for w in sets)
    engine_args.setdefault("num_blocks", max(shape.widths) * most + 64)
    engine = LLM(model=model_path, **engine_args).llm_engine
    runs = []
    for workload in sets:
        for n in shape.widths:
            log(f"parallel sampling: {workload.name}, n = {n}")
            runs.append(asdict(measure(engine, workload, n)))
    return {
        "shape": asdict(shape),
        "dtype": engine.config.dtype,
        "model": model_path,
        "runs": runs,
        "workloads": [{"name": w.name, "num_prompt_tokens": w.num_prompt_tokens,
                       "num_output_tokens": w.num_output_tokens} for w in sets],
        # The paper's Fig. 15 ranges over n = 2, 4, 6, for comparison in the report.
        "paper_saving": {"sharegpt_like": [0.162, 0.305], "alpaca_like": [0.061, 0.098]},
    }
