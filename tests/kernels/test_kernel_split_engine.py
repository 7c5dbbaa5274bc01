"""Steps through the CUDA graphs' buffers with keys split per sequence (decode) and per query
tile (prompt chunks): a tiny Llama on the Triton kernels (the interpreter here, compiled where
CUDA is), its attention bound to a split policy that splits these short contexts, gives the
torch path's greedy tokens.

On a GPU the engine splits by the SM count (kernels/attention_splits.py); on the CPU it never
splits, so this binds a policy for a GPU of a few SMs the way the warm-up binds tuned prefill
tiles (the kernel backend's paged_attention with the argument set). The graphs' buffers run
eagerly on the CPU: the decode graphs' padding rows (context 1) share the step's grid and the
plan the kernel makes on the device from the context lengths, and the mixed-step graphs'
padding tokens (no sequence) sit beside split chunks.
"""

import dataclasses
import functools

import pytest

from engine_service import LLM, SamplingParams
from engine_service.model.kv_cache_setup import graph_rows
from kernels.attention_splits import KVSplitPolicy, decode_tile_n, plan_splits
from kernels.launch_counter import launch_counter
from kernels.triton_attention import paged_attention
from tests.kernels.conftest import DEVICE

# A 100-token prompt among short ones, chunked by a 48-token budget: later chunks attend to
# the cached start of the prompt.
PROMPTS = [list(range(300, 400)), [7], list(range(500, 533))]
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ENGINE = dict(block_size=16, num_blocks=64, device=DEVICE.type, dtype="float32",
              max_num_seqs=6, max_num_batched_tokens=48)
# Splits of 32 keys (one decode tile) up to 4 a sequence; a prompt chunk's few query tiles get
# a split axis of up to 4.
POLICY = KVSplitPolicy(target_programs=200, min_keys_per_split=32, max_splits=4)


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


# Padding tokens' rows carry unwritten attention output (mixed_graphs.py): the interpreter's
# numpy may warn of overflow in them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.timeout(600)
def test_split_attention_through_graph_buffers_gives_the_torch_tokens(tiny_llama_dir) -> None:
    expected = _tokens(LLM(model=str(tiny_llama_dir), kernel_backend="torch",
                           **ENGINE).llm_engine)
    engine = LLM(model=str(tiny_llama_dir), kernel_backend="triton", **ENGINE).llm_engine
    runner = engine.runner
    runner.kernels = dataclasses.replace(
        runner.kernels, paged_attention=functools.partial(paged_attention, kv_splits=POLICY))
    # Off CUDA: the buffers, run eagerly.
    runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
    runner.capture_mixed_graphs(engine.config.max_num_batched_tokens)
    with launch_counter() as launches:
        tokens = _tokens(engine)
    assert runner.decode_graphs.num_replays >= PARAMS.max_tokens - 2
    assert runner.mixed_graphs.num_replays >= 3  # the 100-token prompt alone takes 3 chunks
    # A decode step's plan (3 sequences in the graph of 4 rows: a padding row of one key)
    # splits the long sequence; decode layers and split prompt chunks merged partials.
    decode_step = [len(p) + 1 for p in PROMPTS] + [1]
    splits = plan_splits(POLICY, decode_step, engine.model_config.num_kv_heads,
                         decode_tile_n(16))
    assert splits[0] == 4 and splits[-1] == 1, splits
    layers = engine.model_config.num_layers
    assert launches["combine_splits"] >= layers * (runner.decode_graphs.num_replays + 1)
    assert len({tuple(t) for t in expected}) > 1  # a degenerate model would prove little
    assert tokens == expected
