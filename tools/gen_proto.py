"""Generate the Python gRPC stubs in mtpserve/v1/ from proto/mtpserve/v1/*.proto.

    python tools/gen_proto.py            # rewrite mtpserve/v1/*_pb2*.py(i) in the repository
    python tools/gen_proto.py --out DIR  # write DIR/mtpserve/v1/... instead (the freshness test uses this)

Runs `python -m grpc_tools.protoc` (the pinned grpcio-tools, not a system protoc) so that the output
depends only on the installed grpcio-tools version; tests/cluster/test_router.py regenerates into a
temporary directory and compares bytes with the committed stubs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PACKAGE = "mtpserve.v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "mtpserve" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc into `out`; returns the generated files (under out/mtpserve/v1)."""
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
           f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    cmd += [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    files = sorted(f for f in (out / "mtpserve" / "v1").iterdir() if f.name.endswith(GENERATED_SUFFIXES))
    for f in files:
        f.write_text(fix_imports(f.read_text()))
    return files


def fix_imports(source: str) -> str:
    """Make imports of sibling stubs package-qualified (`from mtpserve.v1 import x_pb2`).

    protoc writes a bare `import x_pb2` when a .proto is compiled without its package directory; the
    stubs must import as part of the installed package wherever the working directory is.
    """
    return re.sub(r"^import (\w+_pb2)( as \w+)?$", rf"from {PACKAGE} import \1\2", source, flags=re.M)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO, help="root to write mtpserve/v1/ under (default: the repo)")
    args = parser.parse_args(argv)
    for f in generate(args.out):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
