"""The compute plane's worker threads: one OpenMP pool for every kernel, sized from the
CPUs this process may use.

torch's intra-op pool is libgomp's; the C kernels (compute_plane/native.py) run on the
same pool (their libgomp resolves to the copy torch loaded: one runtime in the process,
checked in /proc/self/maps). By default torch sizes the pool from the CPUs the machine
has, not those this process may use: a pod limited to 2 CPUs on a 64-core node gets 64
threads, each time-sliced. `usable_cpus()` (hetero_common/cpus.py) reads the affinity
mask and the cgroup CPU quota, and `configure()` sizes the pool from it before torch is
imported (libgomp reads OMP_NUM_THREADS once, when it loads); the compute plane's entry
point calls it.

libgomp's own wait policy (spin ~300k iterations between parallel regions, then sleep)
is kept: a fused decode step runs ~150 short regions, and beside a `nice 19` busy loop a
short spin (GOMP_SPINCOUNT=10000) let the busy loop take a core at every gap, so batch 1
kept 0.67-0.88x of its quiet speed against 0.96-0.98x with the default
(docs/performance.md). GOMP_SPINCOUNT / OMP_WAIT_POLICY in the environment still apply.
"""

from __future__ import annotations

import logging
import os

from hetero_common.cpus import usable_cpus

log = logging.getLogger(__name__)


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
