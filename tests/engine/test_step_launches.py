"""What one engine step asks of the device, counted on the CPU path of a tiny Llama (2 layers):
aten ops (kernel launches on a GPU) per layer, host syncs, host->device uploads.

On CUDA every aten op is at least one kernel launch and every sync stalls the host until the
GPU drains, so these counts are what a GPU step costs in overhead. They are held to budgets:
- the forward (outside the attention kernels) makes no sync and uploads nothing, and launches
  at most LAUNCHES_PER_LAYER per layer plus the embedding and the final norm;
- the kernel backend is called twice per layer (reshape_and_cache, paged_attention);
- the rest of the step (input upload, lm_head, sampling) waits for the device exactly once,
  for the sampled token ids (with logprobs, when asked, in the same transfer), and uploads
  the step's inputs in at most two copies.
The attention kernels' own host code is held to no sync / no upload for the Triton (CUDA)
path by tests/kernels/test_kernel_cuda_compile.py; the torch attention here is the CPU path.
"""

import pytest
import torch

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.model.sampling_params import SamplingParams
from tests.support.step_ops import StepOps, count_step_ops

# Per decoder layer: 2 RMSNorms x 6 (pow, mean, add, rsqrt, 2 mul), 4 linears (qkv, o,
# gate_up, down), RoPE on q and k x 5 (2 mul, neg, cat, add), SiLU + mul, 2 residual adds.
LAUNCHES_PER_LAYER = 12 + 4 + 10 + 2 + 2
EMBEDDING_AND_FINAL_NORM = 1 + 6
MAX_STEP_UPLOADS = 2  # the runner packs the step's int64 and int32 inputs into one copy each


@pytest.fixture
def engine(tiny_llama_dir) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=64, max_num_seqs=8,
                                    kernel_backend="torch"))
    yield engine
    assert engine.check_block_invariants() == []


def _add_requests(engine: LLMEngine, params: SamplingParams) -> None:
    for i in range(4):
        engine.add_request(f"r{i}", list(range(10 + i, 30 + 3 * i)), params)


def _count_step(engine: LLMEngine) -> StepOps:
    with count_step_ops(engine.runner) as ops:
        outputs = engine.step()
    assert outputs, "the step did not run"
    return ops


def _check_forward(ops: StepOps, num_layers: int) -> None:
    forward, layer_ops = ops.get("forward"), ops.get("layer_ops")
    for phase in (forward, layer_ops):
        assert phase.syncs == [], phase.syncs
        assert phase.uploads == [], phase.uploads
    budget = LAUNCHES_PER_LAYER * num_layers + EMBEDDING_AND_FINAL_NORM
    launches = forward.launches + layer_ops.launches
    assert sum(launches.values()) <= budget, dict(launches)
    assert ops.kernel_calls["reshape_and_cache"] == num_layers
    assert ops.kernel_calls["paged_attention"] == num_layers
    assert ops.kernel_calls["build_attention_plan"] <= 1  # once per step, shared by layers


