"""OfflineLLM, the in-process batch API (vLLM's LLM.generate), on the bundled model."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
import weakref
from pathlib import Path

import pytest

from compute_plane.config import ComputeConfig
from control_plane.config import ControlConfig
from hetero_infer.offline import OfflineLLM
from hetero_proto import control_pb2 as pb
from tests.procs import memory_left

PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "Water is", "Red, green,"]


def test_more_prompts_than_the_waiting_queue_all_run_as_each_runs_alone(
    smollm2_path: Path,
) -> None:
    """Offline, every prompt is admitted at once however small --max-waiting is (vLLM's
    LLM.generate takes any number); a batch's greedy output is each prompt's output alone."""
    path = str(smollm2_path)
    llm = OfflineLLM(
        path,
        compute=ComputeConfig(model=path, metrics_port=-1, kv_cache_bytes=32 << 20),
        control=ControlConfig(model=path, metrics_port=-1, max_waiting=2),
    )
    params = pb.GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = llm.generate(PROMPTS, [params] * len(PROMPTS))
    alone = [llm.generate([p], [params])[0] for p in PROMPTS]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]
    assert all(len(c.token_ids[0]) == 6 for c in batch)
    assert llm.control_config.max_waiting == 2  # the caller's config is left as it was


def test_prompts_and_params_that_would_be_misread_are_refused(smollm2_path: Path) -> None:
    """A str for the list ran each character as a prompt, bytes ran their values as token
    ids, a count mismatch was an assert (gone under python -O), and other types failed
    deep inside with TypeErrors that named nothing; the engine serves on afterwards."""
    llm = OfflineLLM(str(smollm2_path))
    p = pb.GenerationParams(max_tokens=2, temperature=0.0)
    for prompts, params, error, message in [
        ("hi", [p, p], ValueError, "1 prompts, params 2"),  # (one prompt, as vLLM's)
        (b"hi", [p], TypeError, "prompts must be a list of prompts, got bytes"),
        ([b"hi"], [p], TypeError, r"prompts\[0\] must be a str or a list of token ids, got bytes"),
        (["a", 5], [p, p], TypeError, r"prompts\[1\] must be a str or a list of token ids"),
        ([[1, "a"]], [p], TypeError, r"prompts\[0\]: token ids must be ints, got 'a'"),
        ([[1, 2.0]], [p], TypeError, r"prompts\[0\]: token ids must be ints, got 2.0"),
        (
            ["a"],
            [],
            ValueError,
            "one GenerationParams, one per prompt or None: 1 prompts, params 0",
        ),
        (["a"], [{"max_tokens": 2}], TypeError, r"params\[0\] must be a GenerationParams"),
        # (one params object of another type was 'one per prompt or None: 1 prompts,
        # params dict', a ValueError that named no type)
        ("a", {"max_tokens": 2}, TypeError, r"^params must be a GenerationParams, a list of"),
        (["a"], 5, TypeError, r"^params must be .* or None, got int$"),
        # vLLM's prompt dicts are {"prompt": text} or {"prompt_token_ids": ids}, no more
        (
            [{"prompt": "a", "multi_modal_data": {}}],
            [p],
            TypeError,
            r"^prompts\[0\]: a prompt dict is .* got keys \['multi_modal_data', 'prompt'\]$",
        ),
        (["a", {}], None, TypeError, r"^prompts\[1\]: a prompt dict is"),
        ({"prompt": [1, 2]}, p, TypeError, r"^prompts\[0\]\['prompt'\] must be a str, got list"),
        (
            [{"prompt_token_ids": "12"}],
            p,
            TypeError,
            r"^prompts\[0\]\['prompt_token_ids'\] must be a list of token ids, got str",
        ),
        ([{"prompt_token_ids": [1, "a"]}], p, TypeError, r"^prompts\[0\]: token ids must be ints"),
    ]:
        with pytest.raises(error, match=message):
            llm.generate(prompts, params)  # type: ignore[arg-type]
    # chat's tools and chat_template_kwargs of another type were bare TypeErrors ("'int'
    # object is not iterable") naming neither
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TypeError, match=r"^tools must be a list of tools or None, got int"):
        llm.chat(hi, p, tools=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^chat_template_kwargs must be a dict or None, got"):
        llm.chat(hi, p, chat_template_kwargs=5)  # type: ignore[arg-type]
    (done,) = llm.generate([[1, 2, 3]], [p])
    assert len(done.token_ids[0]) == 2


def test_a_plane_config_for_another_model_is_refused_not_ignored(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """`model` is what is loaded: a ComputeConfig / ControlConfig naming another model was
    silently ignored; now it is a ValueError before anything loads. One that leaves
    `model` at its default takes the model argument (its other settings apply)."""
    other = smollm2_path.parent  # a path that exists and is not the model
    with pytest.raises(ValueError, match=r"^compute\.model is .* but the model is"):
        OfflineLLM(str(smollm2_path), compute=ComputeConfig(model=str(other), metrics_port=-1))
    with pytest.raises(ValueError, match=r"^control\.model is .* but the model is"):
        OfflineLLM(str(smollm2_path), control=ControlConfig(model=str(other), metrics_port=-1))
    model = tmp_path / "model.gguf"  # (not the bundled file's path, which "default" names)
    model.symlink_to(smollm2_path)
    llm = OfflineLLM(str(model), compute=ComputeConfig(metrics_port=-1, block_size=32))
    assert (llm.compute_config.model, llm.compute_config.block_size) == (str(model), 32)
    # The same file under another name (the link's target) is the same model.
    same = ControlConfig(model=str(smollm2_path), metrics_port=-1)
    assert OfflineLLM(str(model), control=same).control_config is same


def test_generate_from_two_threads_at_once_runs_both_as_each_alone(smollm2_path: Path) -> None:
    """Each generate attaches its own control engine to the one compute engine, resetting
    it: two at once on one instance lost each other's requests (a RequestFailed, an
    IndexError in the model runner, or a hang); they now run one after the other."""
    llm = OfflineLLM(str(smollm2_path))
    params = [pb.GenerationParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 3
    alone = [c.token_ids for c in llm.generate(PROMPTS[:3], params)]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = [c.token_ids for c in llm.generate(PROMPTS[:3], params)]
        except Exception as e:  # (the assert below shows it)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: alone, 1: alone, 2: alone}


def test_logprobs_and_stop_reasons_asked_for_are_returned(smollm2_path: Path) -> None:
    """Completion kept only texts, token ids and finish reasons: logprobs, prompt logprobs
    and which stop string ended a choice were asked for, computed and silently dropped."""
    llm = OfflineLLM(str(smollm2_path))
    asked = pb.GenerationParams(
        max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2, prompt_logprobs=1, n=2
    )
    plain = pb.GenerationParams(max_tokens=12, temperature=0.0, stop=[" 5"])
    done, stopped = llm.generate(["1, 2, 3,", "1, 2, 3,"], [asked, plain])
    assert len(done.logprobs) == 2
    for ids, logprobs in zip(done.token_ids, done.logprobs, strict=True):
        assert [lp.token_id for lp in logprobs] == ids
        assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in logprobs)
    assert [lp.token_id for lp in done.prompt_logprobs] == done.prompt_token_ids[1:]
    assert done.stop_reasons == [None, None]
    assert stopped.texts == [" 4,"] and stopped.stop_reasons == [" 5"]
    assert stopped.logprobs == [[]] and stopped.prompt_logprobs == []


def test_a_refused_prompt_of_a_batch_is_named_by_its_index(smollm2_path: Path) -> None:
    """The engine's refusal ('the prompt has 9001 tokens; ...') did not say which of the
    batch it was; it names prompts[i] now, as the type checks do, and nothing has run."""
    path = str(smollm2_path)
    llm = OfflineLLM(path, control=ControlConfig(model=path, metrics_port=-1, max_model_len=64))
    p = pb.GenerationParams(max_tokens=2, temperature=0.0)
    for prompts, params, message in [
        (["Hi", "word " * 100, "Ho"], [p] * 3, r"prompts\[1\]: the prompt has 101 tokens"),
        (["Hi", "Ho", [1, 49152]], [p] * 3, r"prompts\[2\]: prompt: token id 49152 is out"),
        (["Hi", "Ho"], [p, pb.GenerationParams(n=17)], r"prompts\[1\]: n must be in 1\.\.16"),
        (  # (the gateway's range, docs/api.md: 11 ran)
            ["Hi", "Ho"],
            [p, pb.GenerationParams(repetition_penalty=11)],
            r"prompts\[1\]: repetition_penalty must be in \(0, 10\], got 11",
        ),
    ]:
        with pytest.raises(ValueError, match=rf"^{message}"):
            llm.generate(prompts, params)
    (done,) = llm.generate(["Hi"], [p])
    assert len(done.token_ids[0]) == 2


def test_ctrl_c_during_generate_raises_at_once_and_the_engine_serves_on(
    smollm2_path: Path, ctrl_c_delivered: None
) -> None:
    """The in-process step loop never yielded to the event loop while it had work, so
    asyncio.run's Ctrl-C (a cancel of the main task) landed only once every request had
    finished: ~25 s here for 8 prompts of 1000 tokens. It lands within a step now."""
    llm = OfflineLLM(str(smollm2_path))
    params = [pb.GenerationParams(max_tokens=1000, temperature=0.0, ignore_eos=True)] * 8
    sent: list[float] = []

    def ctrl_c() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(1.0, ctrl_c)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:1] * 8, params)
    # (a step takes ~20 ms; the whole batch ~25 s alone: the bound leaves room for a
    # loaded machine, where a step is slower and the batch slower still)
    assert time.monotonic() - sent[0] < 8.0
    (done,) = llm.generate(["Hi"], [pb.GenerationParams(max_tokens=2, temperature=0.0)])
    assert len(done.token_ids[0]) == 2


def test_one_prompt_one_params_or_none_and_chats_as_vllms_llm_takes_them(
    smollm2_path: Path, hf_smollm2_tokenizer: object
) -> None:
    """vLLM's LLM.generate takes a single prompt and a single params object (or None) as
    well as lists, and LLM.chat renders conversations with the model's chat template. The
    chat's prompt is the one transformers' apply_chat_template makes of the same messages
    (an independent rendering of the GGUF's template); a message the template refuses is
    named; a closed OfflineLLM says so."""
    p = pb.GenerationParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with OfflineLLM(str(smollm2_path)) as llm:
        (one,) = llm.generate("The capital of France is", p)
        (listed,) = llm.generate(["The capital of France is"], [p])
        assert one.token_ids == listed.token_ids and len(one.token_ids[0]) == 4
        both = llm.generate(PROMPTS[:2], p)  # one params for every prompt
        assert [c.token_ids for c in both] == [
            c.token_ids for c in llm.generate(PROMPTS[:2], [p, p])
        ]
        chat = [
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Name a colour."},
        ]
        expected = hf_smollm2_tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            chat, add_generation_prompt=True, tokenize=True
        )
        if hasattr(expected, "keys"):  # (newer transformers: a BatchEncoding)
            expected = expected["input_ids"]
        (c,) = llm.chat(chat, p)
        assert c.prompt_token_ids == list(expected)
        assert len(c.token_ids[0]) == 4
        two = llm.chat([chat, chat[1:]], [p, p])
        assert two[0].prompt_token_ids == list(expected)
        assert two[0].token_ids == c.token_ids and len(two) == 2
        (answer,) = llm.chat(chat)  # the defaults: greedy (the model's), to its end of turn
        assert answer.finish_reasons == [pb.FINISH_REASON_STOP], answer.texts
        with pytest.raises(ValueError, match=r"^conversations\[1\]: messages\[0\]"):
            llm.chat([chat, [{"role": "user", "content": 5}]], p)  # type: ignore[list-item]
        with pytest.raises(TypeError, match="a conversation is a non-empty list"):
            llm.chat([chat, []], p)
    with pytest.raises(RuntimeError, match="OfflineLLM is closed"):
        llm.generate("hi", p)
    with pytest.raises(RuntimeError, match="OfflineLLM is closed"):
        llm.chat(chat, p)


def test_an_empty_or_mistyped_model_is_refused_by_name() -> None:
    """OfflineLLM("") loaded from the current folder (Path("") is "."), reporting a
    missing tokenizer.json there; OfflineLLM(5) was os.fspath's bare TypeError."""
    for model in ("", "  "):
        with pytest.raises(FileNotFoundError, match=r"^model is empty: give a path"):
            OfflineLLM(model)
    with pytest.raises(TypeError, match=r"^model must be a path or a name, got int"):
        OfflineLLM(5)  # type: ignore[arg-type]


def test_weights_and_a_kv_cache_past_the_memory_are_refused_before_loading() -> None:
    """As a compute plane: the cache leaves a quarter of the weights free, with the weights
    it is three quarters past (it loaded them, then named the cache alone)."""
    from hetero_common.model_path import gemma3_gguf

    weights = os.path.getsize(gemma3_gguf())
    available = memory_left()
    kv = available - weights // 4
    compute = ComputeConfig(model="gemma3", metrics_port=-1, kv_cache_bytes=kv)
    with pytest.raises(
        ValueError, match=rf"^--kv-cache-bytes {kv} \(.*\) \+ the weights, ~{weights} "
    ):
        OfflineLLM("gemma3", compute=compute)


def test_a_chat_s_messages_are_checked_and_its_tool_calls_read_as_a_chat_request_s(
    smollm2_path: Path,
) -> None:
    """A message that is not a dict was dict()'s bare error ('dictionary update sequence
    element #0 ...', "'int' object is not iterable"), a tool call without a function a
    KeyError, and a tool call's arguments as JSON text (OpenAI's shape) were rendered as a
    quoted string; a chat request parses them into an object for the template. Each is
    now as the control plane has it: the message named, the arguments an object."""
    p = pb.GenerationParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    hi = {"role": "user", "content": "Hi"}
    with OfflineLLM(str(smollm2_path)) as llm:
        for chat, message in [
            ([hi, "oops"], r"^messages\[1\] must be a message dict \(role, content\), got str"),
            ([[hi], [hi, 5]], r"^conversations\[1\]: messages\[1\] must be a message dict"),
            (  # (the gateway's 400; it rendered an empty turn)
                [hi, {"role": "assistant", "content": "Yo"}, {"role": "user"}],
                r"^messages\[2\]: a user message needs content \(a string or text parts\)",
            ),
            (
                [hi, {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
                r"^messages\[1\]\.tool_calls: each needs function\.name",
            ),
            (
                [hi, {"role": "assistant", "content": "", "tool_calls": {"id": "1"}}],
                r"^messages\[1\]\.tool_calls must be a list",
            ),
        ]:
            with pytest.raises(ValueError, match=message):
                llm.chat(chat, p)  # type: ignore[arg-type]
        call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        sent = [hi, {"role": "assistant", "content": "", "tool_calls": [call]}, hi]
        (as_text,) = llm.chat(sent, p)
        assert call["function"]["arguments"] == '{"a": 1}'  # the caller's left as it was
        as_object = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
        (c,) = llm.chat([hi, {**sent[1], "tool_calls": [as_object]}, hi], p)
        assert as_text.prompt_token_ids == c.prompt_token_ids
        rendered = llm.tokenizer.decode(c.prompt_token_ids)
        assert '<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>' in rendered
        assert len(c.token_ids[0]) == 4


def test_the_control_config_s_chat_template_renders_chats(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """ControlConfig.chat_template (--chat-template: a file overriding the model's own) was
    ignored: chat rendered with the model's template. It is read as the control plane
    reads it: used for every chat, and a file that does not compile refused by name."""
    path = str(smollm2_path)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    control = ControlConfig(model=path, metrics_port=-1, chat_template=str(template))
    p = pb.GenerationParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with OfflineLLM(path, control=control) as llm:
        (c,) = llm.chat([{"role": "user", "content": "Hi"}], p)
        assert llm.tokenizer.decode(c.prompt_token_ids) == "[user] Hi\n"
        assert len(c.token_ids[0]) == 4
    template.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"^--chat-template .*t\.jinja: the chat template does"):
        OfflineLLM(path, control=control)


def test_close_frees_the_engine_at_once(smollm2_path: Path) -> None:
    """close() dropped its reference to the compute engine, but the last call's control
    engine (a reference cycle) still held it, model and KV cache, until Python's cyclic
    GC next ran; close() frees it at once."""
    llm = OfflineLLM(str(smollm2_path))
    llm.generate("Hi", pb.GenerationParams(max_tokens=2, temperature=0.0))
    engine = weakref.ref(llm.engine)
    gc.disable()  # (as when the cyclic GC would not run before the next load)
    try:
        llm.close()
        assert engine() is None
    finally:
        gc.enable()
    llm.close()  # a second close is a no-op


def test_generate_and_chat_run_from_code_an_event_loop_is_running(
    smollm2_path: Path, ctrl_c_delivered: None
) -> None:
    """A notebook's cell runs in an event loop (as any async function does): there each
    call was asyncio.run's RuntimeError 'cannot be called from a running event loop' (and
    a 'never awaited' warning), where vLLM's LLM runs. It runs now, output as outside, and
    Ctrl-C (a notebook's KeyboardInterrupt) still stops it within a step."""
    p = pb.GenerationParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    hi = [{"role": "user", "content": "Hi"}]
    llm = OfflineLLM(str(smollm2_path))
    outside = [c.token_ids for c in (*llm.generate(PROMPTS[:2], p), *llm.chat(hi, p))]
    long = [pb.GenerationParams(max_tokens=600, temperature=0.0, ignore_eos=True)] * 8
    sent: list[float] = []

    def ctrl_c() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    async def cell() -> list[list[list[int]]]:
        inside = [c.token_ids for c in (*llm.generate(PROMPTS[:2], p), *llm.chat(hi, p))]
        # (ipykernel's way; the fixture puts back what was there)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(1.0, ctrl_c)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:1] * 8, long)
        assert time.monotonic() - sent[0] < 2.0
        return inside

    assert asyncio.run(cell()) == outside
    (done,) = llm.generate("Hi", p)
    assert len(done.token_ids[0]) == 4


def test_special_tokens_are_dropped_from_the_text_unless_asked_for(smollm2_path: Path) -> None:
    """skip_special_tokens left unset kept them (proto3's false); vLLM's SamplingParams
    and the gateway drop them unless told not to."""
    im_start = 1  # <|im_start|>, a special token of the bundled model
    p = pb.GenerationParams(max_tokens=2, temperature=0.0, logit_bias={im_start: 100})
    shown = pb.GenerationParams(skip_special_tokens=False)
    shown.MergeFrom(p)
    with OfflineLLM(str(smollm2_path)) as llm:
        dropped, kept = llm.generate(["Hi", "Hi"], [p, shown])
        (default,) = llm.generate("Hi", pb.GenerationParams(max_tokens=2, logit_bias={1: 100}))
    assert dropped.token_ids == kept.token_ids == [[im_start] * 2]
    assert dropped.texts == default.texts == [""]
    assert kept.texts == ["<|im_start|>" * 2]


def test_vllm_s_prompt_dicts_are_the_prompts_they_hold(smollm2_path: Path) -> None:
    """vLLM's LLM.generate takes {"prompt": text} and {"prompt_token_ids": ids} (its
    TextPrompt and TokensPrompt) beside plain prompts; they were a TypeError here."""
    p = pb.GenerationParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with OfflineLLM(str(smollm2_path)) as llm:
        ids = llm.tokenizer.encode(PROMPTS[0])
        plain = llm.generate([PROMPTS[0], ids], p)
        dicts = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], p)
        (one,) = llm.generate({"prompt_token_ids": ids}, p)  # one dict: one prompt
    assert [c.prompt_token_ids for c in dicts] == [c.prompt_token_ids for c in plain] == [ids] * 2
    assert [c.token_ids for c in dicts] == [c.token_ids for c in plain]
    assert one.token_ids == plain[1].token_ids and len(one.token_ids[0]) == 3


def _tiny_hf_folder(out: Path) -> Path:
    """A randomly initialised Llama with a byte-level tokenizer (its 256 bytes, <s>, </s>)
    and a chat template: an HF folder as OfflineLLM and the planes load one."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.conftest import make_tiny_model

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    t.train_from_iterator(
        ["hello"],
        trainers.BpeTrainer(
            vocab_size=258, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet
        ),
    )
    assert t.get_vocab_size() == 258
    t.save(str(out / "tokenizer.json"))
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )
    make_tiny_model(
        "llama",
        out,
        vocab_size=258,
        bos_token_id=256,
        eos_token_id=257,
        max_position_embeddings=128,
    )
    return out


def test_a_folder_s_generation_config_gives_the_params_left_out_as_the_server_does(
    tmp_path: Path,
) -> None:
    """vLLM's LLM (generation_config="auto") runs generate and chat given no params with
    the model's generation_config.json sampling fields (`get_default_sampling_params`), as
    the server fills the fields a request leaves out; OfflineLLM ran them greedy. Params
    given are used as they are (vLLM's too)."""
    import json

    import torch

    folder = _tiny_hf_folder(tmp_path)
    prompt = "hello world"
    explicit = pb.GenerationParams(max_tokens=24, ignore_eos=True)  # greedy: temperature 0
    generation_config = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "do_sample": True}
    with OfflineLLM(str(folder)) as llm:  # no generation_config.json yet: greedy
        assert llm.get_default_sampling_params() == pb.GenerationParams()
        (greedy,) = llm.generate(prompt, explicit)
    # An independent greedy decode: transformers' own, of the same weights and prompt.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([greedy.prompt_token_ids])
    with torch.no_grad():
        reference = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert greedy.token_ids[0] == reference[0, ids.shape[1] :].tolist()

    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    with OfflineLLM(str(folder)) as llm:
        defaults = llm.get_default_sampling_params()
        assert defaults == pb.GenerationParams(temperature=0.9, top_p=0.95, top_k=40)
        defaults.seed = 1  # (a copy: the next call's are the file's again)
        assert not llm.get_default_sampling_params().HasField("seed")
        (again,) = llm.generate(prompt, explicit)  # given: as given, greedy
        assert again.token_ids == greedy.token_ids
        # Left out: sampled at temperature 0.9 from a random model's nearly flat
        # distribution, 4 x 24 tokens that are all the greedy ones (~(1/40)**96) are not.
        sampled = llm.generate([{"prompt_token_ids": greedy.prompt_token_ids}] * 4)
        assert all(len(c.token_ids[0]) > 0 for c in sampled)
        assert any(
            c.token_ids[0][:24] != greedy.token_ids[0][: len(c.token_ids[0])] for c in sampled
        )
        chats = llm.chat([[{"role": "user", "content": "hi"}]] * 4)
        (chat_greedy,) = llm.chat([{"role": "user", "content": "hi"}], explicit)
        assert any(c.token_ids[0] != chat_greedy.token_ids[0][: len(c.token_ids[0])] for c in chats)
