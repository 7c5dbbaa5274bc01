"""A tiny Llama end to end through the Triton kernels vs the torch path, on this machine's device
(CUDA when there is one: compiled kernels; CPU otherwise: the Triton interpreter).

Same greedy tokens, token for token. A small token budget makes the scheduler chunk the long
prompts, so steps mix decode tokens with prefill chunks that attend to an already cached
context; two prompts share a block-aligned prefix, so prefix caching shares blocks between them.
"""

from pathlib import Path

import pytest

from engine_service import LLM, SamplingParams
from tests.kernels.conftest import DEVICE

SHARED_PREFIX = list(range(100, 132))  # two full blocks of 16
PROMPTS = [
    [7],
    list(range(200, 215)),  # 15 tokens: one short of a block
    list(range(300, 317)),  # 17 tokens: one past a block
    SHARED_PREFIX + [5, 6, 7],
    SHARED_PREFIX + [8, 9],
    list(range(400, 445)),  # 45 tokens: chunked over several steps
]


def _generate(model_dir: Path, kernel_backend: str) -> list[list[int]]:
    llm = LLM(
        model=str(model_dir),
        block_size=16,
        num_blocks=64,
        device=DEVICE.type,
        dtype="float32",  # token-exact comparison across backends
        kernel_backend=kernel_backend,
        max_num_batched_tokens=24,
    )
    # The backend the model runner really uses (guards against a silent fallback to torch).
    assert llm.llm_engine.runner.kernels.name == kernel_backend
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.timeout(600)
def test_triton_kernels_match_torch_path_greedy(tiny_llama_dir: Path) -> None:
    torch_tokens = _generate(tiny_llama_dir, "torch")
    triton_tokens = _generate(tiny_llama_dir, "triton")
    assert all(len(t) == 8 for t in torch_tokens)
    assert len({tuple(t) for t in torch_tokens}) > 1  # a degenerate model would prove little
    assert triton_tokens == torch_tokens
