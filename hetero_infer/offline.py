"""Offline batch inference in one process (what vLLM calls `LLM.generate`).

The control plane's engine (tokenizer, scheduler, block manager, detokenizer, stop
strings) drives the compute engine directly: same code as serving, minus gRPC and HTTP.

    with OfflineLLM("default") as llm:
        outs = llm.generate(["The capital of France is"], GenerationParams(max_tokens=8))
        chats = llm.chat([{"role": "user", "content": "Hi!"}], GenerationParams(max_tokens=8))

As vLLM's `LLM`: `generate` takes one prompt or a list, and one GenerationParams for
all, one per prompt, or None (`get_default_sampling_params`: the model folder's
generation_config.json sampling defaults, as the server's for fields a request leaves
out, and as vLLM's LLM applies them); `chat` renders each conversation with the
model's chat template (the control plane's own code, as a chat request is). Unlike vLLM's
SamplingParams, an unset max_tokens means up to the context (control.proto's meaning).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any, TypeVar

import torch

from compute_plane.config import ComputeConfig
from compute_plane.engine import Engine, check_memory_before_loading, load_for
from compute_plane.requests import StepRejected
from control_plane.chat_template import read_chat_template
from control_plane.compute_client import InProcessLink, StepFailed
from control_plane.config import ControlConfig
from control_plane.engine import ControlEngine
from control_plane.grammar import Grammars
from control_plane.outputs import GenerateStream
from control_plane.scheduler import AdmissionError
from control_plane.server import generation_defaults, template_tool_calls
from control_plane.tokenizer import load_tokenizer
from hetero_common.accumulate import Accumulated
from hetero_common.model_path import DEFAULT_MODEL, model_display_name, resolve_model_path
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb


def in_process_link(engine: Engine) -> InProcessLink:
    """The control plane's link to `engine` in this process (reset at each attach)."""

    def answer(request: cpb.StepRequest) -> cpb.StepResult:
        try:
            return engine.step(request)
        except StepRejected as e:
            raise StepFailed(cpb.StepError(code=e.code, message=str(e))) from e

    return InProcessLink(engine.describe, answer, on_attach=engine.reset)


@dataclass
class Completion:
    """One prompt's result: n choices, in index order. `logprobs` (each choice's, a
    TokenLogprob per token) and `prompt_logprobs` (prompt tokens 1.., as vLLM's after its
    None for the first) are empty unless GenerationParams asked for them; a stop reason is
    the stop string or stop/EOS token id that ended the choice, else None (vLLM's)."""

    prompt_token_ids: list[int]
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[int] = field(default_factory=list)
    logprobs: list[list[pb.TokenLogprob]] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    stop_reasons: list[str | int | None] = field(default_factory=list)


