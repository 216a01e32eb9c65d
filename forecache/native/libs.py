"""Locating llama-cpp-python's shared libraries and checking they carry forecache's C API."""

from __future__ import annotations

import ctypes
import functools
import json
import re
from pathlib import Path
from types import ModuleType

from forecache.build.info import BUILD_INFO_NAME, CSRC_DIR, PATCH_DIR
from forecache.native.cache_api import ForecacheAPI, struct_size_mismatches


def _header_patch_version(header: Path = CSRC_DIR / "forecache.h") -> int:
    m = re.search(r"^#define FORECACHE_PATCH_VERSION (\d+)$", header.read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{header} does not define FORECACHE_PATCH_VERSION")
    return int(m.group(1))


# FORECACHE_PATCH_VERSION of the sources this package builds (forecache/csrc/forecache.h).
EXPECTED_PATCH_VERSION = _header_patch_version()

MAX_THREADS = 512  # GGML_MAX_N_THREADS (ggml.h): more would overrun ggml's thread arrays


def _patched_max_seq(patch_dir: Path = PATCH_DIR) -> tuple[int, int]:
    """LLAMA_MAX_SEQ (llama-cparams.h) of stock llama.cpp and as the patch series sets it: the
    lines the patch that raises it (0004) removes and adds."""
    for patch in sorted(patch_dir.glob("*.patch")):
        text = patch.read_text()
        new = re.search(r"^\+#define LLAMA_MAX_SEQ (\d+)$", text, re.MULTILINE)
        old = re.search(r"^-#define LLAMA_MAX_SEQ (\d+)$", text, re.MULTILINE)
        if new and old:
            return int(old.group(1)), int(new.group(1))
    raise RuntimeError(f"no patch in {patch_dir} sets LLAMA_MAX_SEQ")


# Sequences one context decodes together, stock llama.cpp's and forecache's (LLAMA_MAX_SEQ, which
# llama_max_parallel_sequences() returns): read from the patch series, the one place they are set,
# so they are known without loading the library (a command-line option's range).
STOCK_MAX_SEQUENCES, MAX_SEQUENCES = _patched_max_seq()

_FIX = "run `forecache build` (or `make setup`) to install forecache's patched llama-cpp-python"


class PatchedBuildError(RuntimeError):
    """llama-cpp-python is missing, stock, or built from another version of forecache's C API."""


class ModelLoadError(RuntimeError):
    """llama.cpp refused the model; the message says what to try."""


@functools.cache
def check_build_cpu() -> None:
    """Refuse a llama.cpp build compiled for instruction sets this CPU lacks (a wheel or cache
    carried from another machine), before its libraries load and die with SIGILL."""
    from forecache.build.info import installed_build_info, missing_cpu_features

    info = installed_build_info()
    missing = missing_cpu_features(info) if info else []
    if missing:
        raise PatchedBuildError(f"the installed llama.cpp was compiled for a CPU with "
                                f"{', '.join(missing)}, which this CPU lacks: {_FIX}")


def llama_cpp_package() -> ModuleType:
    """The ``llama_cpp`` package, imported once the build is known to fit this CPU."""
    check_build_cpu()
    import llama_cpp

    return llama_cpp


@functools.cache
def llama_cpp_module() -> ModuleType:
    """The imported ``llama_cpp.llama_cpp`` low-level module (loads libllama)."""
    check_build_cpu()
    try:
        import llama_cpp.llama_cpp as low
    except ImportError as e:
        raise PatchedBuildError(f"llama-cpp-python is not installed or does not load ({e}): "
                                f"{_FIX}") from e
    return low


def lib_dir() -> Path:
    """Directory holding libllama / libggml of the imported llama_cpp package."""
    return Path(llama_cpp_module()._base_path)


@functools.cache
def libllama() -> ctypes.CDLL:
    """libllama as loaded by llama-cpp-python, with our C API's signatures declared (call it
    through :func:`api`); refuses a stock build, one of another API version or one whose structs
    differ from their ctypes mirrors."""
    lib = llama_cpp_module()._lib
    try:
        fn = lib.forecache_patch_version
    except AttributeError:
        raise PatchedBuildError(f"the installed llama-cpp-python is a stock build without "
                                f"forecache's patches: {_FIX}") from None
    fn.argtypes = []
    fn.restype = ctypes.c_int32
    version = int(fn())
    if version != EXPECTED_PATCH_VERSION:
        raise PatchedBuildError(f"libllama has forecache patch version {version}, this forecache "
                                f"needs {EXPECTED_PATCH_VERSION}: {_FIX}")
    ForecacheAPI.bind(lib)
    bad = struct_size_mismatches(lib)
    if bad:
        raise PatchedBuildError(f"libllama's structs do not match their ctypes mirrors in "
                                f"forecache.native.cache_api ({'; '.join(bad)}): the mirror or "
                                f"the build is out of date; fix the mirror or {_FIX}")
    return lib


@functools.cache
def api() -> ForecacheAPI:
    """forecache.h's functions on libllama, typed: ``api().cache_load(cache, layer, expert,
    slot, priority)`` (:class:`~forecache.native.cache_api.ForecacheAPI`)."""
    return ForecacheAPI.bind(libllama())


def patch_version() -> int:
    """The patch-series version compiled into libllama (:func:`libllama` refuses a mismatch)."""
    return int(libllama().forecache_patch_version())


@functools.cache
def libggml() -> ctypes.CDLL:
    """libggml (backend registry and devices), the same file llama-cpp-python loaded."""
    libllama()
    path = ggml_lib_path("libggml")
    if path is None:
        raise PatchedBuildError(f"{lib_dir() / 'libggml.so'} is missing: {_FIX}")
    return ctypes.CDLL(str(path))


def ggml_lib_path(name: str, directory: Path | None = None) -> Path | None:
    """The file of ggml library ``name`` (``libggml``, ``libggml-rpc``) that libllama links: its
    soname (``libggml.so.0``). A wheel holds each name as a copy of its own, and a copy loaded
    under another name is a second library with a second backend registry."""
    d = directory or lib_dir()
    for candidate in (d / f"{name}.so.0", d / f"{name}.so"):
        if candidate.exists():
            return candidate
    return None


def build_info() -> dict:
    """The build record written into the package by ``forecache build``."""
    import llama_cpp

    p = Path(llama_cpp.__file__).parent / BUILD_INFO_NAME
    if not p.exists():
        raise PatchedBuildError(f"llama-cpp-python {llama_cpp.__version__} has no forecache build "
                                f"record: {_FIX}")
    return json.loads(p.read_text())
