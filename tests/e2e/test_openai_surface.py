"""The OpenAI (and vLLM) request fields beyond sampling, through the three planes with the
official `openai` client: logit_bias, include_stop_str_in_output, return_token_ids,
logprobs 0, stream_options, chat echo / continue_final_message / chat_template_kwargs,
skip_special_tokens, --chat-template, /tokenize, /detokenize, /version, unknown fields."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.procs import FullStack, gateway_stack

pytestmark = pytest.mark.slow

# The bundled model's template, plus a kwarg that changes the system line.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if shout %}LOUD{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullStack]:
    template: Path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    with gateway_stack(control_args=("--chat-template", str(template))) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack: FullStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as h:
        yield h


def _ids(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_logit_bias(client: openai.OpenAI, model: str, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, logit_bias={"49152": 1})
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "logit_bias"
    assert "49152" in body["message"] and "49152 tokens" in body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="Hi", max_tokens=2, logit_bias={"x": 1})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="Hi", max_tokens=2, logit_bias={"5": 101})
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    (first,) = _ids(http, plain.choices[0].text)[:1]
    (forced,) = _ids(http, " banana")[:1]
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == [forced] * 3  # type: ignore[index]
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] != [first]  # type: ignore[index]


def test_include_stop_str_and_skip_special_tokens(client: openai.OpenAI, model: str) -> None:
    prompt = "The capital of France is Paris. The capital of France is"
    kw = {"model": model, "prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": ["city"]}
    cut = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    kept = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})  # type: ignore[call-overload]
    assert kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == cut + "city"
    im_start = 1  # <|im_start|>, a special token of the bundled model
    kw = {
        "model": model,
        "prompt": "Hi",
        "max_tokens": 2,
        "temperature": 0,
        "logit_bias": {str(im_start): 100},
    }
    shown = client.completions.create(**kw, extra_body={"skip_special_tokens": False})  # type: ignore[call-overload]
    assert shown.choices[0].text == "<|im_start|>" * 2
    assert client.completions.create(**kw).choices[0].text == ""  # type: ignore[call-overload]


def test_return_token_ids_and_logprobs_zero(
    client: openai.OpenAI, model: str, http: httpx.Client
) -> None:
    prompt = "Once upon a time"
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    extra = c.model_extra or {}
    assert extra["prompt_token_ids"] == _ids(http, prompt)
    assert http.post("/detokenize", json={"tokens": extra["token_ids"]}).json()["prompt"] == c.text
    assert c.logprobs is not None and c.logprobs.top_logprobs is not None
    for tok, lp, top in zip(
        c.logprobs.tokens or [],
        c.logprobs.token_logprobs or [],
        c.logprobs.top_logprobs,
        strict=True,
    ):
        assert top == {tok: lp}  # logprobs 0: the sampled token's entry alone
    streamed: list[int] = []
    prompt_ids = None
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    ):
        for ch in chunk.choices:
            streamed += (ch.model_extra or {}).get("token_ids", [])
            prompt_ids = prompt_ids or (ch.model_extra or {}).get("prompt_token_ids")
    assert streamed == extra["token_ids"] and prompt_ids == extra["prompt_token_ids"]
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ids = (chat.model_extra or {})["prompt_token_ids"]
    assert ids == _ids(http, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert len((chat.choices[0].model_extra or {})["token_ids"]) == chat.usage.completion_tokens  # type: ignore[union-attr]


def test_stream_options(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "stream_options"
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hi",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": True},
        )
    )
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    done = [u.completion_tokens for u in usages if u is not None]
    assert done == sorted(done) and done[-1] == 5
    assert all(u.prompt_tokens == usages[-1].prompt_tokens for u in usages if u is not None)  # type: ignore[union-attr]


def _stream_usages(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each chunk's usage of a streamed request, in order."""
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    return [json.loads(ln.removeprefix("data: "))["usage"] for ln in lines]


