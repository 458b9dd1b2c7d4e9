"""A faster GGUF reader, shared by the compute plane's loader and the control plane's
tokenizer (both read the same tokenizer strings from the header)."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader


class FastGGUFReader(GGUFReader):
    """GGUFReader that parses its header from a plain ndarray view of the mmap.

    Slicing np.memmap is ~5x slower than slicing ndarray, and the header holds 50k-260k
    tokenizer strings: this takes the bundled model's parse from seconds to under one.
    """

    def _build_fields(self, *args: Any, **kwargs: Any) -> Any:
        self.data = self.data.view(np.ndarray)  # type: ignore[assignment]  # same mmap buffer
        return super()._build_fields(*args, **kwargs)
