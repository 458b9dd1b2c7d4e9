"""Input processing: a generate request checked once and turned into the scheduler's
requests, one per choice (vLLM v1's input processor, after tokenisation).

Pure: no scheduler state, no I/O. The engine asks the scheduler afterwards whether a
request of that size can be queued now (`Scheduler.check_admission`).
"""

from __future__ import annotations

from dataclasses import dataclass

from control_plane import metrics
from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.grammar import GrammarError, Grammars
from control_plane.outputs import Choice, GenerateStream, Outbox
from control_plane.request import Request
from control_plane.scheduler import AdmissionError
from control_plane.stop import StopChecker
from control_plane.tokenizer import TokenizerWrapper
from hetero_common.limits import MAX_N, MAX_STOP_CHARS, MAX_STOPS
from hetero_common.logs import choice_request_id
from hetero_common.sampling_params import SamplingSpec
from hetero_proto import compute_pb2 as cpb
from hetero_proto import control_pb2 as pb


@dataclass(frozen=True, slots=True)
class ModelBounds:
    """What the checks need to know of the attached compute plane and the pool."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]  # the tokenizer's and the compute plane's


def _check_fields(params: pb.GenerationParams) -> None:
    """Raise AdmissionError naming the first field that is bad whatever the prompt and
    model. A value that would be silently ignored or misread is refused too (as vLLM and
    the gateway refuse it): gRPC clients get no other warning."""
    n = params.n or 1
    if not 1 <= n <= MAX_N:
        raise AdmissionError(f"n must be in 1..{MAX_N}, got {n}")
    if params.max_tokens < 0 or params.min_tokens < 0:
        raise AdmissionError("max_tokens and min_tokens must be >= 0")
    if len(params.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in params.stop):
        raise AdmissionError(
            f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters"
        )
    if not all(params.stop):
        raise AdmissionError("stop strings must not be empty")
    if params.top_k < -1:
        raise AdmissionError(f"top_k must be 0 or -1 (off) or > 0, got {params.top_k}")
    if params.top_logprobs > 0 and not params.logprobs:
        raise AdmissionError("top_logprobs needs logprobs")
    structured = params.structured
    if structured.WhichOneof("kind") == "json_object" and not structured.json_object:
        raise AdmissionError("json_object must be true when set")


def skip_special_tokens(params: pb.GenerationParams) -> bool:
    """Whether special tokens are dropped from the text: unset is true, as vLLM's."""
    return params.skip_special_tokens if params.HasField("skip_special_tokens") else True


