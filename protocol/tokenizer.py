"""Tokenizers and chat templates, pure: strings and bytes in, no file or network I/O.

Two tokenizers share one interface (:class:`Tokenizer`):

- :class:`ByteTokenizer` — the presets' tokenizer: ids ``0..255`` are UTF-8 bytes, then a handful of
  special tokens. Any text round-trips exactly.
- :class:`HFTokenizer` — a Hugging Face ``tokenizers`` tokenizer built from the *content* of a
  ``tokenizer.json`` plus the ``tokenizer_config.json`` dict (special tokens, chat template).

Chat templates are rendered like transformers does (sandboxed jinja2, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``tojson``, ``strftime_now``), so a model's own template produces the prompt it was
trained on. The rendered prompt already contains any BOS the template adds: encode it with
``add_special_tokens=False``.

:class:`DetokenizeState` turns a stream of token ids into text deltas that never split a UTF-8 character
and keep SentencePiece word-boundary spaces (the prefix/read-offset method used by TGI and vLLM).
"""

from __future__ import annotations

import abc
import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Iterator, Mapping, Sequence

from protocol.prompt import message_text

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenizerError",
    "ChatTemplateError",
    "DetokenizeState",
    "decode_stream",
    "render_chat_template",
    "DEFAULT_CHAT_TEMPLATE",
]

REPLACEMENT = "\ufffd"

#: ChatML-style template for the presets (their special tokens ``<|im_start|>``/``<|im_end|>``).
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TokenizerError(ValueError):
    """Input a tokenizer cannot handle (bad ids, malformed tokenizer.json)."""


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or rejected the messages."""


# ----------------------------------------------------------------------------- chat templates


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the request: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages → template input: `protocol.prompt.message_text` of each; part types
    other than text are rejected."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"messages must be a non-empty list, found {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, found {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role must be a string, found {m.get('role')!r}")
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': str}}, "
                        f"found {part!r}")
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts, "
                                    f"found {type(content).__name__}")
        msg["content"] = message_text(msg)      # the recipe's normalisation (protocol/prompt.py)
        out.append(msg)
    return out


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                         **kwargs: Any) -> str:
    """Render a Hugging Face chat template string. Extra keyword arguments (``tools``,
    ``documents``, ``enable_thinking`` …) are passed to the template as variables."""
    from jinja2 import TemplateError

    compiled = _compile(template)
    try:
        return compiled.render(messages=_normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **kwargs)
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, KeyError, AttributeError) as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------- base interface


class Tokenizer(abc.ABC):
    """Common interface. ``eos_token_ids`` is every id that ends generation."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    vocab_size: int
    chat_template: str | None
    bos_token: str
    eos_token: str

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        template = chat_template or self.chat_template
        if not template:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json has no "
                                    "'chat_template'); use /v1/completions or pass a template")
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)

    def detokenizer(self, prompt_ids: Sequence[int] | None = None,
                    skip_special_tokens: bool = True) -> "DetokenizeState":
        return DetokenizeState(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)


