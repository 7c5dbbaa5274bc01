"""Warm-up before serving: the engine runs its kernels once while it is built (so the server,
which builds the engine before it reports SERVING, never serves before it), and on CUDA no
request compiles a kernel variant the warm-up did not."""

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.model.config import load_model_config
from engine_service.model.runner import ModelRunner
from engine_service.model.warmup import warm_up


def test_warm_up_runs_a_mixed_and_a_decode_step_within_the_pool(tiny_llama_dir) -> None:
    config = load_model_config(tiny_llama_dir)
    runner = ModelRunner(config, dtype="float32", device="cpu", kernel_backend="torch",
                         block_size=16, max_model_len=128)
    runner.allocate_kv_cache(num_blocks=4, num_cpu_blocks=0)
    report = warm_up(runner, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=128)
    # 32 tokens over 8 sequences would need 8 blocks: shrunk to 16 over 4 (one block each).
    assert report.steps == [
        "mixed step: 16 prompt tokens over 4 sequences",
        "decode step: 2 sequences of 17 tokens",
    ]
    # The steps went through the model into the pool: every block now holds written K/V.
    written = runner.kv_caches.abs().sum(dim=(0, 1, 3, 4, 5))
    assert bool((written > 0).all()), written
    assert report.compiled_variants == {}  # the torch backend compiles nothing


def test_engine_is_warmed_up_when_built(tiny_llama_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=16, max_num_seqs=4))
    assert [s.split(":")[0] for s in engine.kv_setup.warmup.steps] == ["mixed step",
                                                                       "decode step"]
    assert engine.kv_setup.num_blocks == 16 and engine.kv_setup.plan is None
    assert engine.check_block_invariants() == []  # the warm-up allocated no blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_kernel_compiles_after_warm_up_on_cuda(tiny_llama_dir) -> None:
    from kernels.triton_backend import compiled_variant_counts

    llm = LLM(model=str(tiny_llama_dir), device="cuda", kernel_backend="triton",
              num_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)
    after_warm_up = compiled_variant_counts()
    assert after_warm_up == llm.llm_engine.kv_setup.warmup.compiled_variants
    assert all(after_warm_up.values()), after_warm_up
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 17, 40, 100, 200)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert compiled_variant_counts() == after_warm_up


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_up_times_prefill_tiles_and_keeps_the_fastest_on_cuda(tiny_llama_dir) -> None:
    """CUDA + Triton: the prefill tile shapes (kernels/attention_tiles.py) are timed once and
    the fastest is bound into the runner's attention (the graphs captured after replay it)."""
    llm = LLM(model=str(tiny_llama_dir), device="cuda", kernel_backend="triton",
              dtype="bfloat16", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256)
    report = llm.llm_engine.kv_setup.warmup
    timed = {k: v for k, v in report.prefill_timings_ms.items() if isinstance(v, float)}
    assert timed and report.prefill_tiles in timed
    assert timed[report.prefill_tiles] == min(timed.values())
    attention = llm.llm_engine.runner.kernels.paged_attention
    assert attention.keywords["prefill_tiles"].describe() == report.prefill_tiles
