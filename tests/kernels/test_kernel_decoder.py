"""The decoder layers in one C++ call (kernels/csrc/decoder_cpu.cpp) against the Python layer
loop it replaces: the same logits and the same KV cache, bit for bit, over steps that mix
prefills, prefill chunks over a cached context and decodes, on Llama (GQA, untied) and Qwen2
(qkv biases, tied), block sizes 8 and 16, in float32 and (on AVX512-BF16, where the bf16
linears are ours) bfloat16; where it applies and where it does not; its timings and its
refusals."""

from pathlib import Path

import pytest
import torch

from engine_service.model.config import load_model_config
from engine_service.model.models.fused_decoder import build_fused_decoder
from engine_service.model.runner import ModelRunner
from engine_service.model.step_inputs import StepInputs
from kernels.cpu_extension import cpu_attention_available

pytestmark = pytest.mark.usefixtures("cpu_extension")  # fails or skips without it

# Each step: (sequence, first new position, end) per scheduled sequence.
STEPS = [
    [("a", 0, 12), ("b", 0, 23)],  # two prefills
    [("a", 12, 13), ("b", 23, 24)],  # two decodes
    [("b", 24, 25), ("a", 13, 18), ("c", 0, 3)],  # a decode, a chunk over a cached context, a
    [("a", 18, 19), ("b", 25, 26), ("c", 3, 4)],  # new prompt; then three decodes
]
MAX_LEN = 32


def _bf16_native() -> bool:
    return cpu_attention_available() and bool(torch.ops.pagedgen_cpu_linear.bf16_native())


# (Without the extension the cpu_extension fixture fails or skips it, saying why.)
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    cpu_attention_available() and not _bf16_native(),
    reason="no AVX512-BF16: bf16 linears are oneDNN's, no fused loop"))]


