"""CPU tensors that every decode step reads end to end, placed in memory backed by transparent
huge pages (2 MiB) instead of 4 KiB pages.

Why: a CPU decode step streams all of the model's packed weights once (SmolLM2 in bf16: 269 MB)
and reads K/V blocks scattered over the pool. With 4 KiB pages that is a TLB miss every 4 KiB
of weights, and torch's allocator asks for huge pages only when THP_MEM_ALLOC_ENABLE is set
before torch starts, and then for every tensor of 2 MiB or more (activations too, each fresh
allocation faulting in zeroed 2 MiB pages); on a machine whose THP mode is `madvise`, the
common default, nothing it allocates gets them. Here only the long-lived tensors do: the
packed weights (one arena for all of them: most are under 2 MiB each) and the KV pool.

Linux only (madvise(MADV_HUGEPAGE) on an anonymous mapping); elsewhere, or with THP set to
`never`, these are ordinary tensors and nothing else changes.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Where each tensor starts in the shared buffer: whole cache lines at least, and the
# kernels' vector loads never straddle a page at a tensor's start.
TENSOR_ALIGN_BYTES = 4096


def huge_pages_supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_bytes(num_bytes: int) -> torch.Tensor | None:
    """A zeroed uint8 tensor of `num_bytes` starting on a 2 MiB boundary, in an anonymous
    mapping advised to use huge pages (pages are faulted in, 2 MiB at a time, on first touch);
    None where madvise(MADV_HUGEPAGE) does not exist. The tensor keeps the mapping alive."""
    if num_bytes <= 0 or not huge_pages_supported():
        return None
    # Whole huge pages from an aligned start to past the end, so the last partial one is
    # inside the mapping too.
    length = -(-num_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES
    try:
        mapping = mmap.mmap(-1, length,
                            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as error:  # what torch's allocator would say, with the size asked for
        raise RuntimeError(f"not enough memory: tried to map {num_bytes} bytes "
                           f"({num_bytes / 2**30:.2f} GiB): {error}") from error
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as error:  # THP compiled out of this kernel: ordinary pages, still correct
        log.debug("madvise(MADV_HUGEPAGE) refused: %s", error)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to `mapping`
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + num_bytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, backed by huge pages where supported."""
    raw = huge_page_bytes(math.prod(shape) * dtype.itemsize)
    if raw is None:
        return torch.zeros(shape, dtype=dtype)
    # Written now, as torch.zeros writes it: every page is resident from here on, so a pool
    # the machine cannot hold fails at start, not at the request that first reaches its end.
    raw.zero_()
    return raw.view(dtype).view(shape)


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES


class HugePageArena:
    """One huge-page buffer that tensors are copied into, one after another."""

    def __init__(self, raw: torch.Tensor) -> None:
        self._raw = raw
        self._offset = 0

    @classmethod
    def with_room_for(cls, sizes: list[int]) -> HugePageArena | None:
        """An arena with room for tensors of these byte sizes (or less), each starting
        aligned; None where huge pages are not supported. Room left unwritten costs address
        space, not memory: pages become resident when written."""
        raw = huge_page_bytes(sum(_aligned(size) for size in sizes))
        return None if raw is None else cls(raw)

    def fits(self, tensor: torch.Tensor) -> bool:
        return self._offset + tensor.numel() * tensor.element_size() <= self._raw.numel()

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `tensor` in the arena (same shape, dtype and values)."""
        num_bytes = tensor.numel() * tensor.element_size()
        if not self.fits(tensor):
            raise ValueError(f"the arena has {self._raw.numel() - self._offset} bytes left, "
                             f"a tensor of {num_bytes} does not fit")
        copy = self._raw[self._offset:self._offset + num_bytes].view(tensor.dtype)
        copy = copy.view(tensor.shape)
        copy.copy_(tensor)
        self._offset += _aligned(num_bytes)
        return copy
