"""The decoder layers in one C++ call (kernels/csrc/decoder_cpu.cpp), on the CPU for float32,
and for bfloat16 where its linears are ours (AVX512-BF16).

The Python layer loop (llama.py) calls ~12 kernels per layer, and at batch 1 the Python and
dispatch work between them was ~5 ms of a ~24 ms SmolLM2 decode step whose linears already
stream the weights at the machine's read bandwidth. The C++ loop calls the same kernels in the
same order on the same tensors, so it computes the same bits (tests/kernels/
test_kernel_decoder.py compares the two), and the Python loop stays the reference and the path
for everything else: the torch kernel backend, fp16 and bf16 on oneDNN's linears, CUDA.
It knows the layer as llama.py builds it and nothing more: a model with more in its layers
(biases beyond q/k/v, another norm) must not get one (build_fused_decoder checks what it can).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_service.model.models.llama import StepContext
from engine_service.model.models.packed_linear import PackedLinear


@dataclass(slots=True)
class FusedDecoder:
    # Per layer: input norm, qkv (packed), o (packed), post-attention norm, gate_up (packed),
    # down (packed): the order decoder_cpu.cpp reads them in. The model's own tensors, shared.
    layer_weights: list[torch.Tensor]
    qkv_biases: list[torch.Tensor]  # one per layer, or none
    qk_norms: list[torch.Tensor]  # q_norm and k_norm weights, two per layer, or none (Qwen3)
    final_norm: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    scale: float
    # float64 [2]: when set, the op adds the seconds it spends in linears and in attention
    # (bench/decode_step.py's split of a step).
    timings: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, ctx: StepContext, kv_caches: torch.Tensor
                 ) -> torch.Tensor:
        """x: the embedded tokens (overwritten: it is the residual stream); returns the hidden
        states after the final norm, as LlamaForCausalLM.forward does."""
        return torch.ops.pagedgen_cpu_decoder.forward(
            x, self.layer_weights, self.qkv_biases, self.qk_norms, self.final_norm, kv_caches,
            ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc, ctx.cos,
            ctx.sin, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size,
            self.eps, self.scale, self.timings)


def _ours(linear: nn.Module, bias_allowed: bool = False) -> bool:
    """On our packed kernel, and with no bias the C++ loop would leave out (it adds the qkv
    projection's only)."""
    return (isinstance(linear, PackedLinear) and linear.ours
            and (bias_allowed or linear.bias is None))


def build_fused_decoder(model: nn.Module) -> FusedDecoder | None:
    """The fused loop over `model`'s layers, or None where it does not apply (not float32 or
    bfloat16 on our packed linears, no layers)."""
    layers = list(model.layers)
    if not layers or model.norm.weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    weights, biases, qk_norms = [], [], []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (_ours(attn.qkv_proj, bias_allowed=True)
                and all(_ours(m) for m in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
            return None
        weights += [layer.input_layernorm.weight.detach(), attn.qkv_proj.packed_weight,
                    attn.o_proj.packed_weight, layer.post_attention_layernorm.weight.detach(),
                    mlp.gate_up_proj.packed_weight, mlp.down_proj.packed_weight]
        if attn.qkv_proj.bias is not None:
            biases.append(attn.qkv_proj.bias)
        if attn.q_norm is not None:
            if attn.q_norm.eps != model.norm.eps or attn.k_norm.eps != model.norm.eps:
                return None  # the C++ loop has one eps for every norm
            qk_norms += [attn.q_norm.weight.detach(), attn.k_norm.weight.detach()]
    if biases and len(biases) != len(layers):
        return None  # (biases on some layers only: no checkpoint we load has that)
    if qk_norms and len(qk_norms) != 2 * len(layers):
        return None
    first = layers[0].self_attn
    return FusedDecoder(weights, biases, qk_norms, model.norm.weight.detach(), first.num_heads,
                        first.num_kv_heads, first.head_dim,
                        layers[0].mlp.down_proj.in_features, model.norm.eps, first.scale)
