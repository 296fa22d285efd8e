"""Token counts for a model that runs elsewhere: local tokenizer first, then tiktoken, then the server.

A remote server reports ``usage`` with every reply, and that count is the truth; this module is
for what the server does not tell (a server without usage, a budget checked before sending). The
local Hugging Face tokenizer, when the user has the model's files, counts exactly: messages are
rendered through its chat template. OpenAI-family model names are counted with tiktoken and the
per-message overhead OpenAI documents; any other name is counted by nobody here, so
:class:`TokenCounter` answers ``None`` and its ``source`` says ``"server"``.

tiktoken downloads its encodings on first use, which fails offline. liubai points
``TIKTOKEN_CACHE_DIR`` at its own cache (unless the user chose a directory) and uses an encoding
only when its file is there with the right sha256, so tiktoken never reaches for the network;
``liubai pull tiktoken`` (``runtime/backends/tiktoken_pull.py``) fills that cache.
"""

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from runtime.paths import cache_dir

SOURCES = ("tokenizer", "tiktoken", "server", "estimate")

# OpenAI's documented chat overhead: every message is wrapped in 3 tokens, a ``name`` costs one
# more, and the reply is primed with 3 (``<|start|>assistant<|message|>``).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3


@dataclass(frozen=True, slots=True)
class TiktokenFile:
    """One encoding file as tiktoken caches it: named by the sha1 of its URL, checked by sha256."""

    encoding: str
    sha256: str

    @property
    def url(self) -> str:
        return f"https://openaipublic.blob.core.windows.net/encodings/{self.encoding}.tiktoken"

    @property
    def cache_name(self) -> str:
        return hashlib.sha1(self.url.encode()).hexdigest()


# The hashes are the ones tiktoken itself expects (tiktoken_ext/openai_public.py).
TIKTOKEN_FILES: Mapping[str, TiktokenFile] = MappingProxyType(
    {
        "cl100k_base": TiktokenFile(
            "cl100k_base", "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
        ),
        "p50k_base": TiktokenFile(
            "p50k_base", "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069"
        ),
        "o200k_base": TiktokenFile(
            "o200k_base", "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
        ),
    }
)

# Chat model families, most specific first ("gpt-4o" before "gpt-4").
_FAMILY_ENCODINGS = (
    ("gpt-4o", "o200k_base"),
    ("chatgpt-4o", "o200k_base"),
    ("gpt-4.1", "o200k_base"),
    ("gpt-4.5", "o200k_base"),
    ("gpt-5", "o200k_base"),
    ("o1", "o200k_base"),
    ("o3", "o200k_base"),
    ("o4", "o200k_base"),
    ("gpt-4", "cl100k_base"),
    ("gpt-3.5", "cl100k_base"),
    ("gpt-35", "cl100k_base"),  # Azure deployment names
)


@dataclass(frozen=True, slots=True)
class TokenCount:
    tokens: int
    source: str  # one of SOURCES

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"a token count cannot be negative, got {self.tokens}")
        if self.source not in SOURCES:
            raise ValueError(f"token count source must be one of {', '.join(SOURCES)}, got {self.source!r}")


def tiktoken_cache_dir() -> Path:
    """Where tiktoken looks for its files: the user's choice, else liubai's cache."""
    chosen = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    return Path(chosen) if chosen else cache_dir() / "tiktoken"


def use_liubai_tiktoken_cache() -> Path:
    """Point ``TIKTOKEN_CACHE_DIR`` at :func:`tiktoken_cache_dir` unless the user set it; return it.

    An empty value (tiktoken's "do not cache") is replaced too: offline, no cache means no tiktoken.
    """
    path = tiktoken_cache_dir()
    if not os.environ.get("TIKTOKEN_CACHE_DIR"):
        os.environ["TIKTOKEN_CACHE_DIR"] = str(path)
    return path


def tiktoken_file_ok(encoding: str, directory: Path | None = None) -> bool:
    """Whether the cache holds ``encoding``'s file with the sha256 tiktoken expects.

    Checked here because tiktoken, finding a missing or corrupt file, would download it.
    """
    spec = TIKTOKEN_FILES.get(encoding)
    if spec is None:
        return False
    path = (directory or tiktoken_cache_dir()) / spec.cache_name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    return hashlib.sha256(data).hexdigest() == spec.sha256