class InputProcessor:
    def __init__(self, tokenizer: TokenizerWrapper, grammars: Grammars | None = None) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars or Grammars(tokenizer)

    def check(self, prompt_ids: list[int], params: pb.GenerationParams, bounds: ModelBounds) -> int:
        """Raise AdmissionError naming the first bad field; return the request's max_tokens
        (when unset: what the context leaves after the prompt; 0 with prompt_only)."""
        _check_fields(params)
        if not prompt_ids:
            raise AdmissionError("the prompt is empty")
        if len(prompt_ids) >= bounds.max_model_len:
            raise AdmissionError(
                f"the prompt has {len(prompt_ids)} tokens; the maximum context length is "
                f"{bounds.max_model_len} tokens, prompt and output together"
            )
        vocab = bounds.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            bad_id = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise AdmissionError(
                f"prompt: token id {bad_id} is out of vocabulary (ids must be in 0..{vocab - 1}; "
                f"the vocabulary has {vocab} tokens)"
            )
        if bad := [t for t in params.stop_token_ids if not 0 <= t < vocab]:
            raise AdmissionError(
                f"stop_token_ids: token id {bad[0]} is not in 0..{vocab - 1} "
                f"(the vocabulary has {vocab} tokens)"
            )
        if params.prompt_only:
            max_tokens = 0  # (0 is "up to the context" only when it generates)
            if params.max_tokens:
                raise AdmissionError(
                    f"prompt_only generates nothing: max_tokens must be 0, got {params.max_tokens}"
                )
        else:
            max_tokens = params.max_tokens or bounds.max_model_len - len(prompt_ids)
        if params.min_tokens > max_tokens:
            raise AdmissionError(
                f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})"
            )
        spec = SamplingSpec.from_proto(self.sampling(params, 0, bounds))
        problem = spec.validate(bounds.vocab_size)
        if problem:
            raise AdmissionError(problem)
        if params.HasField("structured"):
            try:
                self.grammars.compile(params.structured)  # cached for make_stream
            except GrammarError as e:
                raise AdmissionError(str(e)) from None
        return max_tokens

    @staticmethod
    def check_resumed(
        resumed: list[int], params: pb.GenerationParams, max_tokens: int, bounds: ModelBounds
    ) -> None:
        """Raise AdmissionError unless `resumed` (output the client has) can be resumed."""
        if not resumed:
            return
        if (params.n or 1) != 1:
            raise AdmissionError("num_resumed_output_tokens needs n = 1")
        if len(resumed) >= max_tokens:
            raise AdmissionError(
                f"num_resumed_output_tokens ({len(resumed)}) leaves nothing of max_tokens "
                f"({max_tokens}) to generate"
            )
        vocab = bounds.vocab_size
        if bad := [t for t in resumed if not 0 <= t < vocab]:
            raise AdmissionError(f"resumed output token id {bad[0]} is not in 0..{vocab - 1}")

    def sampling(
        self, params: pb.GenerationParams, index: int, bounds: ModelBounds
    ) -> cpb.SamplingParams:
        """Choice `index`'s sampling parameters as the compute plane takes them."""
        sampling = cpb.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p or 1.0,
            top_k=max(0, params.top_k),
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty or 1.0,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            logprobs=params.logprobs,
            top_logprobs=params.top_logprobs,
        )
        for t, bias in params.logit_bias.items():
            sampling.logit_bias[t] = bias
        if params.min_tokens:
            # The compute plane masks these until min_tokens tokens exist.
            eos = set() if params.ignore_eos else bounds.eos_token_ids
            sampling.min_tokens = params.min_tokens
            sampling.min_tokens_banned_ids.extend(sorted(set(params.stop_token_ids) | eos))
        if params.HasField("seed"):
            sampling.seed = (params.seed + index) % (1 << 64)  # choices differ, reproducibly
        if params.HasField("prompt_logprobs") and index == 0:  # the others fork its prompt
            sampling.prompt_logprobs = params.prompt_logprobs
        return sampling

    def make_stream(
        self,
        stream_id: str,
        prompt_ids: list[int],
        params: pb.GenerationParams,
        bounds: ModelBounds,
        max_tokens: int,
        outbox: Outbox | None = None,
        client_id: str = "",
        model_name: str = "",
        resumed: list[int] | None = None,
    ) -> GenerateStream:
        """The stream of a checked request, with a scheduler Request per choice
        (`<stream_id>-<i>`), each with its detokenizer and stop-string checker.
        `resumed`: output the client already has (one choice; `check_resumed`): the
        request starts with it generated, its detokenizer and grammar past it."""
        resumed = resumed or []
        stream = GenerateStream(
            stream_id, list(prompt_ids), [], self.tokenizer, outbox=outbox, client_id=client_id
        )
        grammar = None
        if params.HasField("structured"):
            try:
                grammar = self.grammars.start(params.structured, resumed)
            except GrammarError as e:
                raise AdmissionError(str(e)) from None
            kind = params.structured.WhichOneof("kind") or ""
            metrics.constrained_requests.labels(model_name=model_name, kind=kind).inc()
        for i in range(params.n or 1):
            req = Request(
                request_id=choice_request_id(stream_id, i),
                prompt_token_ids=list(prompt_ids),
                token_ids=[*prompt_ids, *resumed],
                # A prompt-only request samples once, when its prompt is computed, and
                # drops that token (Request.prompt_only).
                max_tokens=max_tokens or 1,
                prompt_only=params.prompt_only,
                sampling=self.sampling(params, i, bounds),
                min_tokens=params.min_tokens,
                ignore_eos=params.ignore_eos,
                eos_token_ids=bounds.eos_token_ids,
                stop_token_ids=frozenset(params.stop_token_ids),
                grammar=None if grammar is None else grammar if i == 0 else grammar.copy(),
                # Its prompt's logits are all needed: a prefix-cache hit would skip them.
                skip_prefix_cache=params.HasField("prompt_logprobs"),
                cache_salt=params.cache_salt,
            )
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens(params))
            for token in resumed:  # the client has their text
                detok.push(token)
            # (resumed tokens count toward min_tokens: the client has their text)
            unsearched = max(0, params.min_tokens - len(resumed))
            stop = StopChecker(list(params.stop), params.include_stop_str_in_output, unsearched)
            stream.choices.append(Choice(i, req, detok, stop))
        return stream
