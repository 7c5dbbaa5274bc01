"""The GPU check's served stage imports on the GPU image: every package it needs that the
image lacks is among the wheels bench/gpu_prepare.sh carries.

The image's package list is in the device tool's notes (KINDS.md); these are the project's
dependencies missing from it (or, grpcio and protobuf, there too old). The stage's modules are
imported in a subprocess where those packages' modules cannot be found unless gpu_prepare.sh
carries their distribution. On 2026-11-28 cryptography (trust/), starlette, uvicorn and
pydantic (the HTTP front) were missing from the carry: pagedgen-engine and
engine_service.tools.launch stopped at import, so the served stage could not run.
"""

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PREPARE = REPO_ROOT / "bench" / "gpu_prepare.sh"
NOT_ON_IMAGE = ("cryptography", "cffi", "pycparser", "starlette", "uvicorn", "httptools",
                "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                "grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-tools",
                "protobuf", "redis", "hiredis", "gguf")
SERVE_STAGE_MODULES = ("bench.gpu_serve", "bench.peers_grpc", "engine_service.tools.launch",
                       "engine_service.serving.server")

_BLOCKED_IMPORT = """
import importlib, json, sys
blocked = set(json.loads(sys.argv[1]))
class NotOnImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)")
        return None
sys.meta_path.insert(0, NotOnImage())
failed = {}
for module in json.loads(sys.argv[2]):
    try:
        importlib.import_module(module)
    except ImportError as error:
        failed[module] = str(error)
print(json.dumps(failed))
"""


def carried_packages() -> set[str]:
    text = PREPARE.read_text()
    body = re.search(r"^PACKAGES=\(([^)]*)\)", text, re.MULTILINE).group(1)
    return {_norm(name) for name in body.split()}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def top_level_modules(distributions: set[str]) -> set[str]:
    modules = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if any(_norm(d) in distributions for d in dists):
            modules.add(module)
    return modules


def import_failures(blocked: set[str]) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT, json.dumps(sorted(blocked)),
         json.dumps(SERVE_STAGE_MODULES)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_serve_stage_imports_with_the_carried_wheels():
    missing = {_norm(n) for n in NOT_ON_IMAGE} - carried_packages()
    assert import_failures(top_level_modules(missing)) == {}


def test_without_the_wheels_it_would_not():
    """The blocker works: with nothing carried, the stage's modules fail to import."""
    failed = import_failures(top_level_modules({_norm(n) for n in NOT_ON_IMAGE}))
    assert "engine_service.serving.server" in failed
    assert "engine_service.tools.launch" in failed
