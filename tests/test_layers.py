"""Floors import downward only, and no plane imports another.

    hetero_infer, benchmarks        entry points (may import anything below)
    compute_plane | control_plane | gateway   the three planes, never each other
    hetero_common                   shared bottom floor (no plane)
    hetero_proto                    generated stubs

Read from the source with `ast`, so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = (
    "hetero_proto",
    "hetero_common",
    "compute_plane",
    "control_plane",
    "gateway",
    "hetero_infer",
    "benchmarks",
)
BELOW = {
    "hetero_proto": {"hetero_proto"},
    "hetero_common": {"hetero_proto", "hetero_common"},
    "compute_plane": {"hetero_proto", "hetero_common", "compute_plane"},
    "control_plane": {"hetero_proto", "hetero_common", "control_plane"},
    "gateway": {"hetero_proto", "hetero_common", "gateway"},
}
# The control plane and the gateway ship in an image without torch (planes.Dockerfile).
NO_TORCH = ("hetero_common", "control_plane", "gateway")
TORCH_LIKE = {"torch", "triton", "cupy"}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_floor_imports_only_what_lies_below_it(package: str) -> None:
    bad = []
    for path in package_files(package):
        for name in imported_packages(path) & set(OURS):
            if name not in BELOW[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", NO_TORCH)
def test_the_torch_free_floors_import_no_torch(package: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in package_files(package)
        for name in imported_packages(path) & TORCH_LIKE
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_back_arrow(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from control_plane.engine import ControlEngine\n")
    assert imported_packages(f) == {"control_plane"}


def test_the_planes_image_carries_no_compute_plane_code() -> None:
    """planes.Dockerfile copies exactly the floors the control plane and gateway need."""
    text = (ROOT / "deploy/docker/planes.Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (?:--from=\S+ )?(\w+) ", text, re.M))
    assert "compute_plane" not in copied
    needed = set().union(*(BELOW[p] for p in ("control_plane", "gateway")))
    assert needed <= copied, f"planes.Dockerfile must COPY {sorted(needed - copied)}"
