"""What the engine needs to know about a model, read from a local HF directory or GGUF file."""

from dataclasses import dataclass
from pathlib import Path

from engine_service.model.config_json import (
    MODEL_TYPE_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    QWEN_ARCHITECTURES,
    WINDOWED_ARCHITECTURES,
    layer_biases,
    read_config_json,
)

# RoPE whose frequencies change with the sequence's length (HF recomputes them as it grows):
# one table for every position cannot be them.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope", "su")  # ("su": longrope's first name)

SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPE_ARCHITECTURES.values())


@dataclass(slots=True)
class ModelConfig:
    path: Path  # the HF directory (a GGUF file's directory when gguf_file is set)
    gguf_file: str | None
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2's always; Llama's and Qwen3's with the flag)
    eos_token_ids: tuple[int, ...]
    # Unscaled RoPE's base when read from config.json (config_json.py); None: RoPE comes from
    # hf_config, the transformers config, through HF's own rotary embedding (any scaling).
    hf_config: object | None = None
    rope_theta: float | None = None
    qk_norm: bool = False  # a per-head RMSNorm on q and k (Qwen3's q_norm, k_norm)
    o_proj_bias: bool = False  # Llama's and Qwen3's attention_bias covers o_proj too
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down
    # The window some layers attend within (Mistral's sliding_window, Qwen's sliding layers),
    # or None. The engine attends to the whole context, the same as the window until the
    # context outgrows it: so it serves no longer contexts than the window (longest_context).
    sliding_window: int | None = None

    def longest_context(self) -> int:
        """The most tokens (prompt and output) one sequence may hold with this model:
        max_position_embeddings, within the sliding window where there is one (vLLM's
        --disable-sliding-window does the same)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)


def load_model_config(model: str | Path) -> ModelConfig:
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"model must be a local HF directory or GGUF file; {str(model)!r} does not exist"
        )
    gguf_file = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file must be a .gguf file, got {str(model)!r}")
        path, gguf_file = path.parent, path.name
    elif not (path / "config.json").exists():
        raise ValueError(f"model directory {str(model)!r} has no config.json")
    fields = None if gguf_file is not None else read_config_json(path)
    if fields is not None:
        return ModelConfig(path=path, gguf_file=None, **fields)
    return _from_transformers(path, gguf_file)


def _from_transformers(path: Path, gguf_file: str | None) -> ModelConfig:
    """Through transformers' AutoConfig: GGUF files, RoPE scaling, anything config_json.py
    does not read itself."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    except KeyError as error:  # a field its config class needs, missing (a bare KeyError)
        said = error.args[0] if error.args else error
        raise ValueError(f"the model's config could not be read by transformers: {said}") \
            from None
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if not architecture:
        architecture = MODEL_TYPE_ARCHITECTURES.get(config.model_type, "")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model architecture must be one of {SUPPORTED_ARCHITECTURES}, got {architecture!r}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if gguf_file is not None and config.model_type == "phi3":
        _phi3_gguf_fields(config, path / gguf_file, head_dim)
    _check_rope(config)
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        path=path,
        gguf_file=gguf_file,
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        **layer_biases(architecture, getattr(config, "attention_bias", False),
                       getattr(config, "mlp_bias", False)),
        eos_token_ids=eos_ids,
        hf_config=config,
        qk_norm=architecture in QK_NORM_ARCHITECTURES,
        sliding_window=_sliding_window(config, architecture),
    )


def _phi3_gguf_fields(config, gguf_path: Path, head_dim: int) -> None:
    """What transformers' GGUF reading leaves out of a Phi-3 config, read from the file
    itself: the rotary dimensions (Phi-4-mini rotates 3/4 of each head) and the sliding
    window (Phi-3-mini-4k's 2047)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)

    def scalar(key: str) -> int | None:
        field = reader.get_field(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    rotary = scalar("phi3.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        config.partial_rotary_factor = rotary / head_dim  # (refused by _check_rope)
    window = scalar("phi3.attention.sliding_window")
    if window:  # (llama.cpp writes 0 for Phi-4: no window)
        config.sliding_window = window


def _check_rope(config) -> None:
    """ValueError for RoPE the engine's kernels do not apply: over part of each head only
    (Phi-4-mini's partial_rotary_factor), or with frequencies that change with the length."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is None and isinstance(params, dict):
        partial = params.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise ValueError(f"the model's partial_rotary_factor must be 1 (RoPE over the whole "
                         f"head: the engine rotates whole heads), got {partial}")
    rope_type = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"the model's rope_type must not be one of {LENGTH_DEPENDENT_ROPE} "
                         f"(frequencies that change with the sequence's length, which one "
                         f"table for every position cannot hold), got {rope_type!r}")


def _sliding_window(config, architecture: str) -> int | None:
    """The window as transformers' modeling code applies it: Mistral's on every layer, Qwen's
    on the layers its layer_types mark sliding (none unless use_sliding_window), Llama none."""
    window = getattr(config, "sliding_window", None)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):
        raise ValueError(f"the model's sliding_window must be a positive number of tokens or "
                         f"null, got {window!r}")
    if architecture in WINDOWED_ARCHITECTURES:
        return window
    if architecture in QWEN_ARCHITECTURES:
        return window if "sliding_attention" in (getattr(config, "layer_types", None) or ()) \
            else None
    return None