def encoding_for_model(model_name: str) -> str | None:
    """The tiktoken encoding of an OpenAI chat model name, or None for any other model.

    Accepts provider prefixes and snapshots: ``openai/gpt-4o-2024-08-06``, ``ft:gpt-4o:org::id``.
    """
    name = model_name.strip().lower().rsplit("/", 1)[-1].removeprefix("ft:")
    for family, encoding in _FAMILY_ENCODINGS:
        if name == family or (name.startswith(family) and name[len(family)] in "-.:"):
            return encoding
    return None


class TokenCounter:
    """Counts text and chat messages the way one model does, or says it cannot (``None``)."""

    def __init__(
        self,
        source: str,
        *,
        tokenizer: Any | None = None,
        encoding: Any | None = None,
        note: str | None = None,
    ) -> None:
        if source not in ("tokenizer", "tiktoken", "server"):
            raise ValueError(f"a token counter's source is tokenizer, tiktoken or server, got {source!r}")
        if source == "tokenizer" and tokenizer is None:
            raise ValueError("a tokenizer counter needs a tokenizer")
        if source == "tiktoken" and encoding is None:
            raise ValueError("a tiktoken counter needs an encoding")
        self.source = source
        self.tokenizer: Any = tokenizer  # a transformers tokenizer, when source is "tokenizer"
        self.encoding: Any = encoding  # a tiktoken.Encoding, when source is "tiktoken"
        self.note = note  # why a better source was not used, for a status line

    @classmethod
    def for_model(
        cls, model_name: str, tokenizer: Any | None = None, *, fallback_encoding: str | None = None
    ) -> "TokenCounter":
        """The best local counter for ``model_name``.

        ``fallback_encoding`` (e.g. ``"cl100k_base"``) counts an unknown model name with tiktoken
        anyway, as a labelled approximation; only when the user asks for it.
        """
        if tokenizer is not None:
            return cls("tokenizer", tokenizer=tokenizer)
        if fallback_encoding is not None and fallback_encoding not in TIKTOKEN_FILES:
            raise ValueError(
                f"unknown tiktoken encoding {fallback_encoding!r}; choose one of {', '.join(TIKTOKEN_FILES)}"
            )
        name = encoding_for_model(model_name) or fallback_encoding
        if name is None:
            return cls("server", note=f"no local tokenizer for {model_name!r}; counts come from the server")
        directory = use_liubai_tiktoken_cache()
        if not tiktoken_file_ok(name, directory):
            return cls("server", note=f"tiktoken {name} is not in {directory}; run `liubai pull tiktoken`")
        import tiktoken

        return cls("tiktoken", encoding=tiktoken.get_encoding(name))

    @property
    def encoding_name(self) -> str | None:
        return None if self.encoding is None else str(self.encoding.name)

    def count_text(self, text: str) -> TokenCount | None:
        if self.source == "tokenizer":
            return TokenCount(len(self.tokenizer.encode(text, add_special_tokens=False)), "tokenizer")
        if self.source == "tiktoken":
            return TokenCount(len(self.encoding.encode(text, disallowed_special=())), "tiktoken")
        return None

    def count_messages(self, messages: Sequence[Mapping[str, str]]) -> TokenCount | None:
        """Tokens of a prompt made of ``messages``, the assistant's turn opened."""
        if self.source == "tokenizer":
            return TokenCount(len(self._render_ids(messages)), "tokenizer")
        if self.source == "tiktoken":
            total = TOKENS_REPLY_PRIMING
            for message in messages:
                total += TOKENS_PER_MESSAGE
                for key, value in message.items():
                    total += len(self.encoding.encode(str(value), disallowed_special=()))
                    if key == "name":
                        total += TOKENS_PER_NAME
            return TokenCount(total, "tiktoken")
        return None

    def _render_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The ids the model sees: its chat template (which places the special tokens), else the text."""
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
            )
        else:
            text = "\n\n".join(str(m.get("content", "")) for m in messages)
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids
