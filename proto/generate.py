"""Regenerates the committed Python code for proto/*.proto (run after editing a .proto).

    python proto/generate.py            # writes proto/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python proto/generate.py --out DIR  # writes into DIR instead (the staleness test uses this)

Uses grpcio-tools (pinned in pyproject's test extra, so every machine generates the same bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def generate(out: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted((REPO / "proto").glob("*.proto"))
    (out / "proto").mkdir(parents=True, exist_ok=True)
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{REPO}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(p.relative_to(REPO)) for p in protos]]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out / "proto").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO, help="root to write proto/... under (default: the repo)")
    for path in generate(parser.parse_args().out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
