"""Tokenizer from a Hugging Face folder (tokenizer.json) or from GGUF metadata.

GGUF stores a byte-level BPE vocabulary and merges plus a `pre` name for the
pre-tokenizer; we rebuild the equivalent `tokenizers.Tokenizer`. SmolLM2's `smollm`
pre-tokenizer splits every digit on its own before GPT-2 byte-level BPE.
"""

from __future__ import annotations

from functools import cache, cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from control_plane.chat_template import GEMMA3_TEMPLATE, render_chat
from hetero_common import vocab
from hetero_common.model_path import read_json_object

# `tokenizer.ggml.pre` -> pre-tokenizer split regex (None: GPT-2's own, built into ByteLevel)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    """The tokenizer files are missing or of a kind we cannot build, or an input is one
    it cannot take (a text that is not Unicode, a chat for a model without a template)."""


@cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@cache
def _byte_table() -> dict[int, int]:
    """`_byte_decoder` for str.translate: each of its characters to the code point of its
    byte, and every other character below 256 to U+0100, so that a piece with a character
    outside the map fails to encode as latin-1."""
    table = dict.fromkeys(range(256), 0x100)
    table.update((ord(c), b) for c, b in _byte_decoder().items())
    return table


class TokenizerWrapper:
    """Encode / decode, token bytes, special ids, chat template."""

    def __init__(
        self,
        tok: Tokenizer,
        *,
        byte_level: bool,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos: bool,
        chat_template: str | None,
        special_ids: set[int],
    ) -> None:
        self.tok = tok
        self.byte_level = byte_level
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.all_special_ids = frozenset(special_ids)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._bytes: list[bytes] = [self._token_bytes(i) for i in range(self.vocab_size)]
        self._bytes_skipping: list[bytes] | None = None  # built on first use
        # No token spans more bytes than this, so a text of B bytes has >= B / this tokens.
        self.max_token_bytes = max(1, *(len(b) for b in self._bytes))

    @cached_property
    def vocab_fingerprint(self) -> bytes:
        """hetero_common.vocab's fingerprint of this vocabulary (a compute plane's model
        must have the same)."""
        return vocab.tokenizer_fingerprint(self.tok)

    def _token_bytes(self, i: int) -> bytes:
        piece = self.tok.id_to_token(i)
        if piece is None:
            return b""
        if i in self.all_special_ids:
            return piece.encode()
        if self.byte_level:  # the bytes of a piece of mapped characters, else its UTF-8
            try:
                return piece.translate(_byte_table()).encode("latin-1")
            except UnicodeEncodeError:
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # byte-fallback token
        return piece.replace("▁", " ").encode()

    def bytes_table(self, skip_special_tokens: bool) -> list[bytes]:
        """Each token id's bytes; special tokens' empty when skipped. Shared: do not modify."""
        if not skip_special_tokens:
            return self._bytes
        if self._bytes_skipping is None:
            self._bytes_skipping = [
                b"" if i in self.all_special_ids else b for i, b in enumerate(self._bytes)
            ]
        return self._bytes_skipping

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_unicode(text)
        # encode_batch releases the GIL (encode does not), so a long prompt tokenised in a
        # worker thread does not stall the event loop and every other request with it.
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The token decoded alone (for logprob displays)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        bos = self.tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos or "",
            eos or "",
            tools,
            continue_final_message=continue_final_message,
            special_tokens=self.special_tokens,
            kwargs=kwargs,
        )

    @property
    def special_tokens(self) -> dict[str, str]:
        """Template variables as transformers passes its special_tokens_map."""
        out = {}
        for name, tid in (
            ("bos_token", self.bos_token_id),
            ("eos_token", (self.eos_token_ids or (None,))[0]),
        ):
            if tid is not None and (piece := self.tok.id_to_token(tid)):
                out[name] = piece
        return out


def _check_unicode(text: str) -> None:
    """tokenizers refuses a lone UTF-16 surrogate with a TypeError. JSON can spell one
    ("\\ud800"), so a chat's JSON fields (tools, template variables, documents, tool-call
    arguments) can bring one into the rendered prompt: that is the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(
            f"the input holds a lone UTF-16 surrogate at character {e.start} of the prompt, "
            "which is not text"
        ) from None


def load_tokenizer(path: Path) -> TokenizerWrapper:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_dir():
        return _from_folder(path)
    raise TokenizerError(f"{path}: not a model folder nor a .gguf file")


