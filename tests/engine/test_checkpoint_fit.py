"""A checkpoint must fit the model the engine builds for it: a tensor the model has no place
for (a bias, a norm, a projection of a variant we do not implement) is refused by name, on one
device and under tensor parallelism, instead of loading without it and computing something
else; a missing one is named too."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_service import LLM, SamplingParams
from tests.support.hf_reference import hf_greedy_ignore_eos
from tests.support.qwen3_gguf import write_qwen3_gguf
from tests.support.tiny_models import make_tiny_model


def _with_tensors(source: Path, out: Path, change) -> Path:
    out.mkdir(exist_ok=True)
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


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [list(range(100, 110)), list(range(200, 240))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("with_index", [True, False])
def test_mistral_s_consolidated_file_beside_the_hf_shards_is_not_read(tiny_llama_dir, tmp_path,
                                                                       with_index):
    """Mistral's repos ship consolidated.safetensors (their own names for the same weights)
    beside the HF files: the index's files are read, or without an index all but it."""
    model_dir = _with_tensors(tiny_llama_dir, tmp_path / "model", lambda tensors: None)
    [weights] = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    native = {name.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq")
              : t for name, t in tensors.items()}
    save_file(native, model_dir / "consolidated.safetensors", metadata={"format": "pt"})
    if with_index:
        index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, weights.name)}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = LLM(str(tiny_llama_dir), num_blocks=32, dtype="float32")
    try:
        reference = _greedy(expected)
    finally:
        expected.close()
    for tp in (1, 2):
        llm = LLM(str(model_dir), num_blocks=32, dtype="float32", tensor_parallel_size=tp)
        try:
            assert _greedy(llm) == reference if tp == 1 else len(_greedy(llm)) == 2
        finally:
            llm.close()


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_attention_bias_without_o_proj_biases_loads_as_transformers_does(
        smollm2_dir, tmp_path, tensor_parallel_size, caplog):
    """A Llama config with attention_bias (q, k, v and o in Llama) over a checkpoint with
    q/k/v biases only (Qwen2.5 converted to Llama): transformers zero-fills the o biases, so
    the model is one without them; ours loads so too, and says so."""
    model_dir = make_tiny_model("llama", tmp_path / "model", tokenizer_dir=smollm2_dir, seed=6,
                                extra_config={"attention_bias": True})
    [weights] = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    for name in [n for n in tensors if n.endswith("o_proj.bias")]:
        del tensors[name]
    save_file(tensors, weights, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="engine_service.model.loader"):
        llm = LLM(str(model_dir), num_blocks=64, dtype="float32",
                  tensor_parallel_size=tensor_parallel_size)
    try:
        prompts = [list(range(100, 110)), list(range(200, 240))]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        got = [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.close()
    if tensor_parallel_size == 1:  # (rank 0 of a TP engine logs in its own process)
        assert any("no layer of the checkpoint has those biases" in r.getMessage()
                   for r in caplog.records)
        assert got == hf_greedy_ignore_eos(model_dir, prompts, 12)
    else:
        assert len(got) == 2


def test_a_qwen3_gguf_file_gives_its_directory_s_tokens(smollm2_dir, tmp_path):
    """The GGUF path (transformers dequantizes, the unused-tensor check runs) on Qwen3: a
    float32 GGUF written from a tiny Qwen3 gives the directory's greedy tokens."""
    model_dir = make_tiny_model("qwen3", tmp_path / "model", tokenizer_dir=smollm2_dir, seed=7,
                                extra_config={"head_dim": 128})
    gguf_file = write_qwen3_gguf(model_dir, tmp_path / "tiny-qwen3.gguf")
    outputs = []
    for model in (model_dir, gguf_file):  # (token ids in and out: no tokenizer to convert)
        llm = LLM(str(model), num_blocks=32, dtype="float32", skip_tokenizer_init=True)
        try:
            assert llm.llm_engine.model_config.qk_norm
            outputs.append(_greedy(llm))
        finally:
            llm.close()
    assert outputs[0] == outputs[1]
