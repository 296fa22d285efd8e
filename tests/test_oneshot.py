"""The one-shot run's pieces: option validation, the chat-template prompt, the timing line."""

import pytest

from agent.oneshot import RunOptions, build_prompt_ids, format_timing
from runtime.metrics import RequestMetrics


class FakeTokenizer:
    """Records the messages it was given; "tokenizes" to one id per character."""

    def __init__(self, chat_template: str | None = "chatml") -> None:
        self.chat_template = chat_template
        self.messages: list[dict[str, str]] = []

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> str:
        assert add_generation_prompt and not tokenize
        self.messages = messages
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        assert not add_special_tokens  # the template already placed the special tokens
        return {"input_ids": [ord(c) for c in text]}


def test_prompt_uses_chat_template_with_system() -> None:
    tok = FakeTokenizer()
    ids = build_prompt_ids(tok, "hi", system="be brief")
    assert tok.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert "".join(map(chr, ids)) == "<system>be brief<user>hi<assistant>"


def test_prompt_without_system_or_template() -> None:
    tok = FakeTokenizer()
    build_prompt_ids(tok, "hi")
    assert tok.messages == [{"role": "user", "content": "hi"}]
    plain = build_prompt_ids(FakeTokenizer(chat_template=None), "hi")
    assert "".join(map(chr, plain)) == "hi"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"prompt": "  "}, "empty"),
        ({"max_tokens": 0}, "--max-tokens"),
        ({"top_p": 1.5}, "--top-p"),
        ({"top_k": -1}, "--top-k"),
        ({"kv_pool": "12XB"}, "unknown size unit"),
        ({"kv_dtype": "int3"}, "--kv-dtype must be one of auto, int8, fp8, int4"),
        ({"v_dtype": "fp4"}, "--v-dtype"),
    ],
)
def test_options_validate(kwargs: dict[str, object], fragment: str) -> None:
    values: dict[str, object] = {"prompt": "hi", **kwargs}
    with pytest.raises(ValueError, match=fragment):
        RunOptions(**values)  # type: ignore[arg-type]


def test_timing_line() -> None:
    m = RequestMetrics(
        num_prompt_tokens=35,
        num_cached_tokens=16,
        prefill_ms=120.4,
        ttft_ms=130.2,
        num_generated_tokens=64,
        decode_ms=2066.0,
    )
    assert format_timing(m) == (
        "prompt 35 tok (cached 16) · prefill 120 ms · ttft 130 ms · 64 tok in 2.1 s (30.5 tok/s)"
    )
