"""Structured output and tool calling through `hetero-infer serve` (three processes),
driven by the official `openai` client; every answer is checked with `jsonschema`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from benchmarks.json_schemas import SCHEMAS, TOPICS, prompt
from hetero_infer.local import free_port, stop_process, wait_http_ready

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hetero_infer.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--compute-metrics-port", "0", "--control-metrics-port", "0"])
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/ready", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _parallel(fn: Callable[[Any], Any], jobs: list[Any], workers: int = 16) -> list[Any]:
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, jobs))


def _sampling(i: int, sampled: bool) -> dict[str, Any]:
    return {"temperature": 0.8, "seed": 1000 + i} if sampled else {"temperature": 0}


def test_thirty_json_schemas_greedy_and_sampled(client: openai.OpenAI, model: str) -> None:
    """30 schemas x 3 prompts x (greedy, sampled): each answer parses and validates."""

    def run(job: tuple[int, str, dict[str, Any], str, bool]) -> tuple[str, str, str]:
        i, what, schema, topic, sampled = job
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt(what, schema, topic)}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
            max_tokens=400,
            **_sampling(i, sampled),
        )
        c = r.choices[0]
        return what, c.finish_reason, c.message.content or ""

    jobs = [
        (k, what, schema, topic, sampled)
        for k, ((what, schema), topic, sampled) in enumerate(
            (s, t, b) for s in SCHEMAS for t in TOPICS for b in (False, True)
        )
    ]
    assert len(jobs) == 180
    schemas = dict(SCHEMAS)
    for what, reason, text in _parallel(run, jobs):
        assert reason == "stop", (what, text)
        jsonschema.validate(json.loads(text), schemas[what])


def test_streamed_json_equals_the_whole_answer(client: openai.OpenAI, model: str) -> None:
    what, schema = SCHEMAS[7]  # nested object
    kw: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt(what, schema, TOPICS[0])}],
        "extra_body": {"guided_json": schema},
        "temperature": 0,
        "max_tokens": 300,
    }
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    jsonschema.validate(json.loads(whole or ""), schema)


REGEXES = [
    r"\d{3}-\d{3}-\d{4}",
    r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}",
    r"(yes|no), because [a-z ]{5,30}\.",
]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin", "Madrid"]]


def test_guided_regex_and_choice(client: openai.OpenAI, model: str) -> None:
    prompts = ["My phone number is", "The author of the book is", "Is water wet? Answer:"]

    def regex_job(job: tuple[int, str, bool]) -> None:
        i, pattern, sampled = job
        r = client.completions.create(
            model=model,
            prompt=prompts[i % 3],
            extra_body={"guided_regex": pattern},
            max_tokens=60,
            **_sampling(i, sampled),
        )
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, text), text

    def choice_job(job: tuple[int, list[str], bool]) -> None:
        i, choices, sampled = job
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Pick one of {choices} for: sunny day"}],
            extra_body={"guided_choice": choices},
            max_tokens=20,
            **_sampling(i, sampled),
        )
        assert r.choices[0].message.content in choices

    _parallel(regex_job, [(i, p, s) for i, p in enumerate(REGEXES * 3) for s in (False, True)])
    _parallel(choice_job, [(i, c, s) for i, c in enumerate(CHOICES * 3) for s in (False, True)])


def _strict_json(line: str) -> Any:
    """JSON as RFC 8259 has it: -Infinity or NaN (which Python's json writes and reads)
    is not JSON to a JavaScript or Go client."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_logprobs_of_a_constrained_answer_name_only_allowed_tokens(
    client: openai.OpenAI, url: str, model: str
) -> None:
    """Logprobs are those of the masked distribution: a token the grammar forbids is not
    among the top ones (it has no probability), so a request for more alternatives than
    the grammar allows gets fewer, all finite, streamed and not."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Is the sky blue?"}],
        "guided_choice": ["yes", "no"],
        "logprobs": True,
        "top_logprobs": 10,
        "max_tokens": 3,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content) in ("yes", "no")
    for t in content:
        assert 1 <= len(t["top_logprobs"]) < 10  # "yes", "no", their prefixes
        assert t["token"] == t["top_logprobs"][0]["token"]  # greedy: the most likely
    lines = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        lines = [x[6:] for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    streamed = [t for x in lines for c in _strict_json(x)["choices"] if c.get("logprobs") for t in c["logprobs"]["content"]]  # fmt: skip

    # (the same tokens; a prefix-cache hit may move the logprobs in the last digits)
    def tops(ts: list[dict[str, Any]]) -> list[list[str]]:
        return [[t["token"]] + [x["token"] for x in t["top_logprobs"]] for t in ts]

    assert tops(streamed) == tops(content)
    assert [t["logprob"] for t in streamed] == pytest.approx(
        [t["logprob"] for t in content], abs=1e-3
    )
    completion = client.completions.create(
        model=model, prompt="Is the sky blue? Answer:", max_tokens=3, temperature=0,
        logprobs=10, extra_body={"guided_regex": "(yes|no)"},
    )  # fmt: skip
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    assert all(1 <= len(top) < 10 for top in lp.top_logprobs)


def test_json_object_and_grammar(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=300,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    sql = 'root ::= "SELECT " col " FROM users WHERE id = " [0-9]+ \ncol ::= "name" | "email" | "*"'
    r2 = client.completions.create(
        model=model,
        prompt="A SQL query that reads a user's email:",
        extra_body={"guided_grammar": sql},
        temperature=0,
        max_tokens=40,
    )
    assert re.fullmatch(r"SELECT (name|email|\*) FROM users WHERE id = [0-9]+", r2.choices[0].text)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Convert an amount between currencies",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                    "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                },
                "required": ["amount", "from", "to"],
                "additionalProperties": False,
            },
        },
    },
]
QUESTIONS = [
    "What is the weather in Paris?",
    "How much is 100 dollars in euros?",
    "Is it raining in Tokyo right now?",
    "Convert 5000 yen to pounds.",
    "Tell me the temperature in Cairo in fahrenheit.",
]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse_validate_and_stream_the_same(
    client: openai.OpenAI, model: str, choice: str
) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def run(job: tuple[int, str, bool]) -> None:
        i, question, sampled = job
        name = TOOLS[i % 2]["function"]["name"]
        tool_choice: Any = (
            "required" if choice == "required" else {"type": "function", "function": {"name": name}}
        )
        kw: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": 200,
            **_sampling(i, sampled),
        }
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        calls = c.message.tool_calls or []
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
            if choice == "named":
                assert call.function.name == name
        assert c.message.content == ""  # a forced call has no text (as vLLM answers)
        streamed: dict[int, dict[str, str]] = {}
        reasons = []
        for chunk in client.chat.completions.create(**kw, stream=True):
            if not chunk.choices:
                continue
            reasons.append(chunk.choices[0].finish_reason)
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function is not None:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
        assert reasons[-1] == "tool_calls"
        got = [streamed[k] for k in sorted(streamed)]
        want = [{"name": x.function.name, "arguments": x.function.arguments} for x in calls]
        if not sampled or kw.get("seed") is not None:  # seeded: the same tokens again
            assert got == want

    _parallel(run, [(i, q, s) for i, q in enumerate(QUESTIONS * 2) for s in (False, True)])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_cut_by_max_tokens_gives_its_arguments_so_far(
    client: openai.OpenAI, model: str, choice: str
) -> None:
    """max_tokens cuts the forced call: finish_reason length, no markup as content, the
    call with its arguments as far as they got (a prefix of the whole call's), streamed
    alike (as OpenAI and vLLM give a call cut short)."""
    tool_choice: Any = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    kw: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTIONS[0]}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kw, max_tokens=200).choices[0]
    (call,) = whole.message.tool_calls or []
    name, args = call.function.name, call.function.arguments
    for max_tokens in (4, 16, 20):
        c = client.chat.completions.create(**kw, max_tokens=max_tokens).choices[0]
        assert c.finish_reason == "length" and c.message.content == ""
        cut = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        assert len(cut) <= 1 and all(n == name and args.startswith(a) for n, a in cut)
        assert max_tokens == 4 or cut, "the name was written: the call is there"
        streamed, reasons = [], []
        for chunk in client.chat.completions.create(**kw, max_tokens=max_tokens, stream=True):
            for ch in chunk.choices:
                assert not ch.delta.content
                reasons.append(ch.finish_reason)
                for d in ch.delta.tool_calls or []:
                    assert d.function is not None
                    streamed.append((d.function.name, d.function.arguments))
        assert streamed == cut and reasons[-1] == "length"


def test_tool_results_go_through_the_template(client: openai.OpenAI, model: str) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=40
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage is not None and r.usage.prompt_tokens > 100  # the tool prompt was rendered


def test_free_requests_unchanged_by_constrained_neighbours(
    client: openai.OpenAI, model: str
) -> None:
    free = [f"Write a sentence about the number {i}." for i in range(16)]

    def free_job(p: str) -> str:
        r = client.completions.create(model=model, prompt=p, temperature=0, max_tokens=32)
        return r.choices[0].text

    def constrained_job(i: int) -> str:
        what, schema = SCHEMAS[i]
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt(what, schema, TOPICS[1])}],
            extra_body={"guided_json": schema},
            temperature=0,
            max_tokens=200,
        )
        return r.choices[0].message.content or ""

    alone = _parallel(free_job, free)
    jobs: list[tuple[str, Any]] = [("free", p) for p in free] + [("c", i) for i in range(16)]
    mixed = _parallel(
        lambda j: free_job(j[1]) if j[0] == "free" else constrained_job(j[1]), jobs, workers=32
    )
    assert mixed[:16] == alone


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format",  # (the control plane's grammar error, named by the gateway)
            "objectx",
        ),
        ({"extra_body": {"guided_regex": "(("}}, "guided_regex", "regex"),
        ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs", "regex"),
        ({"extra_body": {"guided_json": "{nope"}}, "guided_json", "not valid JSON"),
        (
            {"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}},
            "guided_choice",
            "at most one",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
            "",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", ""),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
            '"nonsense" is not valid',
        ),
        ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern", ""),
        # Grammars past llguidance's limits: its matcher fails and then allows only EOS,
        # which ended the request "stop" with output the grammar refuses (twice in a row:
        # the cached matcher carried the failure). No text matches these two:
        ({"extra_body": {"guided_grammar": "root ::= root"}}, "guided_grammar", "no text"),
        ({"extra_body": {"guided_json": {"$ref": "#"}}}, "guided_json", "no text"),
        # and these fail after a few tokens, mid-generation:
        ({"extra_body": {"guided_regex": "a{1000000}"}}, "guided_regex", "too many"),
        ({"extra_body": {"guided_regex": "a{1000000}"}}, "guided_regex", "too many"),
        (
            {"extra_body": {"guided_choice": [f"option {i}" for i in range(2100)]}},
            "guided_choice",
            "max is 2000",
        ),
    ],
)
def test_bad_structured_requests_are_400(
    client: openai.OpenAI, model: str, body: dict[str, Any], param: str | None, needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, **body
        )
    err = e.value.body
    assert isinstance(err, dict)
    assert needle.lower() in err["message"].lower()
    if param is not None:
        assert err["param"] == param
    # The server goes on.
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert r.choices[0].message.content is not None


def _start_log(*flags: str) -> list[str]:
    """A control plane's log lines up to the one saying it listens (no compute plane:
    none is needed to start)."""
    cmd = [sys.executable, "-m", "hetero_infer.cli", "control-plane", "--port", str(free_port())]
    cmd += ["--compute", f"127.0.0.1:{free_port()}", "--metrics-port", "-1", *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append(raw.decode(errors="replace"))
            if "control plane listening" in lines[-1]:
                return lines
        raise AssertionError(f"exited before listening: {''.join(lines)}")
    finally:
        stop_process(proc)  # type: ignore[arg-type]


def test_the_vocabulary_view_is_built_before_the_control_plane_listens() -> None:
    """`serve` builds llguidance's view of the vocabulary before the gRPC port accepts
    anything, so the first constrained request finds it; --no-grammar-warmup leaves it
    to that request."""
    lines = _start_log()
    ready = [i for i, line in enumerate(lines) if "llguidance's view" in line]
    assert ready == [i for i, line in enumerate(lines) if "49152-token vocabulary ready" in line]
    assert len(ready) == 1 and ready[0] < len(lines) - 1, lines
    assert not any("llguidance's view" in line for line in _start_log("--no-grammar-warmup"))