def test_greedy_prefill_and_decode_steps(engine: LLMEngine) -> None:
    _add_requests(engine, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    num_layers = engine.model_config.num_layers
    for phase in ("prefill", "decode", "decode"):
        ops = _count_step(engine)
        _check_forward(ops, num_layers)
        step = ops.get("step")
        assert step.syncs == ["Tensor.tolist"], (phase, step.syncs)
        assert len(step.uploads) <= MAX_STEP_UPLOADS, (phase, step.uploads)
    assert not engine.has_unfinished_requests()


def test_sampled_step_with_every_feature_waits_once(engine: LLMEngine) -> None:
    """Top-k + top-p + min-p, a seed, all three penalties and logprobs: still one transfer."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, seed=3,
                            presence_penalty=0.5, frequency_penalty=0.2,
                            repetition_penalty=1.2, logprobs=3, max_tokens=3,
                            ignore_eos=True)
    _add_requests(engine, params)
    for phase in ("prefill", "decode", "decode"):
        ops = _count_step(engine)
        _check_forward(ops, engine.model_config.num_layers)
        step = ops.get("step")
        assert step.syncs == ["Tensor.tolist"], (phase, step.syncs)
        # Sampling uploads its per-row parameters and the token histories (penalties).
        assert len(step.uploads) <= MAX_STEP_UPLOADS + 7, (phase, step.uploads)
    assert not engine.has_unfinished_requests()


def test_step_inputs_upload_as_aligned_views(engine: LLMEngine) -> None:
    """Each input is a view of one upload, starting on a 16-byte boundary whatever the batch:
    Triton specializes pointers on that alignment, so a shifting one would compile again."""
    runner = engine.runner
    for lengths in ([1], [3, 1, 2], [5, 7, 1, 1, 9]):
        parts = tuple(list(range(n)) for n in lengths)
        for dtype in (torch.int64, torch.int32):
            views = runner._upload(parts, dtype)
            assert [v.tolist() for v in views] == [list(p) for p in parts]
            assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one copy
            assert all(v.data_ptr() % 16 == 0 for v in views), [v.data_ptr() for v in views]


# ---- the CUDA path: Triton kernels, counted by their launch wrappers ---------------------------
# Per decoder layer on CUDA: 4 linears (qkv, o, gate_up, down) and 5-6 Triton launches (2 norms
# with their residual adds, rotary with the KV-cache write, attention and, with split KV, its
# combine). Issue 30's budget: at most 12.
CUDA_LAUNCHES_PER_LAYER = 12
CUDA_EMBEDDING_AND_FINAL_NORM = 2


def test_cuda_path_decode_layer_within_twelve_launches(tiny_llama_dir) -> None:
    """The Triton backend (CUDA's; here in Triton's interpreter): the model's own aten ops plus
    every Triton launch, per layer, within the budget, at prefill and at decode."""
    from kernels.launch_counter import launch_counter

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=64, max_num_seqs=8,
                                    kernel_backend="triton", dtype="float32"))
    _add_requests(engine, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    num_layers = engine.model_config.num_layers
    for phase in ("prefill", "decode", "decode"):
        with launch_counter() as triton_launches:
            ops = _count_step(engine)
        forward = ops.get("forward")
        assert forward.syncs == [] and forward.uploads == [], (phase, forward)
        layer_calls = ("rms_norm", "add_rms_norm", "rotary_and_cache", "silu_mul")
        # The norms: each layer's two, and the final one (the first layer's input norm has no
        # residual to add yet).
        assert triton_launches["rms_norm"] == 1, phase
        assert triton_launches["add_rms_norm"] == 2 * num_layers, phase
        assert [triton_launches[k] for k in ("rotary_and_cache", "silu_mul",
                                             "paged_attention")] == [num_layers] * 3, phase
        total = forward.num_launches + sum(triton_launches.values())
        budget = CUDA_LAUNCHES_PER_LAYER * num_layers + CUDA_EMBEDDING_AND_FINAL_NORM
        assert total <= budget, (phase, dict(forward.launches), dict(triton_launches))
        # (rotary and reshape_and_cache run fused, never apart)
        assert set(triton_launches) <= {*layer_calls, "paged_attention", "combine_splits"}, (
            triton_launches)
    assert not engine.has_unfinished_requests()
    assert engine.check_block_invariants() == []


# Padding tokens' rows carry unwritten attention output (mixed_graphs.py): the interpreter's
# numpy may warn of overflow in them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_cuda_path_mixed_step_through_graph_buffers_within_budget(tiny_llama_dir) -> None:
    """A mixed step (decodes beside a new prompt) through the mixed-step graphs' buffers
    (engine_service/model/mixed_graphs.py, run eagerly here with the Triton kernels): the
    forward captured on CUDA keeps the per-layer launch budget and neither syncs nor uploads;
    the step around it waits once (the sampled tokens) and uploads nothing by torch.tensor
    (its inputs go through the fixed buffers' copies)."""
    from engine_service.model.kv_cache_setup import graph_rows
    from kernels.launch_counter import launch_counter

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=64, max_num_seqs=8,
                                    kernel_backend="triton", dtype="float32",
                                    max_num_batched_tokens=128))
    runner = engine.runner
    runner.capture_decode_graphs(graph_rows(engine.config), engine.max_model_len)
    runner.capture_mixed_graphs(engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    _add_requests(engine, params)
    num_layers = engine.model_config.num_layers
    for phase in ("prefill", "mixed"):
        if phase == "mixed":
            engine.add_request("late", list(range(40, 53)), params)
        before, computed = runner.mixed_graphs.num_replays, engine.num_computed_tokens
        with launch_counter() as triton_launches:
            ops = _count_step(engine)
        assert runner.mixed_graphs.num_replays == before + 1, phase
        # prefill: the four prompts whole; mixed: their four decodes and the new prompt
        assert engine.num_computed_tokens - computed == {"prefill": 92, "mixed": 4 + 13}[phase]
        forward = ops.get("forward")
        assert forward.syncs == [] and forward.uploads == [], (phase, forward)
        total = forward.num_launches + sum(triton_launches.values())
        budget = CUDA_LAUNCHES_PER_LAYER * num_layers + CUDA_EMBEDDING_AND_FINAL_NORM
        assert total <= budget, (phase, dict(forward.launches), dict(triton_launches))
        step = ops.get("step")
        assert step.syncs == ["Tensor.tolist"], (phase, step.syncs)
        assert step.uploads == [], (phase, step.uploads)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.check_block_invariants() == []
