"""Tensor parallelism on the CPU (gloo, 2 ranks of one torch thread each;
PAGEDGEN_TEST_TP_DEVICE=cuda runs them on NCCL where there are GPUs enough): the sharded engine
gives the tokens of one rank and of HF, through preemption, chunked prefill, the prefix cache,
parallel sampling and beam search; a dead or hung worker fails the offline API with a clear
error instead of a hang, and closing the engine leaves no process behind.

Exactness: the row-parallel all-reduce sums two partial dot products where one rank sums one,
so logits move in their last bits and a near-tie may flip. Greedy runs are compared as vLLM
compares logprobs: tokens equal, or from the first difference on (only that position is
checked; after it the contexts differ) each side's token is in the other's top 5.
"""

import os
import pickle
import signal
import time

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.model.beam_search_params import BeamSearchParams
from engine_service.model.parallel.workers import TensorParallelError
from tests.engine.prompts import parity_prompts
from tests.support.hf_reference import hf_greedy_top_logprobs
from tests.support.tiny_models import make_tiny_model

# cpu (gloo, the default) or cuda (NCCL, on a machine with at least as many GPUs as ranks).
DEVICE = os.environ.get("PAGEDGEN_TEST_TP_DEVICE", "cpu")
MAX_TOKENS = 24
TOP = 5
BLOCK_SIZE = 8
CHUNK_TOKENS = 32  # prompts past this are prefilled in chunks


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    found = parity_prompts(AutoTokenizer.from_pretrained(smollm2_dir))[:8]
    assert max(map(len, found)) > CHUNK_TOKENS
    return found


@pytest.fixture(scope="module")
def model_dirs(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir, smollm2_dir, tmp_path_factory
               ) -> dict:
    """The shapes TP splits differently: 4 heads / 2 KV heads (one KV head a rank), Qwen2's
    qkv biases and tied embeddings, Qwen3's per-head q and k norms (whole on each rank), one
    KV head (replicated on both ranks), 6 heads / 2 KV heads (3 query heads a rank)."""
    return {
        "llama": tiny_llama_dir,
        "qwen2": tiny_qwen2_dir,
        "qwen3": tiny_qwen3_dir,
        "llama_1kv": make_tiny_model("llama", tmp_path_factory.mktemp("tp_llama_1kv"),
                                     tokenizer_dir=smollm2_dir, seed=2, num_kv_heads=1),
        "qwen2_6h2kv": make_tiny_model("qwen2", tmp_path_factory.mktemp("tp_qwen2_6h2kv"),
                                       tokenizer_dir=smollm2_dir, seed=3, hidden_size=96,
                                       num_heads=6, num_kv_heads=2),
        # Biases on every projection: the row-parallel ones (o, down) added by one rank.
        "llama_biases": make_tiny_model("llama", tmp_path_factory.mktemp("tp_llama_biases"),
                                        tokenizer_dir=smollm2_dir, seed=4,
                                        extra_config={"attention_bias": True,
                                                      "mlp_bias": True}),
    }


def _pool_args(kind: str, prompts: list[list[int]]) -> dict:
    """Tiny Llama: a pool so small that requests preempt by recompute; tiny Qwen2: by swap;
    the others roomy. Every engine prefills in chunks of CHUNK_TOKENS."""
    args = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": CHUNK_TOKENS,
            "dtype": "float32", "num_blocks": 512, "device": DEVICE}
    tight = -(-(max(map(len, prompts)) + MAX_TOKENS) // BLOCK_SIZE) + 6
    if kind == "llama":
        args.update(num_blocks=tight, preemption_mode="recompute")
    elif kind == "qwen2":
        args.update(num_blocks=tight, preemption_mode="swap", swap_space=1 << 22)
    return args


@pytest.fixture(scope="module")
def engines(model_dirs, prompts):
    """One TP=2 LLM and one TP=1 LLM per model, made when first asked for, shared by the
    module's tests and closed at its end."""
    made: dict[tuple[str, int], LLM] = {}

    def get(kind: str, tp: int) -> LLM:
        if (kind, tp) not in made:
            made[kind, tp] = LLM(str(model_dirs[kind]), tensor_parallel_size=tp,
                                 **_pool_args(kind, prompts))
        return made[kind, tp]

    yield get
    for llm in made.values():
        llm.close()
    for (_, tp), llm in made.items():
        if tp > 1:
            assert all(p.returncode is not None for p in llm.llm_engine.runner.workers.procs)


def _greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          logprobs=TOP, **params))
    assert llm.llm_engine.check_block_invariants() == []
    return [(c.token_ids, [lp.top for lp in c.logprobs]) for o in outputs for c in o.outputs]


