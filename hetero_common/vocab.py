"""A model's vocabulary as both planes see it: a fingerprint of its token strings, so that
the control plane can tell whether a compute plane serves a model its tokenizer belongs
to, whatever form either side read it from (a GGUF file's metadata, an HF folder's
tokenizer.json; quantized or dense).

The fingerprint is one short hash per block of BLOCK token ids, in id order, and two
vocabularies differ only when most blocks that both cover differ. Blocks, not one hash,
because the forms do not list quite the same tokens: embeddings are often padded past the
tokenizer (GGUF conversions add [PAD] tokens), a tokenizer may hold a token past the
embedding (Gemma 3's <image_soft_token>), a conversion may rewrite a few added tokens.
Another tokenizer shares almost no block: its ids mean other strings throughout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BLOCK = 1024  # token ids per hash
_DIGEST = 8  # bytes per hash


def fingerprint(tokens: Sequence[str | None]) -> bytes:
    """The hashes of each BLOCK of `tokens` (id -> token string; None for an id that has
    none), concatenated; b"" for no tokens. A SentencePiece "▁" counts as the space it
    stands for: Gemma's GGUF stores runs of spaces as spaces, its tokenizer.json as "▁"s."""
    out = bytearray()
    for start in range(0, len(tokens), BLOCK):
        h = hashlib.blake2b(digest_size=_DIGEST)
        for token in tokens[start : start + BLOCK]:
            h.update((token or "").replace("▁", " ").encode("utf-8", "surrogatepass") + b"\0")
        out += h.digest()
    return bytes(out)


def tokenizer_fingerprint(tok: Tokenizer) -> bytes:
    """`fingerprint` of a `tokenizers.Tokenizer`'s vocabulary, added tokens included."""
    return fingerprint(
        [tok.id_to_token(i) for i in range(tok.get_vocab_size(with_added_tokens=True))]
    )


def agreement(a: bytes, b: bytes) -> tuple[int, int]:
    """(blocks that agree, blocks compared): those both fingerprints cover."""
    n = min(len(a), len(b)) // _DIGEST
    same = sum(
        a[i * _DIGEST : (i + 1) * _DIGEST] == b[i * _DIGEST : (i + 1) * _DIGEST] for i in range(n)
    )
    return same, n


def differ(a: bytes, b: bytes) -> bool:
    """Whether two fingerprints are of different vocabularies: most blocks both cover
    differ. False when either is empty (a model without tokenizer data: nothing to say)."""
    same, compared = agreement(a, b)
    return 2 * same < compared
