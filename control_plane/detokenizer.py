"""Incremental detokenisation: text deltas that never split a UTF-8 character.

Works on each token's raw bytes (byte-level BPE and byte-fallback tokens stand for
bytes, not characters), so a push costs O(token length), not O(sequence length).
"""

from __future__ import annotations

import codecs

from control_plane.tokenizer import TokenizerWrapper


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenizerWrapper, skip_special_tokens: bool = True) -> None:
        self._bytes = tokenizer.bytes_table(skip_special_tokens)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decode = self._decoder.decode

    def push(self, token_id: int) -> str:
        """Text completed by this token (may be empty while a character is incomplete)."""
        try:
            data = self._bytes[token_id]
        except IndexError:  # a token of the model's padded vocabulary, past the tokenizer's
            data = b""
        return self._decode(data)

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
