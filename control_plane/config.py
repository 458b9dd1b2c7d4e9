"""The control plane's one config dataclass (CLI flags and --config JSON map onto it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.speculative import SpeculativeConfig
from hetero_common.discovery import targets
from hetero_common.server_config import GrpcServerConfig
from hetero_common.tls import ClientTLS

# Steps planned beyond the one awaited, at most (each costs a finished request a token
# of compute, and a new request a step before its first token).
MAX_STEPS_AHEAD = 4


@dataclass(frozen=True)
class ControlConfig(GrpcServerConfig):
    port: int = field(default=50051, metadata={"help": "gRPC port of the public API"})
    compute: str = field(
        default="127.0.0.1:50052",
        metadata={
            "help": "compute planes: HOST:PORT[,HOST:PORT...]; a host name stands for every "
            "address it resolves to (a Kubernetes headless Service: one per ready pod), "
            "and file:PATH for the HOST:PORT lines of a file; names and files are read "
            "again every --compute-resolve-interval seconds"
        },
    )
    compute_resolve_interval: float = field(
        default=5.0,
        metadata={"help": "seconds between re-resolving --compute (planes join and leave)"},
    )
    max_compute_planes: int = field(
        default=0,
        metadata={
            "help": "drive at most this many compute planes (0: all); with R control planes "
            "sharing N compute planes, N/R each"
        },
    )
    route_load_slack: int = field(
        default=16,
        metadata={
            "help": "a request goes to the compute plane with its longest prefix-cache hit "
            "unless that plane has more than this many requests beyond the least loaded one"
        },
    )
    model: str = field(
        default="default",
        metadata={"help": "tokenizer source: HF folder, .gguf, 'default' or 'gemma3'"},
    )
    metrics_port: int = field(
        default=8001,
        metadata={
            "help": "port of the Prometheus /metrics endpoint (0: a free one, logged; -1: off)"
        },
    )
    compute_timeout: float = field(
        default=60.0,
        metadata={"help": "seconds to wait for a lost compute plane before failing its requests"},
    )
    max_num_seqs: int = field(default=256, metadata={"help": "most requests in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one step"})
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "cap on prompt + output tokens (default: the compute plane's)"},
    )
    max_num_blocks: int | None = field(
        default=None,
        metadata={"help": "use at most this many KV blocks (default: all the compute plane has)"},
    )
    max_waiting: int = field(
        default=1024,
        metadata={"help": "bounded waiting queue; beyond it requests get RESOURCE_EXHAUSTED"},
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse KV blocks of identical prompt prefixes"}
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "a jinja2 chat template file that overrides the model's own"},
    )
    stream_interval: int = field(
        default=1,
        metadata={
            "help": "send each stream its tokens every N tokens (the first and last at once); "
            "N > 1 cuts the per-token cost of streaming at high concurrency"
        },
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            "help": "plan and send each step before the previous one's result arrives, so the "
            "compute plane never waits for the control plane (EOS and max_tokens then end a "
            "request one step late; its extra token is dropped). Steps with grammar masks or "
            "speculative proposals are still planned one at a time. Unset: on for a compute "
            "plane that runs on a GPU in another process, off for one on a CPU (where its "
            "step is long beside the round trip and the planes share the cores) and for an "
            "in-process engine"
        },
    )
    steps_ahead: int | None = field(
        default=None,
        metadata={
            "help": "with async scheduling, how many steps are planned and sent beyond the "
            "one whose result is awaited (1 to 4): with 2, step k+2 leaves when step k's "
            "result arrives, so the round trip (result back, plan, send, the compute plane's "
            "input build) has two device steps to hide behind instead of one. EOS, stop "
            "strings and max_tokens then end a request up to N steps late; the tokens "
            "sampled for it meanwhile are dropped. Unset: 2 for a compute plane on a GPU, 1 "
            "else"
        },
    )
    speculative: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding: ngram (prompt lookup, here) or draft (the compute "
            "plane's --draft-model proposes); off by default"
        },
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "speculative decoding: most tokens proposed per step (k)"}
    )
    ngram_min: int = field(
        default=1, metadata={"help": "ngram speculation: shortest suffix looked up"}
    )
    ngram_max: int = field(
        default=4, metadata={"help": "ngram speculation: longest suffix looked up"}
    )
    speculative_max_batch: int = field(
        default=8,
        metadata={
            "help": "speculate only in steps where at most this many requests decode "
            "(beyond it verifying proposals costs the batch more than it saves)"
        },
    )
    speculative_adaptive: bool = field(
        default=True,
        metadata={
            "help": "each request's k follows its acceptance, and proposals that keep "
            "failing pause (off: always k)"
        },
    )
    grammar_cache_mb: int = field(
        default=256,
        metadata={
            "help": "cap, in MiB, of the compiled structured-output grammars kept for reuse "
            "(an upper estimate of their size; least recently used dropped first; the "
            "newest is kept whatever its size)"
        },
    )
    grammar_warmup: bool = field(
        default=True,
        metadata={
            "help": "build llguidance's view of the vocabulary (structured output) before "
            "serving: seconds and ~200 MB for Gemma 3's; off: at the first request with a "
            "grammar, stalling the other streams meanwhile (docs/performance.md)"
        },
    )
    compute_tls_ca: str | None = field(
        default=None,
        metadata={"help": "PEM CA bundle: dial the compute plane over TLS, verified by it"},
    )
    compute_tls_cert: str | None = field(
        default=None, metadata={"help": "PEM client certificate for the compute plane (mTLS)"}
    )
    compute_tls_key: str | None = field(
        default=None, metadata={"help": "PEM private key of --compute-tls-cert"}
    )

    @property
    def speculation(self) -> SpeculativeConfig | None:
        if self.speculative is None:
            return None
        return SpeculativeConfig(
            self.speculative,
            self.num_speculative_tokens,
            self.ngram_min,
            self.ngram_max,
            self.speculative_max_batch,
            self.speculative_adaptive,
        )

    @property
    def compute_tls(self) -> ClientTLS:
        return ClientTLS(
            self.compute_tls_ca, self.compute_tls_cert, self.compute_tls_key, "compute-tls"
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.compute_tls  # noqa: B018 -- validates the TLS flags
        targets(self.compute)  # a malformed address stops start-up
        self.speculation  # noqa: B018 -- validates the speculative decoding flags
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # 0 or less re-read --compute in a busy loop; a negative cap drove no compute plane.
        if not self.compute_resolve_interval > 0:  # NaN too
            raise ValueError(
                f"compute_resolve_interval must be > 0, got {self.compute_resolve_interval}"
            )
        for name in (
            "compute_timeout",
            "max_compute_planes",
            "route_load_slack",
            "grammar_cache_mb",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.steps_ahead is not None and not 1 <= self.steps_ahead <= MAX_STEPS_AHEAD:
            raise ValueError(
                f"steps_ahead must be 1 to {MAX_STEPS_AHEAD}, got {self.steps_ahead} "
                "(--no-async-scheduling plans one step at a time)"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_blocks is not None and self.max_num_blocks < 2:
            raise ValueError(
                f"max_num_blocks must be >= 2 (block 0 is reserved), got {self.max_num_blocks}"
            )
