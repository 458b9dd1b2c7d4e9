"""pyproject's floors are the versions that generated hetero_proto/, and hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _requirements() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = {}
    for req in project["dependencies"]:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", req).groups()  # type: ignore[union-attr]
        out[name.lower()] = spec
    return out


def _floor(spec: str) -> str:
    m = re.search(r">=\s*([0-9][0-9.]*)", spec)
    assert m, f"no >= floor in {spec!r}"
    return m.group(1)


def _generated_version(glob: str, pattern: str) -> str:
    """The one version every generated file of `glob` names (`pattern`'s group 1)."""
    versions = set()
    for path in (REPO / "hetero_proto").glob(glob):
        m = re.search(pattern, path.read_text())
        assert m, f"{path}: no generator version"
        versions.add(m.group(1))
    assert len(versions) == 1, versions
    return versions.pop()


PROTOBUF = ("*_pb2.py", r"# Protobuf Python Version: (\S+)")
GRPC = ("*_pb2_grpc.py", r"GRPC_GENERATED_VERSION = '([^']+)'")


def test_floors_are_the_versions_that_generated_the_stubs() -> None:
    reqs = _requirements()
    assert _floor(reqs["protobuf"]) == _generated_version(*PROTOBUF)
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(reqs[name]) == _generated_version(*GRPC), name


def test_the_base_install_has_no_torch() -> None:
    """The control plane and gateway image installs `.` alone: torch is the compute extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not {"torch", "safetensors"} & set(_requirements())
    assert any(r.startswith("torch") for r in project["optional-dependencies"]["compute"])


@pytest.mark.slow
def test_stubs_import_with_the_floor_protobuf(tmp_path: Path) -> None:
    """`pip install protobuf==<floor>` then importing the stubs works (needs PyPI)."""
    floor = _floor(_requirements()["protobuf"])
    target = tmp_path / "site"
    install = ["install", "-q", "--no-deps", "--target", str(target), f"protobuf=={floor}"]
    pip = subprocess.run(
        [sys.executable, "-m", "pip", *install],
        capture_output=True,
        text=True,
    )
    if pip.returncode:
        pytest.skip(f"cannot install protobuf=={floor} here: {pip.stderr.strip()[-300:]}")
    code = (
        "import google.protobuf as p; "
        f"assert p.__version__ == {floor!r}, p.__version__; "
        "import hetero_proto.compute_pb2, hetero_proto.control_pb2, "
        "hetero_proto.compute_pb2_grpc, hetero_proto.control_pb2_grpc"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO)])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_every_package_is_installed() -> None:
    """Each top-level package of the repository is in setuptools' list (else an installed
    `hetero-infer`, run from anywhere but the repository root, cannot import it)."""
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    listed = {pattern.rstrip("*") for pattern in find["find"]["include"]}
    ours = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert ours <= listed, f"not installed: {sorted(ours - listed)}"
