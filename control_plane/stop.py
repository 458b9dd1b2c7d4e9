"""Stop strings on streamed text: matched across token boundaries, never leaked.

Text that could still be the start of a stop string is held back until it either
completes a match (then it and everything after it are dropped) or cannot match.
As vLLM's min_tokens: the text of a request's first min_tokens tokens is not searched.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: list[str], include: bool = False, min_tokens: int = 0) -> None:
        """`include`: keep the matched stop string at the end of the text; `min_tokens`:
        how many tokens' text (`feed_token`) passes unsearched."""
        self.stop = [s for s in stop if s]
        self.include = include
        self.held = ""
        self.stopped = False
        self.unsearched = min_tokens

    def feed_token(self, text: str) -> tuple[str, str | None]:
        """`feed` for the text of one token (the first min_tokens pass as they are)."""
        if self.unsearched > 0:
            self.unsearched -= 1
            return text, None
        return self.feed(text)

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string matched or None)."""
        if self.stopped:
            return "", None
        if not self.stop:
            return text, None
        buf = self.held + text
        # The stop string that completes first wins (as when text comes a character at a
        # time), the earlier start on a tie: the result does not depend on the chunking.
        hits = [(i + len(s), i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        if hits:
            _, i, s = min(hits)
            self.held, self.stopped = "", True
            return buf[: i + len(s) if self.include else i], s
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
