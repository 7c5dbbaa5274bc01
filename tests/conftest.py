"""Session fixtures shared by every test folder: the default model and the tiny models.

Everything runs by default (no --run-slow switch): the SmolLM2 conversion is done once by
scripts/setup.sh, and the tiny models take about a second to build.
"""

import os

# Tests never reach a model hub; set before anything imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Two or more pytest-xdist workers on a 2-core machine: one torch (OpenMP) thread per worker
# process and per process it starts without its own setting. At torch's default (a thread per
# core) two workers computing at once keep 4 spinning threads on 2 cores, and each op waits at
# its barrier: two SmolLM2 bf16 parity tests run side by side took 69 s at 2 threads each and
# 39 s at 1. Servers the tests start inherit it (an engine's core honours OMP_NUM_THREADS).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine_service.tools.prepare_model import ensure_default_model  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402
from tests.support.tls import SessionCerts  # noqa: E402

if os.environ.get("OMP_NUM_THREADS") == "1":
    torch.set_num_threads(1)  # in case torch was imported before the variable was set


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
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """2-layer Qwen3: q_norm and k_norm per head, heads wider than hidden / heads (4 x 32 on
    64), no biases, GQA, tied embeddings."""
    out_dir = tmp_path_factory.mktemp("tiny_qwen3")
    return make_tiny_model("qwen3", out_dir, tokenizer_dir=smollm2_dir, seed=2)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """2-layer Phi-3 (Phi-4's family): q/k/v and gate/up stored fused in the checkpoint, GQA,
    no biases, untied."""
    out_dir = tmp_path_factory.mktemp("tiny_phi3")
    return make_tiny_model("phi3", out_dir, tokenizer_dir=smollm2_dir, seed=6)


@pytest.fixture(scope="session")
def test_certs(tmp_path_factory: pytest.TempPathFactory) -> SessionCerts:
    """The session's development CA and a certificate per role: every service the shared
    fixtures start runs on TLS with them (secure is the default, issue 32)."""
    return SessionCerts.make(tmp_path_factory.mktemp("certs"))