def test_continuous_usage_counts_cached_tokens(model: str, http: httpx.Client) -> None:
    """Every usage object of a stream carries prompt_tokens_details, its cached_tokens the
    prefix cache's hit (the final usage's): it came on the final one only. A chat's role
    chunks too: they said 0, sent before the hit was known. Chat and completions, n 1
    (packed deltas) and 2."""
    text = "A prompt of a few blocks, streamed twice with usage on every chunk: " * 3
    opts = {"include_usage": True, "continuous_usage_stats": True}
    common = {"model": model, "max_tokens": 4, "stream_options": opts, "ignore_eos": True}
    requests = [
        ("/v1/completions", {"prompt": text}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
    ]
    for path, body in requests:
        for n in (1, 2):
            for _ in range(2):  # the second hits the prefix cache
                usages = _stream_usages(http, path, common | body | {"n": n})
            final = usages[-1]
            assert final["prompt_tokens_details"]["cached_tokens"] >= 16, (path, n, final)
            assert all(u.keys() == final.keys() for u in usages), (path, n, usages)
            counted = [u for u in usages if u["completion_tokens"]]
            assert counted[-1]["completion_tokens"] == 4 * n
            details = final["prompt_tokens_details"]
            assert all(u["prompt_tokens_details"] == details for u in usages), (path, n, usages)
            if path == "/v1/chat/completions":  # the role chunks (one per choice) came first
                assert [u["completion_tokens"] for u in usages[:n]] == [0] * n, usages


def test_an_auto_tool_call_cut_by_max_tokens_is_its_call_so_far(
    client: openai.OpenAI, model: str, http: httpx.Client
) -> None:
    """tool_choice auto, the model's call cut by max_tokens (the answer pinned by a regex:
    the bundled 135M model calls no tool on its own): finish_reason length, the text before
    the call as content, the call with its arguments as far as they got (as OpenAI returns
    a truncated call and vLLM streams one); the raw call text was the content. Streamed
    alike."""
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    answer = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    answer += "\n</tool_call>"
    kw: Any = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools,
        "tool_choice": "auto",
        "temperature": 0,
        "extra_body": {"guided_regex": re.escape(answer), "return_token_ids": True},
    }
    whole = client.chat.completions.create(max_tokens=100, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    ids = (whole.model_extra or {})["token_ids"]

    def text(n: int) -> str:
        return str(http.post("/detokenize", json={"tokens": ids[:n]}).json()["prompt"])

    # The fewest tokens that reach into the arguments: the answer cut there.
    cut = next(n for n in range(len(ids)) if '"arguments": {"ci' in text(n))
    head, _, args = text(cut).partition('<tool_call>\n{"name": "get_weather", "arguments": ')
    r = client.chat.completions.create(max_tokens=cut, **kw).choices[0]
    assert r.finish_reason == "length"
    assert r.message.content == head == "Let me check. "
    got = [(c.function.name, c.function.arguments) for c in r.message.tool_calls or []]  # type: ignore[union-attr]
    assert got == [("get_weather", args)] and '{"city": "Paris"}'.startswith(args)
    chunks = [
        c.choices[0] for c in client.chat.completions.create(max_tokens=cut, stream=True, **kw)
    ]
    assert "".join(c.delta.content or "" for c in chunks) == head
    deltas = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in deltas] == got  # type: ignore[union-attr]
    assert chunks[-1].finish_reason == "length"


def test_chat_echo_continue_and_template_kwargs(
    client: openai.OpenAI, model: str, http: httpx.Client
) -> None:
    msgs = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "My favourite color is"},
    ]
    r = client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
        extra_body={
            "echo": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "return_token_ids": True,
        },
    )
    assert (r.choices[0].message.content or "").startswith("My favourite color is")
    prompt_ids = (r.model_extra or {})["prompt_token_ids"]
    assert prompt_ids[-len(_ids(http, " is")) :] == _ids(http, " is")  # the turn is left open
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=2,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True},  # with add_generation_prompt: exclusive
        )
    plain = http.post("/tokenize", json={"messages": msgs[:1]}).json()["tokens"]
    loud = http.post(
        "/tokenize", json={"messages": msgs[:1], "chat_template_kwargs": {"shout": True}}
    ).json()["tokens"]
    assert len(loud) > len(plain)  # the --chat-template file's kwarg took effect


