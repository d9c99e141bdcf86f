"""Generate Python stubs, mypy stubs and Envoy's descriptor set from protos/.

Run through `make protos`. Output: llm/v1/*_pb2.py(i), *_pb2_grpc.py(i) at the
repository root (gitignored) and build/llm_v1.pb (with imports, for Envoy's
grpc_json_transcoder).
"""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

# Not common.config.ROOT: this runs before the project is installed (an image's build
# stage, `make protos`), where neither the repository root nor PyYAML is importable.
ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT
DESCRIPTOR_SET = ROOT / "build" / "llm_v1.pb"


def _googleapis_include() -> Path:
    import google.api.annotations_pb2 as ann

    # .../site-packages/google/api/annotations_pb2.py -> .../site-packages
    return Path(ann.__file__).resolve().parent.parent.parent


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    if not protos:
        print("no .proto files under protos/", file=sys.stderr)
        return 1
    # protoc finds the mypy plugins on PATH; they live beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    well_known = Path(str(resources.files(grpc_tools) / "_proto"))
    DESCRIPTOR_SET.parent.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{_googleapis_include()}",
        f"-I{well_known}",
        f"--python_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        f"--mypy_out={OUT_DIR}",
        f"--mypy_grpc_out={OUT_DIR}",
        f"--descriptor_set_out={DESCRIPTOR_SET}",
        "--include_imports",
        "--include_source_info",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return int(rc)
    for pkg in {Path(p).parent for p in protos}:
        d = OUT_DIR / pkg
        while d != OUT_DIR:
            (d / "__init__.py").touch()
            d = d.parent
    (OUT_DIR / "llm" / "py.typed").touch()
    rel = DESCRIPTOR_SET.relative_to(ROOT)
    print(f"generated {len(protos)} protos -> llm/, descriptor set -> {rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
