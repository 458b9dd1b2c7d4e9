"""The compute plane's thread pool is sized from the CPUs the process may use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_common import cpus


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpus.cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpus.cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.cgroup_cpu_quota(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.cgroup_cpu_quota(tmp_path) is None
    assert cpus.cgroup_cpu_quota(tmp_path / "absent") is None


def test_usable_cpus_follow_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: None)
    assert cpus.usable_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 0.5)
    assert cpus.usable_cpus() == 1  # half a CPU of quota: one thread
    assert cpus.half_the_cpus() == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_a_pinned_compute_plane_uses_one_thread() -> None:
    """`taskset` to one CPU: the pool torch gets is one thread, not the machine's count."""
    code = (
        "from compute_plane import threads; n = threads.configure(); "
        "import torch; threads.apply(n); print(torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cpu = str(min(os.sched_getaffinity(0)))
    out = subprocess.run(
        ["taskset", "-c", cpu, sys.executable, "-c", code],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    assert out.stdout.strip() == "1"
