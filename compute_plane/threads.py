"""The compute plane's worker threads: one OpenMP pool for every kernel, sized from the
CPUs this process may use, that does not spin against its neighbours.

torch's intra-op pool is libgomp's; the C kernels (compute_plane/native.py) run on the
same pool (their libgomp resolves to the copy torch loaded). Two things go wrong by
default on a shared node:

- torch sizes the pool from the CPUs the machine has, not those this process may use:
  a pod limited to 2 CPUs on a 64-core node gets 64 threads, each time-sliced.
  `usable_cpus()` reads the affinity mask and the cgroup CPU quota.
- between parallel regions libgomp's threads spin (up to ~300k iterations) waiting for
  the next one, burning a core a neighbour (a sidecar, another pod, a `nice 19` batch
  job) could use. A short spin keeps the fast path (the next region usually starts
  within microseconds) and sleeps soon after. Measured on the development machine
  (docs/performance.md), the throughput collapse beside a busy loop that [P] reported
  does not reproduce today with either spin count, so this is a precaution, not the
  measured cure.

`configure()` runs before torch is imported (libgomp reads its settings once, when it
loads); the compute plane's entry point calls it.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

# Iterations a waiting libgomp thread spins before it sleeps (its default is 300,000
# with as many threads as CPUs): ~10-50 microseconds here.
SPIN_COUNT = 10_000


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
    """Size the pool (`num_threads`, else usable_cpus()) and shorten its spin; before torch."""
    n = num_threads or usable_cpus()
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
    return n


def apply(num_threads: int) -> None:
    """After torch is imported: make its pool match (an earlier import may have sized it)."""
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    log.info("compute threads: %d (OpenMP, spin %s)", num_threads, os.environ.get("GOMP_SPINCOUNT"))