def _from_gguf(path: Path) -> TokenizerWrapper:
    from hetero_common.gguf_reader import open_gguf

    reader = open_gguf(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    tokens: list[str] | None = field("tokenizer.ggml.tokens")
    if tokens is None:
        raise TokenizerError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    types: list[int] = field("tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "llama" and not field("tokenizer.ggml.add_space_prefix", True):
        return _gemma_from_gguf(field, tokens, types)
    if kind != "gpt2":
        raise TokenizerError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE, and "
            "'llama' SentencePiece BPE without a prefix space, as Gemma's)"
        )
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = field("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama-bpe", "llama3", "qwen2"):
        regex = _QWEN2_REGEX if pre == "qwen2" else _LLAMA3_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise TokenizerError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    special = {i for i, t in enumerate(types) if t == 3}
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    eos = field("tokenizer.ggml.eos_token_id")
    bos = field("tokenizer.ggml.bos_token_id")
    return TokenizerWrapper(
        tok,
        byte_level=True,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
        chat_template=field("tokenizer.chat_template"),
        special_ids=special,
    )


def _gemma_from_gguf(field: Any, tokens: list[str], types: list[int]) -> TokenizerWrapper:
    """A SentencePiece BPE vocabulary (Gemma's GGUF: `llama` model, no prefix space) as a
    `tokenizers` BPE with byte fallback. The file lists no merges: they are rebuilt from
    the vocabulary, each token's splits into two tokens, ranked by the token's place in
    the file (Gemma's merge order; its scores do not follow it). Runs of spaces are
    stored as real spaces but looked up as "▁"s."""
    spaces = {i for i, t in enumerate(tokens) if t and not t.strip(" ")}
    pieces = ["▁" * len(t) if i in spaces else t for i, t in enumerate(tokens)]
    vocab = {t: i for i, t in enumerate(pieces)}
    merges = []
    for rank, piece in enumerate(pieces):
        if types[rank] != 1 and rank not in spaces:  # normal tokens are reached by merging
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        splits = [(a, b) for a, b in splits if a in vocab and b in vocab]
        # Within one token: longer left parts first, then the vocabulary's order.
        splits.sort(key=lambda ab: (-len(ab[0]), vocab[ab[0]], vocab[ab[1]]))
        merges += splits
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=pieces[int(field("tokenizer.ggml.unknown_token_id", 3))],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    special = {i for i, t in enumerate(types) if t == 3}
    tok.add_special_tokens(
        [AddedToken(pieces[i], special=True, normalized=False) for i in sorted(special)]
    )
    # User-defined tokens (runs of newlines, ...) match whole; runs of spaces merge.
    added = [i for i, t in enumerate(types) if t == 4 and i not in spaces]
    tok.add_tokens([AddedToken(pieces[i], normalized=False) for i in added])
    eos, bos = field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.bos_token_id")
    template = field("tokenizer.chat_template")
    if not template and field("general.architecture") == "gemma3":
        template = GEMMA3_TEMPLATE.read_text()  # (the bundled gemma3 file has none)
    return TokenizerWrapper(
        tok,
        byte_level=False,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
        chat_template=template,
        special_ids=special,
    )


def _from_folder(folder: Path) -> TokenizerWrapper:
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        raise TokenizerError(f"{folder}: missing tokenizer.json")
    spec = read_json_object(tj)
    try:
        tok = Tokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise TokenizerError(f"{tj}: not a tokenizer the tokenizers library reads: {e}") from None
    cfg_path = folder / "tokenizer_config.json"
    cfg = read_json_object(cfg_path) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def token_id(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return None if value is None else tok.token_to_id(value)

    eos_ids: list[int] = []
    for source in (folder / "generation_config.json", folder / "config.json"):
        if source.is_file():
            eos = read_json_object(source).get("eos_token_id")
            for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
                if int(i) not in eos_ids:
                    eos_ids.append(int(i))
    cfg_eos = token_id(cfg.get("eos_token"))
    if cfg_eos is not None and cfg_eos not in eos_ids:
        eos_ids.append(cfg_eos)
    decoder = (spec.get("decoder") or {}).get("type", "")
    decoders_used = {decoder} | {
        d.get("type") for d in (spec.get("decoder") or {}).get("decoders", [])
    }
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    return TokenizerWrapper(
        tok,
        byte_level="ByteLevel" in decoders_used,
        bos_token_id=token_id(cfg.get("bos_token")),
        eos_token_ids=tuple(eos_ids),
        add_bos=bool(cfg.get("add_bos_token", False)),
        chat_template=template,
        special_ids=special,
    )
