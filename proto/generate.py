"""Regenerates the committed Python stubs (sidecar_pb2*.py, .pyi) from sidecar.proto with grpcio-tools.

Usage: python -m dspark_sidecar.proto.generate [--out DIR]

The .proto is compiled under protoc's virtual include path `dspark_sidecar/proto/`, so the
generated `sidecar_pb2_grpc.py` imports `from dspark_sidecar.proto import sidecar_pb2` (a
package-qualified import that works without putting proto/ on sys.path). protoc writes the
stubs under DIR/dspark_sidecar/proto/ of a scratch folder; they are then moved flat into DIR.

The stubs embed the generator's versions and check them at import (protobuf runtime >= the
bundled protoc's, grpcio >= grpcio-tools'), so regenerate with exactly the grpcio-tools the
committed stubs were written with (TOOLS_VERSION, the test extra's pin) to keep them identical
across machines; the generator refuses any other.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "sidecar.proto"
# The import path the .proto has inside protoc: it becomes the stubs' module path.
VIRTUAL_DIR = "dspark_sidecar/proto"
GENERATED = ("sidecar_pb2.py", "sidecar_pb2.pyi", "sidecar_pb2_grpc.py")
# The grpcio-tools minor the stubs are generated with. The device's grpcio 1.84 refuses, at import, stubs
# stamped by a newer grpcio-tools, and its protobuf those of the newer protoc such a release bundles; pip's
# pick for a bare `grpcio-tools` is newer, and nothing stopped it overwriting the committed stubs (the
# byte-identity test regenerates with the same tools, so it passes on the machine that wrote them).
# The whole version, not its minor: the stubs stamp the tools' full version (GRPC_GENERATED_VERSION),
# so a 1.84.1 wrote stubs that differ from the committed ones and that grpcio 1.84.0 refuses at import.
TOOLS_VERSION = "1.84.0"


def generate(out_dir: Path | str = PROTO_DIR) -> list[Path]:
    """Compile sidecar.proto into `out_dir`; returns the paths written (GENERATED order)."""
    # Imported here so importing the stubs never needs grpcio-tools.
    from grpc_tools import grpc_version, protoc

    if grpc_version.VERSION != TOOLS_VERSION:  # before anything is written
        raise RuntimeError(
            f"grpcio-tools {grpc_version.VERSION} is not {TOOLS_VERSION}: its stubs would differ from the "
            f"committed ones, and a newer one's do not import with the deployed grpcio {TOOLS_VERSION}; install "
            f"grpcio-tools=={TOOLS_VERSION} (the test extra's pin) and run this again"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dspark-protoc-") as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{VIRTUAL_DIR}={PROTO_DIR}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            f"{VIRTUAL_DIR}/{PROTO_NAME}",
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args[1:])}")
        written = []
        for name in GENERATED:
            src = Path(scratch, VIRTUAL_DIR, name)
            dst = out_dir / name
            shutil.copyfile(src, dst)
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=PROTO_DIR, help=f"output folder (default: {PROTO_DIR})"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
