"""A model whose layers attend within a sliding window (Mistral's sliding_window, Qwen's
use_sliding_window layers): the engine attends to the whole context, which is the window's
attention only while the context fits in it, so it serves no longer context than the window,
says so, and matches HF there."""

import json
import logging
import shutil
from pathlib import Path

import pytest

from engine_service import SamplingParams
from engine_service.core.config import EngineConfig
from engine_service.core.errors import RequestTooLargeError
from engine_service.serving.server import served_context
from tests.support.hf_reference import hf_greedy_ignore_eos

WINDOW = 64


@pytest.fixture(scope="module")
def sliding_qwen2_dir(tiny_qwen2_dir, tmp_path_factory) -> Path:
    """The tiny Qwen2 with its second layer sliding over 64 tokens (of 4,096 positions)."""
    out = tmp_path_factory.mktemp("sliding_qwen2")
    for item in tiny_qwen2_dir.iterdir():
        shutil.copy2(item, out / item.name)
    config = json.loads((out / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_context_is_the_window_and_the_engine_says_why(sliding_qwen2_dir, make_llm,
                                                           caplog):
    with caplog.at_level(logging.WARNING, logger="engine_service.core.engine"):
        llm = make_llm(sliding_qwen2_dir, num_blocks=64, block_size=16)
    assert llm.llm_engine.max_model_len == WINDOW
    assert any(f"sliding window of {WINDOW} tokens" in r.getMessage() for r in caplog.records)
    # The server sizes its messages for the same context before its core loads the model.
    assert served_context(EngineConfig(model=str(sliding_qwen2_dir))) == WINDOW
    # An explicit longer max_model_len is held to the window too.
    assert served_context(EngineConfig(model=str(sliding_qwen2_dir), max_model_len=1024)) == (
        WINDOW)
    with pytest.raises(RequestTooLargeError, match=f"the {WINDOW}-token context"):
        llm.generate({"prompt_token_ids": list(range(100, 100 + WINDOW + 1))},
                     SamplingParams(max_tokens=4))


def test_within_the_window_greedy_is_hf_s(sliding_qwen2_dir, make_llm):
    """HF applies the window; within it every query sees every key, as ours do."""
    llm = make_llm(sliding_qwen2_dir, num_blocks=64, block_size=16)
    prompts = [list(range(200, 210)), list(range(300, 340))]
    params = SamplingParams(temperature=0, max_tokens=WINDOW - 40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_ignore_eos(
        sliding_qwen2_dir, prompts, WINDOW - 40)
