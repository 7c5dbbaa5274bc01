"""Decode steps as CUDA graphs (engine_service/model/cuda_graphs.py): greedy tokens equal to
eager steps' at padded batch sizes, under preemption (recompute and swap) and in beam search;
the block pool's invariants hold after every step; the graphs really replay.

The size rule and the CPU's eager path run everywhere; the rest needs a CUDA GPU (skipped
without one, run by bench/gpu_check.sh on a lent GPU).
"""

import gc
import os
import random
import uuid
from types import SimpleNamespace

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.core.config import EngineConfig
from engine_service.core.errors import InvalidRequestError
from engine_service.model.beam_search_params import BeamSearchParams
from engine_service.model.cuda_graphs import capture_sizes
from engine_service.model.kv_cache_setup import graph_rows, uses_cuda_graphs

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


def test_graphs_run_on_cuda_with_triton_unless_eager(tiny_llama_dir) -> None:
    """Which engines capture graphs, and how many rows the largest has (runners stubbed: only
    their device and kernels are read)."""
    def runner(device: str, kernels: str) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), kernels=SimpleNamespace(name=kernels))

    config = EngineConfig(model=str(tiny_llama_dir))
    assert uses_cuda_graphs(config, runner("cuda", "triton"))
    assert not uses_cuda_graphs(EngineConfig(model=str(tiny_llama_dir), enforce_eager=True),
                                runner("cuda", "triton"))
    assert not uses_cuda_graphs(config, runner("cuda", "torch"))  # host-built index tensors
    assert not uses_cuda_graphs(config, runner("cpu", "triton"))
    # Not under tensor parallelism: a rank's graph would capture NCCL collectives (the inputs
    # reach every rank: tests/engine/test_tensor_parallel_graphs.py).
    assert not uses_cuda_graphs(EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2),
                                runner("cuda", "triton"))
    assert graph_rows(config) == 256
    small_budget = EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=100)
    assert graph_rows(small_budget) == 100  # no decode step runs more sequences than tokens


