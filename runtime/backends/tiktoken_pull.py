"""``liubai pull tiktoken``: fill tiktoken's cache from a package-index wheel, never from the web.

tiktoken fetches its encodings from a blob store that is out of reach. The PyPI wheel
``litellm==1.110.2`` ships cl100k_base, p50k_base and o200k_base already in tiktoken's cache
form (each file named by the sha1 of its download URL). The pull downloads that wheel with pip
(never installing or importing it), checks the wheel's sha256, copies only those three members
into :func:`~runtime.backends.token_counting.tiktoken_cache_dir` after checking each one's sha256 against
tiktoken's own, and finally loads each encoding through tiktoken. The wheel is platform-tagged,
so pip is told the one platform whose file the checksum below belongs to, on every host.
"""

import hashlib
import os
import tempfile
import zipfile
from pathlib import Path

from runtime.backends.token_counting import TIKTOKEN_FILES, tiktoken_file_ok, use_liubai_tiktoken_cache
from runtime.errors import PullError
from runtime.models.wheel_download import PullProgress, download_wheel, remove_stale_downloads, sha256_of

TIKTOKEN_PULL_NAME = "tiktoken"
WHEEL_REQUIREMENT = "litellm==1.110.2"
WHEEL_SHA256 = "9d94d1c7d524b6fd10c14f9c8c6c4f0ac31705f9964ac59dcfd8337c046d8917"
# litellm-1.110.2-cp310-abi3-manylinux_2_28_x86_64.whl, the file WHEEL_SHA256 was observed on.
WHEEL_PLATFORM_ARGS = (
    "--only-binary=:all:",
    "--platform",
    "manylinux_2_28_x86_64",
    "--python-version",
    "3.10",
    "--implementation",
    "cp",
    "--abi",
    "abi3",
)
MEMBER_DIR = "litellm/litellm_core_utils/tokenizers/"
_SAMPLE = "hello world, 留白"


def pull_tiktoken_encodings(progress: bool = True) -> Path:
    """Put cl100k_base, p50k_base and o200k_base into tiktoken's cache once; return the cache dir.

    Returns at once (after loading each encoding) when all three files are present and intact.
    Raises ``PullError`` with a one-line message when pip cannot fetch the wheel, a checksum
    differs, or tiktoken cannot load a file.
    """
    directory = use_liubai_tiktoken_cache()
    show = PullProgress(progress, num_stages=4)
    if all(tiktoken_file_ok(name, directory) for name in TIKTOKEN_FILES):
        _load_all()
        show.note(f"tiktoken encodings already in {directory}")
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_downloads(directory)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=directory) as tmp:
        wheel = _download(Path(tmp), show)
        show.stage(f"verify sha256 of {wheel.name}")
        digest = sha256_of(wheel, show)
        if digest != WHEEL_SHA256:
            raise PullError(
                f"checksum mismatch for {wheel.name}: expected sha256 {WHEEL_SHA256[:16]}..., "
                f"got {digest[:16]}...; refusing to use it"
            )
        show.stage(f"copy {', '.join(TIKTOKEN_FILES)} into {directory}")
        _extract(wheel, directory)
    show.stage("load each encoding with tiktoken")
    _load_all()
    show.note(f"ready: {directory}")
    return directory


def _download(dest: Path, show: PullProgress) -> Path:
    show.stage(f"download {WHEEL_REQUIREMENT} with pip (not installed)")
    return download_wheel(WHEEL_REQUIREMENT, dest, show, WHEEL_PLATFORM_ARGS)


def _extract(wheel: Path, directory: Path) -> None:
    """Copy each encoding's member, checked against tiktoken's sha256, into place atomically."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            for spec in TIKTOKEN_FILES.values():
                member = MEMBER_DIR + spec.cache_name
                try:
                    data = zf.read(member)
                except KeyError:
                    raise PullError(f"{wheel.name} has no member {member} ({spec.encoding})") from None
                if hashlib.sha256(data).hexdigest() != spec.sha256:
                    raise PullError(
                        f"{member} in {wheel.name} is not tiktoken's {spec.encoding}; refusing it"
                    )
                partial = directory / f".{spec.cache_name}.partial"
                partial.write_bytes(data)
                os.replace(partial, directory / spec.cache_name)
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel.name} is not a valid wheel: {exc}") from exc


def _load_all() -> None:
    """Load every encoding through tiktoken; the files were checked, so it reads them from the cache."""
    import tiktoken

    for name in TIKTOKEN_FILES:
        try:
            encoding = tiktoken.get_encoding(name)
            ok = encoding.decode(encoding.encode(_SAMPLE)) == _SAMPLE
        except Exception as exc:  # tiktoken's loader raises assorted types; one line at the edge
            raise PullError(f"tiktoken could not load {name}: {type(exc).__name__}: {exc}") from exc
        if not ok:
            raise PullError(f"tiktoken's {name} does not round-trip text; the cache file is wrong")
