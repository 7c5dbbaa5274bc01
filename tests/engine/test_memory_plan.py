"""KV pool sizing: the arithmetic (pure), and the wiring on a faked 80 GiB CUDA device.

The device is faked at the level of torch's CUDA memory queries (mem_get_info, allocated /
peak / reserved): the bookkeeping a real device reports, driven by the sizes of a Llama-8B-
and a Llama-70B-shaped model built on the meta device (parameters with shapes, no storage).
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine_service.model.config import ModelConfig
from engine_service.model.kv_cache_setup import profile_memory_plan
from engine_service.model.loader import model_weight_bytes
from engine_service.model.memory_plan import (
    GiB,
    InsufficientDeviceMemoryError,
    MiB,
    blocks_in,
    plan_kv_cache,
)
from engine_service.model.runner import ModelRunner, kv_bytes_per_block


def llama_config(hidden: int, intermediate: int, layers: int, heads: int) -> ModelConfig:
    """Llama-3-shaped: 128256-token vocabulary, 8 KV heads of 128, untied lm_head."""
    return ModelConfig(
        path=Path("/nonexistent/llama"),  # never read: only shapes are used
        gguf_file=None,
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_ids=(128001,),
        hf_config=None,
    )


LLAMA_8B = llama_config(hidden=4096, intermediate=14336, layers=32, heads=32)
LLAMA_70B = llama_config(hidden=8192, intermediate=28672, layers=80, heads=64)


@dataclass
class FakeCudaDevice:
    """What torch.cuda's memory queries report for one device, kept as plain counters."""

    total: int
    outside_torch: int  # CUDA context, library workspaces: in use, but not torch's
    allocated: int = 0
    peak: int = 0
    reserved: int = 0  # torch's caching allocator: allocated plus cached free blocks

    def allocate(self, num_bytes: int) -> None:
        self.allocated += num_bytes
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def free(self, num_bytes: int) -> None:
        self.allocated -= num_bytes  # stays reserved (cached) until empty_cache

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats",
                            lambda device=None: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(cuda, "empty_cache", lambda: setattr(self, "reserved", self.allocated))
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (
            self.total - self.reserved - self.outside_torch, self.total))


# ---- the arithmetic ---------------------------------------------------------------------------

