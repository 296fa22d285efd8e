"""Shared fixtures: every test gets its own data dir; the model cache is shared on purpose.

Databases and logs go to ``tmp_path`` so no test can read or write the user's history. The
model cache (``~/.cache/liubai/models``) is left alone: converting the default model costs
~20 s and ~500 MB, so it is pulled once and reused by every run. Tests of the pull machinery
itself point ``LIUBAI_CACHE_DIR`` at a temporary directory with the ``fake_cache`` fixture.

Caches of what was measured or built on this machine (:data:`MACHINE_CACHES`: the GEMM plans
of ``runtime/layers/gemm.py``, inductor's compiled graphs) go to a fresh directory per test
session, never to the user cache, so no test depends on what an earlier run left there. Per
session, not per test: module- and session-scoped engines are built before any function-scoped
fixture runs, and timing a GEMM plan costs a minute or more, which each test would otherwise
pay again. The KV disk tier is one too (for module-scoped engines), and each test also gets a
fresh one of its own.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.models.loader import resolve_model
from runtime.models.registry import DEFAULT_MODEL

# The environment variable that moves each machine-specific cache, and its directory's name.
MACHINE_CACHES = {
    "LIUBAI_GEMM_PLAN_DIR": "gemm",
    "LIUBAI_WEIGHT_CACHE_DIR": "weights",
    "LIUBAI_WEIGHT_PLAN_DIR": "weight-plan",
    "LIUBAI_KV_DISK_DIR": "kv",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
}


@pytest.fixture(scope="session", autouse=True)
def _hermetic_machine_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("machine-caches")
    with pytest.MonkeyPatch.context() as patch:
        for variable, name in MACHINE_CACHES.items():
            patch.setenv(variable, str(root / name))
        yield root


@pytest.fixture(autouse=True)
def _hermetic_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    data = tmp_path / "liubai-data"
    monkeypatch.setenv("LIUBAI_DATA_DIR", str(data))
    # The KV disk tier per test too: a later run in the same test may hit what an earlier one
    # wrote, a test never hits another test's blocks.
    monkeypatch.setenv("LIUBAI_KV_DISK_DIR", str(tmp_path / "liubai-kv"))
    return data


@pytest.fixture
def fake_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache for tests that pull or convert fakes."""
    cache = tmp_path / "liubai-cache"
    monkeypatch.setenv("LIUBAI_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model's directory, pulled once into the user cache if missing."""
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion with one that writes a stub model directory.

    Returns the list of GGUF files it was asked to convert, so tests can count conversions.
    """
    from runtime.models import pull as model_pull

    calls: list[Path] = []

    def convert(gguf_file: Path, out_dir: Path, show: object) -> None:
        calls.append(gguf_file)
        (out_dir / "config.json").write_text('{"model_type": "llama"}\n')
        (out_dir / "weights.bin").write_bytes(gguf_file.read_bytes())

    monkeypatch.setattr(model_pull, "_convert", convert)
    return calls


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), default_model_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    from tests.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), default_model_path)
