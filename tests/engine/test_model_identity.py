"""The block-hash identity comes from the served model name and the weights' content, not the
path: one checkpoint at two paths hashes alike, a checkpoint changed in place does not."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.model.fingerprint import weights_fingerprint


def _engine(model: Path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", num_blocks=16, **kwargs))


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(cache))
    return cache


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_one_checkpoint_at_two_paths_hashes_alike(tiny_llama_dir, tmp_path, cache_dir):
    name = tiny_llama_dir.name
    elsewhere = _copy(tiny_llama_dir, tmp_path / "mounted" / name)
    a, b = _engine(tiny_llama_dir), _engine(elsewhere)
    assert a.config.served_model_name == b.config.served_model_name == name
    assert a.hasher.identity == b.hasher.identity
    assert a.hasher.seed_hash == b.hasher.seed_hash
    assert str(tiny_llama_dir) not in a.hasher.identity
    # Another directory name is another served name (clients call it something else): not
    # shared, unless the name is given.
    renamed = _copy(tiny_llama_dir, tmp_path / "other-name")
    assert _engine(renamed).hasher.identity != a.hasher.identity
    assert _engine(renamed, served_model_name=name).hasher.identity == a.hasher.identity


def test_a_checkpoint_changed_in_place_gets_another_identity(tiny_llama_dir, tmp_path,
                                                            cache_dir):
    model = _copy(tiny_llama_dir, tmp_path / "tiny_llama")
    before = _engine(model).hasher.identity
    assert list((cache_dir / "fingerprints").iterdir())  # the answer was cached
    weights = next(model.glob("*.safetensors"))
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor; same size
    weights.write_bytes(bytes(data))
    # Modification time put back (as `cp -p` or a sync tool would): the cached answer must not
    # be read back for the changed bytes.
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns
    after = _engine(model).hasher.identity
    assert after != before
    assert weights_fingerprint(model, None, use_cache=False) in after


def test_config_json_is_part_of_the_fingerprint(tiny_llama_dir, tmp_path, cache_dir):
    model = _copy(tiny_llama_dir, tmp_path / "tiny_llama")
    before = weights_fingerprint(model, None)
    config = model / "config.json"
    config.write_text(config.read_text().replace('"rope_theta"', '"rope_theta_unused"'))
    assert weights_fingerprint(model, None) != before


def test_the_cached_fingerprint_equals_the_computed_one(tiny_llama_dir, cache_dir):
    computed = weights_fingerprint(tiny_llama_dir, None, use_cache=False)
    assert weights_fingerprint(tiny_llama_dir, None) == computed  # computed, then cached
    [entry] = (cache_dir / "fingerprints").iterdir()
    assert entry.read_text() == computed
    assert weights_fingerprint(tiny_llama_dir, None) == computed  # read back


def test_an_unwritable_cache_only_costs_time(tiny_llama_dir, tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(blocked))
    assert weights_fingerprint(tiny_llama_dir, None) == weights_fingerprint(
        tiny_llama_dir, None, use_cache=False)


@pytest.mark.parametrize("name", ["", "two words", "tab\there", "x" * 257, "bell\x07"])
def test_bad_served_model_names_are_refused_by_field(tiny_llama_dir, name):
    with pytest.raises(ValueError, match="served_model_name") as info:
        EngineConfig(model=str(tiny_llama_dir), served_model_name=name)
    assert "printable characters without spaces" in str(info.value)


def test_a_gguf_file_is_named_by_its_stem(tmp_path):
    model = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert EngineConfig(model=str(model)).served_model_name == "SmolLM2-135M-Instruct.Q4_1"


def test_a_directory_name_with_spaces_gives_a_usable_default_name(tmp_path):
    model = tmp_path / "My Model\tv2"
    assert EngineConfig(model=str(model)).served_model_name == "My-Model-v2"
