"""C kernels for the CPU, compiled with the system's C compiler on first use.

Each source in `csrc/` is built into a shared library once per version of the sources
(one may include another), flags, compiler and CPU, and cached under `$HETERO_INFER_CACHE_DIR` (default `~/.cache/hetero-infer`).
The libraries link libgomp, which resolves to the copy torch has already loaded: their
OpenMP loops run on torch's thread pool. Where no compiler is found the callers fall
back to torch with a warning (KernelUnavailable).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -ffast-math lets the reductions and expf vectorise. It is given to the compile step only:
# linking with it adds crtfastmath.o, which would switch the whole process (torch included)
# to flush-to-zero on load.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")


class KernelUnavailable(RuntimeError):
    """A C kernel could not be built or loaded here."""


def _cpu_signature() -> bytes:
    """What -march=native depends on: a cache shared by different CPUs must not mix them."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features", b"model name")):
                    return line
    except OSError:
        pass
    return os.uname().machine.encode()


def _cache_dir() -> Path:
    explicit = os.environ.get("HETERO_INFER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetero-infer"


@functools.cache
def load_library(name: str) -> ctypes.CDLL:
    """`csrc/<name>.c` as a loaded library (built once per source/flags/CPU, then cached)."""
    source_path = CSRC / f"{name}.c"
    # Sources include one another: every file in csrc/ is part of each library's key.
    source = b"".join(f.read_bytes() for f in sorted(CSRC.iterdir()) if f.suffix in (".c", ".h"))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler found (cc or gcc on PATH, or $CC)")
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS).encode()
    key = hashlib.sha256(source + flags + cc.encode() + _cpu_signature())
    lib_path = _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not lib_path.exists():
        try:
            lib_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # as a missing compiler: the callers fall back or name it
            raise KernelUnavailable(
                f"cannot make the kernel cache {lib_path.parent} ($HETERO_INFER_CACHE_DIR): {e}"
            ) from e
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        obj = lib_path.with_suffix(f".{os.getpid()}.o")
        try:
            _run([cc, *COMPILE_FLAGS, str(source_path), "-o", str(obj)])
            _run([cc, str(obj), "-o", str(tmp), *LINK_FLAGS])
        finally:
            obj.unlink(missing_ok=True)
        os.replace(tmp, lib_path)  # atomic: concurrent builders each install a whole file
        log.info("built the C kernel %s: %s", name, lib_path)
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as e:
        raise KernelUnavailable(f"loading {lib_path}: {e}") from e


def _run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{' '.join(cmd)}: {e}") from e
    if done.returncode != 0:
        raise KernelUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
