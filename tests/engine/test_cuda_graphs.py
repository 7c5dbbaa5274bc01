"""Decode steps as CUDA graphs (engine_service/model/cuda_graphs.py): greedy tokens equal to
eager steps' at padded batch sizes, under preemption (recompute and swap) and in beam search;
the block pool's invariants hold after every step; the graphs really replay.

The size rule and the CPU's eager path run everywhere; the rest needs a CUDA GPU (skipped
without one, run by bench/gpu_check.sh on a lent GPU).
"""

import gc
import random
import uuid

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.model.beam_search_params import BeamSearchParams
from engine_service.model.cuda_graphs import capture_sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_capture_sizes_cover_every_batch_with_little_padding() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    for n in range(1, 257):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < 16 and padded < 2 * n or padded == n, (n, padded)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        capture_sizes(0)


def test_cpu_engine_captures_no_graphs(tiny_llama_dir) -> None:
    llm = LLM(model=str(tiny_llama_dir), num_blocks=16, max_num_seqs=4)
    assert llm.llm_engine.runner.decode_graphs is None


def _prompts(count: int, seed: int) -> list[dict]:
    """Prompts of 1 to 100 tokens: one-block, partial-block and many-block contexts."""
    rng = random.Random(seed)
    lens = [1, 5, 17, 40, 100, 3, 64, 9, 33, 2, 7, 50, 12, 20, 8, 16, 31]
    return [{"prompt_token_ids": [rng.randrange(3, 5000) for _ in range(lens[i % len(lens)])]}
            for i in range(count)]


def _run(model_dir, requests: list[tuple[dict, SamplingParams]], buffers_on_cpu=False,
         **engine_args):
    """Every request to completion, the pool's invariants checked after each step; the token
    ids of every completion in request order, and how many steps replayed a graph.
    buffers_on_cpu: a CPU engine given the graphs' buffers, which it runs eagerly."""
    args = dict(device="cuda", dtype="float32", num_blocks=256, max_num_seqs=32)
    args.update(engine_args)
    engine = LLM(model=str(model_dir), **args).llm_engine
    if buffers_on_cpu:
        engine.runner.capture_decode_graphs(args["max_num_seqs"], engine.max_model_len)
    ids = [uuid.uuid4().hex for _ in requests]
    for request_id, (prompt, params) in zip(ids, requests, strict=True):
        engine.add_request(request_id, prompt["prompt_token_ids"], params)
    finished = {}
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        assert engine.check_block_invariants() == [], f"step {step}"
        step += 1
    graphs = engine.runner.decode_graphs
    replays = 0 if graphs is None else graphs.num_replays
    tokens = [[list(c.token_ids) for c in finished[i].outputs] for i in ids]
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, replays


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# Triton on the CPU means its interpreter: where CUDA is, the kernels are compiled for the GPU.
CPU_BACKENDS = [("auto", 3), ("auto", 17)] + [("triton", 3)] * (not torch.cuda.is_available())


@pytest.mark.parametrize("backend, batch", CPU_BACKENDS)
def test_graph_buffers_give_the_usual_tokens_on_cpu(tiny_llama_dir, backend, batch) -> None:
    """The rows, padding rows (no K/V write) and block tables the graphs read, run eagerly on
    the CPU (C++ kernels, and the Triton kernels in the interpreter): the same tokens as the
    usual step inputs, bit for bit (these kernels' rows do not depend on the batch)."""
    params = GREEDY if backend == "auto" else SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True)
    requests = [(p, params) for p in _prompts(batch, seed=batch)]
    cpu = dict(device="cpu", kernel_backend=backend, max_num_seqs=batch + 2)
    buffer_tokens, replays = _run(tiny_llama_dir, requests, buffers_on_cpu=True, **cpu)
    usual_tokens, usual_replays = _run(tiny_llama_dir, requests, **cpu)
    assert buffer_tokens == usual_tokens
    assert usual_replays == 0 and replays >= params.max_tokens - 1


@needs_cuda
@pytest.mark.parametrize("batch", [1, 3, 17])  # graphs of 1, 4 and 32 rows: 0, 1, 15 padded
def test_graph_decode_gives_the_eager_tokens(tiny_llama_dir, batch) -> None:
    requests = [(p, GREEDY) for p in _prompts(batch, seed=batch)]
    graph_tokens, replays = _run(tiny_llama_dir, requests)
    eager_tokens, eager_replays = _run(tiny_llama_dir, requests, enforce_eager=True)
    assert graph_tokens == eager_tokens
    assert eager_replays == 0
    # Every step after the first (the prefill) decodes: 23 of them, all replayed.
    assert replays >= GREEDY.max_tokens - 1


@needs_cuda
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_graph_decode_under_preemption_gives_the_eager_tokens(tiny_qwen2_dir, mode) -> None:
    # 12 sequences of up to 100 + 24 tokens in 40 blocks of 16: some are preempted and resumed.
    requests = [(p, GREEDY) for p in _prompts(12, seed=7)]
    small = dict(num_blocks=40, preemption_mode=mode, swap_space=64 << 20)
    graph_tokens, replays = _run(tiny_qwen2_dir, requests, **small)
    eager_tokens, _ = _run(tiny_qwen2_dir, requests, enforce_eager=True, **small)
    assert graph_tokens == eager_tokens
    assert replays > 0


@needs_cuda
def test_graph_decode_in_beam_search_gives_the_eager_beams(tiny_llama_dir) -> None:
    # Beams fork and share blocks (copy-on-write copies before the replayed steps).
    beam = BeamSearchParams(beam_width=4, n=2, max_tokens=12).sampling_params()
    requests = [(p, beam) for p in _prompts(3, seed=3)] + [(_prompts(1, 9)[0], GREEDY)]
    graph_tokens, replays = _run(tiny_llama_dir, requests)
    eager_tokens, _ = _run(tiny_llama_dir, requests, enforce_eager=True)
    assert graph_tokens == eager_tokens
    assert replays > 0


@needs_cuda
def test_graph_decode_runs_in_bfloat16(tiny_llama_dir) -> None:
    # bf16 (the default on CUDA for bf16 checkpoints): the graphs capture and replay, and the
    # pool stays consistent; tokens are compared in float32 above, where they are exact.
    requests = [(p, GREEDY) for p in _prompts(5, seed=5)]
    tokens, replays = _run(tiny_llama_dir, requests, dtype="bfloat16")
    assert [len(t[0]) for t in tokens] == [GREEDY.max_tokens] * 5
    assert replays >= GREEDY.max_tokens - 1