class OfflineLLM:
    def __init__(
        self,
        model: str = "default",
        compute: ComputeConfig | None = None,
        control: ControlConfig | None = None,
    ) -> None:
        path = resolve_model_path(model)
        compute = _serving(compute, "compute", model, path)
        control = _serving(control, "control", model, path)
        self.compute_config = compute or ComputeConfig(model=str(path), metrics_port=-1)
        self.control_config = control or ControlConfig(model=str(path), metrics_port=-1)
        self.tokenizer = load_tokenizer(path)
        if self.control_config.chat_template:  # (as the control plane's serve takes it)
            self.tokenizer.chat_template = read_chat_template(self.control_config.chat_template)
        self.model_name = model_display_name(path)
        # Compiled grammars for the OfflineLLM's life (the first generate's control
        # engine makes them, the later ones share them): a schema given again is not
        # compiled again.
        self._grammars: Grammars | None = None
        self._sampling_defaults = generation_defaults(path)  # (the control plane's reader)
        check_memory_before_loading(self.compute_config, path)  # (as a compute plane)
        self.engine = Engine(self.compute_config, load_for(self.compute_config, path))
        self.engine.warmup()
        # One generate at a time: each attaches its own control engine to self.engine,
        # resetting it, so a second one running beside it lost the first one's requests.
        self._running = threading.Lock()
        self._closed = False

    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[Prompt],
        params: pb.GenerationParams | Sequence[pb.GenerationParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to the end, all admitted at once (the waiting queue is made to
        hold them, as vLLM's LLM.generate takes any number); results in prompt order.
        Each prompt is a string, a list of token ids, or vLLM's {"prompt": text} or
        {"prompt_token_ids": ids}, either with a "cache_salt" (a non-empty string: the
        prompt shares prefix-cache blocks only with prompts of the same salt; a single
        string or dict: one prompt); `params` one GenerationParams for every prompt, one
        per prompt, or None (the model's defaults: `get_default_sampling_params`).
        TypeError / ValueError name a prompt or params that is neither, or a count of
        params that does not match (AdmissionError, a ValueError, for a prompt or params
        the engine refuses: `prompts[i]: ...`, raised before any prompt runs). Calls from
        several threads run one after another."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        if not _is_list(prompts):
            return self._run(prompts, self._per_prompt(params, 0))  # type: ignore[arg-type]  # (refused)
        undicted = [_undict(p, i) for i, p in enumerate(prompts)]
        listed = [prompt for prompt, _ in undicted]
        per_prompt = self._per_prompt(params, len(listed))
        _check(listed, per_prompt)  # (before reading params: they are the caller's to check)
        salts = [salt for _, salt in undicted]
        salted = [_salted(p, s, i) for i, (p, s) in enumerate(zip(per_prompt, salts, strict=True))]
        return self._run(listed, salted)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        params: pb.GenerationParams | Sequence[pb.GenerationParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """`generate` on conversations: one (a list of {"role", "content", ...} messages)
        or a list of them, each rendered with the model's chat template as the control
        plane renders a chat request (`tools` and `chat_template_kwargs` as there).
        ChatTemplateError (a ValueError) names the conversation and message it refuses:
        `conversations[1]: messages[2]: ...`."""
        if self._closed:
            raise RuntimeError("OfflineLLM is closed")
        if tools is not None and not isinstance(tools, list):
            raise TypeError(f"tools must be a list of tools or None, got {type(tools).__name__}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise TypeError(
                "chat_template_kwargs must be a dict or None, got "
                f"{type(chat_template_kwargs).__name__}"
            )
        one = isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)
        chats = [messages] if one else messages
        if isinstance(chats, str | bytes) or not isinstance(chats, Sequence):
            raise TypeError(
                "messages must be a conversation (a list of message dicts) or a list of "
                f"them, got {type(messages).__name__}"
            )
        prompts: list[str | list[int]] = []
        for i, chat in enumerate(chats):
            where = "" if one else f"conversations[{i}]: "
            if isinstance(chat, str | bytes) or not isinstance(chat, Sequence) or not chat:
                raise TypeError(f"{where}a conversation is a non-empty list of message dicts")
            try:
                text = self.tokenizer.apply_chat_template(
                    _messages(chat),
                    add_generation_prompt,
                    tools,
                    continue_final_message=continue_final_message,
                    kwargs=dict(chat_template_kwargs or {}),
                )
            except (TypeError, ValueError) as e:
                raise type(e)(f"{where}{e}") from None
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self._run(prompts, self._per_prompt(params, len(prompts)))

    def get_default_sampling_params(self) -> pb.GenerationParams:
        """What a generate or chat given no params runs with (vLLM's
        `LLM.get_default_sampling_params`): control.proto's defaults (greedy, up to the
        context) with the model folder's generation_config.json sampling fields
        (temperature, top_p, top_k, min_p, repetition_penalty), as the server gives a
        request that leaves them out; none for a GGUF file. A new message each call: set
        more fields on it (a seed, max_tokens) and pass it. Params given are used as they
        are (vLLM's LLM too): a field they leave at 0 is control.proto's 0."""
        out = pb.GenerationParams()
        for name, value in self._sampling_defaults.items():
            setattr(out, name, type(getattr(out, name))(value))  # (top_k: an int)
        return out

    def _per_prompt(self, params: object, n: int) -> Any:
        """One GenerationParams per prompt: `params` itself when a list (checked by
        _check), a copy for each when one, the model's defaults when None."""
        if params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(params, pb.GenerationParams):
            return [_copy(params) for _ in range(n)]
        return params

    def close(self) -> None:
        """Free the model and its KV cache; generate and chat raise RuntimeError after."""
        with self._running:
            self._closed = True
            self.engine = None  # type: ignore[assignment]
        # The last call's control engine, a cycle, still holds the engine; and a GPU's
        # memory goes back to the device only when torch's cache lets it go.
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def __enter__(self) -> OfflineLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self, prompts: Sequence[str | list[int]], params: list[pb.GenerationParams]
    ) -> list[Completion]:
        _check(prompts, params)
        with self._running:
            if self._closed:
                raise RuntimeError("OfflineLLM is closed")
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # (none: the usual case)
                return asyncio.run(self._generate(prompts, params))
            return _beside_the_loop(self._generate(prompts, params))

    async def _generate(
        self, prompts: Sequence[str | list[int]], params: list[pb.GenerationParams]
    ) -> list[Completion]:
        config = self.control_config
        config = dataclasses.replace(config, max_waiting=max(config.max_waiting, len(prompts)))
        control = ControlEngine(
            config,
            self.tokenizer,
            in_process_link(self.engine),
            model_name=self.model_name,
            grammars=self._grammars,
        )
        self._grammars = control.grammars
        control.warm_up()  # (once per OfflineLLM: the engines of its tokenizer share it)
        await control.start()
        try:
            await control.first_attached()
            streams = []
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                ids = (
                    self.tokenizer.encode(prompt)
                    if isinstance(prompt, str)
                    else list(map(int, prompt))
                )
                try:
                    streams.append(control.submit(ids, p))
                except AdmissionError as e:  # which of the batch (none has run)
                    raise AdmissionError(f"prompts[{i}]: {e}") from None
            return [await _collect(s) for s in streams]
        finally:
            await control.stop()


def _beside_the_loop(work: Coroutine[Any, Any, R]) -> R:
    """asyncio.run(work) from code that an event loop is running (a notebook's cell, an
    async function), which asyncio.run refuses: in a thread of its own, the caller's loop
    blocked meanwhile as by any other blocking call. A KeyboardInterrupt while it waits
    cancels the work, as asyncio.run's Ctrl-C does, and is raised once it has stopped."""
    started: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[R]]] = []
    result: list[R] = []
    error: list[BaseException] = []

    async def run() -> R:
        started.append((asyncio.get_running_loop(), asyncio.current_task()))  # type: ignore[arg-type]
        return await work

    def thread() -> None:
        try:
            result.append(asyncio.run(run()))
        except BaseException as e:
            error.append(e)

    worker = threading.Thread(target=thread, name="OfflineLLM")
    worker.start()
    try:
        worker.join()
    except KeyboardInterrupt:
        if started:
            loop, task = started[0]
            loop.call_soon_threadsafe(task.cancel)
        worker.join()
        raise
    if error:
        raise error[0]
    return result[0]


