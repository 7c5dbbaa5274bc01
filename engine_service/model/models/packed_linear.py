"""Linear layers with weights packed once at load time, for the CPU path.

float32: our kernel (kernels/csrc/linear_cpu.cpp) over panels of 16 output columns. oneDNN's
packed linear costs ~40 us per call before it multiplies anything, and a decode step of SmolLM2
calls 121 linears. `python -m bench.linear` compares them side by side (the layer weights stay
in cache between its calls, as they do not in a decode step, where the fixed cost is a smaller
share: the decode step itself went from 83-87 to 46-68 ms at batch 1 and from 242-245 to
188-195 ms at 32, one thread, bench.decode_step). Each row's result is the same whatever batch
it runs in. Without the C++ extension, float32 takes oneDNN's path.

bfloat16 on a CPU with AVX512-BF16: our kernel too (kernels/csrc/linear_bf16_cpu.cpp), for the
same reason: at batch 1 oneDNN's fixed cost per call made a bf16 decode step no faster than
float32's. Side by side (AMD EPYC with AVX512-BF16, 2 threads, `python -m bench.linear --dtype
bfloat16`, bench/results/linear_bf16.json): 1 row 1.7-2.6x faster than oneDNN's packed bf16
linear, 4 rows 1.5-2.4x, 32 rows 1.06-1.31x, 256 rows 0.99-1.05x, 2048 rows 0.93-1.00x; the
bf16 decode step at batch 1 went from 19.8 to 9.5 ms. Each row's result is the same whatever
batch it runs in, as for float32.

On a CPU with AMX (Sapphire Rapids and later): the same packed weights on AMX tiles
(kernels/csrc/linear_bf16_amx.cpp), for every row count. Against oneDNN's AMX linear (Xeon
with AMX, 2 threads, `python -m bench.linear --dtype bfloat16`, bench/results/xeon_amx/
linear_bf16.json): 1 row 1.17-3.29x faster, 4 rows 1.18-3.35x, 32 rows 1.10-2.44x, 256 rows
0.57-1.46x, 2048 rows 0.66-0.87x; on oneDNN's linears a bf16 engine also lost the decoder
layers in one C++ call (the bf16 decode step at batch 1: 17.5 -> 11.1 ms, bench.decode_step).
A row's result is still the same in every batch.

Elsewhere (bf16 asked for on a CPU without AVX512-BF16, or a build that does not target it):
oneDNN's blocked weight layout (mkldnn._reorder_linear_weight), which runs on AMX and
AVX512-BF16 and emulates bf16 on other AVX512 CPUs. MKL's sgemm (what nn.Linear calls on CPU)
repacks the weight on every call, which at decode batch sizes costs as much as the multiply;
the blocked layout made a bf16 batch-1 linear ~2x faster (576x3072: 185 -> 91 us; LM head
576x49152: 8.6 -> 4.0 ms). The batch-size hint picks the blocking; 32 measured within a few
percent of the best at 1, 32 and 256 rows. oneDNN's bf16 reorder needs AVX512BW/VL/DQ or
AVX-NE-CONVERT; elsewhere bf16 stays nn.Linear.

Weights are frozen after loading, so packing once is safe. The linears are the same whatever
the attention kernel backend: kernel_backend="torch" runs them on our kernel too (and so builds
the extension at load when the cache lacks it).
"""

import logging

import torch
from torch import nn

from engine_service.model.dtype import cpu_flags
from engine_service.model.huge_pages import HugePageArena

log = logging.getLogger(__name__)


def _our_kernel_available(dtype: torch.dtype = torch.float32) -> bool:
    from kernels.cpu_extension import cpu_attention_available  # one extension, all kernels

    if not cpu_attention_available():
        return False
    if dtype == torch.bfloat16:  # built only where the compiler targets AVX512-BF16
        return bool(torch.ops.pagedgen_cpu_linear.bf16_native())
    return dtype == torch.float32


def bf16_linear_kernel() -> str:
    """Which kernel runs this process's bfloat16 linears on the CPU: "amx", "vdpbf16ps" (ours,
    linear_bf16_amx.cpp / linear_bf16_cpu.cpp), "onednn" or "torch" (nn.Linear). The two of
    ours round alike but sum in other orders, so their last bits differ: logged at load."""
    if _our_kernel_available(torch.bfloat16):
        return "amx" if torch.ops.pagedgen_cpu_linear.bf16_amx() else "vdpbf16ps"
    return "onednn" if can_pack(torch.device("cpu"), torch.bfloat16) else "torch"


