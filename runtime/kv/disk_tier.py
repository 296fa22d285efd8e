"""The prefix cache's disk tier: full blocks' KV kept in files, so a new process starts warm.

A block file holds one sealed block in the pool's stored format (:meth:`KVCache.export_blocks`;
quantized blocks stay quantized), named by the block's chained digest (``runtime/kv/digest.py``)
and filed under a fingerprint of everything that changes the numbers (:func:`fingerprint`)::

    <root>/<fingerprint>/<digest hex>.blk

    header  "LBKVBLK1" | layout version u32 | num tokens u32 | payload bytes u64 | crc32 u32
    body    digest (16 bytes) | token ids (int64 LE each) | payload (bytes_per_block)

The crc covers the body, so a file cut short (``kill -9``, a full disk) or corrupted is detected
and ignored (and removed), never loaded; a hit is also verified against the stored token ids, as
in-memory hits are. Files are written to a temporary name and renamed, so a reader never sees
half a file and two processes writing the same block are harmless.

Writes are behind: :meth:`DiskTier.save` takes a copy of the blocks' bytes and a background
thread writes them, so decoding never waits for the disk. At exit pending writes get a bounded
flush (:data:`EXIT_FLUSH_S`). The tier's size (all fingerprints together) is bounded by
``limit_bytes``, evicting least recently used files first; use is a file's mtime, which the tier
sets itself (strictly increasing within a process), so a later process sees the same order. A
write that fails (a full or read-only disk) turns the tier off with one warning on the
``liubai.kv`` logger; the engine goes on in memory.
"""

import atexit
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.kv.digest import DIGEST_SIZE

LAYOUT_VERSION = 1  # bump when a block's stored bytes or the file format change
MAGIC = b"LBKVBLK1"
_HEADER = struct.Struct("<8sIIQI")  # magic, layout version, num tokens, payload bytes, crc32
SUFFIX = ".blk"
EXIT_FLUSH_S = 2.0  # the most a process waits at exit for pending writes
MAX_PENDING_BYTES = 512 * 1024**2  # write-behind backlog beyond which new blocks are not saved
STALE_TEMP_S = 600.0  # a temporary file this old belongs to a writer that died

log = logging.getLogger("liubai.kv")


def default_root() -> Path:
    """``LIUBAI_KV_DISK_DIR``, else ``kv/`` in the user cache dir."""
    from runtime.paths import cache_dir

    override = os.environ.get("LIUBAI_KV_DISK_DIR")
    return Path(override) if override else cache_dir() / "kv"


def fingerprint(model_path: Path, numbers: dict[str, object]) -> str:
    """What a block's numbers depend on, as 32 hex digits: the model's files and ``numbers`` (dtype,
    weight format, KV dtypes, block size, forward, device...) and the KV layout version.

    Model files count by name, size and mtime, and small ones (config, tokenizer) by content too:
    hashing gigabytes of weights at every start would cost more than the tier saves. A re-pulled
    model therefore starts a new fingerprint: cold once, never wrong.
    """
    h = hashlib.blake2b(digest_size=16, person=b"liubai-kv-fprint")
    h.update(f"layout={LAYOUT_VERSION};torch={torch.__version__};".encode())
    for key in sorted(numbers):
        h.update(f"{key}={numbers[key]};".encode())
    files = [model_path] if model_path.is_file() else sorted(p for p in model_path.rglob("*") if p.is_file())
    for path in files:
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        if st.st_size <= 1024**2:
            h.update(path.read_bytes())
    return h.hexdigest()


@dataclass(slots=True, frozen=True)
class DiskTierStats:
    """The tier at one moment: files of every fingerprint under the root, and this process's counts."""

    enabled: bool
    root: str
    limit_bytes: int
    num_blocks: int
    num_bytes: int
    num_hit_blocks: int
    num_written_blocks: int
    num_evicted_blocks: int
    num_pending_blocks: int
    notice: str | None = None  # why the tier turned itself off, if it did


@dataclass(slots=True)
class _Pending:
    digests: list[bytes]
    token_ids: list[tuple[int, ...]]
    data: torch.Tensor  # (n, bytes_per_block) uint8, CPU


