"""Decode steps through the decode graphs' buffers with keys split per sequence: a tiny Llama
on the Triton kernels (the interpreter here, compiled where CUDA is), its decode attention
bound to a split policy that splits these short contexts, gives the torch path's greedy
tokens.

On a GPU the engine splits by the SM count (kernels/attention_splits.py); on the CPU it never
splits, so this binds a policy for a GPU of a few SMs the way the warm-up binds tuned prefill
tiles (the kernel backend's paged_attention with the argument set). The graphs' buffers run
eagerly on the CPU: their padding rows (context 1) share the step's grid and the plan the
kernel makes on the device from the context lengths.
"""

import dataclasses
import functools
from pathlib import Path

import pytest

from engine_service import LLM, SamplingParams
from kernels.attention_splits import KVSplitPolicy, decode_tile_n, plan_splits
from kernels.launch_counter import launch_counter
from kernels.triton_attention import paged_attention
from tests.kernels.conftest import DEVICE

# A 100-token context among short ones: the policy below splits it, and only it.
PROMPTS = [list(range(300, 400)), [7], list(range(200, 215)), list(range(500, 533)),
           [9, 10, 11]]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _engine(model_dir: Path, kernel_backend: str):
    return LLM(model=str(model_dir), block_size=16, num_blocks=64, device=DEVICE.type,
               dtype="float32", kernel_backend=kernel_backend, max_num_seqs=6).llm_engine


def _tokens(engine) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        assert engine.check_block_invariants() == []
    return [finished[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.timeout(600)
def test_split_decode_through_graph_buffers_gives_the_torch_tokens(tiny_llama_dir) -> None:
    expected = _tokens(_engine(tiny_llama_dir, "torch"))
    engine = _engine(tiny_llama_dir, "triton")
    runner = engine.runner
    policy = KVSplitPolicy(target_programs=12, min_keys_per_split=32)
    runner.kernels = dataclasses.replace(
        runner.kernels, paged_attention=functools.partial(paged_attention, kv_splits=policy))
    runner.capture_decode_graphs(6, engine.max_model_len)  # off CUDA: the buffers, run eagerly
    with launch_counter() as launches:
        tokens = _tokens(engine)
    assert runner.decode_graphs.num_replays >= PARAMS.max_tokens - 1
    # The first decode step's plan (5 sequences in the graph of 6 rows: a padding row of one
    # key) splits the long sequence; each decode step's layers merged partials, the prefill
    # step's did not.
    first_step = [len(p) + 1 for p in PROMPTS] + [1]
    splits = plan_splits(policy, first_step, engine.model_config.num_kv_heads, decode_tile_n(16))
    assert splits[0] > 1 and splits[1:] == [1] * 5, splits
    layers = engine.model_config.num_layers
    assert launches["combine_splits"] == launches["paged_attention"] - layers
    assert len({tuple(t) for t in expected}) > 1  # a degenerate model would prove little
    assert tokens == expected