def test_enforce_eager_must_be_a_bool(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 'false'"):
        EngineConfig(model=str(tiny_llama_dir), enforce_eager="false")


def test_a_captured_pool_cannot_be_replaced(tiny_llama_dir) -> None:
    """The graphs read the KV pool at its address: replacing it would leave them reading
    freed memory, so the runner refuses."""
    engine = LLM(model=str(tiny_llama_dir), num_blocks=16, max_num_seqs=4).llm_engine
    engine.runner.capture_decode_graphs(4, engine.max_model_len)
    with pytest.raises(RuntimeError, match="captured by the decode CUDA graphs"):
        engine.runner.allocate_kv_cache(16, 0)


@needs_cuda
def test_graph_memory_is_measured_from_an_empty_cache(tiny_llama_dir) -> None:
    """Each capture empties the ordinary pool's cache; measured from a full one, the graphs'
    memory came out negative on an H200 and the plan's check against it could not fire."""
    engine = LLM(model=str(tiny_llama_dir), device="cuda", num_blocks=16, max_num_seqs=4,
                 enforce_eager=True).llm_engine
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # freed: 64 MiB left cached
    added = engine.runner.capture_decode_graphs(4, engine.max_model_len)
    assert added > 0


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


def _staged_run(model_dir, plan: list[tuple[int, list[int], SamplingParams]], graphs: bool,
                device: str, mixed: bool = False, **engine_args) -> dict:
    """Requests added at the steps the plan gives ((step, prompt, params), in step order), run
    to completion with the block invariants checked after every step; each request's outputs
    (tokens and logprobs, or the error that refused it) and how many steps replayed a graph
    (decode graphs; with `mixed`, "mixed_replays": the mixed-step graphs').
    On the CPU, graphs=True gives the engine the graphs' buffers, which it runs eagerly (the
    mixed-step graphs' too with `mixed`)."""
    args = dict(device=device, dtype="float32", enforce_eager=not graphs) | engine_args
    engine = LLM(model=str(model_dir), **args).llm_engine
    if graphs and device == "cpu":
        engine.runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
        if mixed:
            engine.runner.capture_mixed_graphs(engine.config.max_num_batched_tokens)
    wide_steps = []  # steps of more sequences than the graphs have rows (they run eagerly)
    if mixed:
        plain_execute, rows = engine.runner.execute, graph_rows(engine.config)

        def execute(scheduled):
            wide_steps.extend([len(scheduled)] * (len(scheduled) > rows))
            return plain_execute(scheduled)

        engine.runner.execute = execute
    pending = [(at, str(i), prompt, params) for i, (at, prompt, params) in enumerate(plan)]
    outputs: dict[str, object] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            try:
                engine.add_request(request_id, prompt, params)
            except InvalidRequestError as error:  # e.g. more beams than a step can hold
                outputs[request_id] = type(error).__name__
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = [
                    (list(c.token_ids),
                     None if c.logprobs is None else [round(x.logprob, 4) for x in c.logprobs])
                    for c in output.outputs]
        assert engine.check_block_invariants() == [], f"step {step}"
        step += 1
        assert step < 3000, "no progress"
    graph_state = engine.runner.decode_graphs
    outputs["replays"] = 0 if graph_state is None else graph_state.num_replays
    if mixed:
        mixed_state = engine.runner.mixed_graphs
        outputs["mixed_replays"] = 0 if mixed_state is None else mixed_state.num_replays
        outputs["preemptions"] = engine.stats().num_preemptions
        outputs["forwards"] = engine.stats().num_steps
        outputs["wide_steps"] = len(wide_steps)
    del engine
    gc.collect()
    return outputs


def _random_plan(seed: int) -> tuple[list, dict]:
    """A seeded random run: pool, budget and block size drawn; requests of every kind (greedy
    with logprobs, seeded sampling with n > 1, beam search) arriving at random steps, some
    sharing a prefix; so batches grow and shrink, prompts prefill in chunks (a budget of 1
    makes one-token chunks that do not sample), sequences are preempted."""
    rng = random.Random(seed)
    max_num_seqs = rng.choice([1, 3, 5, 6, 9])
    args = dict(max_num_seqs=max_num_seqs, num_blocks=rng.choice([12, 24, 64]),
                block_size=rng.choice([8, 16]),
                max_num_batched_tokens=rng.choice([1, 3, 16, 64, 512]),
                enable_prefix_caching=rng.random() < 0.5,
                preemption_mode=rng.choice(["recompute", "swap"]), swap_space=16 << 20)
    shared = [rng.randrange(3, 5000) for _ in range(80)]
    plan = []
    for _ in range(rng.randint(5, 14)):
        length = rng.randint(1, 70)
        prompt = (shared[:length] if rng.random() < 0.4
                  else [rng.randrange(3, 5000) for _ in range(length)])
        kind = rng.random()
        if kind < 0.6:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True,
                                    logprobs=rng.choice([None, 2]))
        elif kind < 0.8:
            params = SamplingParams(temperature=1.0, n=rng.randint(1, min(3, max_num_seqs)),
                                    seed=rng.randrange(100), max_tokens=rng.randint(1, 15),
                                    ignore_eos=True)
        else:
            params = BeamSearchParams(beam_width=rng.randint(1, min(3, max_num_seqs)), n=1,
                                      max_tokens=rng.randint(1, 10)).sampling_params()
        plan.append((rng.randint(0, 30), prompt, params))
    plan.sort(key=lambda item: item[0])
    return plan, args


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5000) for _ in range(length)]


# Targeted runs, each a case the random ones may not draw:
TARGETED = {
    # The batch shrinks 4 -> 1, the last row finishing first, while new requests arrive.
    # (Stale padding rows do not show here: the blocks they would write are reused only
    # after the batch has grown again; test_padding_rows_are_reset_every_step checks them.)
    "shrinking batch, blocks reused": (
        [(0, _ids(8, i), _greedy(18 - 5 * i)) for i in range(4)]
        + [(6 + 3 * i, _ids(12, 10 + i), _greedy(8)) for i in range(4)],
        dict(max_num_seqs=5, num_blocks=12, block_size=8)),
    # Two sequences decode while a long prompt prefills one token a step (a budget of 3):
    # all rows one token, the prompt's row not sampled.
    "one-token chunks that do not sample": (
        [(0, _ids(5, 1), _greedy(30)), (0, _ids(9, 2), _greedy(30)), (3, _ids(40, 3), _greedy(4))],
        dict(max_num_seqs=4, num_blocks=64, max_num_batched_tokens=3)),
    # A budget of 1: every step one token, most of them not sampled.
    "budget of one token": (
        [(0, _ids(6, 4), _greedy(5)), (2, _ids(3, 5), _greedy(5))],
        dict(max_num_seqs=2, num_blocks=64, max_num_batched_tokens=1)),
    # As many sequences as the largest graph: its last row is a real one.
    "a full largest graph": (
        [(0, _ids(3 + i, 20 + i), _greedy(6)) for i in range(5)],
        dict(max_num_seqs=5, num_blocks=64)),
}


