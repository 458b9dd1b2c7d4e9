"""hetero_common.gguf_reader.FastGGUFReader against gguf-py's own GGUFReader: the same
metadata (values, types, order) and tensors, from files gguf-py's GGUFWriter wrote in
both byte orders and from the bundled model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from hetero_common.gguf_reader import FastGGUFReader, open_gguf

V = gguf.GGUFValueType
ARRAYS: dict[str, tuple[list[Any], V]] = {
    "tokens": (["<s>", "", "héllo", "日本語", " ", "\n", "🤖" * 3], V.STRING),
    "merges": ([f"a{i} b{i}" for i in range(300)], V.STRING),
    "scores": ([0.5, -1.25, 3.0], V.FLOAT32),
    "types": ([1, 3, 1, 6], V.INT32),
    "u8": ([0, 255, 7], V.UINT8),
    "i64": ([-(2**40), 2**40], V.INT64),
    "f64": ([1e-300, -2.5], V.FLOAT64),
    "flags": ([True, False, True], V.BOOL),
    "nested": ([[1, 2], [3]], V.ARRAY),
}


def _write(path: Path, endian: gguf.GGUFEndian) -> Path:
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_string("general.name", "tiny ✓")
    w.add_uint32("general.alignment", 64)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_float32("llama.rope.freq_base", 10000.0)
    for key, (values, sub) in ARRAYS.items():
        w.add_key_value(f"test.{key}", values, V.ARRAY, sub_type=sub)
    w.add_uint64("test.after_arrays", 2**63 + 5)
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd.weight", (16, 8)), ("blk.0.attn_q.weight", (8, 8))):
        t = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(name, t.byteswap() if endian == gguf.GGUFEndian.BIG else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same(path: Path) -> FastGGUFReader:
    ours, ref = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(ref.fields)
    for key, want in ref.fields.items():
        got = ours.fields[key]
        assert got.contents() == want.contents(), key
        assert len(got.data) == len(want.data) or (want.contents() == [] and not got.data), key
        assert got.types[: len(want.types)] == want.types, key
        if want.types and want.types[0] == V.ARRAY and len(want.data) > 1:
            assert got.contents(1) == want.contents(1), key
            assert got.contents(slice(0, 2)) == want.contents(slice(0, 2)), key
    assert ours.alignment == ref.alignment and ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert a.data_offset == b.data_offset and np.array_equal(a.data, b.data)
    return ours


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_as_gguf_py_reads_it(
    tmp_path: Path, endian: gguf.GGUFEndian
) -> None:
    ours = _same(_write(tmp_path / "t.gguf", endian))
    assert ours.fields["test.tokens"].contents() == ARRAYS["tokens"][0]  # as written
    assert ours.fields["test.nested"].contents() == [1, 2, 3]  # gguf-py flattens these
    assert ours.fields["test.after_arrays"].contents() == 2**63 + 5


def test_the_bundled_model_reads_as_gguf_py_reads_it(smollm2_path: Path) -> None:
    ours = _same(smollm2_path)
    assert len(ours.fields["tokenizer.ggml.tokens"].data) == 49152


def test_a_string_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf", gguf.GGUFEndian.LITTLE)
    raw = bytearray(path.read_bytes())
    at = raw.index("héllo".encode())
    raw[at + 1] = 0xFF  # a byte that no UTF-8 text holds
    path.write_bytes(bytes(raw))
    with pytest.raises(UnicodeDecodeError):
        FastGGUFReader(path)


def test_a_truncated_file_is_a_value_error_naming_it(tmp_path: Path) -> None:
    # Cut inside the header it was an IndexError (a traceback at start-up), and a string
    # array whose count runs past the end read empty strings until memory ran out.
    raw = _write(tmp_path / "t.gguf", gguf.GGUFEndian.LITTLE).read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in range(0, len(raw) - 1, 7):
        cut.write_bytes(raw[:size])
        with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file"):
            open_gguf(cut)


def test_a_string_array_longer_than_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_key_value("tokenizer.ggml.tokens", ["a"], V.ARRAY, sub_type=V.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    raw = bytearray(path.read_bytes())
    at = raw.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8
    assert int.from_bytes(raw[at : at + 8], "little") == 1  # the array's count
    raw[at : at + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="a string array ends past the end of the file"):
        open_gguf(path)
