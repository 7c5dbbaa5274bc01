"""Tiny random-init HF model directories for fast engine tests.

Each directory looks like a real checkpoint (config.json, model.safetensors,
generation_config.json, tokenizer files), so the engine and the HF reference load it the way they
load SmolLM2. The tokenizer is SmolLM2's (49152 tokens), so text prompts and chat templates work.

The weights are drawn larger than HF's default init (std 0.02), so the logits are peaked: the
top-1/top-2 gap of a greedy step is ~0.1 (median) while float32 reordering moves logits by ~1e-5,
so a token-for-token comparison with the reference is meaningful rather than flaky. Larger stds
(0.2, 0.3) widen the gap but amplify the reordering noise faster (measured: the median-gap to
noise ratio is ~3e4 at 0.1, ~2e4 at 0.2, ~1.5e4 at 0.3), hence 0.1.
"""

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

TinyModelKind = Literal["llama", "qwen2", "qwen3", "phi3"]
# Qwen3's heads are wider than hidden_size / num_heads (0.6B: 16 heads of 128 on 1,024): the
# tiny one likewise, 4 heads of 32 on 64, so q's width (128) is not the hidden size.
QWEN3_HEAD_DIM = 32

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# SmolLM2's tokenizer: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SMOLLM2_VOCAB_SIZE = 49152
SMOLLM2_BOS_TOKEN_ID = 1
SMOLLM2_EOS_TOKEN_ID = 2

# Llama 3.1 style rope scaling. With head_dim 16 and theta 10000 the rotary wavelengths span
# ~6 to ~20000 positions, so against an original context of 512 (low/high-frequency cut-offs at
# 512 and 128 positions) some dimensions are left alone, some divided by `factor` and some
# interpolated: all three branches of the llama3 formula are exercised.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


@dataclass(frozen=True)
class TinyModelSpec:
    kind: TinyModelKind
    seed: int = 0
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # None: the family's usual choice (Llama unties, Qwen2 small models tie) so both lm_head
    # paths are covered by the two default tiny models.
    tie_word_embeddings: bool | None = None
    init_std: float = 0.1
    extra_config: dict[str, Any] = field(default_factory=dict)


def _build_config(spec: TinyModelSpec) -> PretrainedConfig:
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        rope_parameters = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    common: dict[str, Any] = dict(
        vocab_size=SMOLLM2_VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters,
        initializer_range=spec.init_std,
        bos_token_id=SMOLLM2_BOS_TOKEN_ID,
        eos_token_id=SMOLLM2_EOS_TOKEN_ID,
        pad_token_id=SMOLLM2_EOS_TOKEN_ID,
        **spec.extra_config,
    )
    if spec.kind == "llama":
        tie = False if spec.tie_word_embeddings is None else spec.tie_word_embeddings
        return LlamaConfig(**{"attention_bias": False, **common}, tie_word_embeddings=tie)
    if spec.kind == "qwen2":
        tie = True if spec.tie_word_embeddings is None else spec.tie_word_embeddings
        # Qwen2's q/k/v projections always carry a bias (o_proj does not).
        return Qwen2Config(**common, tie_word_embeddings=tie, use_sliding_window=False)
    if spec.kind == "qwen3":
        # No biases, q_norm and k_norm per head; small Qwen3 checkpoints tie their embeddings.
        tie = True if spec.tie_word_embeddings is None else spec.tie_word_embeddings
        head_dim = spec.extra_config.get("head_dim", QWEN3_HEAD_DIM)
        return Qwen3Config(**{"attention_bias": False, **common, "head_dim": head_dim},
                           tie_word_embeddings=tie, use_sliding_window=False)
    if spec.kind == "phi3":
        # Llama's layers with q/k/v and gate/up stored fused; Phi-4 unties, Phi-3-mini ties.
        tie = False if spec.tie_word_embeddings is None else spec.tie_word_embeddings
        return Phi3Config(**{"sliding_window": None, **common}, tie_word_embeddings=tie)
    raise ValueError(f"tiny model kind must be 'llama', 'qwen2', 'qwen3' or 'phi3', got "
                     f"{spec.kind!r}")


@torch.no_grad()
def _randomize_parameters(model: torch.nn.Module, spec: TinyModelSpec) -> None:
    """Deterministic init from spec.seed, independent of HF's init order.

    HF initializes norm weights to 1 and biases to 0; both would hide bugs (a dropped norm
    weight or an ignored qkv bias would still match), so they get random nonzero values too.
    """
    generator = torch.Generator().manual_seed(spec.seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if "norm" in name:
            values = torch.empty(param.shape).uniform_(0.5, 1.5, generator=generator)
        elif name.endswith(".bias"):
            values = torch.empty(param.shape).normal_(0.0, 0.5, generator=generator)
        else:
            values = torch.empty(param.shape).normal_(0.0, spec.init_std, generator=generator)
        param.copy_(values)


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for filename in TOKENIZER_FILES:
        source = tokenizer_dir / filename
        if not source.is_file():
            raise FileNotFoundError(
                f"tokenizer file {filename} missing from {tokenizer_dir}; "
                "pass the prepared SmolLM2 directory (engine_service.tools.prepare_model)"
            )
        shutil.copy2(source, out_dir / filename)


def make_tiny_model(
    kind: TinyModelKind,
    out_dir: Path,
    *,
    tokenizer_dir: Path,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool | None = None,
    init_std: float = 0.1,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Writes a random-init model of the given family into out_dir and returns out_dir.

    tokenizer_dir: a directory with SmolLM2's tokenizer files (the prepared default model).
    """
    spec = TinyModelSpec(
        kind=kind,
        seed=seed,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        init_std=init_std,
        extra_config=dict(extra_config or {}),
    )
    config = _build_config(spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_parameters(model, spec)
    if config.tie_word_embeddings:
        # Tying makes lm_head and embed_tokens the same tensor; re-tie in case the copy above
        # went through the lm_head name last.
        model.tie_weights()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _copy_tokenizer(Path(tokenizer_dir), out_dir)
    return out_dir