@pytest.mark.parametrize("case", list(TARGETED))
def test_graph_buffers_in_targeted_runs_on_cpu(tiny_llama_dir, case) -> None:
    plan, args = TARGETED[case]
    with_buffers = _staged_run(tiny_llama_dir, plan, True, "cpu", **args)
    usual = _staged_run(tiny_llama_dir, plan, False, "cpu", **args)
    assert usual.pop("replays") == 0 and with_buffers.pop("replays") > 0
    assert with_buffers == usual


def test_padding_rows_are_reset_every_step(tiny_llama_dir) -> None:
    """A padding row writes no K/V (slot -1) and reads one key of block 0, every step: one that
    kept the row's last sequence would attend over (and write into) blocks that sequence may
    no longer hold. Checked on the buffers after each step of a batch shrinking 4 -> 1 (its
    outputs equal the usual ones only while no freed block is reused in time to show it)."""
    engine = LLM(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=5,
                 num_blocks=64, block_size=8).llm_engine
    engine.runner.capture_decode_graphs(5, engine.max_model_len)
    graphs = engine.runner.decode_graphs
    plain_run = graphs.run
    padded_steps = []

    def checked_run(scheduled):
        logits = plain_run(scheduled)
        n = len(scheduled)
        size = min(s for s in graphs.sizes if s >= n)
        pad = slice(n, size)
        assert (graphs.host64[2, pad] == -1).all() and (graphs.host32[pad] == 1).all()
        assert (graphs.host32[graphs.region:].view(graphs.max_size, -1)[pad, 0] == 0).all()
        padded_steps.append(size - n)
        return logits

    graphs.run = checked_run
    for i in range(4):
        engine.add_request(str(i), _ids(8, i), _greedy(18 - 5 * i))
    while engine.has_unfinished_requests():
        engine.step()
    assert any(padded_steps), padded_steps  # 3 sequences ran in the graph of 4


# Four seeds by default (two plans on each tiny model; the targeted runs above pin the cases a
# plan may not draw); more, or one to replay, with PAGEDGEN_GRAPH_SEEDS=0,1,... (test_mixed_graphs
# reads it too).
RANDOM_SEEDS = [int(s) for s in os.environ.get("PAGEDGEN_GRAPH_SEEDS", "0,1,2,3").split(",")]


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_graph_buffers_in_random_runs_on_cpu(tiny_llama_dir, tiny_qwen2_dir, seed) -> None:
    """Random runs (_random_plan) with the graphs' buffers, run eagerly on the CPU, give
    every request the outputs (tokens and logprobs) of the usual step inputs."""
    model_dir = tiny_llama_dir if seed % 2 else tiny_qwen2_dir
    print(f"seed {seed}")
    plan, args = _random_plan(seed)
    with_buffers = _staged_run(model_dir, plan, True, "cpu", **args)
    usual = _staged_run(model_dir, plan, False, "cpu", **args)
    assert usual.pop("replays") == 0 and with_buffers.pop("replays") > 0
    assert with_buffers == usual


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
@pytest.mark.parametrize("seed", range(4))
def test_graph_decode_in_random_runs_gives_the_eager_tokens(tiny_llama_dir, seed) -> None:
    """Random runs (_random_plan) on the GPU: the tokens of eager steps (logprobs are
    not compared: a graph's attention splits the keys differently, see cuda_graphs.py)."""
    print(f"seed {seed}")
    plan, args = _random_plan(seed)
    graphs = _staged_run(tiny_llama_dir, plan, True, "cuda", **args)
    eager = _staged_run(tiny_llama_dir, plan, False, "cuda", **args)
    assert eager.pop("replays") == 0 and graphs.pop("replays") > 0
    tokens = {k: [t for t, _ in v] for k, v in graphs.items()}
    assert tokens == {k: [t for t, _ in v] for k, v in eager.items()}


@needs_cuda
def test_graph_decode_runs_in_bfloat16(tiny_llama_dir) -> None:
    # bf16 (the default on CUDA for bf16 checkpoints): the graphs capture and replay, and the
    # pool stays consistent; tokens are compared in float32 above, where they are exact.
    requests = [(p, GREEDY) for p in _prompts(5, seed=5)]
    tokens, replays = _run(tiny_llama_dir, requests, dtype="bfloat16")
    assert [len(t[0]) for t in tokens] == [GREEDY.max_tokens] * 5
    assert replays >= GREEDY.max_tokens - 1
