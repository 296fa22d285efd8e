"""Opening the backend an ``AgentConfig`` names: the local engine, or an OpenAI-compatible server."""

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.config import AgentConfig
from runtime.backends.backend import Backend
from runtime.models.registry import lookup

if TYPE_CHECKING:
    from runtime.engine.engine import Engine


def open_backend(config: AgentConfig) -> Backend:
    if config.backend == "openai":
        from runtime.backends.openai_backend import OpenAIBackend

        assert config.base_url is not None
        # A local model directory given as --model lends its tokenizer for exact token counts.
        # (and is served under its directory's name, as ``liubai serve`` names it).
        local_dir = Path(config.model).is_dir()
        return OpenAIBackend.from_env(
            config.base_url,
            Path(config.model).name if local_dir else config.model,
            config.api_key_env,
            tokenizer_path=config.model if local_dir else None,
        )

    from runtime.backends.backend import LocalBackend

    engine, name = open_engine(
        config.model,
        kv_pool=config.kv_pool,
        kv_disk=config.kv_disk,
        dtype=config.dtype,
        weights=config.weights,
        compile=config.compile,
        speculate=config.speculate,
        num_draft_tokens=config.num_draft_tokens,
        draft_model=config.draft_model,
        draft_weights=config.draft_weights,
        kv_dtype=config.kv_dtype,
        k_dtype=config.k_dtype,
        v_dtype=config.v_dtype,
        max_num_seqs=config.max_num_seqs,
    )
    return LocalBackend(engine, model_name=name)


def open_engine(model: str, **options: Any) -> "tuple[Engine, str]":
    """The local engine for ``model`` (a short name, directory or .gguf) and the name it goes by."""
    from runtime.errors import DraftModelError, ModelError
    from runtime.models.loader import resolve_model

    # Resolve first: a bad --model (or --draft-model) fails before the engine allocates anything,
    # and a missing registry model is pulled with its own progress display.
    path = resolve_model(model)
    if options.get("draft_model") is not None:
        try:
            options["draft_model"] = str(resolve_model(options["draft_model"]))
        except ModelError as exc:
            raise DraftModelError(f"--draft-model: {exc}") from exc

    from runtime import Engine

    options.setdefault("on_notice", notice_to_stderr)
    return Engine(model=str(path), device="auto", **options), model_name_for(model, path)


def notice_to_stderr(line: str) -> None:
    """The engine's lines worth a user's attention (a weight plan being measured, a decode graph
    compiling, compiling falling back to eager), where liubai's other notices go. Read from
    ``sys`` at each call: while the TUI runs, Textual holds stderr and keeps them off the screen."""
    print(f"liubai: {line}", file=sys.stderr, flush=True)


def model_name_for(spec: str, path: Path) -> str:
    """What the model is called (in logs, and by ``liubai serve``'s clients): the registry's short
    name, a .gguf file's stem, or the directory's name."""
    entry = lookup(spec)
    if entry is not None:
        return entry.name
    given = Path(spec).expanduser()
    return given.stem if given.suffix.lower() == ".gguf" else path.name
