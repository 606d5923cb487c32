"""Generate the Python gRPC stubs and their typing from proto/.

Usage: python scripts/generate_stubs.py [OUTPUT_ROOT]

Writes protocol/posenc_protocol/v1/posenc_pb2.py, posenc_pb2.pyi, posenc_pb2_grpc.py and
posenc_pb2_grpc.pyi (under OUTPUT_ROOT instead of protocol/ when given, which the
staleness test uses to compare a fresh generation with the committed files).

protoc names the Python modules after the proto package, ``posenc.v1``; the stubs live in
the protocol package both the SDK and the server import, so their own imports are moved
there (the proto package, and so the wire names, stay ``posenc.v1``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
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


# What protoc writes for the proto package, and what it becomes in posenc_protocol.
_RENAMES = (
    ("from posenc.v1 import", "from posenc_protocol.v1 import"),
    ("'posenc.v1.posenc_pb2'", "'posenc_protocol.v1.posenc_pb2'"),
)


def generate(output_root: Path) -> None:
    """Run protoc with the grpc and mypy-protobuf plugins; the stubs go to
    ``output_root/posenc_protocol/v1``."""
    with tempfile.TemporaryDirectory() as scratch:
        _protoc(Path(scratch))
        generated = Path(scratch) / "posenc" / "v1"
        package = output_root / "posenc_protocol" / "v1"
        package.mkdir(parents=True, exist_ok=True)
        for source in sorted(generated.iterdir()):
            text = source.read_text()
            for old, new in _RENAMES:
                text = text.replace(old, new)
            (package / source.name).write_text(text)
        (package / "__init__.py").touch()


def _protoc(output_root: Path) -> None:
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


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "protocol")
