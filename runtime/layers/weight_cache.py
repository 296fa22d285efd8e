"""Quantized weights kept on disk, keyed by the float weights they came from and the format.

Quantizing the default model to int4 costs about 3.9 s at every load on a 2-core Intel Xeon
(the grid search of ``weights.int4_codes`` over 120 matrices); reading the packed result back
costs well under a second. The key is a SHA-256 of the float matrices themselves (about 0.4 s
for the default model's 540 MB), the format, its group size, the torch version (the CPU int4
kernel's packed layout is torch's to change) and :data:`CACHE_VERSION`, so a changed model, a
changed quantizer or another torch can never read a stale file.

Files live in ``weights/`` under liubai's cache dir (``runtime/paths.py``), or in the directory
named by ``LIUBAI_WEIGHT_CACHE_DIR``. A file that cannot be read is quantized again and
rewritten; a cache that cannot be written only means quantizing again next time.

Every new torch, model or quantizer version leaves the old files unreadable by key, so the
cache is pruned when it grows: after each write, the files used least recently (a hit renews a
file's time) go until the rest fit in :data:`MAX_CACHE_BYTES` (``LIUBAI_WEIGHT_CACHE_MAX_MB``),
the file just written always kept; temporary files a killed process left behind go after an hour.
"""

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.layers.weights import INT4_GROUP_SIZE, Int4Weight, Int8Weight, QuantizedWeight
from runtime.paths import cache_dir

log = logging.getLogger(__name__)

# Bump when quantize()'s output for the same weights changes (codes, scales, packing).
CACHE_VERSION = 1
# The default model's int4 file is 66 MB and its int8 one about 140 MB: room for a few models.
MAX_CACHE_BYTES = 2 << 30
STALE_TMP_SECONDS = 3600


def cache_root() -> Path:
    """Where quantized weights are kept: ``$LIUBAI_WEIGHT_CACHE_DIR``, else ``weights/`` in the cache dir."""
    override = os.environ.get("LIUBAI_WEIGHT_CACHE_DIR")
    return Path(override) if override else cache_dir() / "weights"


def weights_key(matrices: Sequence[torch.Tensor], weights: str) -> str:
    """A digest of ``matrices`` (shapes, dtypes and bytes, in order) and all their packing depends on."""
    digest = hashlib.sha256()
    header = f"v{CACHE_VERSION} {weights} group{INT4_GROUP_SIZE} torch{torch.__version__}"
    digest.update(header.encode())
    for matrix in matrices:
        data = matrix.detach().contiguous()
        digest.update(f"{tuple(data.shape)} {data.dtype}".encode())
        digest.update(data.view(torch.uint8).reshape(-1).numpy().tobytes())
    return digest.hexdigest()[:32]


def cached_quantize(
    key: str, count: int, quantize_all: Callable[[], list[QuantizedWeight]]
) -> list[QuantizedWeight]:
    """The ``count`` quantized matrices filed under ``key``, or ``quantize_all()``'s, then filed."""
    path = cache_root() / f"{key}.pt"
    if path.exists():
        try:
            stored = [_from_dict(d) for d in torch.load(path, weights_only=True)]
            if len(stored) == count:
                _touch(path)
                return stored
        except Exception as exc:  # a truncated or foreign file: quantize again and replace it
            log.warning("quantized weights in %s unreadable (%s); quantizing again", path, exc)
    quantized = quantize_all()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save([_to_dict(w) for w in quantized], tmp)
        tmp.replace(path)
        prune(path.parent, keep=path)
    except OSError as exc:
        log.info("quantized weights not cached (%s)", exc)
    return quantized


def max_cache_bytes() -> int:
    override = os.environ.get("LIUBAI_WEIGHT_CACHE_MAX_MB")
    return int(float(override) * (1 << 20)) if override else MAX_CACHE_BYTES


def prune(root: Path, keep: Path) -> list[Path]:
    """Remove the least recently used files until the rest fit in :func:`max_cache_bytes`, and
    stale temporary files; ``keep`` stays whatever its size. Returns what was removed."""
    now, removed = time.time(), []
    files = []
    for entry in root.iterdir():
        try:
            stat = entry.stat()
        except OSError:  # removed by another process meanwhile
            continue
        if ".tmp" in entry.suffix and now - stat.st_mtime > STALE_TMP_SECONDS:
            removed.append(entry)
        elif entry.suffix == ".pt" and entry != keep:
            files.append((stat.st_mtime, stat.st_size, entry))
    total = sum(size for _, size, _ in files) + keep.stat().st_size
    for _, size, entry in sorted(files, key=lambda f: f[0]):
        if total <= max_cache_bytes():
            break
        removed.append(entry)
        total -= size
    for entry in removed:
        entry.unlink(missing_ok=True)
        log.info("weight cache: removed %s", entry.name)
    return removed


def _touch(path: Path) -> None:
    """Mark ``path`` used now, so pruning keeps it longest (a read-only cache is left as it is)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _to_dict(weight: QuantizedWeight) -> dict[str, Any]:
    if isinstance(weight, Int8Weight):
        return {"kind": "int8", "qweight": weight.qweight, "scales": weight.scales}
    return {
        "kind": "int4",
        "packed": weight.packed,
        "scales_and_zeros": weight.scales_and_zeros,
        "shape": [weight.group_size, weight.out_features, weight.in_features],
    }


def _from_dict(data: dict[str, Any]) -> QuantizedWeight:
    if data["kind"] == "int8":
        return Int8Weight(data["qweight"], data["scales"])
    group_size, out_features, in_features = data["shape"]
    return Int4Weight(data["packed"], data["scales_and_zeros"], group_size, out_features, in_features)
