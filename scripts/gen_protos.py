"""Generate the Python gRPC stubs in pagedgen_api/ from protos/ (the one source of the wire API).

Usage: python scripts/gen_protos.py [OUT_ROOT]
The stubs are checked in; tests/test_proto_stubs.py regenerates them into a temporary folder
and fails when the checked-in copies drift from protos/.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos"
PACKAGE = "pagedgen_api"


def generate(out_root: Path) -> list[Path]:
    """Compile every protos/*.proto into out_root/pagedgen_api/; return the files written."""
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    # Map protos/ to the virtual folder pagedgen_api/ so generated imports read
    # "from pagedgen_api import x_pb2" and work from an installed package.
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE}={PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
    ] + [f"{PACKAGE}/{p.name}" for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    return sorted((out_root / PACKAGE).glob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(out):
        print(path)
