"""Generate the Python gRPC stubs and their typing from proto/.

Usage: python scripts/generate_stubs.py [OUTPUT_ROOT]

Writes client/posenc/v1/posenc_pb2.py, posenc_pb2.pyi, posenc_pb2_grpc.py and
posenc_pb2_grpc.pyi (under OUTPUT_ROOT instead of client/ when given, which the
staleness test uses to compare a fresh generation with the committed files).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILES = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))


def _plugin(name: str) -> str:
    # mypy-protobuf installs its plugins beside this interpreter, which may not be on PATH.
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} not found: install the dev extra (mypy-protobuf)")
    return path


def generate(output_root: Path) -> None:
    """Run protoc with the grpc and mypy-protobuf plugins into output_root."""
    output_root.mkdir(parents=True, exist_ok=True)
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={output_root}",
        f"--grpc_python_out={output_root}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--mypy_out={output_root}",
        f"--mypy_grpc_out={output_root}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for package_dir in {output_root / Path(p).parent for p in PROTO_FILES}:
        (package_dir / "__init__.py").touch()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client")
