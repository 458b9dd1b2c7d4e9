"""Kernel tests: on the GPU when torch sees one, else in the Triton interpreter on the CPU.

`triton.jit` picks the interpreter when it decorates a kernel, that is when a kernel
module is first imported; pytest imports this conftest before any test module of
this folder, and nothing outside the folder imports a kernel module.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
