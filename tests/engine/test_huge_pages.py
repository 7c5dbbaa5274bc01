"""The packed weights and the KV pool on huge pages (engine_service/model/huge_pages.py): same
values, one buffer, aligned, released when dropped, and what the engine really reads."""

import gc
import warnings
from pathlib import Path

import pytest
import torch

from engine_service import SamplingParams
from engine_service.model.huge_pages import (
    HUGE_PAGE_BYTES,
    TENSOR_ALIGN_BYTES,
    HugePageArena,
    huge_page_zeros,
    huge_pages_supported,
)

needs_madvise = pytest.mark.skipif(not huge_pages_supported(), reason="no MADV_HUGEPAGE here")
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, int] | None:
    """The /proc/self/smaps entry holding `address`: start, end, AnonHugePages (kB) and
    THPeligible (absent on old kernels: -1)."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if entry is not None:
                return entry
            start, end = (int(x, 16) for x in head.split("-"))
            if start <= address < end:
                entry = {"start": start, "end": end, "thp_eligible": -1}
        elif entry is not None and head == "AnonHugePages:":
            entry["anon_huge_kb"] = int(line.split()[1])
        elif entry is not None and head == "THPeligible:":
            entry["thp_eligible"] = int(line.split()[1])
    return entry


@needs_madvise
def test_copies_keep_values_shapes_and_dtypes_in_one_aligned_buffer():
    originals = [torch.randn(100, 37), torch.randn(3, 3, 3).to(torch.bfloat16),
                 torch.arange(10), torch.randn(8, 6).t()]  # the last one not contiguous
    arena = HugePageArena.with_room_for([t.numel() * t.element_size() for t in originals])
    copies = [arena.place(t) for t in originals]
    pointers = [c.data_ptr() for c in copies]
    assert pointers[0] % HUGE_PAGE_BYTES == 0
    assert all(p % TENSOR_ALIGN_BYTES == 0 for p in pointers)
    assert pointers == sorted(pointers) and len(set(pointers)) == len(pointers)
    storage = copies[0].untyped_storage().data_ptr()
    for original, copy in zip(originals, copies, strict=True):
        assert copy.untyped_storage().data_ptr() == storage  # one buffer
        assert copy.is_contiguous() and copy.dtype == original.dtype
        assert torch.equal(copy, original)
    before = originals[0].clone()
    copies[0].add_(1)  # a copy, not an alias of what it was made from
    assert torch.equal(originals[0], before)
    with pytest.raises(ValueError, match="does not fit"):  # sized for these, and full
        arena.place(torch.zeros(TENSOR_ALIGN_BYTES, dtype=torch.uint8))


@needs_madvise
def test_zeros_are_zero_and_the_mapping_goes_with_the_last_view():
    pool = huge_page_zeros((4, 2, 1000, 16), torch.bfloat16)
    assert pool.shape == (4, 2, 1000, 16) and pool.dtype == torch.bfloat16
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not pool.any()
    address = pool.data_ptr()
    mapping = _mapping_of(address)
    assert mapping is not None and mapping["end"] - address >= pool.numel() * 2
    pool_end = address + pool.numel() * 2
    layer = pool[1]
    del pool
    gc.collect()
    # A view still holds it: the pool's range stays mapped. (Not the same smaps entry: the
    # kernel merges neighbouring mappings into it and splits them off again as they come and go.)
    held = _mapping_of(address)
    assert held is not None and held["start"] <= address and held["end"] >= pool_end, held
    layer.fill_(1)
    del layer
    gc.collect()
    after = _mapping_of(address)  # gone, or another mapping that reused the range
    assert after is None or (after["start"], after["end"]) != (mapping["start"], mapping["end"])


@needs_madvise
def test_a_mapping_too_large_names_its_size():
    with pytest.raises(RuntimeError, match=r"not enough memory: tried to map \d+ bytes"):
        huge_page_zeros((1 << 50,), torch.uint8)  # 1 PiB: more than any address space allows


@needs_madvise
@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="transparent huge pages are off on this machine")
def test_the_memory_is_backed_by_huge_pages():
    pool = huge_page_zeros((8 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 8 huge pages
    mapping = _mapping_of(pool.data_ptr())
    assert mapping is not None
    if mapping["thp_eligible"] == 0:
        pytest.skip("huge pages are disabled for this process (prctl or cgroup)")
    if mapping["end"] - mapping["start"] != 9 * HUGE_PAGE_BYTES:  # 8 + the alignment slack
        pytest.skip("merged with a neighbouring mapping: its huge pages would count too")
    # The kernel may fall back to small pages for some of them when memory is fragmented;
    # none at all means the advice did not reach it.
    assert mapping["anon_huge_kb"] >= HUGE_PAGE_BYTES // 1024


def test_the_engine_reads_the_relocated_weights_and_pool(make_llm, tiny_llama_dir):
    from engine_service.model.models.packed_linear import PackedLinear, _our_kernel_available

    for dtype in ("float32", "bfloat16"):
        if not _our_kernel_available(getattr(torch, dtype)):
            continue  # oneDNN's packed layout: left where it is
        llm = make_llm(tiny_llama_dir, dtype=dtype, num_blocks=16)
        runner = llm.llm_engine.runner
        ours = [m for m in runner.model.modules() if isinstance(m, PackedLinear) and m.ours]
        assert ours
        if huge_pages_supported():
            assert runner.kv_caches.data_ptr() % HUGE_PAGE_BYTES == 0
            assert len({m.packed_weight.untyped_storage().data_ptr() for m in ours}) == 1
        fused = runner.model.fused_decoder
        if fused is not None:  # it holds the weights it was built with: the relocated ones
            held = {w.data_ptr() for w in fused.layer_weights}
            assert {m.packed_weight.data_ptr() for m in ours
                    if m is not runner.model.lm_head} <= held
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params)[0].outputs[0]
        assert len(out.token_ids) == 4


def test_loading_frees_the_unpacked_weights(monkeypatch, make_llm, tiny_llama_dir):
    """Each nn.Linear's own weight is gone once the model is loaded: only its packed copy
    remains (both at once doubled the memory a model needs at load)."""
    from engine_service.model import loader
    from engine_service.model.models.packed_linear import _our_kernel_available

    if not _our_kernel_available(torch.float32):
        pytest.skip("float32 linears are not on our packed kernel here")
    unpacked: dict[int, str] = {}  # data pointer -> parameter name
    real = loader._checkpoint_state

    def recording(model, config, dtype, device):
        state = real(model, config, dtype, device)
        unpacked.update({t.data_ptr(): name for name, t in state.items() if "proj" in name})
        return state

    monkeypatch.setattr(loader, "_checkpoint_state", recording)
    llm = make_llm(tiny_llama_dir, dtype="float32", num_blocks=16)
    assert unpacked
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on torch's deprecated aliases warns)
        warnings.simplefilter("ignore")
        # (Tensors without storage, e.g. oneDNN's packed weights another test left for the
        # collector, have no data pointer to compare.)
        alive = sorted({unpacked[t.data_ptr()] for t in gc.get_objects()
                        if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                        and t.layout == torch.strided and t.data_ptr() in unpacked})
    assert alive == [], f"unpacked weights still referenced after loading: {alive}"
    del llm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_size_bound_holds_for_our_layouts(dtype):
    from torch import nn

    from engine_service.model.models.packed_linear import (
        PackedLinear,
        _our_kernel_available,
        packed_bytes_bound,
    )

    if not _our_kernel_available(dtype):
        pytest.skip(f"{dtype} linears are not on our packed kernel here")
    for out_features, in_features in [(1, 1), (15, 3), (16, 16), (33, 7), (64, 576), (960, 577)]:
        linear = nn.Linear(in_features, out_features, bias=False).to(dtype)
        bound = packed_bytes_bound(linear)
        packed = PackedLinear(linear).packed_weight
        assert packed.numel() * packed.element_size() <= bound, (out_features, in_features)
