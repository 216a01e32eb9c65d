"""Build and install the patched llama-cpp-python that forecache runs on.

The pinned llama-cpp-python sdist is fetched from the package index (or taken from a local sdist
or unpacked tree), checked against its sha256, trimmed to the libraries we load, given forecache's
own C/C++ sources (``forecache/csrc``: headers into include/, sources into src/ of the vendored
llama.cpp), patched with ``forecache/data/patches/*.patch`` in order (edits to upstream files
only) and its Python package with ``forecache/data/patches/python/*.patch`` (the parameters and
hooks forecache loads models with), built into a wheel and installed into the running
environment. Wheels are cached under the user's cache directory keyed by (version, hash of the
patches and sources, backend flags, the CPU's instruction sets), so a second setup on the same
machine installs in seconds and a cache carried to another CPU is never used there. The same sdist
built without the series and the sources is the unpatched reference the lossless tests compare
with (``--reference``).

Modules, by job (lower ones never import higher ones):

- ``base``: :class:`BuildError` and the progress line.
- ``info``: what the runtime reads of a build (the build record, the CPU check, where the
  sources and the patch series are); the only part ``forecache.native`` imports.
- ``toolchain``: compilers, cmake, CUDA detection, a backend's CMake flags.
- ``sources``: the pinned sdist, trimming, forecache's sources, the patch series and its hash.
- ``config``: :class:`BuildConfig`, what a build is keyed by.
- ``wheels``: the wheel cache and installing into the environment (:func:`build`).
- ``reference``: the unpatched reference build.
- ``__main__``: ``python -m forecache.build``.

The package uses only the standard library: it runs before the project's dependencies exist.
Its public names are re-exported here (``from forecache import build; build.patch_files()``).
"""

from __future__ import annotations

from forecache.build.base import BuildError, log
from forecache.build.config import STOCK, BuildConfig, build_config
from forecache.build.info import (
    BUILD_INFO_NAME,
    CSRC_DIR,
    PATCH_DIR,
    cpu_features,
    installed_build_info,
    missing_cpu_features,
)
from forecache.build.reference import build_reference, reference_dir
from forecache.build.sources import (
    CSRC_DEST,
    LLAMA_CPP_PYTHON_VERSION,
    PYTHON_PATCH_DIR,
    SDIST_NAME,
    SDIST_SHA256,
    TRIM_DIRS,
    TRIM_GGML_BACKENDS,
    add_sources,
    apply_patches,
    export_source,
    fetch_sdist,
    llama_cpp_commit,
    patch_files,
    patch_series_hash,
    python_patch_files,
    sha256_file,
    source_files,
    trim_tree,
    unpack_source,
    verify_sdist,
)
from forecache.build.toolchain import (
    TRIM_CMAKE_ARGS,
    backend_cmake_args,
    build_cpu_features,
    check_toolchain,
    choose_backend,
    find_nvcc,
    gpu_present,
)
from forecache.build.wheels import (
    build,
    build_lock,
    build_wheel,
    cached_wheel,
    install_wheel,
    stamp_tree,
)

__all__ = [
    "BUILD_INFO_NAME", "CSRC_DEST", "CSRC_DIR", "LLAMA_CPP_PYTHON_VERSION", "PATCH_DIR",
    "PYTHON_PATCH_DIR", "SDIST_NAME", "SDIST_SHA256", "STOCK", "TRIM_CMAKE_ARGS", "TRIM_DIRS",
    "TRIM_GGML_BACKENDS", "BuildConfig", "BuildError", "add_sources", "apply_patches",
    "backend_cmake_args", "build", "build_config", "build_cpu_features", "build_lock",
    "build_reference", "build_wheel", "cached_wheel", "check_toolchain", "choose_backend",
    "cpu_features", "export_source", "fetch_sdist", "find_nvcc", "gpu_present",
    "install_wheel", "installed_build_info", "llama_cpp_commit", "log", "missing_cpu_features",
    "patch_files", "patch_series_hash", "python_patch_files", "reference_dir", "sha256_file",
    "source_files", "stamp_tree", "trim_tree", "unpack_source", "verify_sdist",
]
