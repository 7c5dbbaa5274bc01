"""Load HF Llama-family weights (safetensors directory or GGUF file) into our model."""

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine_service.model.config import ModelConfig
from engine_service.model.models.fused_decoder import build_fused_decoder
from engine_service.model.models.llama import LlamaForCausalLM
from engine_service.model.models.packed_linear import can_pack, pack_linear_layers

log = logging.getLogger(__name__)

# (our fused parameter, the HF parameters concatenated into it along dim 0)
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _read_hf_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    if config.gguf_file is not None:
        # GGUF weights are quantized: let transformers dequantize them, then take its tensors.
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            config.path, gguf_file=config.gguf_file, dtype=torch.float32
        )
        return dict(hf_model.state_dict())
    files = checkpoint_files(Path(config.path))
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the HF checkpoint in `path`: those its index names, else all
    of them but a consolidated*.safetensors beside others. Mistral's repos ship their own
    format's consolidated.safetensors next to the HF shards: other names for the same
    weights, which loaded as well would be unused tensors (check_all_tensors_used)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            weight_map = None
        if isinstance(weight_map, dict) and weight_map:
            return sorted({path / str(name) for name in weight_map.values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors files")
    return [f for f in files if not f.name.startswith("consolidated")] or files


def checkpoint_names(config: ModelConfig) -> set[str] | None:
    """The checkpoint's tensor names, read from the safetensors headers; None for a GGUF file
    (known only once transformers has dequantized it)."""
    if config.gguf_file is not None:
        return None
    names = set()
    for file in checkpoint_files(Path(config.path)):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


# A bias flag of the config, and the checkpoint tensors that carry it.
_BIASES = {
    "attention_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "o_proj_bias": ("self_attn.o_proj.bias",),
    "mlp_bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"),
}


def fit_biases(config: ModelConfig, names: set[str] | None) -> ModelConfig:
    """`config` without the biases its flags promise and no layer of the checkpoint has:
    transformers loads such a checkpoint with zero biases (its missing keys), which is no
    bias. The known case: Qwen2.5 converted to a Llama config with attention_bias, which
    covers o_proj in Llama, and Qwen2.5 has no o_proj bias. A bias on some layers only
    stays an error (the loader names what is missing)."""
    if names is None:
        return config
    absent = [flag for flag, tensors in _BIASES.items()
              if getattr(config, flag) and not any(n.endswith(tensors) for n in names)]
    if not absent:
        return config
    log.warning("the config asks for %s but no layer of the checkpoint has those biases: "
                "loaded without them, as transformers loads it (zeros)", " and ".join(absent))
    return dataclasses.replace(config, **dict.fromkeys(absent, False))


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def check_all_tensors_used(config: ModelConfig, names: object, used: set[str]) -> None:
    """Raise ValueError when the checkpoint holds tensors the model has no place for: a
    variant of its architecture we do not implement (a bias, a norm, another projection),
    which would otherwise load without them and compute something else."""
    unused = sorted(n for n in names if n not in used and not _never_loaded(n, config))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4
                                         else "")
        raise ValueError(f"the checkpoint has {len(unused)} tensors a {config.architecture} "
                         f"has no place for in this engine ({shown}): a variant of the "
                         f"architecture it does not implement")


def _never_loaded(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that are derived or duplicated, not weights: RoPE's
    inverse frequencies, a tied LM head saved beside the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and config.tie_word_embeddings)


def _checkpoint_state(model: LlamaForCausalLM, config: ModelConfig, dtype: torch.dtype,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """The model's parameters from the checkpoint, in `dtype` on `device`. A function of its
    own so that nothing else (the raw checkpoint tensors, a loop variable) outlives it."""
    hf = _read_hf_tensors(config)
    state, used = {}, set()
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name == "lm_head.weight" and "lm_head.weight" not in hf:
            raise ValueError("model has untied embeddings but no lm_head.weight")
        fused = next((f for f in _FUSED if f"{f}." in name), None)
        if fused is None or _hf_name(name) in hf:  # (Phi-3 stores them fused, as we do)
            parts = [_hf_name(name)]
        else:
            parts = [_hf_name(name.replace(fused, part)) for part in _FUSED[fused]]
        missing = [p for p in parts if p not in hf]
        if missing:
            raise ValueError(f"weights for {name} not found in the checkpoint (missing {missing})")
        used.update(parts)
        tensor = torch.cat([hf[p] for p in parts], dim=0) if len(parts) > 1 else hf[parts[0]]
        if tensor.shape != param.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
            )
        state[name] = tensor.to(dtype=dtype, device=device)
    check_all_tensors_used(config, hf, used)
    return state


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = fit_biases(config, checkpoint_names(config))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Nothing here keeps a reference to the weights but the model: each unpacked weight is
    # freed as its layer is packed (a 7B model in bf16 is 14 GB; two copies at once do not
    # fit where one and a little do).
    model.load_state_dict(_checkpoint_state(model, config, dtype, device), strict=False,
                          assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    if can_pack(device, dtype):
        pack_linear_layers(model)
        model.fused_decoder = build_fused_decoder(model)
    return model


def model_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the model's parameters take in `dtype` (tied weights once), from a meta-device
    instance: known before anything is read or allocated."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    unique = {id(p): p for p in model.parameters()}.values()
    element = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in unique) * element
