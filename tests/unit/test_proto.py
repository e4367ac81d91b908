"""The committed generated code matches proto/pdserve/v1/pdserve.proto and imports by package path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools is not installed")
def test_regenerating_gives_byte_identical_files(tmp_path: Path) -> None:
    from pdserve.proto import generate

    written = generate.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(GENERATED)
    for name in GENERATED:
        fresh = (tmp_path / "proto" / "pdserve" / "v1" / name).read_bytes()
        committed = (ROOT / "proto" / "pdserve" / "v1" / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run python proto/generate.py"


def test_generated_modules_import_by_package_path() -> None:
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
    from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "pdserve.v1"
    assert pb_grpc.proto_dot_pdserve_dot_v1_dot_pdserve__pb2 is pb
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["Generation"].methods] == ["Generate", "GetModelInfo"]


def test_unset_optional_sampling_fields_are_distinguishable_from_zero() -> None:
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

    unset, zero = pb.SamplingParams(), pb.SamplingParams(temperature=0.0, max_tokens=0)
    assert not unset.HasField("temperature") and not unset.HasField("max_tokens")
    assert zero.HasField("temperature") and zero.HasField("max_tokens")
