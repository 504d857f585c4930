"""Regenerate `generation_pb2.py`, `generation_pb2_grpc.py` and `generation_pb2.pyi` from
`generation.proto` with grpcio-tools: `python -m switchyard.gateway.grpc.proto.generate`.

protoc writes the service module's import of the messages as a top-level `import
generation_pb2`; it is rewritten to a relative import, so the modules work inside the
package. tests/gateway/test_grpc_proto.py checks the committed files equal a fresh run."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "generation.proto"
GENERATED = ("generation_pb2.py", "generation_pb2_grpc.py", "generation_pb2.pyi")
_TOP_LEVEL_IMPORT = "import generation_pb2 as generation__pb2"
_RELATIVE_IMPORT = "from . import generation_pb2 as generation__pb2"


def generate(out_dir: Path, proto_dir: Path = HERE) -> list[Path]:
    """Write the generated modules into `out_dir`; returns their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    status = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={out_dir}",
                          f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(proto_dir / PROTO)])
    if status != 0:
        raise RuntimeError(f"protoc failed on {proto_dir / PROTO} (status {status})")
    service = out_dir / "generation_pb2_grpc.py"
    text = service.read_text()
    if _TOP_LEVEL_IMPORT not in text:
        raise RuntimeError(f"protoc's output changed: {_TOP_LEVEL_IMPORT!r} not found in {service}")
    service.write_text(text.replace(_TOP_LEVEL_IMPORT, _RELATIVE_IMPORT))
    return [out_dir / name for name in GENERATED]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (HERE / path.name).write_bytes(path.read_bytes())
            print(f"wrote {HERE / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
