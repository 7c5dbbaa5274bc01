"""Session fixtures shared by every test folder: the default model and the tiny models.

Everything runs by default (no --run-slow switch): the SmolLM2 conversion is done once by
scripts/setup.sh, and the tiny models take about a second to build.
"""

import os

# Tests never reach a model hub; set before anything imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine_service.tools.prepare_model import ensure_default_model  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402
from tests.support.tls import SessionCerts  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as float32 safetensors (converted now if set-up did not)."""
    return ensure_default_model(quiet=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """2-layer Llama, GQA (4 query heads, 2 KV heads), untied lm_head."""
    out_dir = tmp_path_factory.mktemp("tiny_llama")
    return make_tiny_model("llama", out_dir, tokenizer_dir=smollm2_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """2-layer Qwen2 with nonzero qkv biases, GQA, tied embeddings."""
    out_dir = tmp_path_factory.mktemp("tiny_qwen2")
    return make_tiny_model("qwen2", out_dir, tokenizer_dir=smollm2_dir, seed=1)


@pytest.fixture(scope="session")
def test_certs(tmp_path_factory: pytest.TempPathFactory) -> SessionCerts:
    """The session's development CA and a certificate per role: every service the shared
    fixtures start runs on TLS with them (secure is the default, issue 32)."""
    return SessionCerts.make(tmp_path_factory.mktemp("certs"))
