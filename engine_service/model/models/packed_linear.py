"""Linear layers with weights pre-packed for oneDNN, for the CPU path.

MKL's sgemm (what nn.Linear calls on CPU) repacks the weight matrix on every call; at decode
batch sizes that costs as much as the multiply. oneDNN with a weight packed once at load time
measured 1.4-2.6x faster here for SmolLM2's shapes at 32 rows, and faster at 1 and 512 rows too
(see bench/kernels.py). Weights are frozen after loading, so packing once is safe.
"""

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Plain attributes, not parameters: the packed layout is not a checkpoint format.
        self.packed_weight = linear.weight.detach().to_mkldnn()
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
