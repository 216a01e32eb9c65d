"""What every step of the build shares: its error and its progress line."""

from __future__ import annotations

import sys


class BuildError(RuntimeError):
    """A build step failed; the message says which and what to do."""


def log(msg: str) -> None:
    """Print a progress line of the build to stderr."""
    print(f"[forecache build] {msg}", file=sys.stderr, flush=True)
