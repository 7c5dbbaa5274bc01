"""The processes that run no model import no torch (issue 36): the engine's serving front
(pagedgen-engine's own process; the model runs in its core process), the router, the prefix
index, the HTTP front, and the small tools. torch costs a start ~1.3 s and the front ~180 MiB of
memory; a stray module-level import anywhere on their import paths brings it back, and this
says which one.

Each module is imported in a fresh interpreter (the repository root first on sys.path, as the
servers run), which then reports whether torch (or transformers, which may import it) got
loaded and, if so, the import chain that first reached it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.import_witness import witness_source

REPO_ROOT = Path(__file__).resolve().parents[1]

# Records the stack of the first import of torch, then lets it proceed.
PROBE = witness_source("torch") + r"""
__import__(sys.argv[2])
print(json.dumps({"heavy": [m for m in ("torch", "transformers") if m in sys.modules],
                  "chain": first_import}))
"""

LIGHT_MODULES = [
    "engine_service.serving.server",  # pagedgen-engine: the serving front
    "engine_service.serving.http_backend",  # the engine's HTTP front
    "openai_api.server",
    "router.server",  # pagedgen-router
    "router.http_backend",
    "prefix_index.server.main",  # pagedgen-prefix-index
    "engine_service.tools.stack",  # pagedgen-stack
    "engine_service.tools.prepare_model",  # pagedgen-prepare-model (converts lazily)
    "tenancy.keys_tool",  # pagedgen-keys
    "trust.certs_tool",  # pagedgen-certs
]


def heavy_imports(module: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO_ROOT), module],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, f"importing {module} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_imports_no_torch(module: str) -> None:
    found = heavy_imports(module)
    assert found["heavy"] == [], (
        f"importing {module} loaded {found['heavy']}; torch first imported from:\n  "
        + "\n  ".join(found["chain"]))


def test_probe_sees_torch() -> None:
    """The probe is not blind: the engine itself imports torch, and the chain names it."""
    found = heavy_imports("engine_service.core.engine")
    assert "torch" in found["heavy"]
    assert any("engine_service/core/engine.py" in frame for frame in found["chain"])
