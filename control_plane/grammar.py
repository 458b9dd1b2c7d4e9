"""Structured output: grammars compiled with llguidance, advanced token by token here.

The control plane owns the grammar work (the compute plane only applies masks): it
compiles a request's grammar at admission (compiled grammars are cached by spec), and
after each step it feeds every constrained request its sampled token and computes the
mask of the tokens its next step may sample. Masks of a step's requests are computed
together by llguidance's thread pool, which releases the GIL.

Why llguidance and not xgrammar: llguidance's wheel needs nothing else (no torch, no
transformers, no triton), which keeps the control plane torch-free, and its mask for a
JSON schema takes 10-90 µs on this 2-core machine (docs/api.md).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from tokenizers import Tokenizer

from control_plane import metrics
from control_plane.tokenizer import TokenizerWrapper
from hetero_common.cpus import side_lane
from hetero_common.grammar_errors import readable
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb

# JSON is generated compactly, as json.dumps writes it: whitespace the grammar allowed
# anywhere lets a small model spend its whole budget on newlines.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# The compiled-grammar cache is capped by an estimate of its matchers' bytes, as
# llguidance exposes no size: a base plus so much per byte of spec (the serialized
# StructuredOutput, the cache key), fitted to the malloc'd bytes of compiled specs that
# benchmarks/grammar_memory.py measures (docs/performance.md: it over-counts enums and
# alternations, under-counts deeply nested objects).
MATCHER_BASE_BYTES = 128 * 1024
MATCHER_BYTES_PER_SPEC_BYTE = 128
DEFAULT_CACHE_BYTES = 256 * 2**20


class GrammarError(ValueError):
    """The structured-output spec does not compile; the message names the problem."""


def grammar_text(spec: pb.StructuredOutput) -> str:
    """The llguidance grammar of a spec (not yet checked against a tokenizer)."""
    kind = spec.WhichOneof("kind")
    if kind == "json_schema":
        try:
            schema = json.loads(spec.json_schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError("json_schema is nested too deeply") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("json_schema must be a JSON object")
        return _from_schema(schema)
    if kind == "json_object":
        return _from_schema({"type": "object"})
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        if not spec.choice.choices:
            raise GrammarError("guided_choice must list at least one string")
        alts = " | ".join(json.dumps(c) for c in spec.choice.choices)
        return llg.LLMatcher.grammar_from_lark(f"start: {alts}")
    if kind == "grammar":
        text = spec.grammar
        if "::=" in text:  # GBNF / EBNF, as vLLM's guided_grammar and llama.cpp take it
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # the converter raises plain exceptions on bad input
                raise GrammarError(f"guided_grammar: {e}") from None
        return llg.LLMatcher.grammar_from_lark(text)
    raise GrammarError("structured output: no kind set")


def _from_schema(schema: dict[str, Any] | bool) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as e:
        raise GrammarError(f"json_schema: {readable(str(e))}") from None


def _build(spec: pb.StructuredOutput, lltok: llg.LLTokenizer) -> llg.LLMatcher:
    """A spec's matcher (any thread); GrammarError when it does not compile."""
    t0 = time.perf_counter()
    # (no validate_grammar first: it parses the grammar again and says the same)
    m = llg.LLMatcher(lltok, grammar_text(spec), log_level=0)
    if m.is_error():
        raise GrammarError(f"{spec.WhichOneof('kind')}: {readable(m.get_error())}")
    metrics.grammar_compile_seconds.observe(time.perf_counter() - t0)
    return m


def spec_key(spec: pb.StructuredOutput) -> bytes:
    return spec.SerializeToString(deterministic=True)


