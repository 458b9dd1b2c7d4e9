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
from typing import ClassVar


def interpreted() -> bool:
    """True when triton runs kernels in its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The launch arguments of a kernel with a `PDL` constexpr, as a programmatic dependent.
PDL_LAUNCH: dict[str, bool] = {"PDL": True, "launch_pdl": True}


class _Launch:
    """How this process launches the decode step's Triton kernels (set once at start-up,
    before any CUDA graph is captured: a graph keeps the launches it recorded)."""

    kwargs: ClassVar[dict[str, bool]] = {}


def set_dependent_launch(on: bool) -> None:
    """Launch the decode step's Triton kernels (the small-step linears, the rotation with
    its KV write, decode attention's split and combine, the norms) as programmatic
    dependent launches (Hopper and later: `--pdl`). Each may then start while the kernel
    before it finishes; it reads nothing another kernel writes, and writes nothing, before
    `griddepcontrol.wait` (which returns once that kernel is done and its writes are
    seen), and then lets the next one start. The interpreter has no grids to overlap:
    there this is ignored."""
    _Launch.kwargs = PDL_LAUNCH if on and not interpreted() else {}


def dependent_launch() -> dict[str, bool]:
    """The launch arguments of a kernel with a `PDL` constexpr, per `set_dependent_launch`
    (decided once there: kernels are launched on every eager step). Not to be modified."""
    return _Launch.kwargs
