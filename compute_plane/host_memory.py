"""Host memory a CPU KV pool may take: the pool is mapped lazily (its pages are given as
first written), so a --kv-cache-bytes past what the machine has is not refused by the
kernel at start-up; the OOM killer ends the process later, once enough blocks are used.
So it is checked at start-up against what is available: the smaller of the machine's
MemAvailable and what the cgroup's memory limit leaves."""

from __future__ import annotations

from pathlib import Path

from hetero_common.model_path import resolve_model_path, weights_bytes

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


def memory_available() -> tuple[str, int] | None:
    """The memory this process may still take, in bytes, and where that figure comes from:
    the smaller of MemAvailable and what the cgroup's limit leaves (None: both unknown)."""
    sources = {
        "MemAvailable in /proc/meminfo": mem_available(),
        "what the cgroup's memory limit leaves": cgroup_memory_left(),
    }
    known = [(what, n) for what, n in sources.items() if n is not None]
    return min(known, key=lambda item: item[1]) if known else None


def weights_estimate(model: str | Path, draft_model: str | None = None) -> int:
    """A compute plane's weights in memory before they load: the model files' size (about
    right for a GGUF, whose matrices stay quantized on the CPU; low for weights cast wider
    or dequantized), the draft model's too."""
    models = [model, *([draft_model] if draft_model else [])]
    return sum(weights_bytes(resolve_model_path(m)) for m in models)


def check_kv_budget(budget: int, planes: int = 1, weights: int = 0) -> None:
    """ValueError naming --kv-cache-bytes when `budget` bytes and `weights` bytes (for each
    of `planes` compute planes on this machine: `serve --compute-planes`; `weights`: an
    estimate of the model's in memory, 0 where it is loaded already) are more than this
    process has available (nothing when that is unknown)."""
    found = memory_available()
    if found is None:
        return
    what, available = found
    total = (budget + weights) * planes
    if total <= available:
        return
    asked = f"--kv-cache-bytes {budget} ({_gib(budget)})"
    if weights:
        estimate = "the model files' size, an estimate"
        asked += f" + the weights, ~{weights} bytes ({_gib(weights)}: {estimate})"
    if planes > 1:
        asked = f"--compute-planes {planes} x " + (f"({asked})" if weights else asked)
    if planes > 1 or weights:
        asked += f" = {total} bytes ({_gib(total)})"
    if weights * planes >= available:  # no --kv-cache-bytes fits
        fewer = " or fewer --compute-planes" if planes > 1 else ""
        outcome, remedy = "as it loads", f"the weights alone do not fit: a smaller model{fewer}"
    else:
        more = " or --compute-planes" if planes > 1 else ""
        outcome, remedy = "as the cache fills", f"lower --kv-cache-bytes{more}"
    raise ValueError(
        f"{asked} is more than the memory available, "
        f"{available} bytes ({_gib(available)}: {what}); the OOM killer would end the "
        f"compute plane {outcome}: {remedy}"
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
