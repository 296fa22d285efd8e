"""Messages to token ids, one message at a time, through the model's chat template.

The prefix cache only hits if turn N+1's prompt starts with exactly the token ids of turn N's.
Tokenizing a whole rendered conversation does not promise that: BPE can merge across the
boundary between the generation prompt (``<|im_start|>assistant\\n``) and the reply that later
follows it. So each message is rendered by the template on its own (the text the template adds
for it, found by rendering with and without it) and tokenized on its own; an assistant
message's segment is split after the generation prompt, so the ids a prompt ended with are the
ids the next prompt continues from. The ids of each message are computed once and cached.
"""

from typing import Any

# For tokenizers without a chat template (tiny test models, base models): ChatML.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
_ANCHOR = {"role": "system", "content": "x"}


class ChatRenderer:
    source = "tokenizer"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.template: str | None = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
        anchor_text = self._render([_ANCHOR])
        self.generation_prompt_text = self._render([_ANCHOR], add_generation_prompt=True)[len(anchor_text) :]
        self.generation_prompt_ids = self.encode(self.generation_prompt_text)
        self._anchor_text = anchor_text
        self._cache: dict[tuple[str, str, bool], list[int]] = {}

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def segment_text(self, role: str, content: str, first: bool = False) -> str:
        """The text the template adds for one message: at the very start, or after another."""
        if first:
            return self._render([{"role": role, "content": content}])
        full = self._render([_ANCHOR, {"role": role, "content": content}])
        if not full.startswith(self._anchor_text):
            raise ValueError("the chat template renders a message differently depending on what follows it")
        return full[len(self._anchor_text) :]

    def message_ids(self, role: str, content: str, first: bool = False) -> list[int]:
        key = (role, content, first)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        text = self.segment_text(role, content, first)
        if role == "assistant" and text.startswith(self.generation_prompt_text):
            ids = self.generation_prompt_ids + self.encode(text[len(self.generation_prompt_text) :])
        else:
            ids = self.encode(text)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = ids
        return ids

    def count(self, role: str, content: str, first: bool = False) -> int:
        return len(self.message_ids(role, content, first))


class _ApproximateTokenizer:
    """About four characters per token, for a remote model nothing local can count.

    Pieces are interned so that ids decode back to their text, which compaction needs to cut a
    long message to size. The counts are estimates; the server's reported usage is what the
    request log records.
    """

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for start in range(0, len(text), 4):
            piece = text[start : start + 4]
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            ids.append(self._ids[piece])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self._pieces[i] for i in ids)


class _TiktokenTokenizer:
    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def encode(self, text: str) -> list[int]:
        return list(self.encoding.encode(text, disallowed_special=()))

    def decode(self, ids: list[int]) -> str:
        return str(self.encoding.decode(ids))


class CountingRenderer:
    """Counts a remote model's prompt where no local tokenizer renders it exactly.

    With tiktoken (OpenAI-family models) each message costs its role and content tokens plus
    OpenAI's documented 3 per message and 3 to prime the reply; without it, an estimate. The ids
    only count: a remote backend is sent the messages, never these ids.
    """

    MESSAGE_OVERHEAD = 3
    REPLY_PRIMING = 3

    def __init__(self, model_name: str) -> None:
        from runtime.backends.token_counting import TokenCounter

        counter = TokenCounter.for_model(model_name)
        if counter.source == "tiktoken":
            self.tokenizer: Any = _TiktokenTokenizer(counter.encoding)
            self.source = "tiktoken"
        else:
            self.tokenizer = _ApproximateTokenizer()
            self.source = "estimate"
        self.generation_prompt_ids = [0] * self.REPLY_PRIMING

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def message_ids(self, role: str, content: str, first: bool = False) -> list[int]:
        return [0] * self.MESSAGE_OVERHEAD + self.encode(role) + self.encode(content)

    def count(self, role: str, content: str, first: bool = False) -> int:
        return len(self.message_ids(role, content, first))


Renderer = ChatRenderer | CountingRenderer


def renderer_for(tokenizer: Any | None, model_name: str) -> Renderer:
    """The model's own chat template where its tokenizer is local; a counter otherwise."""
    return ChatRenderer(tokenizer) if tokenizer is not None else CountingRenderer(model_name)
