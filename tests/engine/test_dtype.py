"""dtype="auto": resolved once, from the CPU's bf16 flags or the checkpoint, and the resolved
name is what the engine runs in, reports and seeds its block hashes with."""

import json

import pytest
import torch

from engine_service.core.config import EngineConfig
from engine_service.model.dtype import (
    checkpoint_dtype,
    cpu_feature_flags,
    cpu_has_native_bf16,
    resolve_dtype,
)

X86_WITH_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
X86_WITHOUT_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
X86_AMX = "flags\t\t: avx2 avx512f amx_tile amx_bf16\n"


def test_cpu_flags_are_read_from_the_flags_line():
    assert "avx512_bf16" in cpu_feature_flags(X86_WITH_BF16)
    assert cpu_feature_flags("model name\t: Some CPU\n") == frozenset()


@pytest.mark.skipif(
    __import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="x86 flags"
)
def test_native_bf16_needs_the_bf16_flag_not_just_avx512():
    assert cpu_has_native_bf16(X86_WITH_BF16)
    assert cpu_has_native_bf16(X86_AMX)
    assert not cpu_has_native_bf16(X86_WITHOUT_BF16)


def test_explicit_dtypes_pass_through_and_bad_names_are_refused():
    for name in ("float32", "float16", "bfloat16"):
        assert resolve_dtype(name, "cpu", "unused") == name
    with pytest.raises(ValueError, match=r"dtype must be one of .*'auto'.*got 'fp8'"):
        resolve_dtype("fp8", "cpu", "unused")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model="unused", dtype="half")


def test_auto_on_cpu_follows_the_cpu(tmp_path):
    want = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve_dtype("auto", "cpu", tmp_path) == want
    assert EngineConfig(model=str(tmp_path)).dtype == want  # auto is the default


def test_auto_on_cuda_takes_the_checkpoint_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    assert resolve_dtype("auto", "cuda", tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert resolve_dtype("auto", "cuda", tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert resolve_dtype("auto", "cuda", tmp_path) == "bfloat16"


def test_engine_runs_reports_and_hashes_the_resolved_dtype(make_llm, tiny_llama_dir):
    bf16 = make_llm(tiny_llama_dir, dtype="bfloat16", num_blocks=16).llm_engine
    fp32 = make_llm(tiny_llama_dir, dtype="float32", num_blocks=16).llm_engine
    auto = make_llm(tiny_llama_dir, dtype="auto", num_blocks=16).llm_engine
    assert bf16.runner.kv_caches.dtype == torch.bfloat16
    assert bf16.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert fp32.runner.kv_caches.dtype == torch.float32
    assert auto.config.dtype in ("float32", "bfloat16")
    assert auto.runner.kv_caches.dtype == getattr(torch, auto.config.dtype)
    # KV computed in another dtype is other KV: block hashes must never collide across dtypes.
    assert bf16.hasher.seed_hash != fp32.hasher.seed_hash
    same = bf16 if auto.config.dtype == "bfloat16" else fp32
    assert auto.hasher.seed_hash == same.hasher.seed_hash
    # bf16 linears are packed for oneDNN only where its bf16 reorder runs (AVX512 or
    # AVX-NE-CONVERT); elsewhere (an AVX2 CPU) they stay nn.Linear rather than fail at load.
    from engine_service.model.models.packed_linear import PackedLinear, can_pack

    for llm, dtype in ((bf16, torch.bfloat16), (fp32, torch.float32)):
        packed = any(isinstance(m, PackedLinear) for m in llm.runner.model.modules())
        assert packed == can_pack(torch.device("cpu"), dtype)
    if hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported"):
        assert can_pack(torch.device("cpu"), torch.bfloat16) == (
            torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())
