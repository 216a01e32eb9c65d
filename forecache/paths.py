"""Where forecache keeps files of its own (caches, named models, chat history), and writing
small files so that readers never see half of one (``write_atomic``).

Standard library only: ``python -m forecache.build`` runs before forecache's dependencies are
installed. Linux follows the XDG base directories; macOS and Windows their usual places.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

APP = "forecache"


def _user_path(override: str, xdg_var: str, xdg_default: str, mac: str, *parts: str) -> Path:
    """$``override`` when set, else ``parts`` under forecache's folder of the user directory that
    ``xdg_var`` names on Linux (``mac`` below the home folder on macOS, LOCALAPPDATA on Windows)."""
    env = os.environ.get(override)
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / mac
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get(xdg_var) or Path.home() / xdg_default)
    return base.joinpath(APP, *parts)


def cache_dir() -> Path:
    """Builds, sdists, fingerprints, predictors and made models: $FORECACHE_CACHE_DIR, else the
    user cache directory (``~/.cache/forecache`` on Linux)."""
    sub = ("Cache",) if sys.platform == "win32" else ()
    return _user_path("FORECACHE_CACHE_DIR", "XDG_CACHE_HOME", ".cache", "Library/Caches", *sub)


def model_dir() -> Path:
    """Where named models are looked for: $FORECACHE_MODEL_DIR, else the user data directory."""
    return _user_path("FORECACHE_MODEL_DIR", "XDG_DATA_HOME", ".local/share",
                      "Library/Application Support", "models")


def chat_history_file() -> Path:
    """The chat's line history: $FORECACHE_CHAT_HISTORY, else the user state directory."""
    return _user_path("FORECACHE_CHAT_HISTORY", "XDG_STATE_HOME", ".local/state",
                      "Library/Application Support", "chat_history")


def write_atomic(path: Path, data: bytes | str, mode: int | None = None) -> None:
    """Write ``data`` to a temp file beside ``path``, flush it to disk, then rename it over
    ``path``; an interruption leaves the old file (or none), never a partial one. ``mode``: the
    file's permission bits (default the temp file's, 0o600)."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
