from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "dtype", "device", "block_size", "num_kv_blocks", "max_model_len", "vocab_size", "eos_token_ids", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size", "kv_cache_bytes", "bos_token_id", "attention_backend", "weight_bytes", "quantization", "sliding_window", "draft_model", "max_speculative_tokens", "vocab_fingerprint", "weights_fingerprint")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    kv_cache_bytes: int
    bos_token_id: int
    attention_backend: str
    weight_bytes: int
    quantization: str
    sliding_window: int
    draft_model: str
    max_speculative_tokens: int
    vocab_fingerprint: bytes
    weights_fingerprint: bytes
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hidden_size: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., attention_backend: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., quantization: _Optional[str] = ..., sliding_window: _Optional[int] = ..., draft_model: _Optional[str] = ..., max_speculative_tokens: _Optional[int] = ..., vocab_fingerprint: _Optional[bytes] = ..., weights_fingerprint: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs", "min_tokens", "min_tokens_banned_ids", "logit_bias", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_BANNED_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logprobs: bool
    top_logprobs: int
    min_tokens: int
    min_tokens_banned_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., min_tokens_banned_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_scheduled_tokens", "block_ids", "sampling", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ContinuingRequest(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_scheduled_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "continuing", "finished_ids", "decode_ids", "masks", "proposals")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTINUING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_IDS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    continuing: _containers.RepeatedCompositeFieldContainer[ContinuingRequest]
    finished_ids: _containers.RepeatedScalarFieldContainer[str]
    decode_ids: _containers.RepeatedScalarFieldContainer[str]
    masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., continuing: _Optional[_Iterable[_Union[ContinuingRequest, _Mapping]]] = ..., finished_ids: _Optional[_Iterable[str]] = ..., decode_ids: _Optional[_Iterable[str]] = ..., masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("request_id", "size", "bitmask", "ids", "invert")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    INVERT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    size: int
    bitmask: bytes
    ids: _containers.RepeatedScalarFieldContainer[int]
    invert: bool
    def __init__(self, request_id: _Optional[str] = ..., size: _Optional[int] = ..., bitmask: _Optional[bytes] = ..., ids: _Optional[_Iterable[int]] = ..., invert: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenResult(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob", "top_logprobs", "rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "start", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    tokens: _containers.RepeatedCompositeFieldContainer[TokenResult]
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[TokenResult, _Mapping]]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RequestFailure(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_ids", "sampled_token_ids", "results", "error", "num_tokens", "num_seqs", "forward_ns", "sample_ns", "draining", "failed", "prompt_logprobs", "received_unix_ns", "prepare_ns", "replied_unix_ns", "accepted", "device_idle_ns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    REPLIED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDLE_NS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenResult]
    error: StepError
    num_tokens: int
    num_seqs: int
    forward_ns: int
    sample_ns: int
    draining: bool
    failed: _containers.RepeatedCompositeFieldContainer[RequestFailure]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    received_unix_ns: int
    prepare_ns: int
    replied_unix_ns: int
    accepted: _containers.RepeatedCompositeFieldContainer[Accepted]
    device_idle_ns: int
    def __init__(self, step_id: _Optional[int] = ..., sampled_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., results: _Optional[_Iterable[_Union[TokenResult, _Mapping]]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_seqs: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., draining: _Optional[bool] = ..., failed: _Optional[_Iterable[_Union[RequestFailure, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., received_unix_ns: _Optional[int] = ..., prepare_ns: _Optional[int] = ..., replied_unix_ns: _Optional[int] = ..., accepted: _Optional[_Iterable[_Union[Accepted, _Mapping]]] = ..., device_idle_ns: _Optional[int] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_proposed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_proposed: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_proposed: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_steps", "num_prompt_tokens_computed", "num_output_tokens_computed", "num_sampled_tokens", "num_requests_added", "num_active_requests", "num_failed_requests", "num_resets", "num_proposed_tokens", "num_accepted_tokens")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_ADDED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESETS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_prompt_tokens_computed: int
    num_output_tokens_computed: int
    num_sampled_tokens: int
    num_requests_added: int
    num_active_requests: int
    num_failed_requests: int
    num_resets: int
    num_proposed_tokens: int
    num_accepted_tokens: int
    def __init__(self, num_steps: _Optional[int] = ..., num_prompt_tokens_computed: _Optional[int] = ..., num_output_tokens_computed: _Optional[int] = ..., num_sampled_tokens: _Optional[int] = ..., num_requests_added: _Optional[int] = ..., num_active_requests: _Optional[int] = ..., num_failed_requests: _Optional[int] = ..., num_resets: _Optional[int] = ..., num_proposed_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...
