"""config.json read without transformers (engine_service/model/config_json.py) and the
TokenizersBackend loaded directly (engine_service/model/tokenizer.py) give what transformers
gives: every ModelConfig field, the RoPE tables bit for bit, the tokenizer's class, ids, chat
rendering and text. What the fast reader does not know falls back to transformers."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_service.model.config import _from_transformers, load_model_config
from engine_service.model.config_json import read_config_json
from engine_service.model.models.llama import rope_cos_sin_cache
from engine_service.model.tokenizer import load_tokenizer


def shape_fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in ("hf_config", "rope_theta")}


def assert_same_as_transformers(path: Path) -> None:
    fast = load_model_config(path)
    assert fast.rope_theta is not None and fast.hf_config is None, "took the slow path"
    slow = _from_transformers(path, None)
    assert shape_fields(fast) == shape_fields(slow)
    for got, want in zip(rope_cos_sin_cache(fast, 4096, torch.float32, torch.device("cpu")),
                         rope_cos_sin_cache(slow, 4096, torch.float32, torch.device("cpu")),
                         strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir",
                                   "tiny_phi3_dir", "smollm2_dir"])
def test_test_models_read_as_transformers_reads_them(model, request):
    assert_same_as_transformers(request.getfixturevalue(model))


MINIMAL = {
    "vocab_size": 1000, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
    "num_attention_heads": 6, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "eos_token_id": 2, "num_key_value_heads": 3, "sliding_window": None,
}


@pytest.mark.parametrize("model_type,architecture", [
    ("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"), ("phi3", "Phi3ForCausalLM"),
])
@pytest.mark.parametrize("extra", [
    {"rope_theta": 500000.0},  # transformers v4's spelling
    {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},  # v5's
    {"rope_theta": 10000.0, "num_key_value_heads": 2, "head_dim": 32, "eos_token_id": [5, 7],
     "tie_word_embeddings": True, "attention_bias": True},
    {"rope_theta": 10000.0, "head_dim": None, "eos_token_id": None},
], ids=["v4-rope", "v5-rope", "explicit", "nulls"])
def test_minimal_configs_read_as_transformers_reads_them(tmp_path, model_type, architecture,
                                                          extra):
    config = {"model_type": model_type, "architectures": [architecture], **MINIMAL, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_same_as_transformers(tmp_path)


SLIDING = [
    ("mistral", "MistralForCausalLM", {"sliding_window": 1024}, 1024),
    ("mistral", "MistralForCausalLM", {}, 4096),  # the key absent: the class's default
    ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 512,
                                   "max_window_layers": 1}, 512),
    ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 512,
                                   "max_window_layers": 3}, None),  # no layer slides
    ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 512,
                                   "max_window_layers": 0}, None),
    ("qwen3", "Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 256,
                                   "max_window_layers": 2, "head_dim": 16}, 256),
    ("qwen3", "Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 256,
                                   "head_dim": 16, "layer_types": ["full_attention",
                                   "sliding_attention", "full_attention"]}, 256),
    ("phi3", "Phi3ForCausalLM", {"sliding_window": 2047}, 2047),  # Phi-3-mini-4k's
    ("phi3", "Phi3ForCausalLM", {"sliding_window": None}, None),  # Phi-4's
    ("phi3", "Phi3ForCausalLM", {}, None),
]


@pytest.mark.parametrize(("model_type", "architecture", "extra", "window"), SLIDING)
def test_a_sliding_window_bounds_the_context_as_transformers_reads_it(
        tmp_path, model_type, architecture, extra, window):
    """The window transformers' modeling code would apply: Mistral's on every layer, Qwen's
    on the layers marked sliding; the engine serves no longer context (it attends to all)."""
    config = {"model_type": model_type, "architectures": [architecture], **MINIMAL,
              "rope_theta": 1e6, **extra}
    if "sliding_window" not in extra:
        del config["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_model_config(tmp_path)
    assert shape_fields(ours) == shape_fields(_from_transformers(tmp_path, None))
    assert ours.sliding_window == window
    assert ours.longest_context() == (4096 if window is None else window)
    # Written by transformers itself (v5 writes layer_types): read without it, the same.
    from transformers import AutoConfig

    AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path)
    assert_same_as_transformers(tmp_path)
    assert load_model_config(tmp_path).sliding_window == window


@pytest.mark.parametrize("window", [0, -5])
def test_a_window_of_no_tokens_is_refused(tmp_path, window):
    config = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **MINIMAL,
              "rope_theta": 1e6, "sliding_window": window}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"sliding_window must be a positive number of tokens "
                                         f"or null, got {window}"):
        load_model_config(tmp_path)


@pytest.mark.parametrize("extra", [
    {"rope_theta": 1e6},
    {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "head_dim": 128,
     "tie_word_embeddings": True},
], ids=["v4-rope", "v5-rope"])
def test_qwen3_configs_read_as_transformers_reads_them(tmp_path, extra):
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **MINIMAL,
              "head_dim": 32, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_same_as_transformers(tmp_path)
    assert load_model_config(tmp_path).qk_norm


def test_a_qwen3_config_without_head_dim_goes_to_transformers(tmp_path):
    """Qwen3's config class defaults head_dim to 128, not hidden_size / heads (96 / 6 here)."""
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **MINIMAL,
              "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config_json(tmp_path) is None
    loaded = load_model_config(tmp_path)
    assert (loaded.head_dim, loaded.qk_norm, loaded.attention_bias) == (128, True, False)


