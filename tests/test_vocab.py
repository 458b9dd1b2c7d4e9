"""hetero_common.vocab: the vocabulary fingerprint by which the control plane refuses a
compute plane whose model its tokenizer is not of, and never the same model in another
form (GGUF file or HF folder, each plane reading it its own way)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compute_plane.loader import gguf_file, hf
from control_plane.tokenizer import load_tokenizer
from hetero_common.gguf_reader import open_gguf
from hetero_common.model_path import GEMMA3_DISTRIBUTION, gemma3_gguf
from hetero_common.vocab import BLOCK, agreement, differ, fingerprint
from tests.conftest import installed

VOCAB = [f"tok{i}" for i in range(4 * BLOCK)]


def test_one_vocabulary_whatever_is_past_the_shorter_one() -> None:
    # Embeddings padded past the tokenizer ([PAD] tokens in a GGUF conversion), a tokenizer
    # with a token past the embedding (Gemma 3's <image_soft_token>).
    padded = fingerprint([*VOCAB, *(f"[PAD{i}]" for i in range(BLOCK + 128))])
    assert agreement(fingerprint(VOCAB), padded) == (4, 4)
    assert not differ(fingerprint(VOCAB), padded)
    assert not differ(fingerprint(VOCAB[:-1]), fingerprint(VOCAB))  # 3 of 4 agree
    assert not differ(fingerprint([*VOCAB, "<image_soft_token>"]), fingerprint(VOCAB))


def test_a_few_tokens_written_otherwise_are_the_same_vocabulary() -> None:
    rewritten = list(VOCAB)
    rewritten[5] = rewritten[3 * BLOCK + 1] = "added, normalised"
    assert agreement(fingerprint(VOCAB), fingerprint(rewritten)) == (2, 4)
    assert not differ(fingerprint(VOCAB), fingerprint(rewritten))
    # a SentencePiece piece's "▁" is the space it stands for, as a GGUF may store it
    assert fingerprint(["▁the", "▁▁"]) == fingerprint([" the", "  "])


def test_another_vocabulary_differs() -> None:
    other = [f"other{i}" for i in range(2 * BLOCK)]
    assert agreement(fingerprint(VOCAB), fingerprint(other)) == (0, 2)
    assert differ(fingerprint(VOCAB), fingerprint(other))
    shifted = ["<new special>", *VOCAB]  # every id one further: each block differs
    assert differ(fingerprint(VOCAB), fingerprint(shifted))
    assert differ(fingerprint(["a", "b"]), fingerprint(["b", "a"]))


def test_a_model_without_tokenizer_data_is_not_compared() -> None:
    assert fingerprint([]) == b""
    assert agreement(b"", fingerprint(VOCAB)) == (0, 0)
    assert not differ(b"", fingerprint(VOCAB))
    assert not differ(fingerprint(VOCAB), b"")


def _gguf_fingerprint(path: Path) -> bytes:
    """As the compute plane's GGUF loader reads it."""
    return gguf_file.read_config(path, open_gguf(path)).vocab_fingerprint


def test_the_bundled_model_in_each_form_has_one_fingerprint(
    smollm2_path: Path, hf_smollm2_tokenizer: object, tmp_path: Path
) -> None:
    """The GGUF file (the compute plane's raw strings, the control plane's rebuilt
    tokenizer) and an HF folder's tokenizer.json (transformers' own conversion of it, read
    by each plane) give one fingerprint."""
    hf_smollm2_tokenizer.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    assert (tmp_path / "tokenizer.json").is_file()
    forms = {
        "compute, GGUF": _gguf_fingerprint(smollm2_path),
        "control, GGUF": load_tokenizer(smollm2_path).vocab_fingerprint,
        "compute, tokenizer.json": hf._vocab_fingerprint(tmp_path),
        "control, tokenizer.json": load_tokenizer(tmp_path).vocab_fingerprint,
    }
    assert len(forms["compute, GGUF"]) == 8 * 48  # 49152 tokens
    assert len(set(forms.values())) == 1, {k: v[:16].hex() for k, v in forms.items()}
    assert hf._vocab_fingerprint(tmp_path / "nothing here") == b""


@pytest.mark.skipif(not installed(GEMMA3_DISTRIBUTION), reason="Gemma 3 270M not installed")
def test_gemma3_is_its_own_vocabulary_not_smollm2s(smollm2_path: Path) -> None:
    # Gemma's GGUF stores runs of spaces as spaces; the control plane's tokenizer, as "▁"s.
    gemma = _gguf_fingerprint(gemma3_gguf())
    assert load_tokenizer(gemma3_gguf()).vocab_fingerprint == gemma
    assert len(gemma) == 8 * 256
    smol = _gguf_fingerprint(smollm2_path)
    assert agreement(gemma, smol) == (0, 48)
    assert differ(gemma, smol) and differ(smol, gemma)
