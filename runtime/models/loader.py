"""Turn what the user typed after ``--model`` into a loaded transformers model.

Three spellings are accepted: a registry short name (pulled once into the user cache), a
Hugging Face model directory (anything with a ``config.json``), or a ``.gguf`` file
(converted once and cached by content hash). Resolution is cheap and imports nothing heavy,
so the CLI can reject a bad ``--model`` before torch is even imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import ModelError
from runtime.models.pull import convert_gguf, is_complete, pulled_path
from runtime.models.pull import pull as pull_model
from runtime.models.registry import known_names, lookup

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass(slots=True)
class LoadedModel:
    """A model ready for inference, with what the engine needs to know about it."""

    model: Any  # transformers PreTrainedModel, in eval mode, on ``device``
    tokenizer: Any  # transformers tokenizer with the model's chat template
    path: Path
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: list[int] = field(default_factory=list)


def resolve_model(spec: str | Path, *, pull: bool = True) -> Path:
    """Return the directory of a loadable model for ``spec``; raise ``ModelError`` if none.

    With ``pull=False`` a registry model that is not yet pulled is an error telling the user
    to run ``liubai pull``; a ``.gguf`` file is converted either way (it needs no network).
    """
    if isinstance(spec, str) and (entry := lookup(spec)) is not None:
        target = pulled_path(entry)
        if is_complete(target):
            return target
        if not pull:
            raise ModelError(f"model {entry.name!r} is not pulled yet; run `liubai pull {entry.name}`")
        return pull_model(entry)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelError(f"{path} is a directory without config.json, not a Hugging Face model directory")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path)
        raise ModelError(f"{path} is neither a .gguf file nor a model directory")
    raise ModelError(
        f"unknown model {str(spec)!r}: not a known name ({', '.join(known_names())}), "
        "a model directory or a .gguf file"
    )


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` means CUDA when available, else CPU."""
    import torch

    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"not a device: {device!r} (use auto, cpu or cuda)") from exc


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """``auto`` means bfloat16 on CUDA and float32 on CPU (fp32 decodes faster on our CPUs)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"not a dtype: {dtype!r} (use {', '.join(DTYPE_NAMES)})")
    result: torch.dtype = getattr(torch, name)
    return result


def load_model(
    spec: str | Path,
    *,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "auto",
    pull: bool = True,
) -> LoadedModel:
    """Resolve ``spec``, then load its weights and tokenizer onto ``device`` in ``dtype``."""
    path = resolve_model(spec, pull=pull)
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, target_device)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # A local load takes about a second; transformers' "Loading weights" bar would only be noise
    # above the reply of a one-shot run.
    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=target_dtype)
        model = model.to(target_device).eval()
    except Exception as exc:  # OSError, ValueError, torch errors: all one line at the edge
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"could not load model from {path}: {type(exc).__name__}: {first}") from exc
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        dtype=target_dtype,
        device=target_device,
        eos_token_ids=eos_token_ids(model, tokenizer),
    )


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends a reply: the generation config's (int or list), then the tokenizer's."""
    ids: list[int] = []
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    if isinstance(configured, int):
        ids.append(configured)
    elif configured is not None:
        ids.extend(int(i) for i in configured)
    if isinstance(tokenizer.eos_token_id, int):
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))  # dedupe, keep order
