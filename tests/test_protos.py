"""The committed stubs in hetero_proto/ are exactly what protos/generate.py produces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", REPO / "protos" / "generate.py")
    assert spec and spec.loader
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.generate(tmp_path)
    fresh = sorted(p.name for p in (tmp_path / "hetero_proto").iterdir())
    assert fresh, "protoc produced nothing"
    committed = sorted(p.name for p in (REPO / "hetero_proto").glob("*_pb2*"))
    assert fresh == committed
    for name in fresh:
        assert (tmp_path / "hetero_proto" / name).read_text() == (
            REPO / "hetero_proto" / name
        ).read_text(), f"hetero_proto/{name} is stale: run `python protos/generate.py`"


def test_services_are_declared() -> None:
    from hetero_proto import compute_pb2, control_pb2

    compute = compute_pb2.DESCRIPTOR.services_by_name["ComputePlane"]
    assert {m.name for m in compute.methods} == {"Describe", "Run", "Reset", "Stats"}
    run = compute.methods_by_name["Run"]
    assert run.client_streaming and run.server_streaming
    control = control_pb2.DESCRIPTOR.services_by_name["ControlPlane"]
    assert {m.name for m in control.methods} == {
        "Generate",
        "GenerateMany",
        "Tokenize",
        "Detokenize",
        "ModelInfo",
    }
    many = control.methods_by_name["GenerateMany"]
    assert many.client_streaming and many.server_streaming


def test_tokenize_add_special_tokens_stays_false_when_unset() -> None:
    """vLLM's /tokenize adds special tokens unless told not to; the gRPC field cannot take
    that default compatibly: proto3 writes no bytes for a false bool, so a message from a
    client built before a change to `optional` with "unset: true" (an older gateway in a
    rolling update, asked for add_special_tokens false) reads as unset, i.e. true.
    docs/protocol.md says so; the gateway's /tokenize has vLLM's defaults."""
    from hetero_proto import control_pb2 as pb

    field = pb.TokenizeRequest.DESCRIPTOR.fields_by_name["add_special_tokens"]
    assert not field.has_presence  # (a plain bool: false when unset)
    explicit = pb.TokenizeRequest(text="x", add_special_tokens=False).SerializeToString()
    assert explicit == pb.TokenizeRequest(text="x").SerializeToString()
