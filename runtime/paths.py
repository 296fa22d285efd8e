"""Where liubai keeps files of its own.

Models live in the user cache dir (they can be rebuilt by ``liubai pull``); databases live in
the user data dir (they cannot). Both follow the XDG variables and can be overridden for tests
and unusual setups with ``LIUBAI_CACHE_DIR`` and ``LIUBAI_DATA_DIR``.
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    override = os.environ.get("LIUBAI_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "liubai"


def models_dir() -> Path:
    return cache_dir() / "models"


def data_dir() -> Path:
    override = os.environ.get("LIUBAI_DATA_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "liubai"
