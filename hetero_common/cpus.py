"""The CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota (a
pod limited to 2 CPUs on a 64-core node has 2, not 64). The compute plane sizes its
thread pool from it, the control plane its tokenising and grammar-compiling lanes."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


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


def half_the_cpus() -> int:
    """The size of a pool for work that must never take every CPU (a burst of huge
    prompts to tokenise, of grammars to compile): half of them, at least one."""
    return max(1, usable_cpus() // 2)


def side_lane(name: str) -> ThreadPoolExecutor:
    """A pool of `half_the_cpus` threads named `name`-N (started as work comes), for slow
    work kept off an event loop that must not take every CPU."""
    return ThreadPoolExecutor(half_the_cpus(), thread_name_prefix=name)
