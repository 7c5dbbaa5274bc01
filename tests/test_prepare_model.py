"""The converted default model: complete, float32, tied, coherent, and cheap to re-ensure."""

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from engine_service.model.paths import default_gguf_path, default_model_dir
from engine_service.tools.prepare_model import (
    MARKER_FILENAME,
    GgufFingerprint,
    ensure_default_model,
    is_prepared,
    main,
)
from tests.support.hf_reference import hf_greedy, hf_greedy_ignore_eos

CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_prompt(model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        CAPITAL_QUESTION, tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_converted_dir_is_float32_with_tied_embeddings(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    # A leftover GGUF quantization_config would send loaders back to the GGUF file.
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    assert dtypes == {"F32"}
    # Tied: lm_head is embed_tokens, so only the embedding is stored.
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    record = json.loads((smollm2_dir / MARKER_FILENAME).read_text())
    assert record["source"]["name"] == default_gguf_path().name
    assert record["tie_word_embeddings"] is True and record["lm_head_saved"] is False
    assert (smollm2_dir / "chat_template.jinja").is_file()


def test_greedy_answer_names_paris_and_stops_at_eos(smollm2_dir: Path) -> None:
    prompt = _chat_prompt(smollm2_dir)
    generated = hf_greedy(smollm2_dir, [prompt], max_new_tokens=48)[0]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "Paris" in tokenizer.decode(generated)
    # HF stops at EOS (<|im_end|>) and the EOS id is the last generated id.
    assert generated[-1] == tokenizer.eos_token_id
    assert len(generated) < 48


def test_ignore_eos_runs_on_past_eos_with_same_prefix(smollm2_dir: Path) -> None:
    prompt = _chat_prompt(smollm2_dir)
    stopped = hf_greedy(smollm2_dir, [prompt], max_new_tokens=48)[0]
    running = hf_greedy_ignore_eos(smollm2_dir, [prompt], max_new_tokens=len(stopped) + 8)[0]
    assert len(running) == len(stopped) + 8
    assert running[: len(stopped)] == stopped


def test_second_ensure_is_fast_and_changes_nothing(smollm2_dir: Path) -> None:
    before = {path.name: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()}
    dir_inode = smollm2_dir.stat().st_ino
    started = time.perf_counter()
    again = ensure_default_model()
    elapsed_s = time.perf_counter() - started
    assert again == smollm2_dir
    assert elapsed_s < 1.0, f"no-op ensure took {elapsed_s:.2f} s"
    assert smollm2_dir.stat().st_ino == dir_inode
    assert {path.name: path.stat().st_mtime_ns for path in smollm2_dir.iterdir()} == before


def test_cli_noop_prints_model_dir(smollm2_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--quiet", "--out", str(smollm2_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)


def test_cli_reports_missing_gguf(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "absent.gguf"
    assert main(["--quiet", "--gguf", str(missing), "--out", str(tmp_path / "out")]) == 1
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_incomplete_dir_is_not_taken_as_prepared(smollm2_dir: Path, tmp_path: Path) -> None:
    # A directory holding the marker but missing the weights must be rebuilt, not trusted.
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in (MARKER_FILENAME, "config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy2(smollm2_dir / name, partial / name)
    fingerprint = GgufFingerprint.of(default_gguf_path())
    assert is_prepared(smollm2_dir, fingerprint)
    assert not is_prepared(partial, fingerprint)
    other_source = dataclasses.replace(fingerprint, size_bytes=1)
    assert not is_prepared(smollm2_dir, other_source)
