"""Structured output in the control plane: grammars compiled with llguidance over the real
bundled tokenizer, masks advanced token by token, and the wire forms of a mask."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane import grammar as grammar_module
from control_plane.grammar import GrammarError, Grammars, GrammarState, encode_mask
from control_plane.tokenizer import TokenizerWrapper, load_tokenizer
from hetero_common.model_path import GEMMA3_DISTRIBUTION, gemma3_gguf
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb
from tests.conftest import installed

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> TokenizerWrapper:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def grammars(tok: TokenizerWrapper) -> Grammars:
    g = Grammars(tok)
    g.bind(tok.vocab_size, frozenset(tok.eos_token_ids))
    return g


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The regex of each spec compiled from now on (grammar._build counted)."""
    built: list[str] = []
    build = grammar_module._build

    def counted(spec: pb.StructuredOutput, lltok: object) -> object:
        built.append(spec.regex)
        return build(spec, lltok)  # type: ignore[arg-type]

    monkeypatch.setattr(grammar_module, "_build", counted)
    return built


def _allowed(m: cpb.TokenMask) -> list[int]:
    """The allowed ids of a wire mask, sorted (numpy: for a whole vocabulary per step)."""
    if m.bitmask:
        bits = np.unpackbits(np.frombuffer(m.bitmask, np.uint8), bitorder="little")
        return np.flatnonzero(bits[: m.size]).tolist()
    if m.invert:
        return np.setdiff1d(np.arange(m.size), np.array(m.ids, dtype=np.int64)).tolist()
    return sorted(m.ids)


