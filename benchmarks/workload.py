"""Seeded synthetic workloads: random-token prompts and output lengths, EOS ignored."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Preset:
    num_requests: int
    prompt_len: tuple[int, int]  # uniform, inclusive
    output_len: tuple[int, int]


PRESETS = {
    "default": Preset(64, (32, 512), (32, 256)),  # this 2-core CPU
    "gpu": Preset(256, (100, 1024), (100, 1024)),
    "tiny": Preset(4, (8, 16), (4, 8)),  # smoke tests
}


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def make_workload(
    preset: Preset, seed: int = 0, vocab: tuple[int, int] = (100, 40000)
) -> list[Request]:
    """Prompts of random ordinary token ids (no special tokens), lengths uniform in range."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.randint(*vocab) for _ in range(rng.randint(*preset.prompt_len))],
            rng.randint(*preset.output_len),
        )
        for _ in range(preset.num_requests)
    ]


def _cpu_model() -> str:
    """The processor's name (the development machine is not always the same one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on, including how busy the machine was."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


ROOT = Path(__file__).resolve().parent.parent  # this tree (its git repository)


def unknown_revision(rev: str) -> str | None:
    """Why `rev` cannot be a --compare-ref (not a commit of this tree's repository, or no
    git), or None: checked before anything is loaded, so a typo is a usage error rather
    than git's exit status in a traceback after the model has loaded."""
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
            capture_output=True,
        )
    except OSError as e:
        return f"git cannot be run: {e}"
    return None if found.returncode == 0 else f"{rev!r} is not a commit of {ROOT}"


def preset_dict(preset: Preset) -> dict[str, Any]:
    return asdict(preset)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """A benchmark's JSON report at `path` (its folder made if missing), whole or not at
    all: written beside it, then renamed over it, so that a run stopped while writing
    leaves the report before it (one written part by part keeps its finished parts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temp.write_text(json.dumps(report, indent=2) + "\n")
        temp.replace(path)
    finally:
        temp.unlink(missing_ok=True)


class ReportParts:
    """A report of several parts (sweeps, servers, sections) written whole (`write_report`)
    after each part measured, so that a run stopped or failing part way keeps what it
    measured: the parts not measured yet are listed in its `unfinished`, and the one that
    raised in `failed` (name: its exception), before the exception goes on."""

    def __init__(self, path: Path, report: dict[str, Any], parts: Iterable[str]) -> None:
        self.path, self.report = path, report
        report["unfinished"] = list(parts)
        self._recorded: BaseException | None = None  # (recorded once, by the innermost block)

    def write(self) -> None:
        write_report(self.path, self.report)

    def done(self, part: str) -> None:
        """`part`'s figures are in the report: it is written."""
        self.report["unfinished"].remove(part)
        self.write()

    @contextlib.contextmanager
    def failing(self, name: str) -> Iterator[None]:
        """An exception out of the block (not an interrupt) is recorded as `name`'s in
        `failed`, unless a block inside recorded it, and the report written."""
        try:
            yield
        except Exception as e:
            if e is not self._recorded:
                self._recorded = e
                self.report.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
                self.write()
            raise

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """The block measures `name` (and puts its figures in the report): done when it
        ends, failed if it raises."""
        with self.failing(name):
            yield
        self.done(name)
