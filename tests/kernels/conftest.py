"""Shared set-up for the kernel tests: interpreter mode, random paged batches, tolerances, and
whether the C++ CPU extension's tests run, fail or skip (the `cpu_extension` fixture).

Without CUDA the Triton kernels run in the Triton interpreter on CPU (kernels/triton_jit.py
defines them interpreted whatever the import order); TRITON_INTERPRET=1 is also set here, before
any kernels.triton_* import, for any other Triton code these tests reach.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from kernels.cpu_extension import (  # noqa: E402
    REQUIRE_ENV,
    build_failure,
    extension_required,
    failure_summary,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Kernel vs reference computed in float32 from the same (rounded) inputs. Outputs are weighted
# means of N(0, 1) values, |x| < 4: fp16 rounds to ~1e-3 there, bf16 to ~1.6e-2 (the interpreter
# truncates bf16 instead of rounding to nearest, up to one ulp).
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass
class PagedBatch:
    """One step's attention inputs over a randomly laid out paged KV cache."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def args_in_float32(self) -> tuple:
        """The same inputs upcast, for a float32 reference of a low-precision kernel."""
        return (self.query.float(), self.key_cache.float(), self.value_cache.float(),
                self.block_tables, self.seq_lens, self.query_start_loc, self.scale)


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 7,
    seed: int = 0,
) -> PagedBatch:
    """Sequences with `query_lens[i]` new tokens ending a context of `context_lens[i]` tokens.

    Physical blocks are a random permutation of the pool (plus spare blocks nobody owns), so
    a kernel that ignores the block table, or reads past a sequence's blocks, reads the wrong
    data. Table entries past a sequence's last block point at random (valid) blocks.
    """
    if any(q > c or q < 1 for q, c in zip(query_lens, context_lens, strict=True)):
        raise ValueError(f"need 1 <= query_len <= context_len, got {query_lens}, {context_lens}")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + spare_blocks
    owner = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = owner[start:start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return PagedBatch(
        query=torch.randn(starts[-1], num_heads, head_size, generator=gen).to(DEVICE, dtype),
        key_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        value_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        block_tables=tables.to(DEVICE, torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        scale=head_size**-0.5,
    )


@pytest.fixture
def paged_batch():
    """Factory fixture: `paged_batch(query_lens, context_lens, **shape)` -> PagedBatch."""
    return make_paged_batch


@pytest.fixture(scope="session")
def cpu_extension() -> None:
    """The C++ CPU extension, loaded (built first if the cache lacks it). Where it does not
    build: a failure when $PAGEDGEN_REQUIRE_CPU_EXTENSION=1 (scripts/run_tests.sh sets it where
    a C++ compiler exists, so a broken build cannot turn these tests into skips), else a skip
    that says why. The one place that decides; test files take it with
    `pytestmark = pytest.mark.usefixtures("cpu_extension")`."""
    failure = build_failure()
    if failure is None:
        return
    reason = f"the C++ CPU extension does not build here ({failure_summary(failure)})"
    if extension_required():
        pytest.fail(f"{reason}; it is required here ({REQUIRE_ENV}=1). For the compiler's "
                    "output: python -m kernels.cpu_extension --require", pytrace=False)
    pytest.skip(f"{reason}; {REQUIRE_ENV}=1 makes this a failure")