def test_version_and_unknown_fields(client: openai.OpenAI, model: str, http: httpx.Client) -> None:
    assert http.get("/version").json()["version"]
    for field, value in (("use_beam_search", True), ("best_of", 2), ("frobnicate", 1)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model=model, prompt="Hi", max_tokens=2, extra_body={field: value}
            )
        assert isinstance(e.value.body, dict) and e.value.body["param"] == field
    r = http.post("/tokenize", json={"prompt": "x", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


def test_models_retrieve(client: openai.OpenAI, model: str) -> None:
    served = client.models.retrieve(model)  # GET /v1/models/{id}
    assert served.id == model and served.object == "model"
    assert served.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("not-" + model)
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "model_not_found"


def test_prompt_logprobs_match_transformers(
    client: openai.OpenAI, model: str, http: httpx.Client, hf_smollm2
) -> None:  # type: ignore[no-untyped-def]
    """echo + logprobs and prompt_logprobs score the prompt's tokens as transformers does
    on the same (dequantised) weights; a second identical request (a prefix-cache hit
    otherwise) gets them all again; streaming gives the same."""
    import torch

    prompt = "The quick brown fox jumps over the lazy dog because it"
    ids = _ids(http, prompt)
    with torch.no_grad():
        logp = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)
    want = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    want_rank = [int((logp[i] > logp[i, ids[i + 1]]).sum()) + 1 for i in range(len(ids) - 1)]
    kw = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "echo": True,
        "logprobs": 2,
    }
    for _ in range(2):  # the second would hit the prefix cache
        r = client.completions.create(**kw, extra_body={"prompt_logprobs": 1})  # type: ignore[call-overload]
        c = r.choices[0]
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 2
        got = lp.token_logprobs[1 : len(ids)]
        assert got == pytest.approx(want, abs=0.05)
        assert "".join(lp.tokens[: len(ids)]) == prompt
        vllm = (c.model_extra or {})["prompt_logprobs"]
        assert vllm[0] is None and len(vllm) == len(ids)
        for i, entry in enumerate(vllm[1:]):
            mine = entry[str(ids[i + 1])]
            assert mine["logprob"] == pytest.approx(want[i], abs=0.05)
            top2 = logp[i].topk(2).values.tolist()
            if want_rank[i] == 1 and top2[0] - top2[1] > 0.1:  # clearly the most likely
                assert mine["rank"] == 1
            assert mine["rank"] >= 1
            assert len(entry) <= 2  # the token and the 1 most likely
    streamed_text, streamed_lps = "", []
    for chunk in client.completions.create(**kw, stream=True):  # type: ignore[call-overload]
        for ch in chunk.choices:
            streamed_text += ch.text
            if ch.logprobs is not None:
                streamed_lps += ch.logprobs.token_logprobs or []
    assert streamed_text == c.text
    assert streamed_lps[0] is None and lp.token_logprobs[0] is None
    assert streamed_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers(
    client: openai.OpenAI, model: str, http: httpx.Client, hf_smollm2
) -> None:  # type: ignore[no-untyped-def]
    """lm-evaluation-harness's loglikelihood request (echo, max_tokens 0, logprobs,
    temperature 0), as the legacy OpenAI API and vLLM answer it: the prompt's text with
    each prompt token's logprob (the first null) equal to transformers' log-softmax,
    nothing generated (finish_reason length, completion_tokens 0); token-id prompts, a
    batch with n = 2 and streaming alike. max_tokens 0 without echo stays a 400."""
    import torch

    texts = ["The quick brown fox jumps over the lazy dog", "Paris is the capital of"]
    ids = [_ids(http, t) for t in texts]
    want = []
    with torch.no_grad():
        for p in ids:
            logp = torch.log_softmax(hf_smollm2(torch.tensor([p])).logits[0].float(), -1)
            want.append([logp[i, p[i + 1]].item() for i in range(len(p) - 1)])
    kw: dict[str, Any] = {"model": model, "max_tokens": 0, "temperature": 0, "echo": True}
    r = client.completions.create(prompt=texts[0], logprobs=1, **kw)
    (c,) = r.choices
    assert (c.text, c.finish_reason) == (texts[0], "length")
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ids[0]),
        0,
    )
    lp = c.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids[0])
    assert lp.token_logprobs[1:] == pytest.approx(want[0], abs=0.05)
    assert "".join(lp.tokens) == texts[0] and lp.text_offset is not None
    assert lp.top_logprobs is not None and all(len(t) in (1, 2) for t in lp.top_logprobs[1:])

    batch = client.completions.create(prompt=ids, n=2, logprobs=0, **kw)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert batch.usage is not None and batch.usage.completion_tokens == 0
    for ch in batch.choices:
        i = ch.index // 2
        assert (ch.text, ch.finish_reason) == (texts[i], "length")
        got = ch.logprobs.token_logprobs  # type: ignore[union-attr]
        assert got is not None and got[0] is None
        assert got[1:] == pytest.approx(want[i], abs=0.05)

    chunks = list(
        client.completions.create(
            prompt=texts,
            n=2,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    by_index: dict[int, list[Any]] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            by_index.setdefault(ch.index, []).append(ch)
    assert sorted(by_index) == [0, 1, 2, 3]
    for index, pieces in by_index.items():
        assert "".join(p.text for p in pieces) == texts[index // 2]
        assert pieces[-1].finish_reason == "length"
        lps = [x for p in pieces if p.logprobs is not None for x in p.logprobs.token_logprobs]
        assert lps[0] is None and lps[1:] == pytest.approx(want[index // 2], abs=0.05)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 0
    plain = list(client.completions.create(prompt=texts[1], stream=True, **kw))
    assert "".join(ch.text for chunk in plain for ch in chunk.choices) == texts[1]

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=texts[0], max_tokens=0)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "max_tokens"


def test_vllm_shapes(client: openai.OpenAI, model: str) -> None:
    """What vLLM's own OpenAI-server tests read: null extension keys, stop_reason, the
    chat stream's first chunk, per-chunk usage only with include_usage, n role chunks."""
    r = client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
    extra = r.choices[0].model_extra or {}
    assert extra["prompt_logprobs"] is None and extra["token_ids"] is None
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert (chat.model_extra or {})["prompt_logprobs"] is None
    assert (chat.model_extra or {})["prompt_token_ids"] is None
    assert (chat.choices[0].model_extra or {})["token_ids"] is None
    prompt = "The capital of France is Paris. The capital of France is"
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=20, temperature=0, stop=["city"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert (r.choices[0].model_extra or {})["stop_reason"] == "city"
    msgs: Any = [{"role": "user", "content": "Hi"}]
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=3,
            temperature=0,
            stream=True,
            n=2,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"return_token_ids": True},
        )
    )
    assert (chunks[0].model_extra or {}).get("prompt_token_ids")
    assert not any((c.model_extra or {}).get("prompt_token_ids") for c in chunks[1:])
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]  # a role chunk per choice
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)
    quiet = list(
        client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": False, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    assert all(c.usage is None for c in quiet)


def test_structured_outputs_spelling_and_vocabulary_messages(
    client: openai.OpenAI, model: str
) -> None:
    r = client.completions.create(
        model=model,
        prompt="My phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=model,
            prompt="x",
            max_tokens=2,
            extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}},
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[49152], max_tokens=2)
    assert "out of vocabulary" in str(e.value)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt="x", max_tokens=2, extra_body={"stop_token_ids": [49152]}
        )
    assert "49152 tokens" in str(e.value)
