"""KV budgets: parsing what a user types, converting bytes to tokens at the cache's exact bytes
per token, and refusing budgets that cannot work with a message that says why."""

from pathlib import Path
from typing import Any

import pytest

from memory import Budget, BudgetError, BudgetSpec, ContextManager, Store

FP32 = 46080  # SmolLM2-135M KV bytes per token at float32 ("auto" on CPU)
INT8 = 12060  # and with int8 keys and values, per-block scales included


@pytest.mark.parametrize(
    ("text", "num_bytes", "num_tokens"),
    [
        ("24MiB", 24 * 1024**2, None),
        ("1.5GB", 1_500_000_000, None),
        ("92160000", 92_160_000, None),
        ("4096tok", None, 4096),
        (" 512 tokens ", None, 512),
        ("1TOK", None, 1),
        (2048, None, 2048),
    ],
)
def test_parse(text: str | int, num_bytes: int | None, num_tokens: int | None) -> None:
    spec = BudgetSpec.parse(text)
    assert (spec.num_bytes, spec.num_tokens) == (num_bytes, num_tokens)


@pytest.mark.parametrize("text", ["", "lots", "24 parsecs", "-5tok", "4096 tok tok", "tok"])
def test_bad_text_is_a_budget_error(text: str) -> None:
    with pytest.raises(BudgetError, match="not a KV budget.*24MiB.*4096tok"):
        BudgetSpec.parse(text)


def test_budget_error_is_a_value_error() -> None:
    assert issubclass(BudgetError, ValueError)


def test_bytes_become_tokens_at_the_cache_dtype() -> None:
    spec = BudgetSpec.parse("24MiB")
    assert spec.to_tokens(FP32) == 24 * 1024**2 // FP32 == 546
    assert spec.to_tokens(INT8) == 24 * 1024**2 // INT8 == 2086
    auto, int8 = Budget.from_spec(spec, FP32), Budget.from_spec(spec, INT8)
    assert int8.tokens > 3.8 * auto.tokens
    assert auto.num_bytes is not None and spec.num_bytes is not None and auto.num_bytes <= spec.num_bytes
    assert "546 tokens" in auto.describe() and "MiB" in auto.describe()


def test_token_budgets_ignore_bytes_per_token() -> None:
    assert Budget.from_spec("4096tok", FP32).tokens == Budget.from_spec("4096tok", INT8).tokens == 4096
    remote = Budget.from_spec("4096tok", None)
    assert remote.num_bytes is None and remote.describe() == "4,096 tokens"


def test_a_budget_beyond_the_context_is_capped_at_it() -> None:
    # 300 MiB of int8 KV would hold 26,083 tokens of SmolLM2; its context is 8,192.
    capped = Budget.from_spec("300MiB", INT8, 8192)
    assert (capped.tokens, capped.requested_tokens) == (8192, 300 * 1024**2 // INT8)
    assert capped.high_tokens == int(8192 * 0.85)
    assert capped.describe() == (
        "8,192 tokens (94.2 MiB), the most one conversation can hold; 300MiB would be 26,083"
    )
    within = Budget.from_spec("8192tok", INT8, 8192)
    assert (within.tokens, within.requested_tokens) == (8192, None)
    assert Budget.from_spec("9000tok", None, 8192).describe() == (
        "8,192 tokens, the most one conversation can hold; 9000tok would be 9,000"
    )


def test_bytes_without_bytes_per_token_are_refused() -> None:
    with pytest.raises(BudgetError, match="needs the KV bytes per token.*give it in tokens"):
        Budget.from_spec("24MiB", None)


def test_budget_holding_no_token_is_refused() -> None:
    with pytest.raises(BudgetError, match="holds no tokens"):
        Budget.from_spec("1KiB", FP32)
    with pytest.raises(BudgetError, match="holds no tokens"):
        Budget.from_spec("0tok", FP32)


def test_watermarks_are_validated() -> None:
    budget = Budget.from_spec("1000tok", FP32, high_watermark=0.9, low_watermark=0.5)
    assert (budget.high_tokens, budget.low_tokens) == (900, 500)
    for high, low in [(0.5, 0.5), (0.5, 0.7), (1.2, 0.5), (0.8, 0.0), (0.8, -0.1)]:
        with pytest.raises(BudgetError, match="watermarks must satisfy 0 < low < high <= 1"):
            Budget.from_spec("1000tok", FP32, high_watermark=high, low_watermark=low)
    with pytest.raises(BudgetError, match="reply reserve"):
        Budget.from_spec("1000tok", FP32, reserve_tokens=0)
    with pytest.raises(BudgetError, match="recall_share"):
        Budget.from_spec("1000tok", FP32, recall_share=1.0)


class TokenizerOnly:
    """A backend with a real tokenizer and nothing to run: enough to size a session's budget."""

    kind = "local"
    model_name = "tokenizer-only"

    def __init__(self, tokenizer: Any, bytes_per_token: int | None) -> None:
        self.tokenizer = tokenizer
        self.bytes_per_token = bytes_per_token
        self.kv_dtypes = ("float32", "float32") if bytes_per_token else (None, None)
        self.max_context_tokens = 8192 if bytes_per_token else None

    def stream(self, prompt: Any, params: Any) -> Any:
        raise AssertionError("no request is expected")

    def stats(self) -> None:
        return None


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def test_budget_smaller_than_system_prompt_and_reserve_is_refused(tokenizer: Any, tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    backend = TokenizerOnly(tokenizer, FP32)
    with pytest.raises(
        BudgetError, match=r"smaller than the system prompt \(\d+ tokens\) plus the reply reserve"
    ):
        ContextManager.create(store, backend, system="You are a helpful assistant.", budget="200tok")
    with pytest.raises(BudgetError, match="raise it to at least"):
        ContextManager.create(store, backend, system="word " * 400, budget="420tok", reserve_tokens=64)
    assert store.list_sessions() == []  # refused before anything was stored
    manager = ContextManager.create(store, backend, budget="300tok")
    assert manager.budget.tokens == 300


def test_bytes_budget_on_a_backend_without_bytes_per_token_is_refused(tokenizer: Any, tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    remote = TokenizerOnly(tokenizer, None)
    with pytest.raises(BudgetError, match="cannot report; give it in tokens"):
        ContextManager.create(store, remote, budget="24MiB")
    manager = ContextManager.create(store, remote, budget="4096tok")
    assert manager.budget.bytes_per_token is None
    assert store.get_session(manager.session_id).bytes_per_token is None


def test_session_budget_is_stored_as_given_and_converted(tokenizer: Any, tmp_path: Path) -> None:
    store = Store(tmp_path / "liubai.db")
    manager = ContextManager.create(store, TokenizerOnly(tokenizer, INT8), budget="24MiB")
    session = store.get_session(manager.session_id)
    assert (session.budget_spec, session.budget_tokens, session.bytes_per_token) == ("24MiB", 2086, INT8)
    # Resumed on an fp32 cache, the same bytes hold fewer tokens.
    resumed = ContextManager.resume(store, TokenizerOnly(tokenizer, FP32), manager.session_id)
    assert resumed.budget.tokens == 546
    assert store.get_session(manager.session_id).budget_tokens == 546
    # A budget the model's context cannot hold is stored as the context, for every later request.
    resumed.set_budget("1GiB")
    assert store.get_session(manager.session_id).budget_tokens == 8192
    assert resumed.budget.high_tokens == int(8192 * 0.85)
