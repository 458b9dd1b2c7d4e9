"""The CPU backend: decode attention by a C kernel that reads K/V where they lie in the cache.

The torch backend gathers every decode's context blocks into a padded copy and runs a
masked SDPA; on a CPU that copy is most of a decode step (docs/performance.md). The
kernel in `csrc/paged_attention_cpu.c` walks each sequence's block table instead, on
torch's OpenMP threads (ctypes releases the GIL during the call).
Prefill chunks keep the torch path: a chunk's many query tokens amortise its gather.

The kernel is plain C (fp32 only), compiled with the system's C compiler on first use
and cached under `$HETERO_INFER_CACHE_DIR` (default `~/.cache/hetero-infer`), keyed by
source, flags and CPU. `--attention-backend auto` picks it on a CPU for fp32 and falls
back to the torch backend, with a warning, where no compiler is found.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from compute_plane.attention.torch_backend import AttentionMetadata, TorchPagedAttention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parents[1] / "csrc" / "paged_attention_cpu.c"
# -ffast-math lets the reductions and expf vectorise. It is given to the compile step only:
# linking with it adds crtfastmath.o, which would switch the whole process (torch included)
# to flush-to-zero on load.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here."""


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
def load_kernel() -> Callable[..., int]:
    """The compiled kernel's entry point (built once per source/flags/CPU, then cached)."""
    source = SOURCE.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelUnavailable("no C compiler found (cc or gcc on PATH, or $CC)")
    flags = " ".join(COMPILE_FLAGS + LINK_FLAGS).encode()
    key = hashlib.sha256(source + flags + cc.encode() + _cpu_signature())
    lib_path = _cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        obj = lib_path.with_suffix(f".{os.getpid()}.o")
        try:
            _run([cc, *COMPILE_FLAGS, str(SOURCE), "-o", str(obj)])
            _run([cc, str(obj), "-o", str(tmp), *LINK_FLAGS])
        finally:
            obj.unlink(missing_ok=True)
        os.replace(tmp, lib_path)  # atomic: concurrent builders each install a whole file
        log.info("built the CPU attention kernel: %s", lib_path)
    try:
        fn = ctypes.CDLL(str(lib_path)).paged_decode_attention_f32
    except OSError as e:
        raise KernelUnavailable(f"loading {lib_path}: {e}") from e
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def _run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{' '.join(cmd)}: {e}") from e
    if done.returncode != 0:
        raise KernelUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")


class CPUPagedAttention(TorchPagedAttention):
    """Decodes by the C kernel; prefill chunks as the torch backend."""

    name = "cpu"

    def __init__(self, scale: float) -> None:
        super().__init__(scale)
        self._kernel = load_kernel()

    def prepare_decodes(self, meta: AttentionMetadata) -> None:
        meta.seq_lens_tensor = torch.tensor(meta.seq_lens[: meta.num_decodes], dtype=torch.int32)
        if meta.block_tables.dtype != torch.int32 or not meta.block_tables.is_contiguous():
            meta.block_tables = meta.block_tables.to(torch.int32).contiguous()

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not (k_cache.dtype == v_cache.dtype == q.dtype == torch.float32):
            raise TypeError(f"the CPU attention kernel is fp32 only, got {k_cache.dtype}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the CPU attention kernel needs contiguous KV caches")
        lens = meta.seq_lens_tensor
        assert lens is not None, "prepare() first"
        q = q.contiguous()
        out = torch.empty_like(q)
        tables = meta.block_tables
        d, heads, head_dim = q.shape
        with torch.profiler.record_function("cpu_decode_attention"):
            failed = self._kernel(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                tables.stride(0), lens.data_ptr(), out.data_ptr(), d, heads,
                k_cache.shape[2], head_dim, k_cache.shape[1], self.scale,
            )  # fmt: skip
        if failed:
            raise MemoryError("the CPU attention kernel could not allocate its score buffers")
        return out
