"""llama.cpp's log while a model loads: its warnings and errors kept, so a failed load can say
why in one line (llama-cpp-python discards them when not verbose), and no signal lost in it."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

from forecache.interrupt import signals_held
from forecache.native.libs import llama_cpp_module

LOG_WARN, LOG_ERROR = 3, 4  # enum ggml_log_level (ggml.h)


@contextlib.contextmanager
def load_log(enabled: bool) -> Iterator[list[tuple[int, str]]]:
    """While active, llama.cpp's warnings and errors go to the yielded list instead of the
    terminal (llama-cpp-python discards them when not verbose), so a failed load can be
    explained. Ctrl-C and SIGTERM reach their Python handlers when the block ends: raised in a
    log callback (a Python function llama.cpp calls, ours or llama-cpp-python's), their
    exception could not cross llama.cpp's C frame and the signal would be lost."""
    lines: list[tuple[int, str]] = []
    with signals_held():
        if not enabled:
            yield lines
        else:
            low = llama_cpp_module()

            @low.llama_log_callback
            def collect(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
                if level in (LOG_WARN, LOG_ERROR):
                    lines.append((level, text.decode("utf-8", "replace").strip()))

            low.llama_log_set(collect, ctypes.c_void_p(0))
            try:
                yield lines
            finally:
                from llama_cpp import _logger

                low.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