def test_plan_gives_the_pool_what_the_budget_leaves() -> None:
    plan = plan_kv_cache(total_bytes=80 * GiB, utilization=0.9, weights_bytes=15 * GiB,
                         peak_activation_bytes=3 * GiB, non_torch_bytes=GiB // 2,
                         block_bytes=2 * MiB, margin_bytes=GiB // 2)
    assert plan.budget_bytes == int(0.9 * 80 * GiB)
    left = int(0.9 * 80 * GiB) - 15 * GiB - 3 * GiB - GiB
    assert plan.num_blocks == left // (2 * MiB)
    assert plan.kv_bytes == plan.num_blocks * 2 * MiB
    assert plan.used_bytes <= plan.budget_bytes < plan.used_bytes + 2 * MiB


def test_plan_describes_its_arithmetic() -> None:
    plan = plan_kv_cache(total_bytes=80 * GiB, utilization=0.9, weights_bytes=15 * GiB,
                         peak_activation_bytes=3 * GiB, non_torch_bytes=0,
                         block_bytes=2 * MiB, margin_bytes=GiB)
    text = plan.describe()
    for figure in ("0.9 x 80.00 GiB", "72.00 GiB budget", "15.00 GiB weights",
                   "3.00 GiB peak activations", "1.00 GiB margin", "53.00 GiB",
                   f"{plan.num_blocks} blocks of 2.00 MiB"):
        assert figure in text, (figure, text)


def test_weights_over_budget_is_a_clear_error() -> None:
    with pytest.raises(InsufficientDeviceMemoryError, match=r"weights need 75\.00 GiB.*"
                       r"0\.9 of this device's 80\.00 GiB allows 72\.00 GiB"):
        plan_kv_cache(total_bytes=80 * GiB, utilization=0.9, weights_bytes=75 * GiB,
                      peak_activation_bytes=0, non_torch_bytes=0, block_bytes=MiB)


def test_no_room_left_for_kv_is_a_clear_error() -> None:
    with pytest.raises(InsufficientDeviceMemoryError,
                       match=r"no room for the KV cache .*70\.00 GiB weights - "
                             r"2\.00 GiB peak activations"):
        plan_kv_cache(total_bytes=80 * GiB, utilization=0.9, weights_bytes=70 * GiB,
                      peak_activation_bytes=2 * GiB, non_torch_bytes=0, block_bytes=MiB)


@pytest.mark.parametrize(("field", "value"), [("utilization", 0.0), ("utilization", 1.5),
                                              ("weights_bytes", -1), ("block_bytes", 0)])
def test_bad_inputs_name_the_field(field: str, value: float) -> None:
    args = dict(total_bytes=80 * GiB, utilization=0.9, weights_bytes=GiB,
                peak_activation_bytes=0, non_torch_bytes=0, block_bytes=MiB)
    args[field] = value
    name = "gpu_memory_utilization" if field == "utilization" else field
    with pytest.raises(ValueError, match=rf"{name} must be .*got {value}"):
        plan_kv_cache(**args)


def test_explicit_kv_budget_in_blocks() -> None:
    assert blocks_in(10 * MiB + 5, 2 * MiB) == 5
    with pytest.raises(ValueError, match="kv_cache_memory must hold at least 2 blocks"):
        blocks_in(3 * MiB, 2 * MiB)


# ---- the wiring, on a faked 80 GiB device ----------------------------------------------------

def test_llama_8b_plan_on_an_80_gib_device(monkeypatch, caplog) -> None:
    weights = model_weight_bytes(LLAMA_8B, torch.bfloat16)
    assert 7.9e9 < weights / 2 < 8.1e9  # an 8B-parameter model, in bf16
    device = FakeCudaDevice(total=80 * GiB, outside_torch=600 * MiB)
    device.install(monkeypatch)
    device.allocate(weights)  # what loading put on the device
    block_bytes = kv_bytes_per_block(LLAMA_8B, 16, torch.bfloat16)
    assert block_bytes == 2 * MiB  # 2 (K, V) x 32 layers x 16 slots x 8 heads x 128 x 2 bytes
    scratch, activations = 130 * block_bytes, 3 * GiB

    def profile_forward() -> int:
        device.allocate(scratch + activations)
        device.free(scratch + activations)
        return scratch

    with caplog.at_level(logging.INFO, logger="engine_service.model.kv_cache_setup"):
        plan = profile_memory_plan(torch.device("cuda"), 0.9, block_bytes, profile_forward)
    assert plan.weights_bytes == weights
    assert plan.peak_activation_bytes == activations  # the scratch pool is not activations
    assert plan.non_torch_bytes == 600 * MiB
    budget = int(0.9 * 80 * GiB)
    # The plan fits: weights + KV + activations (+ the rest) within the budget, and the pool
    # is the largest that does.
    assert weights + plan.kv_bytes + activations + 600 * MiB + plan.margin_bytes <= budget
    assert budget - plan.used_bytes < block_bytes
    assert plan.num_blocks > 25_000  # ~52 GiB of KV: ~400k tokens of context
    [record] = [r for r in caplog.records if "KV cache:" in r.getMessage()]
    assert "80.00 GiB total" in record.getMessage()
    assert f"{plan.num_blocks} blocks" in record.getMessage()
    assert plan.cuda_graph_bytes == 0

    # With decode CUDA graphs (captured after the pool), room for them: the profiled peak
    # once more, which bounds their largest forward.
    graphed = profile_memory_plan(torch.device("cuda"), 0.9, block_bytes, profile_forward,
                                  cuda_graphs=True)
    assert graphed.cuda_graph_bytes == activations
    assert graphed.num_blocks == plan.num_blocks - activations // block_bytes
    assert budget - graphed.used_bytes < block_bytes
    assert "3.00 GiB CUDA graphs" in graphed.describe()


def test_model_too_large_for_the_device_fails_before_loading(monkeypatch) -> None:
    device = FakeCudaDevice(total=80 * GiB, outside_torch=600 * MiB)
    device.install(monkeypatch)
    weights = model_weight_bytes(LLAMA_70B, torch.bfloat16)
    assert weights > 130 * GiB
    # The runner checks before it reads a byte (the config's path does not even exist).
    with pytest.raises(InsufficientDeviceMemoryError,
                       match=rf"weights need {weights / GiB:.2f} GiB but the device has "
                             r"79\.41 GiB free of 80\.00 GiB"):
        ModelRunner(LLAMA_70B, dtype="bfloat16", device="cuda", kernel_backend="torch",
                    block_size=16, max_model_len=8192)


def test_activations_leaving_no_room_is_a_clear_error(monkeypatch) -> None:
    device = FakeCudaDevice(total=24 * GiB, outside_torch=500 * MiB)
    device.install(monkeypatch)
    device.allocate(model_weight_bytes(LLAMA_8B, torch.bfloat16))

    def huge_profile() -> int:
        device.allocate(8 * GiB)
        device.free(8 * GiB)
        return 0

    with pytest.raises(InsufficientDeviceMemoryError, match=r"no room for the KV cache.*"
                       r"8\.00 GiB peak activations.*Lower max_num_batched_tokens"):
        profile_memory_plan(torch.device("cuda"), 0.9, 2 * MiB, huge_profile)


def test_profile_run_on_cpu_runs_the_largest_step_through_a_scratch_pool(tiny_llama_dir) -> None:
    from engine_service.model.config import load_model_config

    config = load_model_config(tiny_llama_dir)
    runner = ModelRunner(config, dtype="float32", device="cpu", kernel_backend="torch",
                         block_size=16, max_model_len=64)
    scratch = runner.profile_run(num_tokens=200, num_seqs=3)
    # 200 tokens over 4 sequences of 50 (no sequence past the 64-token context): 4 blocks each.
    assert scratch == 16 * kv_bytes_per_block(config, 16, torch.float32)
    assert runner.kv_caches.numel() == 0  # the scratch pool is gone