# ----------------------------------------------------------------------------- byte-level


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids ``0..255``, special tokens from 256 on.

    Special token strings inside text are encoded as their ids (as Hugging Face tokenizers do by
    default), so a rendered chat template tokenizes its markers as single tokens. Ids in
    ``[256 + len(specials), vocab_size)`` exist in the model's embedding but mean nothing: they decode
    to the empty string."""

    SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, vocab_size: int = 261, chat_template: str | None = DEFAULT_CHAT_TEMPLATE) -> None:
        if vocab_size < 256 + len(self.SPECIALS):
            raise TokenizerError(f"a byte tokenizer needs vocab_size >= {256 + len(self.SPECIALS)}, found {vocab_size}")
        self.vocab_size = vocab_size
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self._special_by_id = {i: t for t, i in self.special_ids.items()}
        self.bos_token = "<|begin_of_text|>"
        self.eos_token = "<|end_of_text|>"
        self.bos_token_id = self.special_ids[self.bos_token]
        self.eos_token_ids = (self.special_ids[self.eos_token], self.special_ids["<|im_end|>"])
        self.pad_token_id = self.special_ids["<|pad|>"]
        self.chat_template = chat_template
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIALS) + ")")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, found {type(text).__name__}")
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self.special_ids.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            if not isinstance(i, int) or i < 0 or i >= self.vocab_size:
                raise TokenizerError(f"token id must be an int in [0, {self.vocab_size}), found {i!r}")
            if i < 256:
                out.append(i)
                continue
            special = self._special_by_id.get(i)
            if special is not None and not skip_special_tokens:
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(special)
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)


# ----------------------------------------------------------------------------- Hugging Face


def _token_content(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]  # serialized AddedToken
    raise TokenizerError(f"special token must be a string or {{'content': str}}, found {value!r}")


def _pick_template(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    raise ChatTemplateError(f"chat_template must be a string or a list of named templates, found {type(value).__name__}")


class HFTokenizer(Tokenizer):
    """A ``tokenizers`` tokenizer plus ``tokenizer_config.json`` settings.

    BOS insertion on ``encode(add_special_tokens=True)`` comes from tokenizer.json's post-processor,
    exactly as transformers' fast tokenizers do. ``extra_eos_token_ids`` adds stop ids from
    ``generation_config.json`` (e.g. Llama-3-Instruct's ``<|eot_id|>``)."""

    def __init__(self, tokenizer: Any, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_token_ids: Iterable[int] = ()) -> None:
        config = dict(config or {})
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_content(config.get("bos_token")) or ""
        self.eos_token = _token_content(config.get("eos_token")) or ""
        pad = _token_content(config.get("pad_token"))
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        eos: list[int] = []
        if self.eos_token:
            eid = tokenizer.token_to_id(self.eos_token)
            if eid is None:
                raise TokenizerError(f"eos_token {self.eos_token!r} from tokenizer_config.json is not in the vocabulary")
            eos.append(eid)
        for e in extra_eos_token_ids:
            if int(e) not in eos:
                eos.append(int(e))
        self.eos_token_ids = tuple(eos)
        self.pad_token_id = tokenizer.token_to_id(pad) if pad else None
        self.chat_template = chat_template if chat_template is not None else _pick_template(config.get("chat_template"))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    @classmethod
    def from_json(cls, tokenizer_json: str | bytes, tokenizer_config: Mapping[str, Any] | None = None,
                  chat_template: str | None = None, extra_eos_token_ids: Iterable[int] = ()) -> "HFTokenizer":
        """From the text of ``tokenizer.json`` (and the parsed ``tokenizer_config.json``)."""
        from tokenizers import Tokenizer as _Tok

        if isinstance(tokenizer_json, bytes):
            tokenizer_json = tokenizer_json.decode("utf-8")
        try:
            tok = _Tok.from_str(tokenizer_json)
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"tokenizer.json could not be parsed: {e}") from e
        return cls(tok, tokenizer_config, chat_template, extra_eos_token_ids)

    @property
    def backend(self) -> Any:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, found {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        for i in ids:
            if not isinstance(i, int) or i < 0 or i >= self.vocab_size:
                raise TokenizerError(f"token id must be an int in [0, {self.vocab_size}), found {i!r}")
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = _clean_up_tokenization(text)
        return text


def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
            .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
            .replace(" 've", "'ve").replace(" 're", "'re"))


# ----------------------------------------------------------------------------- streaming


class DetokenizeState:
    """Incremental detokenization for streaming.

    :meth:`push` returns the text a new token completes — possibly ``""`` while a multi-byte character
    (or a word-boundary space that depends on the next token) is still open — and never a partial UTF-8
    character. :meth:`flush` returns whatever is held back at the end (an unfinished byte sequence then
    becomes U+FFFD). The concatenation of all deltas equals ``decode(all generated ids)`` up to
    tokenizer-specific whitespace cleanup.

    ``prompt_ids`` seeds a few tokens of context so the first generated token decodes with the spacing
    it has after the prompt; they are never emitted.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        seed = list(prompt_ids[-self.CONTEXT:]) if prompt_ids else []
        self._ids: list[int] = seed
        self._prefix = 0
        self._read = len(seed)
        self.text = ""
        self.num_tokens = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        self.num_tokens += 1
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            # Keep the window bounded: only a few tokens of left context matter for spacing.
            if self._prefix > 64:
                drop = self._prefix
                self._ids = self._ids[drop:]
                self._prefix -= drop
                self._read -= drop
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


def decode_stream(tokenizer: Tokenizer, ids: Iterable[int], prompt_ids: Sequence[int] | None = None,
                  skip_special_tokens: bool = True) -> Iterator[str]:
    """Yield the non-empty text deltas of ``ids`` as they become printable, then the flushed tail."""
    state = DetokenizeState(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    for i in ids:
        delta = state.push(i)
        if delta:
            yield delta
    tail = state.flush()
    if tail:
        yield tail
