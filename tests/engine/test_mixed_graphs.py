"""Steps with prefill chunks as CUDA graphs (engine_service/model/mixed_graphs.py): their
buffers, run eagerly on the CPU, give every request the outputs of the usual step inputs in
seeded random runs and in targeted ones (chunked prefill beside decodes, preemption by
recompute and by swap, n > 1, beam search); padding tokens write nothing into the KV pool;
the token buckets; enforce_eager captures nothing. On CUDA (skipped without one, run by
bench/gpu_check.sh's tests stage on a lent GPU): graphed steps give the eager tokens.

The mixed-step buffers need an attention that reads its metadata from tensors (tokens past
the last sequence, rows with no tokens): the torch reference and the Triton kernels (here in
Triton's interpreter). The C++ CPU kernel insists that query_start_loc ends at the token
count, and the CPU never captures graphs, so it is not run on them.
"""

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.model.beam_search_params import BeamSearchParams
from engine_service.model.kv_cache_setup import graph_rows
from engine_service.model.mixed_graphs import MAX_MIXED_GRAPHS, mixed_capture_sizes
from tests.engine.test_cuda_graphs import (
    RANDOM_SEEDS,
    _greedy,
    _ids,
    _random_plan,
    _staged_run,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_mixed_capture_sizes_pad_little_and_stay_few() -> None:
    assert mixed_capture_sizes(1) == [1]
    assert mixed_capture_sizes(16) == [16]
    assert mixed_capture_sizes(100) == [16, 32, 64, 100]
    assert mixed_capture_sizes(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536,
                                         1792, 2048]
    for budget in (3, 300, 4096, 8192, 32768, 100_000):
        sizes = mixed_capture_sizes(budget)
        assert len(sizes) <= MAX_MIXED_GRAPHS and sizes[-1] == budget, (budget, sizes)
        assert sizes == sorted(set(sizes)) and sizes[0] >= 1
        for tokens in range(1, budget + 1, max(1, budget // 997)):
            padded = min(s for s in sizes if s >= tokens)
            assert padded < 2 * tokens or padded <= 16, (budget, tokens, padded)
    assert len(mixed_capture_sizes(8192)) == 36  # steps of 256
    assert mixed_capture_sizes(32768)[5:9] == [512, 1024, 2048, 3072]  # steps of 1,024
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):
        mixed_capture_sizes(0)


def _compare(model_dir, plan, args, backend="torch") -> dict:
    """The plan run with the mixed-step (and decode) buffers and with the usual step inputs;
    both outputs, asserted equal; the buffers' run's counts."""
    args = dict(kernel_backend=backend) | args
    with_buffers = _staged_run(model_dir, plan, True, "cpu", mixed=True, **args)
    usual = _staged_run(model_dir, plan, False, "cpu", mixed=True, **args)
    counts = {k: with_buffers.pop(k) for k in ("replays", "mixed_replays")}
    assert usual.pop("replays") == 0 and usual.pop("mixed_replays") == 0
    assert with_buffers == usual
    # Every step ran through one of the two sets of buffers, but those with more sequences
    # than their rows (graph_rows): seed 3 has steps of 4 sequences at max_num_seqs 3.
    assert (counts["replays"] + counts["mixed_replays"] + usual["wide_steps"]
            == usual["forwards"]), (counts, usual)
    return counts | {"preemptions": usual["preemptions"]}


@pytest.mark.parametrize("seed", RANDOM_SEEDS)  # PAGEDGEN_GRAPH_SEEDS for more
def test_mixed_graph_buffers_in_random_runs_on_cpu(tiny_llama_dir, tiny_qwen2_dir,
                                                   tiny_qwen3_dir, seed) -> None:
    """Random runs (test_cuda_graphs._random_plan: chunked prefill, preemption by recompute or
    swap, n > 1, beam search, prefix sharing, requests arriving at random steps) give every
    request the usual outputs, tokens and logprobs; the models in turn (Qwen3's per-head
    norms write into the projection in place)."""
    model_dir = (tiny_qwen2_dir, tiny_llama_dir, tiny_qwen3_dir)[seed % 3]
    print(f"seed {seed}")
    plan, args = _random_plan(seed)
    counts = _compare(model_dir, plan, args)
    assert counts["mixed_replays"] > 0, counts


def _sampled(n: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, n=n, seed=5, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=1)


# (plan, engine args, whether it preempts): each a case the random runs may not draw.
TARGETED = {
    # Two sequences decode while a 60-token prompt prefills in chunks beside them.
    "chunks beside decodes": (
        [(0, _ids(5, 1), _greedy(20)), (0, _ids(9, 2), _greedy(20)), (3, _ids(60, 3), _greedy(6))],
        dict(max_num_seqs=4, num_blocks=64, max_num_batched_tokens=16), False),
    # Six 30-token prompts in 14 blocks of 8: sequences are preempted and come back.
    "preemption by recompute": (
        [(i, _ids(30, 10 + i), _greedy(12)) for i in range(6)],
        dict(max_num_seqs=6, num_blocks=14, block_size=8, max_num_batched_tokens=40,
             preemption_mode="recompute"), True),
    "preemption by swap": (
        [(i, _ids(30, 20 + i), _greedy(12)) for i in range(6)],
        dict(max_num_seqs=6, num_blocks=14, block_size=8, max_num_batched_tokens=40,
             preemption_mode="swap", swap_space=16 << 20), True),
    # n = 3 forks share the prompt's blocks; a second prompt prefills beside their decodes.
    "n > 1": (
        [(0, _ids(21, 4), _sampled(3, 10)), (2, _ids(37, 5), _sampled(2, 6))],
        dict(max_num_seqs=6, num_blocks=64, block_size=8, max_num_batched_tokens=24), False),
    "beam search": (
        [(0, _ids(19, 6), BeamSearchParams(beam_width=3, n=2, max_tokens=8).sampling_params()),
         (3, _ids(45, 7), _greedy(5))],
        dict(max_num_seqs=6, num_blocks=64, block_size=8, max_num_batched_tokens=20), False),
}


@pytest.mark.parametrize("case", list(TARGETED))
def test_mixed_graph_buffers_in_targeted_runs_on_cpu(tiny_llama_dir, case) -> None:
    plan, args, preempts = TARGETED[case]
    counts = _compare(tiny_llama_dir, plan, args)
    assert counts["mixed_replays"] > 0 and counts["replays"] > 0, counts
    assert (counts["preemptions"] > 0) == preempts, counts


# Padding tokens' attention output is left unwritten (mixed_graphs.py): whatever memory held
# goes through their rows of the GEMMs, and the interpreter's numpy may warn of overflow there.
PADDING_ROWS_MAY_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@PADDING_ROWS_MAY_OVERFLOW
def test_mixed_graph_buffers_with_triton_kernels_on_cpu(tiny_qwen2_dir) -> None:
    """The Triton kernels (the ones graphed on CUDA; here in the interpreter) over the
    buffers: chunks beside decodes, padding tokens and rows, and a fork."""
    plan = [(0, _ids(11, 8), _greedy(4)), (1, _ids(26, 9), _sampled(2, 3))]
    args = dict(max_num_seqs=4, num_blocks=32, block_size=8, max_num_batched_tokens=12)
    counts = _compare(tiny_qwen2_dir, plan, args, backend="triton")
    assert counts["mixed_replays"] > 0 and counts["replays"] > 0, counts


def test_padding_tokens_write_nothing_to_the_kv_cache_on_cpu(tiny_llama_dir) -> None:
    """Every step through the mixed-step buffers changes the KV pool only in the slots of its
    real tokens: the pool is filled with a marker first, and after each step every byte
    outside those slots is compared with the step before."""
    engine = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                 kernel_backend="torch", max_num_seqs=4, num_blocks=32, block_size=8,
                 max_num_batched_tokens=20).llm_engine
    runner = engine.runner
    runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
    runner.capture_mixed_graphs(engine.config.max_num_batched_tokens)
    graphs = runner.mixed_graphs
    runner.kv_caches.fill_(-7.0)
    plain_run = graphs.run
    padded = []

    def checked_run(scheduled):
        before = runner.kv_caches.clone()
        logits = plain_run(scheduled)
        bs = runner.block_size
        real = torch.zeros(runner.kv_caches.shape[2] * bs, dtype=torch.bool)
        for item in scheduled:
            start = item.seq.num_computed_tokens
            for pos in range(start, start + item.num_new_tokens):
                real[item.block_table[pos // bs] * bs + pos % bs] = True
        # [layers, 2, blocks, block_size, heads, dim] -> one row of bytes per slot
        def by_slot(pool: torch.Tensor) -> torch.Tensor:
            slots = pool.view(torch.int32).transpose(0, 2).transpose(1, 3)
            return slots.reshape(real.numel(), -1)
        changed = (by_slot(before) != by_slot(runner.kv_caches)).any(dim=1)
        assert not (changed & ~real).any(), torch.nonzero(changed & ~real).flatten().tolist()
        assert changed[real].all()  # the real tokens' K/V did land
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        padded.append(min(s for s in graphs.sizes if s >= num_tokens) - num_tokens)
        return logits

    graphs.run = checked_run
    for i, (length, at) in enumerate([(13, 0), (7, 0), (30, 2), (9, 5)]):
        while engine.num_steps < at:
            engine.step()
        engine.add_request(str(i), _ids(length, 30 + i), _greedy(6))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(padded) >= 3 and any(padded), padded


def test_rows_are_shared_and_written_incrementally_on_cpu(tiny_llama_dir) -> None:
    """Decode and mixed steps read one set of sequence rows: after every step through either
    buffers, each scheduled sequence's device table row equals its block table, the device
    tables equal the host mirror, and a sequence that keeps its row uploads only the entries
    that changed (new blocks, a copy-on-write), never its whole table again."""
    engine = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                 kernel_backend="torch", max_num_seqs=6, num_blocks=64, block_size=8,
                 max_num_batched_tokens=24).llm_engine
    runner = engine.runner
    runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
    runner.capture_mixed_graphs(engine.config.max_num_batched_tokens)
    rows = runner.decode_graphs
    kinds = []

    def checked(run, kind):
        def wrapped(scheduled):
            before = {i.seq.seq_id: rows._row_of.get(i.seq.seq_id) for i in scheduled}
            written = {seq_id: rows._written[row] for seq_id, row in before.items()
                       if row is not None}
            logits = run(scheduled)
            device = rows.dev32[rows.region :].view(rows.max_size, rows.width)
            host = rows.host32[rows.region :].view(rows.max_size, rows.width)
            assert torch.equal(device, host)
            for item in scheduled:
                row = rows._row_of[item.seq.seq_id]
                assert device[row, : len(item.block_table)].tolist() == item.block_table
            if all(rows._row_of[seq_id] == row for seq_id, row in before.items()):
                new_blocks = sum(len(i.block_table) - written.get(i.seq.seq_id, 0)
                                 for i in scheduled)
                assert rows._num_staged <= new_blocks + len(scheduled) + rows.max_size, kind
            kinds.append(kind)
            return logits
        return wrapped

    rows.run = checked(rows.run, "decode")
    runner.mixed_graphs.run = checked(runner.mixed_graphs.run, "mixed")
    for i, (length, at) in enumerate([(30, 0), (9, 0), (41, 3), (13, 9), (27, 14)]):
        while engine.num_steps < at:
            engine.step()
        params = _sampled(2, 8) if i == 1 else _greedy(12)
        engine.add_request(str(i), _ids(length, 50 + i), params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.check_block_invariants() == []
    assert "decode" in kinds and kinds.count("mixed") >= 4, kinds


def test_no_graph_captured_on_cpu(tiny_llama_dir) -> None:
    """The engine captures the mixed-step graphs with the decode ones, only where those are
    captured (kv_cache_setup.uses_cuda_graphs: CUDA, Triton, not enforce_eager; checked in
    test_cuda_graphs): on the CPU, with or without enforce_eager, no graph."""
    for eager in (False, True):
        engine = LLM(model=str(tiny_llama_dir), device="cpu", num_blocks=16, max_num_seqs=4,
                     enforce_eager=eager).llm_engine
        assert engine.runner.decode_graphs is None and engine.runner.mixed_graphs is None
    engine = LLM(model=str(tiny_llama_dir), device="cpu", num_blocks=16,
                 max_num_seqs=4).llm_engine
    with pytest.raises(RuntimeError, match="capture the decode graphs first"):
        engine.runner.capture_mixed_graphs(64)


@needs_cuda
def test_enforce_eager_on_cuda_captures_no_graph(tiny_llama_dir) -> None:
    config = dict(device="cuda", dtype="float32", num_blocks=64, max_num_seqs=4)
    graphed = LLM(model=str(tiny_llama_dir), **config).llm_engine
    assert graphed.runner.mixed_graphs is not None and graphed.runner.mixed_graphs.graphs
    del graphed
    eager = LLM(model=str(tiny_llama_dir), enforce_eager=True, **config).llm_engine
    assert eager.runner.decode_graphs is None and eager.runner.mixed_graphs is None


@needs_cuda
@pytest.mark.parametrize("seed", range(4))
def test_graphed_mixed_steps_give_the_eager_tokens(tiny_llama_dir, seed) -> None:
    """Random runs on the GPU in float32: every step graphed (decode or mixed) gives the eager
    steps' tokens (logprobs are not compared: graphs split attention differently)."""
    print(f"seed {seed}")
    plan, args = _random_plan(seed)
    graphs = _staged_run(tiny_llama_dir, plan, True, "cuda", mixed=True, **args)
    eager = _staged_run(tiny_llama_dir, plan, False, "cuda", mixed=True, **args)
    assert eager.pop("replays") == 0 and eager.pop("mixed_replays") == 0
    graphs.pop("replays")
    assert graphs.pop("mixed_replays") > 0
    tokens = {k: v if isinstance(v, (int, str)) else [t for t, _ in v]
              for k, v in graphs.items()}
    assert tokens == {k: v if isinstance(v, (int, str)) else [t for t, _ in v]
                      for k, v in eager.items()}



def _completions_with_top5(model_dir, plan, **engine_args) -> tuple[dict[str, list], int]:
    """Each request's completions as [(token, top-5 token ids)] per position, on CUDA in
    bfloat16 (graphs unless enforce_eager is given); and how many mixed steps replayed."""
    engine = LLM(model=str(model_dir), device="cuda", dtype="bfloat16", **engine_args).llm_engine
    pending = [(at, str(i), prompt, params) for i, (at, prompt, params) in enumerate(plan)]
    done: dict[str, list] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [[(t.token_id, set(t.top)) for t in c.logprobs]
                                           for c in output.outputs]
        step += 1
    mixed = engine.runner.mixed_graphs
    return done, 0 if mixed is None else mixed.num_replays


@needs_cuda
def test_graphed_mixed_steps_in_bfloat16_stay_in_the_eager_top5(tiny_llama_dir) -> None:
    """bf16: padding changes which GEMM kernel runs, so tokens may differ; as vLLM's logprob
    check does, each token of one path is in the other's top 5 up to the first position where
    they differ (after it the two continue from different text)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    plan = [(2 * i, _ids(7 + 23 * i, 70 + i), params) for i in range(6)]
    args = dict(max_num_seqs=8, num_blocks=128, max_num_batched_tokens=48)
    graphed, replays = _completions_with_top5(tiny_llama_dir, plan, **args)
    eager, eager_replays = _completions_with_top5(tiny_llama_dir, plan, enforce_eager=True,
                                                  **args)
    assert replays > 0 and eager_replays == 0
    assert graphed.keys() == eager.keys()
    for request_id, completions in graphed.items():
        for ours, theirs in zip(completions, eager[request_id], strict=True):
            for (token, top), (other, other_top) in zip(ours, theirs, strict=True):
                assert token in other_top and other in top, (request_id, token, other)
                if token != other:
                    break
