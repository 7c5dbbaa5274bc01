"""A tiny Qwen3 HF directory written as a float32 GGUF file (the `gguf` package's writer, with
llama.cpp's tensor names), so the GGUF path is tested on Qwen3 without a download."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from safetensors.torch import load_file


def write_qwen3_gguf(model_dir: Path, out: Path) -> Path:
    """`model_dir` (make_tiny_model("qwen3", ..., tied embeddings, SmolLM2's tokenizer)) as a
    GGUF file at `out`. transformers reads no head_dim from a Qwen3 GGUF (its config class's
    default, 128, applies): the model must have heads of 128."""
    config = json.loads((model_dir / "config.json").read_text())
    if config["head_dim"] != 128:
        raise ValueError(f"head_dim must be 128 (what transformers assumes), got "
                         f"{config['head_dim']}")
    arch = gguf.MODEL_ARCH.QWEN3
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight",
                          tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
