"""The tokenizer's EOS id read from its files (engine_service/model/tokenizer_eos.py) is the id
the loaded tokenizer gives, or None (load it and ask); an engine that makes no text (a serving
core) builds and ends sequences on it without importing transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.model.config import load_model_config
from engine_service.model.tokenizer import load_tokenizer
from engine_service.model.tokenizer_eos import read_eos_token_id
from tests.support.import_witness import witness_source

REPO_ROOT = Path(__file__).resolve().parents[2]
WORDS = ["<unk>", "hello", "world", "</s>", "<s>", "a", "b"]


def _with_tokenizer(model_dir: Path, out: Path, eos_token: str | None,
                    added_special: bool) -> Path:
    """model_dir's config and weights with a small word-level tokenizer of our own: its EOS
    among the vocabulary's words, or added as a special token."""
    out.mkdir()
    for path in model_dir.iterdir():
        if path.name in ("config.json", "generation_config.json") or path.suffix == ".safetensors":
            shutil.copy(path, out / path.name)
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {} if eos_token is None else {"eos_token": eos_token}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **extra)
    if added_special:
        tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    tokenizer.save_pretrained(out)
    return out


def _loaded_eos(model_dir: Path) -> int | None:
    return load_tokenizer(load_model_config(model_dir)).eos_token_id


def test_the_shipped_models_eos_is_read_as_the_tokenizer_gives_it(smollm2_dir, tiny_llama_dir,
                                                                    tiny_qwen2_dir):
    for model_dir in (smollm2_dir, tiny_llama_dir, tiny_qwen2_dir):
        read = read_eos_token_id(load_model_config(model_dir))
        assert read is not None and read == _loaded_eos(model_dir), model_dir


@pytest.mark.parametrize("eos_token, added_special", [
    ("</s>", False),  # a word of the vocabulary
    (None, True),  # added as a special token, past the vocabulary
])
def test_an_eos_in_the_vocabulary_or_added_is_read_as_loaded(tiny_llama_dir, tmp_path,
                                                             eos_token, added_special):
    model_dir = _with_tokenizer(tiny_llama_dir, tmp_path / "model", eos_token, added_special)
    read = read_eos_token_id(load_model_config(model_dir))
    assert read is not None and read == _loaded_eos(model_dir)


@pytest.mark.parametrize("added, eos_token", [
    # In the vocabulary (id 3) and listed again as an added token with another id: the
    # vocabulary's id stands.
    ({"id": 9, "content": "</s>"}, "</s>"),
    # Added past a vocabulary of 7 with a written id of 15: the library numbers it 7.
    ({"id": 15, "content": "<|end|>"}, "<|end|>"),
])
def test_added_token_ids_are_the_ones_the_library_gives(tiny_llama_dir, tmp_path, added,
                                                        eos_token):
    """tokenizer.json's written ids of added tokens are not always the ones a load gives (a
    hand-merged file): the id read is the loaded tokenizer's, not the file's."""
    model_dir = _with_tokenizer(tiny_llama_dir, tmp_path / "model", eos_token, False)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_json["added_tokens"] = [  # the saved entry, with the id written otherwise
        token for token in tokenizer_json["added_tokens"] if token["content"] != eos_token
    ] + [{"single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
          "special": True, **added}]
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    read = read_eos_token_id(load_model_config(model_dir))
    assert read is not None and read == _loaded_eos(model_dir) != added["id"]


def test_what_the_files_do_not_say_plainly_is_left_to_the_tokenizer(tiny_llama_dir, tmp_path):
    # No EOS named at all.
    model_dir = _with_tokenizer(tiny_llama_dir, tmp_path / "none", None, False)
    assert read_eos_token_id(load_model_config(model_dir)) is None
    # Two files that disagree.
    model_dir = _with_tokenizer(tiny_llama_dir, tmp_path / "two", "</s>", False)
    (model_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<s>"}))
    assert read_eos_token_id(load_model_config(model_dir)) is None
    # A name the tokenizer does not hold.
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|nowhere|>"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "special_tokens_map.json").unlink()
    assert read_eos_token_id(load_model_config(model_dir)) is None


@pytest.fixture
def config_eos_elsewhere(tiny_llama_dir, tmp_path) -> Path:
    """The tiny Llama with config.json's EOS moved off the tokenizer's: only the tokenizer's
    EOS id says where generation ends."""
    model_dir = tmp_path / "eos_elsewhere"
    shutil.copytree(tiny_llama_dir, model_dir)
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            config = json.loads(path.read_text())
            config["eos_token_id"] = 0
            path.write_text(json.dumps(config))
    return model_dir


def test_an_engine_without_text_ends_on_the_tokenizers_eos(config_eos_elsewhere):
    tokenizer_eos = _loaded_eos(config_eos_elsewhere)
    engines = [LLMEngine(EngineConfig(model=str(config_eos_elsewhere), num_blocks=16,
                                      detokenize=detokenize))
               for detokenize in (True, False)]
    try:
        assert engines[0].eos_token_ids == engines[1].eos_token_ids == {0, tokenizer_eos}
    finally:
        for engine in engines:
            engine.close()


PROBE = witness_source("transformers") + r"""
from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.model.sampling_params import SamplingParams

engine = LLMEngine(EngineConfig(model=sys.argv[2], num_blocks=16, detokenize=False))
engine.add_request("r", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=4))
tokens = []
while engine.has_unfinished_requests():
    for output in engine.step():
        if output.finished:
            tokens = output.outputs[0].token_ids
print(json.dumps({"transformers": "transformers" in sys.modules, "chain": first_import,
                  "eos": sorted(engine.eos_token_ids), "tokens": len(tokens)}))
"""


def test_an_engine_without_text_imports_no_transformers(config_eos_elsewhere):
    """The core's tokenizer load (about 1 s of every engine start, most of it importing
    transformers) is gone: it read the EOS id from the files."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO_ROOT),
                           str(config_eos_elsewhere)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] > 0
    assert report["eos"] == sorted({0, _loaded_eos(config_eos_elsewhere)})
    assert not report["transformers"], f"transformers was imported from {report['chain']}"