def _messages(chat: Sequence[Any]) -> list[dict[str, Any]]:
    """A conversation as the control plane hands a chat request's to the template (its
    checks, and tool calls' JSON text arguments as objects); the caller's are unchanged."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(chat):
        msg = dict(m) if isinstance(m, Mapping) else m  # (render_chat names a non-dict)
        if isinstance(msg, dict) and msg.get("tool_calls"):
            msg["tool_calls"] = template_tool_calls(msg["tool_calls"], i)
        out.append(msg)
    return out


def _undict(prompt: Any, i: int) -> tuple[Any, str | None]:
    """vLLM's prompt dicts as the prompt they hold and its cache salt (None if it has
    none): {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt),
    with an optional "cache_salt"; their other keys (multi-modal data, ...) mean nothing
    here and are refused, not dropped."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        shown = repr(salt) if isinstance(salt, str) else type(salt).__name__
        raise TypeError(f"prompts[{i}]['cache_salt'] must be a non-empty str, got {shown}")
    keys = set(prompt) - {"cache_salt"}
    if keys == {"prompt"}:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise TypeError(f"prompts[{i}]['prompt'] must be a str, got {type(text).__name__}")
        return text, salt
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str | bytes | bytearray) or not isinstance(ids, Sequence):
            raise TypeError(
                f"prompts[{i}]['prompt_token_ids'] must be a list of token ids, got "
                f"{type(ids).__name__}"
            )
        return ids, salt
    raise TypeError(
        f"prompts[{i}]: a prompt dict is {{'prompt': text}} or {{'prompt_token_ids': ids}}, "
        f"with an optional 'cache_salt', got keys {sorted(map(str, prompt))}"
    )