@pytest.mark.parametrize("extra", [
    {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}},
    {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}},
    {},  # no RoPE base at all: the config class's default applies
], ids=["llama3-scaling", "linear-scaling", "no-theta"])
def test_what_the_reader_does_not_know_goes_to_transformers(tmp_path, extra):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **MINIMAL, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config_json(tmp_path) is None
    loaded = load_model_config(tmp_path)
    assert loaded.hf_config is not None and loaded.rope_theta is None
    assert shape_fields(loaded) == shape_fields(_from_transformers(tmp_path, None))


@pytest.mark.parametrize("model_type,architecture", [
    ("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
])
@pytest.mark.parametrize("field", ["rms_norm_eps", "eos_token_id", "max_position_embeddings",
                                   "num_key_value_heads"])
def test_a_missing_core_field_goes_to_transformers(tmp_path, field, model_type, architecture):
    config = {"model_type": model_type, "architectures": [architecture], **MINIMAL,
              "rope_theta": 10000.0}
    del config[field]  # its default differs between config classes
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config_json(tmp_path) is None
    assert shape_fields(load_model_config(tmp_path)) == shape_fields(
        _from_transformers(tmp_path, None))


TEXTS = ["Hello world", "  leading spaces and\ttabs\n", "héllo wörld ✓ 日本語",
         "<|im_start|>user\nhi<|im_end|>", "", "a" * 300]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "smollm2_dir"])
def test_the_tokenizer_is_the_one_autotokenizer_gives(model, request):
    from transformers import AutoTokenizer

    path = request.getfixturevalue(model)
    ours = load_tokenizer(load_model_config(path))
    theirs = AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(theirs)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.clean_up_tokenization_spaces == theirs.clean_up_tokenization_spaces
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_loading_a_model_imports_no_transformers_config_class(tiny_llama_dir):
    """The point of the fast path: a config and a tokenizer without the transformers modules
    that cost seconds of CPU at every engine start."""
    probe = (
        "import sys\n"
        "from engine_service.model.config import load_model_config\n"
        "from engine_service.model.tokenizer import load_tokenizer\n"
        f"load_tokenizer(load_model_config({str(tiny_llama_dir)!r}))\n"
        "heavy = [m for m in ('transformers.models.llama.configuration_llama',\n"
        "         'transformers.models.auto.tokenization_auto', 'accelerate',\n"
        "         'torch.distributed.tensor') if m in sys.modules]\n"
        "print(heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


@pytest.mark.parametrize(("extra", "words"), [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor must be 1"),  # Phi-4-mini's
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor must be 1"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor":
                       [2.0] * 8}, "original_max_position_embeddings": 1024},
     "rope_type must not be one of ('dynamic', 'longrope', 'su')"),  # Phi-3.5-mini's
])
def test_rope_the_kernels_cannot_apply_is_refused_by_name(tmp_path, extra, words):
    config = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **MINIMAL,
              "hidden_size": 96, "num_attention_heads": 6, "rope_theta": 10000.0, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_model_config(tmp_path)


def _phi3_gguf(path: Path, rotary_dims: int, window: int | None) -> Path:
    """A Phi-3 GGUF of config fields alone (heads of 32): what load_model_config reads."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(4096)
    writer.add_block_count(2)
    writer.add_feed_forward_length(256)
    writer.add_embedding_length(128)
    writer.add_rope_dimension_count(rotary_dims)
    writer.add_rope_freq_base(10000.0)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(64)
    if window is not None:
        writer.add_uint32("phi3.attention.sliding_window", window)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}".encode() for i in range(64)])
    writer.add_token_scores([0.0] * 64)
    writer.add_token_types([1] * 64)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((64, 128), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_phi3_gguf_keeps_its_window_and_its_rotary_dimensions(tmp_path):
    """transformers' GGUF reading drops both: Phi-3-mini-4k's window bounds the context, as
    its safetensors' does; Phi-4-mini's partial rotary is refused, as its safetensors' is."""
    windowed = load_model_config(_phi3_gguf(tmp_path / "mini-4k.gguf", 32, 2047))
    assert windowed.sliding_window == 2047 and windowed.longest_context() == 2047
    assert load_model_config(_phi3_gguf(tmp_path / "phi-4.gguf", 32, None)).sliding_window is None
    # llama.cpp's converter writes Phi-4's as 0 (no window), to tell it from Phi-3
    assert load_model_config(_phi3_gguf(tmp_path / "phi-4-0.gguf", 32, 0)).sliding_window is None
    with pytest.raises(ValueError, match="partial_rotary_factor must be 1"):
        load_model_config(_phi3_gguf(tmp_path / "mini.gguf", 24, None))
