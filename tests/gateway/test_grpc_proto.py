"""The committed gRPC modules (gateway/grpc/proto) are what grpcio-tools makes from the
committed generation.proto, and the proto is TGIS's service."""
from __future__ import annotations

import subprocess
import sys

from switchyard.gateway.grpc.proto import generate


def test_committed_modules_are_current(tmp_path):
    for path in generate.generate(tmp_path):
        committed = generate.HERE / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} is stale: run python -m switchyard.gateway.grpc.proto.generate")


def test_the_service_is_tgis():
    from switchyard.gateway.grpc.proto import generation_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    assert service.full_name == "fmaas.GenerationService"
    assert [m.name for m in service.methods] == ["Generate", "GenerateStream", "Tokenize", "ModelInfo"]
    assert {f.name for f in pb.DecodingParameters.DESCRIPTOR.oneofs_by_name["guided"].fields} == {
        "format", "json_schema", "regex", "choice", "grammar"}


def test_the_flag_module_imports_no_grpc():
    """`switchyard serve --help` works without the grpc extra."""
    code = ("import sys, argparse; from switchyard.gateway.grpc.flags import add_grpc_flags; "
            "add_grpc_flags(argparse.ArgumentParser(), {}); "
            "print(any(m == 'grpc' or m.startswith('grpc.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