def assert_close(ours: tuple, ref: tuple, label: str) -> None:
    """Equal tokens, or at the first difference each token in the other's top 5."""
    (tokens, tops), (ref_tokens, ref_tops) = ours, ref
    assert len(tokens) == len(ref_tokens), label
    for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)):
        if a != b:
            assert a in ref_tops[i] and b in tops[i], (
                f"{label}: token {i} is {a}, the reference's {b}, not in each other's top "
                f"{TOP}: {tops[i]} vs {ref_tops[i]}")
            return


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama_1kv", "qwen2_6h2kv",
                                  "llama_biases"])
def test_tp2_greedy_matches_tp1_and_hf(kind, engines, model_dirs, prompts):
    tp2 = engines(kind, 2)
    ours = _greedy(tp2, prompts)
    single = _greedy(engines(kind, 1), prompts)
    for i, prompt in enumerate(prompts):
        hf = hf_greedy_top_logprobs(model_dirs[kind], prompt, MAX_TOKENS, torch.float32, k=TOP)
        hf_run = ([t for t, _ in hf], [top for _, top in hf])
        assert_close(ours[i], single[i], f"{kind} prompt {i} against TP=1")
        assert_close(ours[i], hf_run, f"{kind} prompt {i} against HF")
    counters = tp2.llm_engine.scheduler.counters
    if kind == "llama":
        assert counters.num_recomputed > 0
    if kind == "qwen2":
        assert counters.num_swapped_out > 0
    # Chunked prefill: the longest prompt took several steps before its first token.
    assert tp2.llm_engine.num_steps > max(map(len, prompts)) // CHUNK_TOKENS


def test_tp2_prefix_cache_parallel_sampling_and_beams(engines, prompts):
    tp2, single = engines("llama", 2), engines("llama", 1)
    longest = {"prompt_token_ids": max(prompts, key=len)}
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first, again = tp2.generate(longest, short)[0], tp2.generate(longest, short)[0]
    assert again.num_cached_tokens >= len(longest["prompt_token_ids"]) - BLOCK_SIZE
    assert again.outputs[0].token_ids == first.outputs[0].token_ids

    n2 = _greedy(tp2, prompts[1:4], n=2)
    for i, (ours, ref) in enumerate(zip(n2, _greedy(single, prompts[1:4], n=2), strict=True)):
        assert_close(ours, ref, f"n=2 completion {i}")

    beams = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts[1:3]]
    got = [[s.token_ids for s in o.sequences] for o in tp2.beam_search(requests, beams)]
    want = [[s.token_ids for s in o.sequences] for o in single.beam_search(requests, beams)]
    assert got == want
    assert tp2.llm_engine.check_block_invariants() == []


