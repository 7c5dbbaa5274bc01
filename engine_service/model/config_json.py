"""A model's shape read straight from its config.json, without transformers.

Importing a transformers config class pulls in most of transformers (its activations, hub
kernels and distributed helpers, torch.distributed.tensor, sympy, accelerate): ~3 s of CPU in
each of an engine's two processes, on every start and restart. The checkpoints we serve
(Llama, Mistral, Qwen2, Qwen3, Phi-3 with plain RoPE) need a dozen numbers from the file, so we
read them.
Anything this reader does not know for certain (a missing core field, RoPE scaling, a partial
rotary factor, an unknown architecture) returns None and the caller asks transformers, which
stays the reference: tests/engine/test_config_json.py checks the two agree field by field.
"""

import json
from pathlib import Path

# model_type -> architecture: the families we serve (a GGUF file's config names no
# architecture, only its model_type)
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    # Phi-3 and Phi-4: Llama's layers with q/k/v and gate/up stored fused (as ours are)
    "phi3": "Phi3ForCausalLM",
}
# Every layer attends within the model's sliding_window where it sets one.
WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "Phi3ForCausalLM")
# Qwen3 normalizes each query and key head (an RMSNorm over head_dim) before the rotary.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_UNKNOWN = object()  # a field this reader leaves to transformers

# Present in every real checkpoint; their defaults differ between config classes.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "max_position_embeddings", "rms_norm_eps")


def read_config_json(path: Path) -> dict | None:
    """The fields load_model_config needs, or None where transformers must decide."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None  # transformers gives the user its own error
    if not isinstance(raw, dict):
        return None
    architecture = (raw.get("architectures") or [""])[0]
    if not architecture:
        architecture = MODEL_TYPE_ARCHITECTURES.get(raw.get("model_type"), "")
    if architecture not in MODEL_TYPE_ARCHITECTURES.values():
        return None
    if raw.get("model_type") not in MODEL_TYPE_ARCHITECTURES:
        return None
    if any(not _is_number(raw.get(name)) for name in REQUIRED_FIELDS):
        return None
    # Absent, these take the config class's default, which differs between classes (eos 2 or
    # None; Mistral's KV heads 8, Qwen2's 32, Llama's all heads; a null is an error to some).
    if "eos_token_id" not in raw or not _is_number(raw.get("num_key_value_heads")):
        return None
    rope_theta = _plain_rope_theta(raw)
    if rope_theta is None:
        return None
    sliding_window = _sliding_window(raw, architecture)
    if sliding_window is _UNKNOWN:
        return None
    heads = raw["num_attention_heads"]
    kv_heads = raw["num_key_value_heads"]
    head_dim = raw.get("head_dim")
    if head_dim is None and architecture in QK_NORM_ARCHITECTURES:
        return None  # Qwen3's class defaults it to 128, not hidden_size / heads
    head_dim = head_dim or raw["hidden_size"] // heads
    eos = raw.get("eos_token_id")
    return {
        "architecture": architecture,
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_layers": raw["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(raw["rms_norm_eps"]),
        "max_position_embeddings": raw["max_position_embeddings"],
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        **layer_biases(architecture, raw.get("attention_bias"), raw.get("mlp_bias")),
        "eos_token_ids": tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None
                                                                   else ()),
        "rope_theta": rope_theta,
        "qk_norm": architecture in QK_NORM_ARCHITECTURES,
        "sliding_window": sliding_window,
    }


def _sliding_window(raw: dict, architecture: str) -> object:
    """The sliding window as config.py's _sliding_window reads it from transformers' config,
    or _UNKNOWN where a class default would decide (Mistral's window when the key is absent,
    Qwen's sliding layers when layer_types is)."""
    if architecture in WINDOWED_ARCHITECTURES:
        window = raw.get("sliding_window", _UNKNOWN)
    elif architecture in QWEN_ARCHITECTURES:
        if not raw.get("use_sliding_window", False):
            return None
        layer_types = raw.get("layer_types")
        if not isinstance(layer_types, list) or "sliding_window" not in raw:
            return _UNKNOWN
        if "sliding_attention" not in layer_types:
            return None
        window = raw["sliding_window"]
    else:
        return None
    if window is None or window is _UNKNOWN:
        return window
    valid = isinstance(window, int) and not isinstance(window, bool) and window >= 1
    return window if valid else _UNKNOWN


def layer_biases(architecture: str, attention_bias: object, mlp_bias: object) -> dict:
    """Which projections carry a bias, as transformers' modeling code builds them: Qwen2's
    q/k/v always (its o_proj never); Mistral's and Phi-3's none (they ignore attention_bias);
    Llama's and Qwen3's q/k/v and o with attention_bias; Llama's MLP with mlp_bias."""
    if architecture == "Qwen2ForCausalLM":
        return {"attention_bias": True, "o_proj_bias": False, "mlp_bias": False}
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return {"attention_bias": False, "o_proj_bias": False, "mlp_bias": False}
    attention = bool(attention_bias)
    return {"attention_bias": attention, "o_proj_bias": attention,
            "mlp_bias": architecture == "LlamaForCausalLM" and bool(mlp_bias)}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _plain_rope_theta(raw: dict) -> float | None:
    """The base of unscaled RoPE over the whole head, in either spelling transformers writes
    (v5's rope_parameters, v4's rope_theta + rope_scaling); None for anything else."""
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or set(params) - {"rope_theta", "rope_type",
                                                          "partial_rotary_factor"}:
            return None
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            return None
        if params.get("rope_type", "default") != "default":
            return None
        theta = params.get("rope_theta", raw.get("rope_theta"))
    else:
        if raw.get("rope_scaling") is not None:
            return None
        theta = raw.get("rope_theta")
    return float(theta) if _is_number(theta) else None