def matcher_bytes(key: bytes) -> int:
    """The estimated size of a compiled matcher of the spec with this key."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_SPEC_BYTE * len(key)


class _LLGuidanceVocab:
    """Our tokenizer as llguidance reads one: each token's bytes, the special ones (and
    only they) behind llguidance's 0xFF marker, and an encoder that reads special tokens'
    text as text. llguidance's own loader of a tokenizer.json also marks added tokens that
    look like tags special (Gemma's <b>, <h1>, ...) while its encoder still yields them for
    their text, and that encoder yields <end_of_turn> for the text "<end_of_turn>": a
    grammar whose text is forced through such a string ("<b>" as a regex) got a token its
    own mask allowed and its matcher refused, failing the request."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        special = tokenizer.all_special_ids
        self.eos_token_id = end_token(tokenizer)
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = list(tokenizer.bytes_table(skip_special_tokens=False))
        for i in special:
            self.tokens[i] = b"\xff" + (tokenizer.tok.id_to_token(i) or "").encode()
        self._tok = Tokenizer.from_str(tokenizer.tok.to_str())
        self._tok.encode_special_tokens = True

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance tries bytes first, then passes text
            raise TypeError("text only")
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def end_token(tokenizer: TokenizerWrapper) -> int:
    """The one EOS id llguidance's view of `tokenizer` knows (`Grammars` maps the attached
    model's EOS ids onto it)."""
    return (tokenizer.eos_token_ids or (0,))[0]


_views: weakref.WeakKeyDictionary[TokenizerWrapper, llg.LLTokenizer] = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def llguidance_view(tokenizer: TokenizerWrapper) -> llg.LLTokenizer:
    """llguidance's view of a tokenizer's vocabulary, built once per tokenizer (any
    thread; its Grammars, and the control engines OfflineLLM makes per generate, share
    it). Building it takes seconds and hundreds of MB for a large vocabulary (Gemma 3's;
    docs/performance.md), holding Python's GIL for most of it: the control plane builds
    it before serving (`--grammar-warmup`)."""
    with _views_lock:
        if (view := _views.get(tokenizer)) is None:
            view = llg.LLTokenizer(
                llg.TokenizerWrapper(_LLGuidanceVocab(tokenizer)),
                n_vocab=tokenizer.vocab_size,
                eos_token=[end_token(tokenizer)],
            )
            _views[tokenizer] = view
        return view


class Grammars:
    """Compiles specs for one tokenizer; a request gets a copy of the cached matcher.

    The cache keeps compiled matchers by spec, least recently used dropped first while
    their estimated bytes (`matcher_bytes`) exceed `cache_bytes`; the newest one is kept
    whatever its size (a request compiled off the loop finds it at admission)."""

    def __init__(self, tokenizer: TokenizerWrapper, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.cache_bytes = cache_bytes
        self._lltok: llg.LLTokenizer | None = None
        self._end = end_token(tokenizer)
        self._eos: tuple[int, ...] = (self._end,)
        self._size = tokenizer.vocab_size
        self._cache: OrderedDict[bytes, tuple[llg.LLMatcher, int]] = OrderedDict()
        self._cached_bytes = 0
        self._executor: llg.LLExecutor | None = None
        self._compiler = side_lane("grammar")
        self._compiling: dict[bytes, asyncio.Future[llg.LLMatcher]] = {}  # by spec key
        self._building: asyncio.Future[llg.LLTokenizer] | None = None  # the view, off the loop

    def warm(self) -> None:
        """Build llguidance's view of the vocabulary now (seconds for a large one, holding
        the GIL), so that no request pays it while others stream."""
        self._lltok = llguidance_view(self.tokenizer)

    def bind(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """The attached model's vocabulary and EOS ids (masks cover min(tokenizer, model)).
        The view and the compiled matchers stay: they know one EOS id (`end_token`), and
        masks and sampled tokens are mapped between it and these."""
        self._size = min(self.tokenizer.vocab_size, vocab_size or self.tokenizer.vocab_size)
        eos = tuple(sorted(i for i in eos_token_ids if 0 <= i < self.tokenizer.vocab_size))
        self._eos = eos or (self._end,)

    @property
    def lltok(self) -> llg.LLTokenizer:
        if self._lltok is None:
            self._lltok = llguidance_view(self.tokenizer)
        return self._lltok

    @property
    def warmed(self) -> bool:
        """Whether llguidance's view of the vocabulary is built."""
        return self._lltok is not None

    def compile(self, spec: pb.StructuredOutput) -> llg.LLMatcher:
        """The pristine matcher of a spec (cached); GrammarError when it does not compile."""
        key = spec_key(spec)
        if (m := self._cached(key)) is not None:
            return m
        return self._store(key, _build(spec, self.lltok))

    async def prepare(self, spec: pb.StructuredOutput) -> None:
        """Compile a spec into the cache off the event loop (GrammarError as `compile`),
        so that `start` finds it there: a big grammar takes seconds to compile (llguidance
        releases the GIL), and on the loop it would stall every stream of the plane. The
        compiling lane has half the CPUs: a burst of huge grammars never takes them all."""
        key = spec_key(spec)
        if self._cached(key) is not None:
            return
        compiling = self._compiling.get(key)
        if compiling is not None and compiling.get_loop() is not asyncio.get_running_loop():
            compiling = None  # (left by an event loop that ended: OfflineLLM's generate)
        if compiling is None:  # one compile for a burst
            compiling = asyncio.ensure_future(self._compile_off_loop(spec, key))
            self._compiling[key] = compiling
            compiling.add_done_callback(functools.partial(self._compiled, key))
        m = await asyncio.shield(compiling)  # (a waiter that goes away leaves it to others)
        # Other compiles may have evicted it since it was stored: put it back (newest, so
        # kept whatever its size). Callers admit the request without awaiting again, so
        # `start` finds it, and admission never compiles it again on the loop.
        if self._cached(key) is None:
            self._store(key, m)

    def _compiled(self, key: bytes, compiling: asyncio.Future[llg.LLMatcher]) -> None:
        if self._compiling.get(key) is compiling:
            del self._compiling[key]
        if not compiling.cancelled():
            compiling.exception()  # each waiter has it; none may be left to read it

    async def _compile_off_loop(self, spec: pb.StructuredOutput, key: bytes) -> llg.LLMatcher:
        lltok = await self._view()
        m = await asyncio.get_running_loop().run_in_executor(self._compiler, _build, spec, lltok)
        return self._store(key, m)

    async def _view(self) -> llg.LLTokenizer:
        """`lltok`, built off the loop when not warmed (--no-grammar-warmup), once however
        many compiles wait for it."""
        if self._lltok is not None:
            return self._lltok
        loop = asyncio.get_running_loop()
        building = self._building
        if building is None or building.get_loop() is not loop:
            build = functools.partial(llguidance_view, self.tokenizer)
            building = self._building = loop.run_in_executor(self._compiler, build)
        try:
            self._lltok = await asyncio.shield(building)
        except Exception as e:
            # The requests that waited fail; the next one builds it again (it stuck: every
            # later constrained request failed with this error).
            if self._building is building:
                self._building = None
            raise RuntimeError(
                f"structured output: building llguidance's view of the vocabulary failed: {e}"
            ) from e
        return self._lltok

    def _cached(self, key: bytes) -> llg.LLMatcher | None:
        if (entry := self._cache.get(key)) is not None and not entry[0].is_error():
            self._cache.move_to_end(key)
            return entry[0]  # (compiled again once a copy failed: copies share the error)
        return None

    def _store(self, key: bytes, m: llg.LLMatcher) -> llg.LLMatcher:
        self._drop(key)
        size = matcher_bytes(key)
        self._cache[key] = (m, size)
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, (_, dropped) = self._cache.popitem(last=False)
            self._cached_bytes -= dropped
            metrics.grammar_cache_evictions.inc()
        metrics.grammar_cache_bytes.set(self._cached_bytes)
        return m

    def _drop(self, key: bytes) -> None:
        if (entry := self._cache.pop(key, None)) is not None:
            self._cached_bytes -= entry[1]
            metrics.grammar_cache_bytes.set(self._cached_bytes)

    @property
    def cached_bytes(self) -> int:
        """The estimated bytes of the cached matchers (`matcher_bytes` each)."""
        return self._cached_bytes

    def cached_keys(self) -> list[bytes]:
        """The cached specs' keys, least recently used first."""
        return list(self._cache)

    def _token(self, token: int) -> int:
        """A sampled token as the matchers know it: any EOS id is their one."""
        return self._end if token in self._eos else token

    def start(self, spec: pb.StructuredOutput, output: Sequence[int] = ()) -> GrammarState:
        """A request's own matcher, with the mask of its first token; `output`: tokens it
        already generated (a resumed request), consumed first (GrammarError if the
        grammar refuses one or is complete after them)."""
        kind = spec.WhichOneof("kind") or ""
        state = GrammarState(self.compile(spec).deep_copy(), self._size, spec_key(spec), kind)
        for token in output:
            if not state.matcher.consume_token(self._token(token)):
                raise GrammarError(f"the resumed output's token {token} breaks the grammar")
        if output and state.matcher.is_stopped():
            raise GrammarError("the resumed output already completes the grammar")
        self.advance([(state, None)])
        if state.error:
            raise GrammarError(f"{kind}: {state.error}")
        return state

    def advance(self, pairs: list[tuple[GrammarState, int | None]]) -> None:
        """Feed each state its sampled token (None: none, at the start) and compute the
        masks of their next tokens, in parallel (llguidance's pool, GIL released)."""
        if not pairs:
            return
        t0 = time.perf_counter()
        live: list[GrammarState] = []
        for st, token in pairs:
            if token is not None and not st.matcher.consume_token(self._token(token)):
                if not self._failed(st):
                    st.dead = True  # a token the mask did not allow: cannot happen unless forced
                continue
            if st.matcher.is_stopped():
                st.complete = True
                continue
            live.append(st)
        if live:
            if self._executor is None:
                self._executor = llg.LLExecutor()
            words = (self.tokenizer.vocab_size + 31) // 32
            masks = np.zeros((len(live), words), dtype=np.int32)
            self._executor.unsafe_compute_mask_ptr(
                [(st.matcher, i) for i, st in enumerate(live)],
                masks.ctypes.data,
                words * 4,
                len(live),
            )
            if self._eos != (self._end,):
                self._map_eos(masks)
            for st, row in zip(live, masks, strict=True):
                if not self._failed(st):
                    st.set_mask(row)
        metrics.grammar_mask_seconds.observe(time.perf_counter() - t0)

    def _map_eos(self, masks: np.ndarray) -> None:
        """Where the matchers allow their EOS id, allow the attached model's EOS ids
        instead (llguidance treats each of its EOS ids alike)."""
        bits = masks.view(np.uint32)
        word, bit = divmod(self._end, 32)
        ends = (bits[:, word] >> np.uint32(bit)) & np.uint32(1)
        bits[:, word] &= ~np.uint32(1 << bit)
        for e in self._eos:
            word, bit = divmod(e, 32)
            bits[:, word] |= ends << np.uint32(bit)

    def _failed(self, st: GrammarState) -> bool:
        """Whether the matcher hit one of llguidance's limits (a lexer or parser too large,
        a grammar that matches nothing): its mask then allows only EOS, which would end
        the request as if the grammar were satisfied. The state records the error; the
        cached matcher of its spec is dropped, as its copies share (and carry) the error."""
        if not st.matcher.is_error():
            return False
        error = st.matcher.get_error().split("\n", 1)[0]
        if error == "NoExtensionBias":  # (llguidance's name for it)
            error = "no text can match the grammar"
        st.error = error
        st.dead = True
        self._drop(st.key)
        return True


class GrammarState:
    """One request's matcher and the mask of its next token (without request_id)."""

    __slots__ = ("complete", "dead", "error", "key", "kind", "mask", "matcher", "size")

    def __init__(self, matcher: llg.LLMatcher, size: int, key: bytes, kind: str) -> None:
        self.matcher = matcher
        self.size = size
        self.key, self.kind = key, kind  # its spec's cache key and kind (json_schema, ...)
        self.mask: cpb.TokenMask | None = None
        self.complete = False  # the grammar is satisfied and takes no more tokens
        self.dead = False  # no token can continue it
        self.error = ""  # the matcher failed (dead too): llguidance's message

    def set_mask(self, words: np.ndarray) -> None:
        self.mask = encode_mask(words, self.size)
        if self.mask is None:
            self.dead = True

    def copy(self) -> GrammarState:
        """For a request's other choices (n > 1)."""
        other = GrammarState(self.matcher.deep_copy(), self.size, self.key, self.kind)
        other.mask, other.complete, other.dead = self.mask, self.complete, self.dead
        other.error = self.error
        return other


def encode_mask(words: np.ndarray, size: int) -> cpb.TokenMask | None:
    """llguidance's bitmask (int32 words, token i = bit i % 32 of word i // 32) in the
    smallest TokenMask form; None when it allows nothing."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:size]
    allowed = int(bits.sum())
    if allowed == 0:
        return None
    # A varint id costs ~3 bytes; the bitmask size / 8.
    if 3 * allowed <= size // 8:
        return cpb.TokenMask(size=size, ids=np.flatnonzero(bits).tolist())
    if 3 * (size - allowed) <= size // 8:
        return cpb.TokenMask(size=size, ids=np.flatnonzero(bits == 0).tolist(), invert=True)
    return cpb.TokenMask(size=size, bitmask=np.packbits(bits, bitorder="little").tobytes())