def test_smollm2_at_tp3(smollm2_dir, prompts):
    """The default model's 9 query heads and 3 KV heads: 3 and 1 a rank."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 3:
        pytest.skip("TP=3 on CUDA needs 3 GPUs")
    llm = LLM(str(smollm2_dir), tensor_parallel_size=3, dtype="float32", num_blocks=256,
              device=DEVICE)
    try:
        ours = _greedy(llm, prompts[:3])
        for i, prompt in enumerate(prompts[:3]):
            hf = hf_greedy_top_logprobs(smollm2_dir, prompt, MAX_TOKENS, torch.float32, k=TOP)
            assert_close(ours[i], ([t for t, _ in hf], [top for _, top in hf]),
                         f"SmolLM2 prompt {i}")
    finally:
        llm.close()


def test_a_size_the_heads_do_not_split_by_is_refused_naming_them(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must divide the model's 4 "
                                         "attention heads, got 3"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=0)


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 1e300, 0, True, "60"])
def test_a_collective_timeout_that_bounds_nothing_is_refused_naming_it(timeout_s,
                                                                       tiny_llama_dir):
    """The timeout is what keeps a hung rank from hanging the engine: infinity (or a number
    too large for gloo's milliseconds) was accepted, and failed the start with OverflowError
    naming nothing, after the workers had started."""
    with pytest.raises(ValueError, match="tensor_parallel_timeout_s must be a finite number "
                                         "of seconds > 0 and at most 86400, got"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, tensor_parallel_timeout_s=timeout_s)


@pytest.mark.parametrize("failure", ["killed", "hung"])
def test_a_failed_worker_fails_generate_with_a_clear_error(failure, tiny_llama_dir):
    """A killed worker: the next collective sees the closed connection at once. A hung one
    (SIGSTOP): the all-reduce, or rank 0's next step broadcast when the worker stopped before
    taking it, gives up after tensor_parallel_timeout_s. Either way generate raises
    TensorParallelError naming what happened, and close() leaves no process."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=64,
              tensor_parallel_timeout_s=3, device=DEVICE)
    worker = llm.llm_engine.runner.workers.procs[0]
    try:
        llm.generate("warm", SamplingParams(max_tokens=2))
        os.kill(worker.pid, signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        if failure == "killed":
            worker.wait(30)
        with pytest.raises(TensorParallelError) as raised:
            llm.generate("The capital of France is", SamplingParams(max_tokens=8))
        if failure == "killed":
            assert f"rank 1 (pid {worker.pid}) exited with status -9" in str(raised.value)
        else:
            assert "collective failed" in str(raised.value)
    finally:
        llm.close()
    assert worker.returncode is not None


def test_rank_0_failing_after_a_call_went_out_kills_its_workers_at_close(tiny_llama_dir):
    """Rank 0's own forward failing once the call has reached the workers (here a ValueError
    its model raises, as a bug would) leaves them inside that call's collectives: close()
    kills them. It sent them 'stop' instead, which they could not take until their all-reduce
    timed out (tensor_parallel_timeout_s): close() waited that long, and they exited 1 on
    their own."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=64,
              tensor_parallel_timeout_s=30, device=DEVICE)
    runner = llm.llm_engine.runner
    worker = runner.workers.procs[0]
    try:
        llm.generate("warm", SamplingParams(max_tokens=2))

        def failing_forward(*args, **kwargs):
            raise ValueError("rank 0's forward failed")

        runner._local.model.forward = failing_forward
        with pytest.raises(ValueError, match="rank 0's forward failed"):
            llm.generate("The capital of France is", SamplingParams(max_tokens=4))
        # The group is broken for good: the next step is refused at once, not sent to workers
        # that would take it only after their collective's 30 s timeout.
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="group is broken"):
            llm.llm_engine.runner.run_batch(None)
        assert time.monotonic() - start < 5
    finally:
        llm.close()
    assert worker.returncode == -signal.SIGKILL
    with pytest.raises(TensorParallelError, match="group is closed"):
        runner.run_batch(None)


def test_a_killed_rank_0_takes_its_workers_with_it(tiny_llama_dir):
    """SIGKILL of the process holding the engine (no close, no finalizer): its workers see
    their parent gone and exit; none is left behind."""
    import subprocess
    import sys

    from tests.service.test_engine_death import wait_gone

    script = ("import sys, time; from engine_service import LLM; "
              f"llm = LLM({str(tiny_llama_dir)!r}, tensor_parallel_size=2, num_blocks=32); "
              "print(*[p.pid for p in llm.llm_engine.runner.workers.procs], flush=True); "
              "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(workers) == 1
    finally:
        proc.kill()
        proc.wait()
    assert all(wait_gone(pid) for pid in workers), "a worker outlived rank 0"


def test_a_call_that_does_not_pickle_fails_alone(tiny_llama_dir):
    """Nothing went out: the group is not broken, the next call is served (it was refused as
    'broken' for the engine's life), and block moves recorded before it still reach the
    workers."""
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", num_blocks=64,
              tensor_parallel_timeout_s=30, device=DEVICE)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        before = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
        runner = llm.llm_engine.runner
        pending = runner._pending_moves = [object()]  # as if a copy-on-write waited to go
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            runner.run_batch(lambda: None)  # a local function does not pickle
        assert runner._pending_moves is pending
        runner._pending_moves = []
        after = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
        assert after == before
    finally:
        llm.close()
