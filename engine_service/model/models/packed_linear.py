"""Linear layers with weights pre-packed for oneDNN, for the CPU path.

MKL's sgemm (what nn.Linear calls on CPU) repacks the weight matrix on every call; at decode
batch sizes that costs as much as the multiply. oneDNN with a weight packed once at load time
measured 1.4-2.6x faster here for SmolLM2's shapes at 32 rows, and faster at 1 and 512 rows too
(see bench/kernels.py). Weights are frozen after loading, so packing once is safe.

The packing is oneDNN's own blocked weight layout (mkldnn._reorder_linear_weight), not just a
oneDNN tensor in the plain layout (to_mkldnn): measured here (one thread, thread CPU time) the
blocked layout makes a bf16 batch-1 linear ~2x faster (576x3072: 185 -> 91 us; LM head
576x49152: 8.6 -> 4.0 ms) and fp32 at 32 rows ~1.3x faster; without it bf16 was no faster than
fp32 at batch 1. The batch-size hint picks the blocking; 32 measured within a few percent of
the best at 1, 32 and 256 rows for both dtypes.
"""

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        # oneDNN's bf16 weight reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT and raises
        # without them (an AVX2-only CPU: a bf16 engine asked for by --dtype bfloat16 died at
        # load); nn.Linear runs bf16 there, slowly but right.
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return supported is not None and supported()
    return dtype == torch.float32


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
        # Plain attributes, not parameters: the packed layout is not a checkpoint format.
        self.packed_weight = pack_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every nn.Linear below module with a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linear_layers(child)
    return count
