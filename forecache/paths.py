"""Where forecache keeps files of its own: caches, named models, chat history.

Standard library only: ``python -m forecache.build`` runs before forecache's dependencies are
installed. Linux follows the XDG base directories; macOS and Windows their usual places.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP = "forecache"


def _base(xdg_var: str, xdg_default: str, mac: str, windows_var: str) -> Path:
    if sys.platform == "darwin":
        return Path.home() / mac
    if sys.platform == "win32":
        return Path(os.environ.get(windows_var) or Path.home() / "AppData" / "Local")
    return Path(os.environ.get(xdg_var) or Path.home() / xdg_default)


def cache_dir() -> Path:
    """Builds, sdists, fingerprints, predictors and made models: $FORECACHE_CACHE_DIR, else the
    user cache directory (``~/.cache/forecache`` on Linux)."""
    env = os.environ.get("FORECACHE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    sub = Path(APP) / "Cache" if sys.platform == "win32" else Path(APP)
    return _base("XDG_CACHE_HOME", ".cache", "Library/Caches", "LOCALAPPDATA") / sub


def model_dir() -> Path:
    """Where named models are looked for: $FORECACHE_MODEL_DIR, else the user data directory."""
    env = os.environ.get("FORECACHE_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    base = _base("XDG_DATA_HOME", ".local/share", "Library/Application Support", "LOCALAPPDATA")
    return base / APP / "models"


def chat_history_file() -> Path:
    """The chat's line history: $FORECACHE_CHAT_HISTORY, else the user state directory."""
    env = os.environ.get("FORECACHE_CHAT_HISTORY")
    if env:
        return Path(env).expanduser()
    base = _base("XDG_STATE_HOME", ".local/state", "Library/Application Support", "LOCALAPPDATA")
    return base / APP / "chat_history"
