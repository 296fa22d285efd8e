"""model_loader: every spelling of --model resolves to one directory, or to a one-line error."""

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.errors import ModelError
from runtime.models import pull as model_pull
from runtime.models.loader import eos_token_ids, load_model, resolve_device, resolve_dtype, resolve_model
from runtime.models.registry import DEFAULT_MODEL, REGISTRY
from runtime.paths import models_dir


def test_short_name_resolves_to_pulled_dir(fake_cache: Path) -> None:
    target = models_dir() / DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / model_pull.MARKER).write_text("{}")

    assert resolve_model(DEFAULT_MODEL, pull=False) == target
    assert resolve_model(DEFAULT_MODEL.upper(), pull=False) == target


def test_short_name_not_pulled_tells_user_to_pull(fake_cache: Path) -> None:
    with pytest.raises(ModelError, match=f"run `liubai pull {DEFAULT_MODEL}`"):
        resolve_model(DEFAULT_MODEL, pull=False)


def test_short_name_pulls_when_missing(fake_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pulled: list[str] = []

    def fake_pull(entry: object) -> Path:
        pulled.append(getattr(entry, "name", ""))
        return Path("/pulled")

    monkeypatch.setattr("runtime.models.loader.pull_model", fake_pull)
    assert resolve_model(DEFAULT_MODEL) == Path("/pulled")
    assert pulled == [DEFAULT_MODEL]


def test_model_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="without config.json"):
        resolve_model(tmp_path)


def test_gguf_file_is_converted_once(tmp_path: Path, fake_cache: Path, fake_convert: list[Path]) -> None:
    gguf = tmp_path / "Tiny-Model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF tiny fake")
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()

    first = resolve_model(gguf)
    second = resolve_model(str(gguf))

    assert first == second == models_dir() / "gguf" / f"Tiny-Model.Q8_0-{digest[:12]}"
    assert model_pull.is_complete(first) and (first / "config.json").is_file()
    assert fake_convert == [gguf]
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging dir left


def test_edited_gguf_converts_again(tmp_path: Path, fake_cache: Path, fake_convert: list[Path]) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"v1")
    first = resolve_model(gguf)
    gguf.write_bytes(b"v2")
    assert resolve_model(gguf) != first
    assert len(fake_convert) == 2


@pytest.mark.parametrize("spec", ["no-such-model", "/nonexistent/model", "./missing.gguf"])
def test_unknown_model_lists_known_names(spec: str) -> None:
    with pytest.raises(ModelError) as caught:
        resolve_model(spec)
    message = str(caught.value)
    assert "\n" not in message
    assert spec in message
    for name in REGISTRY:
        assert name in message


def test_other_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelError, match="neither a .gguf file nor a model directory"):
        resolve_model(path)


def test_auto_device_and_dtype() -> None:
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16


def test_bad_dtype_and_device() -> None:
    with pytest.raises(ValueError, match="not a dtype"):
        resolve_dtype("int3", torch.device("cpu"))
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("abacus")


def test_eos_token_ids_merge_config_and_tokenizer() -> None:
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 7]))
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=7)) == [2, 7]
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=0)) == [0]


@pytest.mark.model
def test_default_model_loads(default_model_path: Path) -> None:
    loaded = load_model(DEFAULT_MODEL, device="cpu")

    config = loaded.model.config
    assert loaded.path == default_model_path
    assert config.num_hidden_layers == 30
    assert config.num_key_value_heads == 3
    assert config.num_attention_heads == 9
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert not loaded.model.training
    assert loaded.eos_token_ids == [2]
    assert loaded.tokenizer.chat_template
