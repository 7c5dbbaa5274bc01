"""The CUDA graphs' buffers under tensor parallelism (issue 33, "CUDA graphs per rank", part 1):
rank 0 prepares each step's writes into its decode / mixed-step buffers from the schedule and
sends them (engine_service/model/parallel/tp_runner.py); each worker applies them to its own
buffers and runs the same forward. On the CPU (gloo, 2 ranks of one torch thread each) the
buffers run that forward eagerly, as tests/engine/test_cuda_graphs.py and test_mixed_graphs.py
do on one rank: seeded random runs with chunked prefill, preemption (recompute and swap), a
prefix cache and n > 1 give the greedy tokens of one rank's eager steps, and after every step
each rank's buffers are equal to rank 0's (by digest). Capturing graphs under tensor
parallelism on CUDA is refused (it needs NCCL collectives in a capture: two GPUs).

The torch reference attention runs the mixed-step buffers (the C++ CPU kernel insists that
query_start_loc ends at the token count; tests/engine/test_mixed_graphs.py says so).
"""

import os
import random
import signal
import threading

import pytest

from engine_service import LLM, SamplingParams
from engine_service.core.errors import InvalidRequestError
from engine_service.model.kv_cache_setup import graph_rows
from engine_service.model.parallel.errors import TensorParallelError
from tests.engine.test_tensor_parallel import TOP, assert_close

SEEDS = (10, 11, 23)  # recompute / swap alternate; prefix caching in 10 and 23


def _plan(seed: int) -> tuple[list, dict]:
    """Requests arriving at random steps, some sharing a prefix, greedy with top-5 logprobs,
    n of 1 to 3; a pool of 12 blocks of 8 tokens, so sequences are preempted (by recompute
    for even seeds, by swap for odd ones); a token budget of 8 to 24, so prompts are
    prefilled in chunks."""
    rng = random.Random(seed)
    args = dict(max_num_seqs=rng.choice([4, 6]), num_blocks=12, block_size=8,
                max_num_batched_tokens=rng.choice([8, 16, 24]),
                enable_prefix_caching=rng.random() < 0.5,
                preemption_mode=("recompute", "swap")[seed % 2], swap_space=16 << 20)
    shared = [rng.randrange(3, 5000) for _ in range(40)]
    plan = []
    for _ in range(rng.randint(7, 10)):
        length = rng.randint(1, 40)
        prompt = (shared[:length] if rng.random() < 0.4
                  else [rng.randrange(3, 5000) for _ in range(length)])
        params = SamplingParams(temperature=0, n=rng.choice([1, 1, 2, 3]),
                                max_tokens=rng.randint(2, 16), ignore_eos=True, logprobs=TOP)
        plan.append((rng.randint(0, 12), prompt, params))
    plan.sort(key=lambda item: item[0])
    return plan, args