def _log_bf16_kernel() -> None:
    kernel = bf16_linear_kernel()
    log.info("bfloat16 linears on %s", kernel)
    if "amx_bf16" in cpu_flags() and kernel != "amx":
        log.warning("this CPU has AMX but the bfloat16 linears run on %s: the C++ extension was "
                    "built without AMX (a compiler older than GCC 11 / Clang 12), Linux refused "
                    "the tiles (before 5.16, or a sandbox), or PAGEDGEN_CPU_AMX=0", kernel)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        return _our_kernel_available() or torch.backends.mkldnn.is_available()
    if dtype == torch.bfloat16 and _our_kernel_available(dtype):
        return True
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        # oneDNN's bf16 weight reorder raises without AVX512BW/VL/DQ or AVX-NE-CONVERT (an
        # AVX2-only CPU: a bf16 engine asked for by --dtype bfloat16 died at load).
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return supported is not None and supported()
    return False


PACK_BATCH_SIZE_HINT = 32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout for _linear_pointwise."""
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None:  # older torch: the plain layout still skips MKL's per-call repack
        return weight.to_mkldnn()
    return reorder(weight, PACK_BATCH_SIZE_HINT)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # Plain attributes, not parameters: a packed layout is not a checkpoint format.
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.ours = _our_kernel_available(weight.dtype)
        if self.ours and self.bias is not None:
            # Our kernels add the bias in float32 before the one rounding to the output dtype:
            # converted once here, not on every call.
            self.bias = self.bias.float()
        if self.ours:
            self.packed_weight = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
            self._linear = torch.ops.pagedgen_cpu_linear.linear.default
        else:
            self.packed_weight = pack_weight(weight)
            self._linear = torch.ops.mkldnn._linear_pointwise.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
            if rows.stride(-1) != 1 and rows.shape[-1] > 1:  # (the kernel takes strided rows)
                rows = rows.contiguous()
            y = self._linear(rows, self.packed_weight, self.bias, self.out_features)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        return self._linear(x, self.packed_weight, self.bias, "none", [], "")


def packed_bytes_bound(linear: nn.Linear) -> int:
    """At least the bytes our kernel's packed layout of `linear.weight` takes: float32 panels
    of 16 output columns by every feature (kernels/csrc/linear_cpu.cpp), bf16 panels of 32
    columns by feature pairs (linear_bf16_cpu.cpp); both pad the columns to a whole panel and
    bf16 the features to a pair (tests/engine/test_huge_pages.py checks the bound)."""
    out_features, in_features = linear.weight.shape
    return (out_features + 31) * (in_features + 1) * linear.weight.element_size()


def _linear_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every nn.Linear below `module`. Not the linears themselves: a
    list of them would keep every unpacked weight alive until packing ends."""
    slots = []
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            slots.append((module, name))
        else:
            slots += _linear_slots(child)
    return slots


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every nn.Linear below module with a PackedLinear; returns how many.

    The weights our kernels read go into one huge-page arena (engine_service/model/
    huge_pages.py), each as soon as it is packed: the temporary packed tensor is freed before
    the next layer is packed (the allocator reuses it), and the unpacked weight when its
    nn.Linear is replaced, provided the caller holds no other reference to it. So loading
    holds about one copy of the weights, unpacked shrinking as packed grows. (Packing every
    layer first and placing after kept both sets resident: the freed packed tensors stayed
    in the C heap.)"""
    slots = _linear_slots(module)
    linears = [getattr(parent, name) for parent, name in slots]
    if any(linear.weight.dtype == torch.bfloat16 for linear in linears):
        _log_bf16_kernel()
    sizes = [packed_bytes_bound(linear) for linear in linears
             if _our_kernel_available(linear.weight.dtype)]
    del linears
    arena = HugePageArena.with_room_for(sizes)  # None: none of ours, or no huge pages here
    for parent, name in slots:
        packed = PackedLinear(getattr(parent, name))
        if arena is not None and packed.ours:
            if arena.fits(packed.packed_weight):
                packed.packed_weight = arena.place(packed.packed_weight)
            else:  # packed_bytes_bound is wrong for this layout: correct, but on small pages
                log.warning("packed weight of %s (%s) larger than its bound; left out of the "
                            "huge-page arena", name, tuple(packed.packed_weight.shape))
        setattr(parent, name, packed)
    return len(slots)
