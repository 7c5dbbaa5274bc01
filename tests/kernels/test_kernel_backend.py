"""The kernel backends behind one interface: selection (the C++ CPU kernels where they build,
torch where they cannot, and a failed build an error where it is required), and a model-runner
step through each.

The step does what the model runner does for one layer (write the new K/V by slot mapping, then
attend through the block tables, copy-on-write a shared block), once with the torch backend and
once with Triton, and compares caches and outputs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import TORCH_BACKEND, KernelBackend, cpu_attention, get_kernel_backend
from kernels.cpu_extension import REQUIRE_ENV
from kernels.triton_backend import TRITON_BACKEND
from tests.kernels.conftest import DEVICE

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_backend_selection() -> None:
    assert get_kernel_backend("torch", "cpu") is TORCH_BACKEND
    assert get_kernel_backend("triton", "cpu") is TRITON_BACKEND
    assert TRITON_BACKEND.name == "triton"
    assert TRITON_BACKEND.build_attention_plan is None


@pytest.mark.usefixtures("cpu_extension")  # fails where it must build and does not
def test_auto_backend_uses_the_kernel_on_cpu() -> None:
    backend = get_kernel_backend("auto", "cpu")
    assert backend.name == "cpu"
    assert backend.paged_attention is cpu_attention.paged_attention


def _without_a_compiler(tmp_path: Path, **env: str) -> dict[str, str]:
    """This environment with a fresh extension cache and a C++ compiler that fails."""
    return dict(os.environ, PAGEDGEN_CACHE_DIR=str(tmp_path), CXX="/bin/false",
                PYTHONPATH=str(REPO_ROOT), **env)


def test_falls_back_to_torch_with_one_log_line_without_a_compiler(tmp_path) -> None:
    """A fresh cache and no usable compiler: the engine's backend is torch, and it says so;
    even with $PAGEDGEN_REQUIRE_CPU_EXTENSION=1, which is for set-up and tests, not the engine."""
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from kernels import get_kernel_backend\n"
        "print(get_kernel_backend('auto', 'cpu').name)\n"
        "print(get_kernel_backend('auto', 'cpu').name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                          env=_without_a_compiler(tmp_path, **{REQUIRE_ENV: "1"}),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch", "torch"]
    assert done.stderr.count("CPU paged-attention kernel unavailable") == 1, done.stderr


def test_set_up_build_fails_only_when_required(tmp_path) -> None:
    """`python -m kernels.cpu_extension` (scripts/setup.sh) with no usable compiler: exit 0 and
    one line on the torch fallback; with --require or $PAGEDGEN_REQUIRE_CPU_EXTENSION=1, exit 1
    and say what failed."""
    def build(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kernels.cpu_extension", *args],
                              cwd=REPO_ROOT, env=_without_a_compiler(tmp_path, **env),
                              capture_output=True, text=True, timeout=300)

    lenient = build(**{REQUIRE_ENV: "0"})
    assert lenient.returncode == 0, lenient.stderr
    assert "CPU kernels not built" in lenient.stderr
    assert "the engine will use the torch reference path" in lenient.stderr
    for done in (build("--require", **{REQUIRE_ENV: "0"}), build(**{REQUIRE_ENV: "1"})):
        assert done.returncode == 1, done.stderr
        assert "error: the CPU extension did not build in " in done.stderr
        assert str(tmp_path) in done.stderr and "/bin/false" in done.stderr, done.stderr


def test_torch_path_does_not_import_triton() -> None:
    code = (
        "import sys, torch, kernels\n"
        "b = kernels.get_kernel_backend('auto', 'cpu')\n"
        "assert b.name in ('cpu', 'torch'), b.name\n"
        "assert 'kernels.triton_backend' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _run_step(backend: KernelBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of a mixed step: seq 0 decodes at position 20, seq 1 prefills 5 new tokens
    after a 16-token cached prefix it shares with seq 0 (block 3), then seq 2 forks seq 0 and
    copies its partial last block before writing into it."""
    gen = torch.Generator().manual_seed(0)
    num_layers, num_blocks, block_size, num_kv_heads, num_heads, head_size = 2, 12, 16, 2, 4, 64
    kv_caches = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_size,
                            generator=gen).to(DEVICE)
    key_cache, value_cache = kv_caches[1, 0], kv_caches[1, 1]
    block_tables = torch.tensor([[3, 7], [3, 9], [3, 5]], dtype=torch.int32, device=DEVICE)

    # Copy-on-write: seq 2 forked seq 0 and gets its own copy of block 7.
    backend.copy_blocks(kv_caches, torch.tensor([[7, 5]], device=DEVICE))

    seq_lens = torch.tensor([21, 21, 21], dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([0, 1, 6, 7], dtype=torch.int32, device=DEVICE)
    # New tokens' slots: seq 0 pos 20 (block 7), seq 1 pos 16..20 (block 9), seq 2 pos 20
    # (block 5), and one padding token.
    slots = torch.tensor([7 * 16 + 4, *range(9 * 16, 9 * 16 + 5), 5 * 16 + 4, -1], device=DEVICE)
    num_tokens = len(slots)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEVICE)
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(DEVICE)
    backend.reshape_and_cache(key, value, key_cache, value_cache, slots)

    plan = None
    if backend.build_attention_plan is not None:
        plan = backend.build_attention_plan(block_tables, seq_lens, query_start_loc, block_size)
    out = backend.paged_attention(query[:7], key_cache, value_cache, block_tables, seq_lens,
                                  query_start_loc, head_size**-0.5, plan=plan)
    return kv_caches, out, query


def test_model_runner_step_matches_torch_backend() -> None:
    torch_caches, torch_out, _ = _run_step(TORCH_BACKEND)
    triton_caches, triton_out, _ = _run_step(TRITON_BACKEND)
    assert torch.equal(triton_caches, torch_caches)
    torch.testing.assert_close(triton_out, torch_out, atol=2e-5, rtol=1e-5)
    # Seqs 0 and 2 share the prefix and the copied block but wrote different last tokens.
    assert not torch.allclose(triton_out[0], triton_out[6])
