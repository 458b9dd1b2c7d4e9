"""A faster GGUF reader, shared by the compute plane's loader and the control plane's
tokenizer (both read the same tokenizer strings from the header)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField


class ArrayField(ReaderField):
    """A metadata array decoded in one pass: `contents()` gives its values, as gguf-py's
    ReaderField does; `data` has one entry per element, and `parts` holds the key, type,
    element type and length only (no view per element)."""

    values: list[Any]  # set once, right after construction

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        return self.values[index_or_slice]


class FastGGUFReader(GGUFReader):
    """GGUFReader that decodes each metadata array at once.

    gguf-py builds two numpy views for each string of an array (its length, its bytes),
    and the header holds 50k-260k tokenizer strings: that took the bundled model's parse
    to 1.2 s and Gemma 3's to 5.4 s, paid by each compute and control plane at start.
    Here an array of strings is decoded in one loop over the mapped bytes, and an array
    of numbers is one view. Scalars, strings and arrays of arrays parse as gguf-py's do.
    """

    def _build_fields(self, offs: int, count: int) -> int:
        self.data = self.data.view(np.ndarray)  # type: ignore[assignment]  # same mmap buffer
        host_little = sys.byteorder == "little"
        little = host_little != (self.byte_order == "S")
        for _ in range(count):
            start = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            head: list[Any] = [klen, kdata, raw_type]
            name = str(kdata.tobytes(), encoding="utf-8")
            if raw_type[0] == GGUFValueType.ARRAY:
                decoded = self._array(offs, little)
                if decoded is not None:
                    itype, alen, sub, values, offs = decoded
                    field = ArrayField(
                        start,
                        name,
                        [*head, itype, alen],
                        list(range(len(values))),
                        [GGUFValueType.ARRAY, sub],
                    )
                    field.values = values
                    self._push_field(field, skip_sum=True)
                    continue
            size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
            idxs = [i + len(head) for i in idxs]
            self._push_field(ReaderField(start, name, head + parts, idxs, types), skip_sum=True)
            offs += size
        return offs

    def _array(
        self, offs: int, little: bool
    ) -> tuple[Any, Any, GGUFValueType, list[Any], int] | None:
        """An array of strings or numbers at `offs`: (its element type and length as
        read, the element type, the values, the offset after it); None for arrays of
        arrays (gguf-py's parse)."""
        itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        sub = GGUFValueType(int(itype[0]))
        n, offs = int(alen[0]), offs + 12
        if sub == GGUFValueType.STRING:
            buf = self.data.data  # a memoryview of the mapped bytes
            order: Literal["little", "big"] = "little" if little else "big"
            values: list[Any] = []
            for _ in range(n):
                length = int.from_bytes(buf[offs : offs + 8], order)
                if offs + 8 + length > len(buf):  # else a truncated file reads b"" forever
                    raise ValueError(f"a string array ends past the end of the file ({n} items)")
                values.append(str(buf[offs + 8 : offs + 8 + length], encoding="utf-8"))
                offs += 8 + length
            return itype, alen, sub, values, offs
        nptype = self.gguf_scalar_to_np.get(sub)
        if nptype is None:
            return None
        arr = self._get(offs, nptype, n)
        return itype, alen, sub, arr.tolist(), offs + int(arr.nbytes)


def open_gguf(path: Path) -> FastGGUFReader:
    """The file's reader; a ValueError naming the file for one that is not a GGUF file or
    is truncated or corrupt (gguf-py raises ValueError, KeyError or IndexError)."""
    try:
        return FastGGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from None
