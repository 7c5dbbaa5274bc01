"""A checkpoint must fit the model the engine builds for it: a tensor the model has no place
for (a bias, a norm, a projection of a variant we do not implement) is refused by name, on one
device and under tensor parallelism, instead of loading without it and computing something
else; a missing one is named too."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_service import LLM


def _with_tensors(source: Path, out: Path, change) -> Path:
    for item in source.iterdir():
        shutil.copy2(item, out / item.name)
    [weights] = out.glob("*.safetensors")
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_tensor_the_model_has_no_place_for_is_refused(tiny_llama_dir, tmp_path,
                                                        tensor_parallel_size):
    def add_biases(tensors):
        tensors["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
        tensors["model.layers.0.mlp.extra_norm.weight"] = torch.ones(64)

    model_dir = _with_tensors(tiny_llama_dir, tmp_path, add_biases)
    with pytest.raises(ValueError, match=r"the checkpoint has 2 tensors a LlamaForCausalLM has "
                                         r"no place for in this engine \(model\.layers\.0\.mlp"
                                         r"\.extra_norm\.weight, model\.layers\.1\.self_attn"
                                         r"\.o_proj\.bias\)"):
        LLM(str(model_dir), num_blocks=32, dtype="float32",
            tensor_parallel_size=tensor_parallel_size)


def test_a_missing_tensor_is_named(tiny_qwen3_dir, tmp_path):
    def drop_k_norm(tensors):
        del tensors["model.layers.1.self_attn.k_norm.weight"]

    model_dir = _with_tensors(tiny_qwen3_dir, tmp_path, drop_k_norm)
    with pytest.raises(ValueError, match=r"weights for layers\.1\.self_attn\.k_norm\.weight not "
                                         r"found in the checkpoint"):
        LLM(str(model_dir), num_blocks=32, dtype="float32")


def test_derived_and_duplicated_tensors_are_not_weights(tiny_qwen3_dir, tmp_path):
    """RoPE's inverse frequencies and a tied LM head saved beside its embedding load fine."""
    def add_derived(tensors):
        tensors["model.rotary_emb.inv_freq"] = torch.ones(16)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    model_dir = _with_tensors(tiny_qwen3_dir, tmp_path, add_derived)
    llm = LLM(str(model_dir), num_blocks=32, dtype="float32")
    llm.close()
