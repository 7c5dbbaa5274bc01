"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over the paged KV cache.

Plain PyTorch: q/k/v and gate/up projections are fused into one matmul each (fewer, larger
GEMMs are what the CPU path needs); attention goes through the kernel backend.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine_service.model.config import ModelConfig
from kernels import KernelBackend


@dataclass(slots=True)
class StepContext:
    """Per-step inputs shared by every layer."""

    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    attention_plan: object | None
    cos: torch.Tensor  # [num_tokens, head_dim]
    sin: torch.Tensor  # [num_tokens, head_dim]


class RMSNorm(nn.Module):
    """The norm's weight and epsilon; the math is the kernel backend's (kernels/layer_ops.py:
    HF's order of operations, normalize in float32 then scale, fused on the CPU)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


# Positions whose float64 cos / sin are computed at once: a 1M-position table (Mistral-Nemo's
# default context) in one piece held ~1.5 GB more at its peak.
ROPE_CHUNK_POSITIONS = 1 << 16


def rope_cos_sin_cache(
    config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in HF's order of operations: float32 angles
    (positions times the inverse frequencies, unscaled RoPE's here, any other's from HF's own
    class, so every rope_scaling type HF supports statically is supported), their cos and
    sin rounded to float32, then times the attention scaling in float32.

    The cos and sin are computed in float64 and rounded once, where HF calls float32 ones,
    and in numpy on the calling thread: torch's ops on the CPU were not one function of their
    input (measured: in ~15% of fresh processes the half of a table that torch's second
    thread computed came out an ulp off the same call's later, with float32 and float64 cos
    alike; with one thread, never), so two engines (a restart, a replica, a TP rank) could
    hold different tables. Ours are within an ulp of HF's wherever they differ (a few
    percent of entries)."""
    if config.rope_theta is not None:
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim
        inv_freq, scaling = 1.0 / (config.rope_theta ** exponents), 1.0
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(config.hf_config)
        inv_freq, scaling = rotary.inv_freq.float(), rotary.attention_scaling
    # numpy, on this thread: torch runs these ops on its worker threads too, and there the
    # same table came out an ulp off in some processes (see above).
    inv = inv_freq.numpy().astype(np.float32)
    half = inv.size
    cos = np.empty((max_positions, 2 * half), dtype=np.float32)
    sin = np.empty((max_positions, 2 * half), dtype=np.float32)
    for first in range(0, max_positions, ROPE_CHUNK_POSITIONS):
        last = min(first + ROPE_CHUNK_POSITIONS, max_positions)
        positions = np.arange(first, last, dtype=np.float32)
        freqs = (positions[:, None] * inv[None, :]).astype(np.float64)  # float32 angles
        for table, values in ((cos, np.cos(freqs)), (sin, np.sin(freqs))):
            values = values.astype(np.float32)
            if scaling != 1.0:
                values = values * np.float32(scaling)
            table[first:last, :half] = values
            table[first:last, half:] = values  # HF's emb is cat(freqs, freqs)
    cos, sin = torch.from_numpy(cos), torch.from_numpy(sin)
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.scale = config.head_dim**-0.5
        # Qwen3: an RMSNorm over each q head and each k head, before the rotary.
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor, kernels: KernelBackend
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            kernels.layer_ops.head_rms_norm(qkv, self.q_norm.weight, self.k_norm.weight,
                                            self.num_heads, self.num_kv_heads, self.head_dim,
                                            self.q_norm.eps)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        fused = kernels.layer_ops.rotary_and_cache
        if fused is not None:  # one launch for both (kernels/triton_layer_ops.py)
            q = fused(qkv, ctx.cos, ctx.sin, self.num_heads, self.num_kv_heads, self.head_dim,
                      key_cache, value_cache, ctx.slot_mapping)
        else:
            q, k = kernels.layer_ops.rotary(qkv, ctx.cos, ctx.sin, self.num_heads,
                                            self.num_kv_heads, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads,
                                                          self.head_dim)
            kernels.reshape_and_cache(k, v, key_cache, value_cache, ctx.slot_mapping)
        out = kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            ctx.block_tables,
            ctx.seq_lens,
            ctx.query_start_loc,
            self.scale,
            plan=ctx.attention_plan,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, kernels: KernelBackend) -> torch.Tensor:
        return self.down_proj(kernels.layer_ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: StepContext,
        kv_cache: torch.Tensor,
        kernels: KernelBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): each residual add is fused with
        the norm after it, so the next layer (or the final norm) adds the MLP's output."""
        ops, norm = kernels.layer_ops, self.input_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            residual, h = ops.add_rms_norm(residual, x, norm.weight, norm.eps)
        h = self.self_attn(h, ctx, kv_cache, kernels)
        norm = self.post_attention_layernorm
        residual, h = ops.add_rms_norm(residual, h, norm.weight, norm.eps)
        return self.mlp(h, kernels), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device and given the checkpoint's weights (loader.py): no init.
        # nn.Embedding's own (normal_, a Python decomposition on meta) imports torch._dynamo,
        # about 1 s of every engine start.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The layers in one C++ call, set by the loader where it applies (float32, and
        # bfloat16 on AVX512-BF16, on the CPU: fused_decoder.py); used with a backend whose
        # kernels it calls (fused_layers).
        self.fused_decoder = None

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: torch.Tensor,
        kernels: KernelBackend,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        if self.fused_decoder is not None and kernels.fused_layers:
            return self.fused_decoder(x, ctx, kv_caches)
        residual = None
        for layer_index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx, kv_caches[layer_index], kernels)
        if residual is None:  # no layers
            return kernels.layer_ops.rms_norm(x, self.norm.weight, self.norm.eps)
        return kernels.layer_ops.add_rms_norm(residual, x, self.norm.weight, self.norm.eps)[1]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """float32 logits; into `out` when given (cast on the copy, no float32 temporary)."""
        if out is None:
            return self.lm_head(hidden).float()
        return out.copy_(self.lm_head(hidden))
