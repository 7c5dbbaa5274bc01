"""The checked-in stubs in pagedgen_api/ must be exactly what protos/ generates."""

import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts/gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_match_protos(tmp_path):
    generated = _load_generator().generate(tmp_path)
    assert generated, "protos/ produced no stubs"
    for fresh in generated:
        checked_in = REPO_ROOT / "pagedgen_api" / fresh.name
        assert checked_in.exists(), f"{fresh.name} is generated from protos/ but not checked in"
        assert checked_in.read_bytes() == fresh.read_bytes(), (
            f"pagedgen_api/{fresh.name} drifted from protos/: run python scripts/gen_protos.py"
        )
    names = {p.name for p in generated}
    stale = [p.name for p in (REPO_ROOT / "pagedgen_api").glob("*_pb2*.py*") if p.name not in names]
    assert not stale, f"stubs with no proto left in protos/: {stale}"
