"""Ctrl-C and SIGTERM as a flag checked between tokens.

A KeyboardInterrupt raised while llama.cpp calls back into Python (the expert cache's gate hook)
cannot cross the C frame and would be lost, so long-running loops take the signal as a flag and
stop at the next token instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be so the same cleanup runs; the CLI exits 143."""


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: raise :class:`Terminated`."""
    raise Terminated


class StopFlag:
    """Set by the first SIGINT or SIGTERM while active; ``signum`` says which."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    def raise_if_set(self) -> None:
        """Raise what the signal would have: Terminated for SIGTERM, else KeyboardInterrupt."""
        if self.signum is not None:
            raise Terminated if self.signum == signal.SIGTERM else KeyboardInterrupt


@contextlib.contextmanager
def deferred_signals() -> Iterator[StopFlag]:
    """While active, SIGINT and SIGTERM set the yielded flag instead of raising (main thread
    only; elsewhere the flag is never set and signals keep their handlers)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def on_signal(signum: int, frame: object) -> None:
        flag.signum = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