def scan(root: Path) -> list[tuple[int, Path, int]]:
    """Every block file under ``root`` as (mtime ns, path, size), least recently used first."""
    found: list[tuple[int, Path, int]] = []
    if not root.is_dir():
        return found
    now = time.time()
    for sub in root.iterdir():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            try:
                st = entry.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            if entry.name.endswith(SUFFIX):
                found.append((st.st_mtime_ns, Path(entry.path), st.st_size))
            elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_S:
                Path(entry.path).unlink(missing_ok=True)
    found.sort(key=lambda f: (f[0], f[1].name))
    return found


def clear(root: Path) -> tuple[int, int]:
    """Remove every block file (and temporary file) under ``root``; returns (files, bytes) removed."""
    num_files = num_bytes = 0
    if not root.is_dir():
        return 0, 0
    for sub in root.iterdir():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            if entry.name.endswith((SUFFIX, ".tmp")):
                size = entry.stat().st_size
                Path(entry.path).unlink(missing_ok=True)
                num_files += 1
                num_bytes += size
        try:
            sub.rmdir()
        except OSError:  # something else lives there; leave it
            pass
    return num_files, num_bytes


class DiskTier:
    """Block files of one fingerprint under ``root``, bounded with the others to ``limit_bytes``."""

    def __init__(self, root: Path, fingerprint: str, limit_bytes: int, bytes_per_block: int) -> None:
        if limit_bytes <= 0:
            raise ValueError("a disk tier needs a size limit above 0 (0 turns it off)")
        self.root = root
        self.dir = root / fingerprint
        self.limit_bytes = limit_bytes
        self.bytes_per_block = bytes_per_block
        self.notice: str | None = None
        self._lock = threading.Lock()  # guards the index, the counters and the pending set
        self._files: OrderedDict[Path, int] = OrderedDict()  # every fingerprint's files, LRU first
        self._num_bytes = 0
        self._last_use_ns = 0
        self._pending: set[bytes] = set()
        self._pending_bytes = 0
        self.num_hit_blocks = 0
        self.num_written_blocks = 0
        self.num_evicted_blocks = 0
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for _mtime, path, size in scan(root):
                self._files[path] = size
                self._num_bytes += size
            self._evict_over_limit()
        except OSError as exc:
            self._turn_off(exc)
        self._writer = threading.Thread(target=self._write_loop, name="liubai-kv-disk", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        return self.notice is None

    def path_for(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}{SUFFIX}"

    def has(self, digest: bytes) -> bool:
        """Whether the block is on disk as far as this process knows, or about to be."""
        with self._lock:
            return digest in self._pending or self.path_for(digest) in self._files

    # -- writing -------------------------------------------------------------------------------

    def save(self, digests: list[bytes], token_ids: list[tuple[int, ...]], data: torch.Tensor) -> None:
        """Queue blocks for writing: ``data`` (n, bytes_per_block) uint8 on the CPU, already a copy."""
        if not self.enabled or not digests:
            return
        with self._lock:
            if self._pending_bytes + data.nbytes > MAX_PENDING_BYTES:
                return  # the disk is behind; these blocks stay memory-only
            self._pending.update(digests)
            self._pending_bytes += data.nbytes
        self._queue.put(_Pending(digests, token_ids, data))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self.enabled:
                    for i, (digest, tokens) in enumerate(zip(item.digests, item.token_ids, strict=True)):
                        self._write_file(digest, tokens, item.data[i].numpy())
            except OSError as exc:
                self._turn_off(exc)
            finally:
                with self._lock:
                    self._pending.difference_update(item.digests)
                    self._pending_bytes -= item.data.nbytes

    def _write_file(self, digest: bytes, tokens: tuple[int, ...], payload: np.ndarray) -> None:
        path = self.path_for(digest)
        with self._lock:
            if path in self._files:
                return
        token_bytes = np.asarray(tokens, dtype="<i8").tobytes()
        data = payload.data  # the array's buffer, written as is
        crc = zlib.crc32(data, zlib.crc32(token_bytes, zlib.crc32(digest)))
        header = _HEADER.pack(MAGIC, LAYOUT_VERSION, len(tokens), payload.nbytes, crc)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(digest)
                f.write(token_bytes)
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old state or the whole file
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        size = len(header) + len(digest) + len(token_bytes) + payload.nbytes
        with self._lock:
            self._touch(path)
            self._files[path] = size
            self._num_bytes += size
            self.num_written_blocks += 1
            self._evict_over_limit()

    def _touch(self, path: Path) -> None:
        """Mark ``path`` used now: strictly later than any earlier use, so the order is exact."""
        use_ns = max(time.time_ns(), self._last_use_ns + 1)
        self._last_use_ns = use_ns
        os.utime(path, ns=(use_ns, use_ns))
        if path in self._files:
            self._files.move_to_end(path)

    def _evict_over_limit(self) -> None:
        while self._num_bytes > self.limit_bytes and self._files:
            path, size = self._files.popitem(last=False)
            path.unlink(missing_ok=True)
            self._num_bytes -= size
            self.num_evicted_blocks += 1

    def _turn_off(self, exc: OSError) -> None:
        if self.notice is not None:
            return
        self.notice = f"KV disk tier off: cannot write {self.dir} ({exc.strerror or exc}); KV stays in memory"
        log.warning("%s", self.notice)

    # -- reading -------------------------------------------------------------------------------

    def load_into(self, digest: bytes, tokens: tuple[int, ...], out: torch.Tensor) -> bool:
        """Read the block ``digest`` into ``out`` (bytes_per_block,) uint8; True on a verified hit.

        A file that is missing, cut short, corrupted or of other tokens is a miss; a damaged one is
        removed so it is neither retried nor counted against the limit.
        """
        if not self.enabled:
            return False
        path = self.path_for(digest)
        token_bytes = np.asarray(tokens, dtype="<i8").tobytes()
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                body_head = f.read(DIGEST_SIZE + len(token_bytes))
                view = out.numpy().data
                num_read = f.readinto(view)
                trailing = f.read(1)
        except FileNotFoundError:
            with self._lock:
                self._forget(path)
            return False
        except OSError:
            return False
        ok = len(header) == _HEADER.size
        if ok:
            magic, version, num_tokens, payload_len, crc = _HEADER.unpack(header)
            ok = (
                (magic, version, num_tokens, payload_len) == (MAGIC, LAYOUT_VERSION, len(tokens), out.nbytes)
                and num_read == out.nbytes
                and not trailing
                and body_head == digest + token_bytes
                and zlib.crc32(view, zlib.crc32(body_head)) == crc
            )
        with self._lock:
            if not ok:
                path.unlink(missing_ok=True)
                self._forget(path)
                return False
            if path not in self._files:  # written by another process since this one started
                self._files[path] = _HEADER.size + len(body_head) + out.nbytes
                self._num_bytes += self._files[path]
            try:
                self._touch(path)
            except OSError:  # evicted by another process just now; the bytes read are still good
                pass
            self.num_hit_blocks += 1
        return True

    def _forget(self, path: Path) -> None:
        size = self._files.pop(path, None)
        if size is not None:
            self._num_bytes -= size

    # -- lifetime ------------------------------------------------------------------------------

    def flush(self, timeout: float = EXIT_FLUSH_S) -> bool:
        """Wait up to ``timeout`` seconds for pending writes; True when none is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.005)
        with self._lock:
            return not self._pending

    def close(self, timeout: float = EXIT_FLUSH_S) -> None:
        """Flush (bounded by ``timeout``) and stop the writer; what is still pending is dropped."""
        if not self._writer.is_alive():
            return
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout=0.1)
        atexit.unregister(self.close)

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                enabled=self.enabled,
                root=str(self.root),
                limit_bytes=self.limit_bytes,
                num_blocks=len(self._files),
                num_bytes=self._num_bytes,
                num_hit_blocks=self.num_hit_blocks,
                num_written_blocks=self.num_written_blocks,
                num_evicted_blocks=self.num_evicted_blocks,
                num_pending_blocks=len(self._pending),
                notice=self.notice,
            )


def total_size(files: Iterable[tuple[int, Path, int]]) -> int:
    return sum(size for _mtime, _path, size in files)
