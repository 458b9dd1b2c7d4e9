"""The compute plane's worker threads: one OpenMP pool for every kernel, sized from the
CPUs this process may use.

torch's intra-op pool is libgomp's; the C kernels (compute_plane/native.py) run on the
same pool (their libgomp resolves to the copy torch loaded: one runtime in the process,
checked in /proc/self/maps). By default torch sizes the pool from the CPUs the machine
has, not those this process may use: a pod limited to 2 CPUs on a 64-core node gets 64
threads, each time-sliced. `usable_cpus()` reads the affinity mask and the cgroup CPU
quota, and `configure()` sizes the pool from it before torch is imported (libgomp reads
OMP_NUM_THREADS once, when it loads); the compute plane's entry point calls it.

libgomp's own wait policy (spin ~300k iterations between parallel regions, then sleep)
is kept: a fused decode step runs ~150 short regions, and beside a `nice 19` busy loop a
short spin (GOMP_SPINCOUNT=10000) let the busy loop take a core at every gap, so batch 1
kept 0.67-0.88x of its quiet speed against 0.96-0.98x with the default
(docs/performance.md). GOMP_SPINCOUNT / OMP_WAIT_POLICY in the environment still apply.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup may use (quota / period), or None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cpus() -> int:
    """The CPUs this process may run on (affinity), capped by its cgroup quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def configure(num_threads: int | None = None) -> int:
    """Size the pool (`num_threads`, else usable_cpus()); before torch is imported."""
    n = num_threads or usable_cpus()
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    return n


def apply(num_threads: int) -> None:
    """After torch is imported: make its pool match (an earlier import may have sized it)."""
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    log.info("compute threads: %d (OpenMP)", num_threads)
