"""Load one rank's shards of an HF Llama-family checkpoint.

From safetensors each rank reads only its rows and columns (safetensors slices the file
without reading the rest). A GGUF file is quantized: transformers dequantizes it whole, and
the rank keeps its slices of that.
"""

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine_service.model.config import ModelConfig
from engine_service.model.loader import (
    _read_hf_tensors,
    check_all_tensors_used,
    checkpoint_files,
    fit_biases,
)
from engine_service.model.models.llama import LlamaForCausalLM
from engine_service.model.models.packed_linear import can_pack, pack_linear_layers
from engine_service.model.parallel.group import TensorParallelGroup
from engine_service.model.parallel.layers import build_sharded_model
from engine_service.model.parallel.shard import TensorShard


class _Checkpoint:
    """Named tensors, read whole or as a row or column range."""

    def __init__(self, config: ModelConfig, files: ExitStack) -> None:
        self._whole: dict[str, torch.Tensor] | None = None
        self._slices = {}
        self.read_names: set[str] = set()  # what the model took, of names()
        if config.gguf_file is not None:
            self._whole = _read_hf_tensors(config)
            return
        for path in checkpoint_files(Path(config.path)):
            handle = files.enter_context(safe_open(path, framework="pt"))
            for name in handle.keys():
                self._slices[name] = handle

    def names(self) -> list[str]:
        return list(self._whole if self._whole is not None else self._slices)

    def has(self, name: str) -> bool:
        return name in (self._whole if self._whole is not None else self._slices)

    def read(self, name: str, rows: range | None = None, columns: range | None = None
             ) -> torch.Tensor:
        if not self.has(name):
            raise ValueError(f"weights for {name} not found in the checkpoint")
        self.read_names.add(name)
        if self._whole is not None:
            tensor = self._whole[name]
            if rows is not None:
                tensor = tensor[rows.start : rows.stop]
            return tensor if columns is None else tensor[:, columns.start : columns.stop]
        part = self._slices[name].get_slice(name)
        if rows is not None:
            return part[rows.start : rows.stop]
        if columns is not None:
            return part[:, columns.start : columns.stop]
        return part[:]


def _head_rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _padded_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_zeros((rows - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad])


def _shard_tensor(ckpt: _Checkpoint, name: str, config: ModelConfig, shard: TensorShard
                  ) -> torch.Tensor:
    """This rank's part of our parameter `name` (layers.py's names), from the HF tensors."""
    hd = config.head_dim
    if name == "embed_tokens.weight":
        return _padded_rows(ckpt.read("model.embed_tokens.weight", shard.vocab),
                            shard.vocab_per_rank)
    if name == "lm_head.linear.weight":
        return _padded_rows(ckpt.read("lm_head.weight", shard.vocab), shard.vocab_per_rank)
    prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
    hf = "model." + prefix
    if prefix.endswith("self_attn.qkv_proj"):
        base = hf.removesuffix("qkv_proj")
        kv_rows = _head_rows(shard.kv_heads, hd)
        return torch.cat([ckpt.read(f"{base}q_proj.{leaf}", _head_rows(shard.heads, hd)),
                          ckpt.read(f"{base}k_proj.{leaf}", kv_rows),
                          ckpt.read(f"{base}v_proj.{leaf}", kv_rows)])
    if prefix.endswith(("self_attn.o_proj.linear", "mlp.down_proj.linear")) and leaf == "bias":
        # Row-parallel: the ranks' outputs are summed, so one rank adds the bias.
        bias = ckpt.read(f"{hf.removesuffix('.linear')}.bias")
        return bias if shard.rank == 0 else torch.zeros_like(bias)
    if prefix.endswith("self_attn.o_proj.linear"):
        return ckpt.read(f"{hf.removesuffix('.linear')}.{leaf}",
                         columns=_head_rows(shard.heads, hd))
    if prefix.endswith("mlp.gate_up_proj"):
        base = hf.removesuffix("gate_up_proj")
        return torch.cat([ckpt.read(f"{base}gate_proj.{leaf}", shard.intermediate),
                          ckpt.read(f"{base}up_proj.{leaf}", shard.intermediate)])
    if prefix.endswith("mlp.down_proj.linear"):
        return ckpt.read(f"{hf.removesuffix('.linear')}.{leaf}", columns=shard.intermediate)
    return ckpt.read(hf + "." + leaf)  # norms: whole on every rank


def load_sharded_model(config: ModelConfig, shard: TensorShard, group: TensorParallelGroup,
                       dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    state = {}
    with ExitStack() as files:
        ckpt = _Checkpoint(config, files)
        config = fit_biases(config, set(ckpt.names()))
        with torch.device("meta"):
            model = build_sharded_model(config, shard, group)
        if not config.tie_word_embeddings and not ckpt.has("lm_head.weight"):
            raise ValueError("model has untied embeddings but no lm_head.weight")
        for name, param in model.named_parameters():
            if name == "lm_head.linear.weight" and config.tie_word_embeddings:
                continue
            tensor = _shard_tensor(ckpt, name, config, shard)
            if tensor.shape != param.shape:
                raise ValueError(f"{name}: checkpoint shard of shape {tuple(tensor.shape)} "
                                 f"!= {tuple(param.shape)} (rank {shard.rank} of "
                                 f"{shard.world_size})")
            state[name] = tensor.to(dtype=dtype, device=device)
        check_all_tensors_used(config, ckpt.names(), ckpt.read_names)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.linear.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    if can_pack(device, dtype):
        pack_linear_layers(model)  # the per-layer path: no fused decoder (layers.py says why)
    return model