def _run(model_dir, plan: list, args: dict, tensor_parallel_size: int,
         buffers: bool) -> dict:
    """The plan to completion, block invariants checked after every step; each request's
    completions (tokens and top-5 lists) or the error that refused it. With `buffers`, the
    graphs' buffers run the steps they take, and every rank's digest of them is compared
    after every step."""
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", kernel_backend="torch",
              tensor_parallel_size=tensor_parallel_size, **args)
    engine = llm.llm_engine
    runner = engine.runner
    try:
        if buffers:
            runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
            runner.capture_mixed_graphs(engine.config.max_num_batched_tokens)
        pending = [(at, str(i), prompt, params) for i, (at, prompt, params) in enumerate(plan)]
        outputs: dict[str, object] = {}
        seen_digests = set()
        step = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                _, request_id, prompt, params = pending.pop(0)
                try:
                    engine.add_request(request_id, prompt, params)
                except InvalidRequestError as error:
                    outputs[request_id] = type(error).__name__
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = [
                        (list(c.token_ids), [lp.top for lp in c.logprobs]) for c in output.outputs]
            assert engine.check_block_invariants() == [], f"step {step}"
            if buffers:
                digests = runner.graph_buffer_digests()
                assert len(digests) == tensor_parallel_size
                assert digests.count(digests[0]) == len(digests), (
                    f"step {step}: a worker's graph buffers differ from rank 0's")
                seen_digests.add(digests[0])
            step += 1
            assert step < 3000, "no progress"
        counts = {"preemptions": engine.stats().num_preemptions, "steps": step}
        if buffers:
            counts["decode_replays"] = runner.decode_graphs.num_replays
            counts["mixed_replays"] = runner.mixed_graphs.num_replays
            counts["distinct_digests"] = len(seen_digests)
            # The comparison can fail: a change to rank 0's buffers alone shows.
            runner.decode_graphs.host32[-1] += 1
            digests = runner.graph_buffer_digests()
            assert digests[0] != digests[1]
            runner.decode_graphs.host32[-1] -= 1
        return {"outputs": outputs, "counts": counts}
    finally:
        llm.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_graph_buffers_under_tp2_give_tp1_eager_tokens(seed, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if seed % 2 else tiny_qwen2_dir
    plan, args = _plan(seed)
    print(f"seed {seed}: {len(plan)} requests, {args}")
    ours = _run(model_dir, plan, args, 2, buffers=True)
    reference = _run(model_dir, plan, args, 1, buffers=False)
    counts = ours["counts"]
    print(counts)
    assert counts["decode_replays"] > 0 and counts["mixed_replays"] > 0, counts
    assert counts["preemptions"] > 0, counts
    assert counts["distinct_digests"] > 1, counts  # the buffers did change, alike on each rank
    got, want = ours["outputs"], reference["outputs"]
    assert got.keys() == want.keys()
    for request_id, completions in want.items():
        if isinstance(completions, str):
            assert got[request_id] == completions, request_id
            continue
        assert len(got[request_id]) == len(completions), request_id
        for index, (ours_c, ref_c) in enumerate(zip(got[request_id], completions, strict=True)):
            assert_close(ours_c, ref_c, f"seed {seed} request {request_id} completion {index}")


def test_a_pool_under_the_buffers_is_refused_on_rank_0_first(tiny_llama_dir):
    """The buffers read the KV pool where it is (on CUDA, captured): replacing it is refused
    on rank 0 before the call reaches a worker, so the group lives on and generates."""
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", kernel_backend="torch",
              tensor_parallel_size=2, num_blocks=32, max_num_seqs=4)
    try:
        engine = llm.llm_engine
        engine.runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
        with pytest.raises(RuntimeError, match="captured by the decode CUDA graphs"):
            engine.runner.allocate_kv_cache(32, 0)
        with pytest.raises(RuntimeError, match="captured by the decode CUDA graphs"):
            engine.runner.profile_run(16, 1)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        assert engine.runner.decode_graphs.num_replays > 0
        assert engine.runner.workers.all_alive()
    finally:
        llm.close()


def test_a_worker_killed_mid_step_in_the_buffers_fails_the_step_naming_it(tiny_llama_dir):
    """A worker SIGKILLed while the steps run through the buffers: the step fails at once with
    TensorParallelError naming the rank and its exit (rank 0 sees the closed connection before
    the exit can be reaped: the error waits for it briefly rather than blaming the collective),
    and close() leaves no process."""
    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", kernel_backend="torch",
              tensor_parallel_size=2, num_blocks=400, max_num_seqs=8)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    worker = runner.workers.procs[0]
    try:
        runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
        runner.capture_mixed_graphs(engine.config.max_num_batched_tokens)
        for i in range(8):
            engine.add_request(str(i), [5 + i, 6, 7],
                               SamplingParams(temperature=0, max_tokens=700, ignore_eos=True))
        while runner.decode_graphs.num_replays == 0:
            engine.step()
        killer = threading.Timer(0.2, os.kill, (worker.pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(TensorParallelError) as raised:
            while engine.has_unfinished_requests():
                engine.step()
        killer.join()
        assert f"rank 1 (pid {worker.pid}) exited with status -9" in str(raised.value)
    finally:
        llm.close()
    assert worker.returncode == -9