def _salted(params: pb.GenerationParams, salt: str | None, i: int) -> pb.GenerationParams:
    """Prompt i's params with its dict's cache salt (a copy: the caller's stay as given)."""
    if salt is None:
        return params
    if params.cache_salt and params.cache_salt != salt:
        raise ValueError(
            f"prompts[{i}]['cache_salt'] is {salt!r} but its params' cache_salt is "
            f"{params.cache_salt!r}: give it in one place"
        )
    out = _copy(params)
    out.cache_salt = salt
    return out


def _is_list(prompts: object) -> bool:
    return isinstance(prompts, Sequence) and not isinstance(prompts, str | bytes)


def _copy(params: pb.GenerationParams) -> pb.GenerationParams:
    out = pb.GenerationParams()
    out.CopyFrom(params)
    return out


def _check(prompts: object, params: object) -> None:
    """Refuse what would otherwise be read wrongly: a string for the list (one prompt per
    character), bytes (their values as token ids), ids that are not ints."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    if not isinstance(params, Sequence):
        raise TypeError(
            "params must be a GenerationParams, a list of them (one per prompt) or None, "
            f"got {type(params).__name__}"
        )
    if len(params) != len(prompts):
        raise ValueError(
            f"params: one GenerationParams, one per prompt or None: {len(prompts)} prompts, "
            f"params {len(params)}"
        )
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            continue
        if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
            raise TypeError(
                f"prompts[{i}] must be a str or a list of token ids, got {type(prompt).__name__}"
            )
        if bad := [t for t in prompt if isinstance(t, bool) or not isinstance(t, Integral)]:
            raise TypeError(f"prompts[{i}]: token ids must be ints, got {bad[0]!r}")
    for i, p in enumerate(params):
        if not isinstance(p, pb.GenerationParams):
            raise TypeError(f"params[{i}] must be a GenerationParams, got {type(p).__name__}")


async def _collect(stream: GenerateStream) -> Completion:
    acc = Accumulated()
    while True:
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            raise item
        if acc.add(item):
            break
    choices = [acc.choice(i) for i in range(len(stream.choices))]
    return Completion(
        list(stream.prompt_token_ids),
        [c.token_ids for c in choices],
        [c.text for c in choices],
        [c.finish_reason for c in choices],
        [c.logprobs for c in choices],
        choices[0].prompt_logprobs,
        [c.stop_reason for c in choices],
    )


C = TypeVar("C", ComputeConfig, ControlConfig)
# A prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | list[int] | Mapping[str, Any]
R = TypeVar("R")


def _serving(config: C | None, plane: str, model: str, path: Path) -> C | None:
    """A plane's config for `model`: its `model` left at the default is `model`; one set
    to another model is a ValueError (it would be ignored: `model` is what is loaded)."""
    if config is None:
        return None
    if config.model == DEFAULT_MODEL:  # left unset (resolving it needs the bundled model)
        return dataclasses.replace(config, model=str(path))
    if resolve_model_path(config.model).resolve() == path.resolve():
        return config
    raise ValueError(
        f"{plane}.model is {config.model!r} but the model is {model!r}: give the same "
        "model, or leave it to the model argument"
    )
