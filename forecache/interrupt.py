"""Ctrl-C and SIGTERM: one line and exit 130 or 143, whenever they come.

Before a command runs (Python is still importing its modules) and after it has ended (the
interpreter is shutting down) there is nothing to clean up, so the signal ends the process at
once (``exit_on_signals``). While a command runs they raise, so partial outputs are removed by
their writers' cleanup. A KeyboardInterrupt raised while llama.cpp calls back into Python (the
expert cache's gate hook, the log as a model loads) cannot cross the C frame and would be lost,
so long-running loops take the signal as a flag and stop at the next token instead
(``deferred_signals``), and a load hands it to its handler once it returns (``signals_held``).

This module is imported before anything else the command line needs: only the standard library's
lightest modules here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be so the same cleanup runs; the CLI exits 143."""


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: raise :class:`Terminated`."""
    raise Terminated


def signal_line(signum: int) -> str:
    """What the command line prints when ``signum`` ends it."""
    return f"forecache: {'terminated' if signum == signal.SIGTERM else 'interrupted'}"


def _exit_now(signum: int, frame: object) -> None:
    """End the process for ``signum``: flush what was printed, one line, exit 128 + signum."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # closed, None, or caught in the middle of a write: exit anyway
            pass
    # Ctrl-C leaves the terminal's "^C" on the line: the message starts on the next one
    lead = "" if signum == signal.SIGTERM else "\n"
    try:
        os.write(2, f"{lead}{signal_line(signum)}\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)


def exit_on_signals() -> None:
    """From now on SIGINT and SIGTERM end the process at once with one line and 130 or 143:
    for the moments with nothing to clean up (imports before a command, the interpreter's exit
    after it). Main thread only, as Python installs handlers."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _exit_now)


def raise_on_signals() -> None:
    """From now on SIGINT raises KeyboardInterrupt and SIGTERM :class:`Terminated`, so the
    running command's cleanup runs (main thread only)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)


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


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """While active, SIGINT and SIGTERM are held from the Python functions that handle them and
    handed to them as the block ends, so C code that calls back into Python (llama.cpp's log)
    cannot swallow the exception they raise. A signal the system handles (no Python handler)
    acts at once, as ever. Main thread only; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if signum not in held:
            held.append(signum)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)
                if callable(signal.getsignal(s))}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in held:
            signal.raise_signal(s)