def allowed_set(m: cpb.TokenMask) -> set[int]:
    """Decode a wire mask independently of the encoder (plain Python over the bytes)."""
    if m.bitmask:
        return {i for i in range(m.size) if m.bitmask[i // 8] >> (i % 8) & 1}
    if m.invert:
        return set(range(m.size)) - set(m.ids)
    return set(m.ids)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_encode_mask_round_trips_in_the_smallest_form(data: st.DataObject) -> None:
    size = data.draw(st.integers(1, 700))
    density = data.draw(st.sampled_from([0.0, 0.001, 0.02, 0.5, 0.98, 0.999, 1.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    allowed = rng.random(size) < density
    words = np.zeros((size + 31) // 32, dtype=np.int64)
    for i in np.flatnonzero(allowed):
        words[i // 32] |= 1 << (i % 32)
    m = encode_mask(words.astype(np.uint32).view(np.int32), size)
    if not allowed.any():
        assert m is None
        return
    assert m is not None and m.size == size
    assert allowed_set(m) == set(np.flatnonzero(allowed).tolist())
    wire = len(m.SerializeToString())
    # Never much bigger than the bitmask alone, whichever form it took.
    assert wire <= (size + 7) // 8 + 16


def _walk(grammars: Grammars, spec: pb.StructuredOutput, ids: list[int]) -> GrammarState:
    """Advance a fresh state token by token, checking each token against the mask."""
    state = grammars.start(spec)
    for t in ids:
        assert state.mask is not None and t in allowed_set(state.mask), t
        grammars.advance([(state, t)])
    return state


def _follow(grammars: Grammars, spec: pb.StructuredOutput) -> tuple[GrammarState, list[int]]:
    """Sample the lowest id each mask allows until the grammar is complete or dead."""
    state, out = grammars.start(spec), []
    while not (state.complete or state.dead) and len(out) < 32:
        assert state.mask is not None
        out.append(min(allowed_set(state.mask)))
        grammars.advance([(state, out[-1])])
    return state, out


@pytest.mark.parametrize("regex", [r"<\|im_end\|>", r"a<\|im_start\|>b", "<b>"])
def test_text_spelling_a_special_token_is_generated_as_text(
    grammars: Grammars, tok: TokenizerWrapper, regex: str
) -> None:
    """A grammar that forces the text of a special token ("<|im_end|>" as a regex) is
    generated as that text. llguidance's tokenizer.json loader tokenised the forced text
    into the special token, which its own matcher then refused: the request failed with
    'token "\\xff[2]" doesn't satisfy the grammar'."""
    state, out = _follow(grammars, pb.StructuredOutput(regex=regex))
    assert state.complete and not state.dead, state.error
    assert tok.decode(out) == regex.replace("\\", "")
    assert not set(out) & tok.all_special_ids


@pytest.mark.slow
@pytest.mark.skipif(not installed(GEMMA3_DISTRIBUTION), reason="needs the Gemma 3 packages")
def test_gemma3_tag_tokens_and_special_text_in_a_forced_grammar() -> None:
    """Gemma 3's vocabulary has HTML tags as user-defined tokens (<b> = 200, <h1> = 184):
    text, not special, which llguidance's loader marks special by their look while its
    encoder still gives them for their text; a regex "<b>" failed on its first token."""
    tok = load_tokenizer(gemma3_gguf())
    grammars = Grammars(tok)
    grammars.bind(tok.vocab_size, frozenset(tok.eos_token_ids))
    for regex in ("<b>", "x<h1>y", "<end_of_turn>", "<bos>"):
        state, out = _follow(grammars, pb.StructuredOutput(regex=regex))
        assert state.complete and not state.dead, (regex, state.error)
        assert tok.decode(out) == regex and not set(out) & tok.all_special_ids, regex
    # The compute plane's EOS ids add <end_of_turn> (106) to the file's <eos> (1): where
    # the grammar ends both are allowed, and either ends it.
    grammars.bind(tok.vocab_size, frozenset({1, 106}))
    x = tok.encode("x", add_special_tokens=False)
    for end in (1, 106):
        state = _walk(grammars, pb.StructuredOutput(regex="<b>x*"), tok.encode("<b>", False))
        assert state.mask is not None and {1, 106, *x} <= set(_allowed(state.mask))
        assert not {2, 105} & set(_allowed(state.mask))  # (<bos>, <start_of_turn>)
        grammars.advance([(state, end)])
        assert state.complete and not state.dead


def test_valid_json_instance_is_allowed_token_by_token(
    grammars: Grammars, tok: TokenizerWrapper
) -> None:
    spec = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    text = json.dumps({"name": "Bob", "age": 42, "tags": ["a", "b"]})
    state = _walk(grammars, spec, tok.encode(text, add_special_tokens=False))
    assert state.complete and not state.dead


def test_invalid_json_is_refused_where_it_deviates(
    grammars: Grammars, tok: TokenizerWrapper
) -> None:
    spec = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    good = tok.encode('{"name": "Bob", "age": ', add_special_tokens=False)
    state = _walk(grammars, spec, good)
    assert state.mask is not None
    allowed = allowed_set(state.mask)
    for text in ('"42"', "-1", "x"):  # a string, a negative age, garbage
        assert tok.encode(text, add_special_tokens=False)[0] not in allowed, text
    assert tok.encode("4", add_special_tokens=False)[0] in allowed


def test_json_is_compact_so_whitespace_cannot_run_on(
    grammars: Grammars, tok: TokenizerWrapper
) -> None:
    state = grammars.start(pb.StructuredOutput(json_object=True))
    assert state.mask is not None
    allowed = allowed_set(state.mask)
    assert tok.encode("{", add_special_tokens=False)[0] in allowed
    assert not any(tok.encode(w, add_special_tokens=False)[0] in allowed for w in (" ", "\n"))


def test_choice_and_regex(grammars: Grammars, tok: TokenizerWrapper) -> None:
    spec = pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no way"]))
    state = _walk(grammars, spec, tok.encode("no way", add_special_tokens=False))
    assert state.complete
    regex = pb.StructuredOutput(regex=r"\d{3}-\d{4}")
    state = _walk(grammars, regex, tok.encode("555-1234", add_special_tokens=False))
    assert state.complete
    state = grammars.start(regex)
    assert state.mask is not None
    assert tok.encode("a", add_special_tokens=False)[0] not in allowed_set(state.mask)


def test_gbnf_and_lark_grammars(grammars: Grammars, tok: TokenizerWrapper) -> None:
    gbnf = pb.StructuredOutput(grammar='root ::= "SELECT " [a-z]+ " FROM t"')
    state = _walk(grammars, gbnf, tok.encode("SELECT id FROM t", add_special_tokens=False))
    assert state.complete
    lark = pb.StructuredOutput(grammar='start: "x" NUM\nNUM: /[0-9]+/')
    state = _walk(grammars, lark, tok.encode("x12", add_special_tokens=False))
    assert not state.dead


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (pb.StructuredOutput(json_schema='{"type": "objectx"}'), "objectx"),
        (pb.StructuredOutput(json_schema="{not json"), "not valid JSON"),
        (pb.StructuredOutput(json_schema="[1]"), "must be a JSON object"),
        (pb.StructuredOutput(regex="(("), "regex"),
        (pb.StructuredOutput(choice=pb.ChoiceList()), "at least one"),
        (pb.StructuredOutput(grammar="start: undefined_rule"), "undefined_rule"),
        (pb.StructuredOutput(), "no kind"),
    ],
)
def test_bad_specs_name_the_problem(
    grammars: Grammars, spec: pb.StructuredOutput, needle: str
) -> None:
    with pytest.raises(GrammarError, match=needle):
        grammars.compile(spec)


@pytest.mark.parametrize(
    "spec",
    [
        pb.StructuredOutput(json_schema='{"items": ' * 140 + "{}" + "}" * 140),
        pb.StructuredOutput(grammar="start: %json " + '{"items": ' * 140 + "{}" + "}" * 140),
    ],
    ids=["json_schema", "lark %json"],
)
def test_grammar_compiler_errors_quote_no_position_in_json_we_wrote(
    grammars: Grammars, spec: pb.StructuredOutput
) -> None:
    """Deeper than serde_json reads (128 levels; Python reads it): its 'recursion limit
    exceeded at line 1 column 2220' pointed into the schema as serialised again, not as
    the client sent it."""
    with pytest.raises(GrammarError) as e:
        grammars.compile(spec)
    assert "nested too deeply" in str(e.value) and "column" not in str(e.value), e.value


def test_compiled_grammars_are_cached_and_states_independent(
    grammars: Grammars, tok: TokenizerWrapper
) -> None:
    spec = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    assert grammars.compile(spec) is grammars.compile(spec)
    a, b = grammars.start(spec), grammars.start(spec)
    grammars.advance([(a, tok.encode("{", add_special_tokens=False)[0])])
    assert a.mask is not None and b.mask is not None
    assert allowed_set(a.mask) != allowed_set(b.mask)
    c = a.copy()  # another choice of the same request
    assert c.mask is not None and allowed_set(c.mask) == allowed_set(a.mask)


def test_a_token_the_mask_refused_makes_the_state_dead(
    grammars: Grammars, tok: TokenizerWrapper
) -> None:
    state = grammars.start(pb.StructuredOutput(regex="[0-9]+"))
    grammars.advance([(state, tok.encode("a", add_special_tokens=False)[0])])
    assert state.dead


def test_a_matcher_past_llguidance_limits_fails_each_time_not_as_a_stop(
    grammars: Grammars, tok: TokenizerWrapper
) -> None:
    """Past its limits llguidance's matcher fails and then allows only EOS. The state says
    so (error, dead), and the next request of the same spec fails the same way rather
    than starting from the failed matcher its copies share (which allowed only EOS)."""
    spec = pb.StructuredOutput(regex="a{1000000}")
    for _ in range(2):
        state = grammars.start(spec)
        assert not state.error and state.mask is not None
        (a_run,) = allowed_set(state.mask)  # the vocabulary's longest run of a's
        assert set(tok.decode([a_run])) == {"a"}
        grammars.advance([(state, a_run)])
        assert state.dead and "too many expressions" in state.error
    with pytest.raises(GrammarError, match="grammar: no text can match"):
        grammars.start(pb.StructuredOutput(grammar="root ::= root"))
    with pytest.raises(GrammarError, match="nested too deeply"):
        grammars.compile(pb.StructuredOutput(json_schema='{"items":' * 5000 + "{}" + "}" * 5000))


def test_prepare_compiles_off_the_event_loop_once(
    tok: TokenizerWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big grammar compiles for seconds: `prepare` builds it in its lane, not on the event
    loop (every stream would stall), and `start` then takes it from the cache; a spec that
    does not compile is the same GrammarError there as in `start`; a fresh Grammars
    builds its tokenizer view off the loop too, once for the compiles that wait for it."""
    built: list[str] = []
    build = grammar_module._build

    def recorded(spec: pb.StructuredOutput, lltok: object) -> object:
        built.append(threading.current_thread().name)
        return build(spec, lltok)  # type: ignore[arg-type]

    monkeypatch.setattr(grammar_module, "_build", recorded)
    view = grammar_module.llguidance_view

    def recorded_view(tokenizer: TokenizerWrapper) -> object:
        built.append("lltok " + threading.current_thread().name)
        return view(tokenizer)

    monkeypatch.setattr(grammar_module, "llguidance_view", recorded_view)
    grammars = Grammars(tok)  # not warmed (--no-grammar-warmup)
    spec = pb.StructuredOutput(regex="(yes|no) [0-9]{3}")

    async def go() -> str:
        # Different specs at once on a fresh Grammars: one tokenizer view, each kept.
        first = [spec, pb.StructuredOutput(regex="a+"), pb.StructuredOutput(regex="b+")]
        await asyncio.gather(*map(grammars.prepare, first))
        assert len(grammars._cache) == 3
        await grammars.prepare(spec)  # cached: not built again
        with pytest.raises(GrammarError, match=r"^regex: "):
            await grammars.prepare(pb.StructuredOutput(regex="(unclosed"))
        # A burst of one spec compiles it once; each request gets its error.
        burst = pb.StructuredOutput(choice=pb.ChoiceList(choices=["left", "right"]))
        await asyncio.gather(*(grammars.prepare(burst) for _ in range(5)))
        bad = pb.StructuredOutput(regex="[unclosed")
        errors = await asyncio.gather(
            *(grammars.prepare(bad) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(e, GrammarError) for e in errors), errors
        return threading.current_thread().name

    loop_thread = asyncio.run(go())
    state = grammars.start(spec)
    assert len(built) == 7 and built[0].startswith("lltok grammar"), built
    assert all(t.startswith("grammar") for t in built[1:]) and loop_thread not in built
    assert state.mask is not None and not state.dead


def _regex_key_len(n: int) -> int:
    """The serialized StructuredOutput(regex=<n bytes>): field 3's tag, the length as a
    varint, the bytes (protobuf's wire format)."""
    return 1 + (1 if n < 128 else 2 if n < 16384 else 3) + n


def _estimate(n: int) -> int:
    # The documented estimate (docs/configuration.md --grammar-cache-mb): 128 KiB + 128 B
    # per byte of spec.
    return 128 * 1024 + 128 * _regex_key_len(n)


def test_the_cache_is_capped_by_estimated_bytes_least_recently_used_first(
    tok: TokenizerWrapper,
) -> None:
    """Matchers are dropped, least recently used first, while their estimated bytes exceed
    the cap; the newest is kept even when it alone exceeds it (its request, compiled off
    the loop, finds it at admission). The gauge follows, the evictions count."""
    from prometheus_client import REGISTRY

    def evictions() -> float:
        return REGISTRY.get_sample_value("hetero_structured_output_cache_evictions_total") or 0

    def gauge() -> float | None:
        return REGISTRY.get_sample_value("hetero_structured_output_cache_bytes")

    specs = {n: pb.StructuredOutput(regex="x" * n) for n in (100, 1000, 2000, 20000)}
    key = {n: s.SerializeToString() for n, s in specs.items()}
    assert {n: len(k) for n, k in key.items()} == {100: 102, 1000: 1003, 2000: 2003, 20000: 20004}
    cap = _estimate(100) + _estimate(1000) + _estimate(2000) - 1
    grammars = Grammars(tok, cache_bytes=cap)
    grammars.bind(tok.vocab_size, frozenset(tok.eos_token_ids))
    before = evictions()

    def cached() -> tuple[list[int], int]:
        by_key = {k: n for n, k in key.items()}
        return [by_key[k] for k in grammars.cached_keys()], grammars.cached_bytes

    grammars.compile(specs[100])
    grammars.compile(specs[1000])
    assert cached() == ([100, 1000], 131072 + 13056 + 131072 + 128384)
    grammars.compile(specs[2000])  # one byte over: the oldest goes
    assert cached() == ([1000, 2000], 259456 + 387456)
    assert evictions() - before == 1 and gauge() == 259456 + 387456
    grammars.compile(specs[100])  # compiled again; 1000 is now the least recently used
    assert cached() == ([2000, 100], 387456 + 144128)
    grammars.start(specs[2000])  # a hit makes it the most recent
    grammars.compile(specs[1000])
    assert cached() == ([2000, 1000], 387456 + 259456)
    assert evictions() - before == 3
    grammars.compile(specs[20000])  # bigger than the cap alone: kept, the rest dropped
    assert cached() == ([20000], _estimate(20000)) and _estimate(20000) > cap
    assert grammars.start(specs[20000]).mask is not None  # (served from the cache)
    grammars.compile(specs[100])
    assert cached() == ([100], 144128)
    assert evictions() - before == 6 and gauge() == 144128


def test_a_failed_matcher_leaves_the_cache_and_its_bytes(tok: TokenizerWrapper) -> None:
    grammars = Grammars(tok)
    grammars.bind(tok.vocab_size, frozenset(tok.eos_token_ids))
    ok, huge = pb.StructuredOutput(regex="ok"), pb.StructuredOutput(regex="a{1000000}")
    grammars.compile(ok)
    state = grammars.start(huge)
    assert grammars.cached_bytes == _estimate(2) + _estimate(len("a{1000000}"))
    (a_run,) = allowed_set(state.mask)  # type: ignore[arg-type]
    grammars.advance([(state, a_run)])
    assert state.dead and state.error
    assert grammars.cached_keys() == [ok.SerializeToString()]
    assert grammars.cached_bytes == _estimate(2)


def test_a_grammar_evicted_while_its_request_waited_is_not_compiled_again(
    tok: TokenizerWrapper, compiles: list[str]
) -> None:
    """A request's grammar compiled off the loop can be evicted (other compiles fill the
    cache) before the request resumes to be admitted: admission then compiled it again on
    the event loop, stalling every stream. `prepare` puts it back, so admitting the
    request compiles nothing (counted compiles: one per spec)."""
    g = Grammars(tok, cache_bytes=1)  # (room for the newest only)
    g.bind(tok.vocab_size, frozenset(tok.eos_token_ids))
    a, b = pb.StructuredOutput(regex="[0-9]{4}"), pb.StructuredOutput(regex="[a-z]{4}")

    async def request() -> None:
        waiting = asyncio.ensure_future(g.prepare(a))
        await asyncio.sleep(0)  # (its compile is under way)
        # Another compile stores its grammar the moment a's is done, before a's request
        # resumes: a is evicted.
        g._compiling[grammar_module.spec_key(a)].add_done_callback(lambda _: g.compile(b))
        await waiting
        g.start(a)  # admission, with no await in between (as the server admits)

    asyncio.run(request())
    assert compiles == [a.regex, b.regex]
    assert g.cached_keys() == [a.SerializeToString()]


def test_warm_up_builds_the_vocabulary_view_before_any_request(
    tok: TokenizerWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --grammar-warmup (the default) the engine builds llguidance's view of the
    vocabulary before serving: the first constrained request compiles its grammar with it
    and builds none. Without it, nothing is built until that request."""
    from control_plane.config import ControlConfig
    from control_plane.engine import ControlEngine

    calls: list[str] = []
    view = grammar_module.llguidance_view

    def recorded(tokenizer: TokenizerWrapper) -> object:
        calls.append(threading.current_thread().name)
        return view(tokenizer)

    monkeypatch.setattr(grammar_module, "llguidance_view", recorded)
    lazy = ControlEngine(ControlConfig(metrics_port=-1, grammar_warmup=False), tok)
    lazy.warm_up()
    assert not lazy.grammars.warmed and calls == []

    engine = ControlEngine(ControlConfig(metrics_port=-1), tok)
    assert not engine.grammars.warmed
    engine.warm_up()
    assert engine.grammars.warmed and len(calls) == 1
    params = pb.GenerationParams(structured=pb.StructuredOutput(regex="[0-9]{3}"))
    asyncio.run(engine.prepare(params))
    assert len(calls) == 1  # the request built no view
    assert engine.grammars.start(params.structured).mask is not None
    # Engines of one tokenizer share the view (OfflineLLM makes one per generate).
    again = ControlEngine(ControlConfig(metrics_port=-1), tok)
    again.warm_up()
    assert again.grammars.lltok is engine.grammars.lltok


def test_the_model_s_eos_ids_are_mapped_onto_the_view_s_one(
    grammars: Grammars, tok: TokenizerWrapper
) -> None:
    """The view knows one EOS id; a model with more (Gemma 3's <eos> and <end_of_turn>)
    gets each where the grammar may end, and any of them ends it: the same masks and
    stops as llguidance's own matcher told every EOS id (the reference), token by token
    along random walks. Binding other EOS ids rebuilds nothing and keeps the cache."""
    import random

    import llguidance as llg

    (end,) = tok.eos_token_ids
    other = tok.tok.token_to_id("<|endoftext|>")
    assert other is not None and other != end
    view, spec = grammars.lltok, pb.StructuredOutput(regex="a|ab|[0-9]*")
    grammars.compile(spec)
    keys = grammars.cached_keys()
    grammars.bind(tok.vocab_size, frozenset({end, other}))
    assert grammars.lltok is view and grammars.cached_keys() == keys
    reference_view = llg.LLTokenizer(
        llg.TokenizerWrapper(grammar_module._LLGuidanceVocab(tok)),
        n_vocab=tok.vocab_size,
        eos_token=[end, other],
    )
    words = (tok.vocab_size + 31) // 32
    rng = random.Random(0)
    specs = [spec, pb.StructuredOutput(json_object=True), pb.StructuredOutput(regex="x|xy")]
    ends = 0
    try:
        for s in specs:
            for _ in range(8):
                ref = llg.LLMatcher(reference_view, grammar_module.grammar_text(s))
                state = grammars.start(s)
                for _ in range(12):  # (a random JSON object runs on: its prefix will do)
                    row = np.zeros(words, dtype=np.int32)
                    ref.unsafe_compute_mask_ptr(row.ctypes.data, words * 4)
                    want = np.flatnonzero(
                        np.unpackbits(row.view(np.uint8), bitorder="little")[: tok.vocab_size]
                    )
                    assert state.mask is not None
                    assert _allowed(state.mask) == want.tolist()
                    token = int(rng.choice(want))
                    ends += token in (end, other)
                    assert ref.consume_token(token)
                    grammars.advance([(state, token)])
                    assert state.complete == ref.is_stopped() and not state.dead
                    if state.complete:
                        break
        assert ends >= 4  # (both ids ended walks)
    finally:
        grammars.bind(tok.vocab_size, frozenset(tok.eos_token_ids))


def test_offline_llm_builds_the_vocabulary_view_once_for_all_its_generates(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str]
) -> None:
    """OfflineLLM makes a control engine per generate: they share the view of its
    tokenizer (each built its own before, seconds a generate with Gemma 3's)."""
    import re

    from hetero_infer.offline import OfflineLLM

    built: list[int] = []
    vocab = grammar_module._LLGuidanceVocab

    def counted(tokenizer: TokenizerWrapper) -> object:
        built.append(tokenizer.vocab_size)
        return vocab(tokenizer)

    monkeypatch.setattr(grammar_module, "_LLGuidanceVocab", counted)
    regex = "[0-9]{2}-[a-z]{3}"
    params = pb.GenerationParams(
        max_tokens=20, temperature=0.0, structured=pb.StructuredOutput(regex=regex)
    )
    with OfflineLLM(str(smollm2_path)) as llm:
        for _ in range(2):
            (out,) = llm.generate("A code:", params)
            assert re.fullmatch(regex, out.texts[0]), out.texts
    assert built == [49152]
    # One grammar cache for the OfflineLLM's life: the second generate's schema was
    # compiled by the first (each generate started with an empty cache).
    assert compiles == [regex]


def test_a_failed_lazy_vocabulary_view_is_built_again_by_the_next_request(
    tok: TokenizerWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --no-grammar-warmup the first constrained request builds llguidance's view.
    When that build fails, the requests that waited for it get an error naming
    structured output, and the next request builds it again: the failed build stuck,
    and every later constrained request failed with it."""
    from control_plane.config import ControlConfig
    from control_plane.engine import ControlEngine

    view = grammar_module.llguidance_view
    calls: list[int] = []

    def flaky(tokenizer: TokenizerWrapper) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("out of memory (a stand-in failure)")
        return view(tokenizer)

    monkeypatch.setattr(grammar_module, "llguidance_view", flaky)
    engine = ControlEngine(ControlConfig(metrics_port=-1, grammar_warmup=False), tok)
    engine.warm_up()
    params = pb.GenerationParams(structured=pb.StructuredOutput(regex="[0-9]{3}"))

    async def two_requests() -> str:
        with pytest.raises(RuntimeError) as failed:
            await asyncio.gather(engine.prepare(params), engine.prepare(params))
        await engine.prepare(params)
        return str(failed.value)

    message = asyncio.run(two_requests())
    assert "structured output" in message and "out of memory" in message, message
    assert len(calls) == 2  # (the two that waited shared the first build)
    assert engine.grammars.warmed
    assert engine.grammars.start(params.structured).mask is not None
