"""Host memory a CPU KV pool may take: the pool is mapped lazily (its pages are given as
first written), so a --kv-cache-bytes past what the machine has is not refused by the
kernel at start-up; the OOM killer ends the process later, once enough blocks are used.
So it is checked at start-up against what is available: the smaller of the machine's
MemAvailable and what the cgroup's memory limit leaves."""

from __future__ import annotations

from pathlib import Path

# cgroup v1 writes "no limit" as LONG_MAX rounded down to a page.
_UNLIMITED = 1 << 62


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes, or None when unknown (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # (kB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_memory_left(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the cgroup's limit leaves (the limit less its working set: usage without
    the inactive page cache, which the kernel reclaims first), or None when unlimited or
    unknown."""
    for limit_name, usage_name, stat_name, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        try:
            limit_text = (root / limit_name).read_text().strip()
            usage = int((root / usage_name).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        try:
            limit = int(limit_text)
        except ValueError:
            return None
        if limit >= _UNLIMITED:
            return None
        return max(0, limit - max(0, usage - _stat(root / stat_name, inactive)))
    return None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 when unknown)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def check_kv_budget(budget: int, planes: int = 1) -> None:
    """ValueError naming --kv-cache-bytes when `budget` bytes (for each of `planes` compute
    planes on this machine: `serve --compute-planes`) are more than this process has
    available (nothing when that is unknown)."""
    sources = {
        "MemAvailable in /proc/meminfo": mem_available(),
        "what the cgroup's memory limit leaves": cgroup_memory_left(),
    }
    known = {what: n for what, n in sources.items() if n is not None}
    if not known:
        return
    what, available = min(known.items(), key=lambda item: item[1])
    total = budget * planes
    if total > available:
        asked, lower = f"--kv-cache-bytes {budget} ({_gib(budget)})", "--kv-cache-bytes"
        if planes > 1:
            asked = f"--compute-planes {planes} x {asked} = {total} bytes ({_gib(total)})"
            lower += " or --compute-planes"
        raise ValueError(
            f"{asked} is more than the memory available, "
            f"{available} bytes ({_gib(available)}: {what}); the OOM killer would end the "
            f"compute plane as the cache fills: lower {lower}"
        )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