def _runner(model_dir: Path, block_size: int, dtype: str = "float32",
            kernel_backend: str = "auto") -> ModelRunner:
    runner = ModelRunner(load_model_config(model_dir), dtype=dtype, device="cpu",
                         kernel_backend=kernel_backend, block_size=block_size,
                         max_model_len=MAX_LEN)
    runner.allocate_kv_cache(num_blocks=3 * MAX_LEN // block_size + 1, num_cpu_blocks=0)
    return runner


def _step_inputs(step, tokens: dict[str, list[int]], block_size: int) -> StepInputs:
    """Sequence i owns blocks [1 + i * per_seq, ...) (block 0 stays unused)."""
    per_seq = MAX_LEN // block_size
    inputs = StepInputs([], [], [], [], [0], [], [])
    for name, start, end in step:
        first_block = 1 + "abc".index(name) * per_seq
        table = list(range(first_block, first_block + per_seq))
        inputs.input_ids.extend(tokens[name][start:end])
        inputs.positions.extend(range(start, end))
        inputs.slots.extend(table[p // block_size] * block_size + p % block_size
                            for p in range(start, end))
        inputs.seq_lens.append(end)
        inputs.query_start_loc.append(inputs.query_start_loc[-1] + end - start)
        inputs.block_tables.append(table)
        inputs.sample_rows.append(inputs.query_start_loc[-1] - 1)
    return inputs


def _run_steps(runner: ModelRunner, block_size: int) -> list[torch.Tensor]:
    """Each step's logits (float32, whatever the model's dtype)."""
    generator = torch.Generator().manual_seed(block_size)
    vocab = runner.config.vocab_size
    tokens = {name: torch.randint(0, vocab, (MAX_LEN,), generator=generator).tolist()
              for name in "abc"}
    return [runner.run_batch(_step_inputs(step, tokens, block_size)) for step in STEPS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_fused_layers_compute_the_python_loops_bits(model, block_size, dtype, request):
    model_dir = request.getfixturevalue(model)
    fused_runner = _runner(model_dir, block_size, dtype)
    assert fused_runner.kernels.name == "cpu"
    assert fused_runner.model.fused_decoder is not None  # (on our linears: it applies)
    python_runner = _runner(model_dir, block_size, dtype)
    python_runner.model.fused_decoder = None

    fused_logits = _run_steps(fused_runner, block_size)
    python_logits = _run_steps(python_runner, block_size)

    for step, (fused, python) in enumerate(zip(fused_logits, python_logits, strict=True)):
        assert fused.shape == python.shape == (len(STEPS[step]), fused_runner.config.vocab_size)
        assert torch.equal(fused, python), f"step {step}: logits differ"
    assert fused_runner.kv_caches.dtype == getattr(torch, dtype)
    assert torch.equal(fused_runner.kv_caches, python_runner.kv_caches)
    assert fused_runner.kv_caches.abs().sum() > 0  # the cache was written


def test_only_our_linears_and_the_cpu_backend_use_it(tiny_llama_dir, monkeypatch):
    # bf16: where its linears are ours (AVX512-BF16), and not on oneDNN's.
    bf16 = _runner(tiny_llama_dir, 16, dtype="bfloat16")
    assert (bf16.model.fused_decoder is not None) == _bf16_native()
    qkv = bf16.model.layers[0].self_attn.qkv_proj
    qkv.ours = False
    assert build_fused_decoder(bf16.model) is None
    fp16 = _runner(tiny_llama_dir, 16, dtype="float16")
    assert fp16.model.fused_decoder is None
    # The torch backend is the reference: its runner has the fused loop but must not call it.
    torch_runner = _runner(tiny_llama_dir, 16, kernel_backend="torch")
    assert torch_runner.kernels.name == "torch"

    def refuse(*args, **kwargs):
        raise AssertionError("the fused decoder ran under the torch backend")

    monkeypatch.setattr(torch_runner.model, "fused_decoder", refuse)
    _run_steps(torch_runner, 16)


def test_timings_count_linears_and_attention(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, 16)
    fused = runner.model.fused_decoder
    fused.timings = torch.zeros(2, dtype=torch.float64)
    _run_steps(runner, 16)
    linear_s, attention_s = fused.timings.tolist()
    assert linear_s > 0 and attention_s > 0


def test_bad_arguments_are_refused_with_the_reason(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, 16)
    fused = runner.model.fused_decoder
    x = torch.zeros(1, runner.config.hidden_size)
    args = dict(slot_mapping=torch.zeros(1, dtype=torch.int64),
                block_tables=torch.ones(1, 1, dtype=torch.int32),
                seq_lens=torch.ones(1, dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                cos=runner.cos[:1], sin=runner.sin[:1])
    op = torch.ops.pagedgen_cpu_decoder.forward

    def call(weights, biases=(), kv=runner.kv_caches, x=x, timings=None, qk_norms=()):
        return op(x, list(weights), list(biases), list(qk_norms), fused.final_norm, kv,
                  *args.values(),
                  fused.num_heads, fused.num_kv_heads, fused.head_dim, fused.intermediate_size,
                  fused.eps, fused.scale, timings)

    with pytest.raises(RuntimeError, match="6 tensors per layer, got 5"):
        call(fused.layer_weights[:5])
    with pytest.raises(RuntimeError, match="qkv_biases must be empty or one per layer, got 1"):
        call(fused.layer_weights, biases=[torch.zeros(1)])
    with pytest.raises(RuntimeError, match=r"qk_norms must be empty or two per layer \(q, k\), "
                                           r"got 2 for 2 layers"):
        call(fused.layer_weights, qk_norms=[torch.ones(16)] * 2)
    with pytest.raises(RuntimeError, match="q_weight and k_weight must be contiguous, of qk's "
                                           "dtype, with head_dim elements"):
        call(fused.layer_weights, qk_norms=[torch.ones(fused.head_dim + 1)] * 4)
    with pytest.raises(RuntimeError, match="kv_caches must be .* with 2 layers"):
        call(fused.layer_weights, kv=runner.kv_caches[:1])
    with pytest.raises(RuntimeError, match="x must be contiguous float32 or bfloat16"):
        call(fused.layer_weights, x=x.double())
    with pytest.raises(RuntimeError, match="timings must be float64"):
        call(fused.layer_weights, timings=torch.zeros(2))
    swapped = list(fused.layer_weights)
    swapped[1], swapped[2] = swapped[2], swapped[1]  # layer 0's qkv and o projections
    with pytest.raises(RuntimeError, match=r"layer 0 qkv must be packed Float \[\d+, 64, 16\] for "
                                           r"64 -> \d+ features, got Float \["):
        call(swapped)
    with pytest.raises(RuntimeError, match=r"layer 0 qkv must be packed Float .* got BFloat16"):
        bf16_qkv = list(fused.layer_weights)
        bf16_qkv[1] = bf16_qkv[1].to(torch.bfloat16)
        call(bf16_qkv)
    assert call(fused.layer_weights).shape == x.shape  # the same arguments, valid, run


def test_no_fused_loop_for_a_layer_it_would_compute_wrongly(tiny_llama_dir):
    """A bias it does not add (o, gate_up, down: our layers have none, a future one might)."""
    runner = _runner(tiny_llama_dir, 16)
    assert build_fused_decoder(runner.model) is not None
    down = runner.model.layers[1].mlp.down_proj
    down.bias = torch.zeros(down.out_features)
    assert build_fused_decoder(runner.model) is None
