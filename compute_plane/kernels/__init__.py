"""Triton and CuPy kernels of the CUDA backend, one concept per file.

Importing a kernel module imports triton, and `triton.jit` decides at decoration
time whether kernels are compiled for the GPU or interpreted on the CPU
(`TRITON_INTERPRET=1`, which tests set before the first import). This package's
`__init__` imports nothing heavy, so the CPU path never pays for triton.

Every kernel converts its loads to fp32 and accumulates in fp32 (the interpreter
computes bf16 wrongly, and the GPU path keeps the same numerics), then rounds once
on store to the output's dtype.
"""

from __future__ import annotations

import os


def interpreted() -> bool:
    """True when triton runs kernels in its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
