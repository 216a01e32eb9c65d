"""Writing small files so that readers never see half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
