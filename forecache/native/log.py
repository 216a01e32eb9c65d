"""llama.cpp's log while a model loads: its warnings and errors kept, so a failed load can say
why in one line (llama-cpp-python discards them when not verbose), and no signal lost in it; and
ggml's fatal errors as one line (``abort_in_one_line``)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
from collections.abc import Iterator

from forecache.interrupt import signals_held
from forecache.native.libs import ggml_lib_path, llama_cpp_module

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


_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)  # ggml.h ggml_abort_callback_t


def _one_line(message: bytes) -> None:
    """ggml's abort callback: the message on one line, then the process ends with status 1
    (ggml calls abort() next; records a batch job wrote are already on disk, each fsynced)."""
    text = " ".join(message.decode("utf-8", "replace").split())
    text = re.sub(r"^\S+/([^/\s]+:\d+: )", r"\1", text)  # the source file's name, not its path
    hint = " (an RPC server stopped or answered wrongly: restart it and run again)" \
        if "RPC" in text else ""
    os.write(2, f"forecache: llama.cpp stopped: {text}{hint}\n".encode())
    os._exit(1)


@functools.cache
def abort_in_one_line() -> None:
    """From now on a fatal error in ggml or llama.cpp (GGML_ABORT: a device or RPC server that
    went away mid-run, a failed CUDA call) ends the process with one line on stderr and exit
    status 1, not a debugger's backtrace and SIGABRT."""
    path = ggml_lib_path("libggml-base")
    if path is None:  # a build laid out otherwise keeps ggml's own abort
        return
    lib = ctypes.CDLL(str(path))
    lib.ggml_set_abort_callback.argtypes = [_ABORT_CALLBACK]
    lib.ggml_set_abort_callback.restype = ctypes.c_void_p
    cb = _ABORT_CALLBACK(_one_line)
    _KEEP.append(cb)  # C holds the pointer for the life of the process
    lib.ggml_set_abort_callback(cb)


_KEEP: list = []
