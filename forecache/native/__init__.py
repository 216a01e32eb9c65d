"""ctypes access to the patched llama.cpp: forecache's C API (forecache/csrc/forecache.h, typed
in cache_api and called through ``api()``; forecache-testing.h's controls in testing, for
tests and benchmarks) and ggml backend/device queries.

Everything is loaded from the shared libraries that llama-cpp-python itself loads, so there is one
copy of llama.cpp in the process. llama.h's own functions are used through ``llama_cpp.llama_cpp``.
"""

from forecache.native.libs import (
    EXPECTED_PATCH_VERSION,
    PatchedBuildError,
    api,
    build_info,
    libggml,
    libllama,
    llama_cpp_module,
    llama_cpp_package,
    patch_version,
)

__all__ = [
    "EXPECTED_PATCH_VERSION",
    "PatchedBuildError",
    "api",
    "build_info",
    "libggml",
    "libllama",
    "llama_cpp_module",
    "llama_cpp_package",
    "patch_version",
]
