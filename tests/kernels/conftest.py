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

    from typing import Any

    from triton.runtime import interpreter

    _interpreted_call = interpreter.InterpretedFunction.__call__
    _patched_for: set[str] = set()

    def _device_function_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        """A @triton.jit helper called from a kernel, triton.language patched for it
        once per helper module, not at every call of every program. The interpreter
        patches the language for a whole launch (GridExecutor) and again at each helper
        call; what a helper call patches is never restored, except the tensor methods
        that each launch patches and restores itself. Re-patching at every call took a
        third of an attention kernel's interpreted time."""
        module = self.fn.__module__
        if module in _patched_for:
            return self.rewrite()(*args, **kwargs)
        _patched_for.add(module)
        return _interpreted_call(self, *args, **kwargs)

    interpreter.InterpretedFunction.__call__ = _device_function_call
