"""Opening the backend an ``AgentConfig`` names: the local engine, or an OpenAI-compatible server."""

from pathlib import Path

from runtime.backend import Backend

from .config import AgentConfig


def open_backend(config: AgentConfig) -> Backend:
    if config.backend == "openai":
        from runtime.openai_backend import OpenAIBackend

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

    from runtime.model_loader import resolve_model

    # Resolve first: a bad --model fails before the engine allocates anything, and a missing
    # registry model is pulled with its own progress display.
    path = resolve_model(config.model)

    from runtime import Engine
    from runtime.backend import LocalBackend

    engine = Engine(
        model=str(path),
        kv_pool=config.kv_pool,
        dtype=config.dtype,
        device="auto",
        kv_dtype=config.kv_dtype,
        k_dtype=config.k_dtype,
        v_dtype=config.v_dtype,
        max_num_seqs=config.max_num_seqs,
    )
    name = path.name if Path(config.model).exists() else config.model
    return LocalBackend(engine, model_name=name)
