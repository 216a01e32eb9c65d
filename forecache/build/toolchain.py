"""The machine's side of a build: compilers and cmake, CUDA detection, the CMake flags of a
backend and the instruction sets a build is compiled for."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from forecache.build.base import BuildError
from forecache.build.info import cpu_features

# What the Python package loads is libllama + libggml*; everything else in the tree is skipped.
TRIM_CMAKE_ARGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # ggml's RPC backend: a remote machine's device (or another process's) as a device of this
    # one (forecache --rpc), in the patched build and the unpatched reference alike
    "-DGGML_RPC=ON",
]

# GGML_<NAME>=ON of a build with GGML_NATIVE=OFF -> the /proc/cpuinfo flag it needs
_GGML_ISA_FLAGS = {
    "AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2",
    "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_TILE": "amx_tile",
    "AMX_INT8": "amx_int8", "AMX_BF16": "amx_bf16",
}


def build_cpu_features(cmake_args: list[str]) -> list[str]:
    """The instruction sets a build with these CMake flags is compiled for: this CPU's for a
    native build, the ones named (GGML_AVX2=ON, ...) for a portable one (GGML_NATIVE=OFF), which
    may then run on any CPU that has them (a CUDA build carried to a GPU machine)."""
    if "-DGGML_NATIVE=OFF" not in cmake_args:
        return cpu_features()
    named = {a[len("-DGGML_"):-len("=ON")] for a in cmake_args
             if a.startswith("-DGGML_") and a.endswith("=ON")}
    return sorted(_GGML_ISA_FLAGS[n] for n in named if n in _GGML_ISA_FLAGS)


def gpu_present() -> bool:
    """Whether an NVIDIA GPU is visible to this machine."""
    return Path("/dev/nvidia0").exists() or _has_nvidia_smi()


def _has_nvidia_smi() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def find_nvcc() -> str | None:
    """Path of nvcc on PATH or in the usual CUDA location."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for cand in ("/usr/local/cuda/bin/nvcc",):
        if os.access(cand, os.X_OK):
            return cand
    return None


def choose_backend(requested: str = "auto") -> str:
    """cpu or cuda: FORECACHE_CUDA=1/0 forces; otherwise CUDA when nvcc and a GPU are present."""
    env = os.environ.get("FORECACHE_CUDA")
    if requested == "auto" and env in ("0", "1"):
        requested = "cuda" if env == "1" else "cpu"
    if requested == "auto":
        requested = "cuda" if find_nvcc() and gpu_present() else "cpu"
    if requested == "cuda" and not find_nvcc():
        raise BuildError("CUDA build requested but nvcc was not found: install the CUDA toolkit "
                         "or put nvcc on PATH (or set FORECACHE_CUDA=0 for a CPU build)")
    if requested not in ("cpu", "cuda"):
        raise BuildError(f"unknown backend {requested!r}: use cpu, cuda or auto")
    return requested


def backend_cmake_args(backend: str) -> list[str]:
    """CMake flags for the backend; FORECACHE_CMAKE_ARGS adds more (they key the cache too)."""
    args = list(TRIM_CMAKE_ARGS)
    if backend == "cuda":
        archs = os.environ.get("FORECACHE_CUDA_ARCHS", "native")
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        nvcc = find_nvcc()
        if nvcc:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    else:
        args.append("-DGGML_CUDA=OFF")
    extra = os.environ.get("FORECACHE_CMAKE_ARGS", "").split()
    return args + extra


def check_toolchain(backend: str) -> None:
    """Fail early, with what to install, when the compilers or cmake are missing."""
    missing = [tool for tool in ("cc", "c++") if not shutil.which(tool)]
    if missing:
        raise BuildError(f"no C/C++ compiler found ({', '.join(missing)} missing): install one, "
                         "e.g. `apt-get install build-essential` (Debian/Ubuntu)")
    cmake = shutil.which("cmake")
    if cmake:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"(\d+)\.(\d+)", out)
        if m and (int(m.group(1)), int(m.group(2))) < (3, 21):
            raise BuildError(f"cmake {m.group(0)} is too old (3.21+ needed): "
                             "`pip install cmake` or install a newer cmake")
    elif not _module_available("cmake"):
        raise BuildError("cmake not found: install it (`apt-get install cmake` or "
                         "`pip install cmake`), version 3.21 or newer")
    if not _module_available("scikit_build_core"):
        raise BuildError("scikit-build-core is not installed in this environment: "
                         "`pip install scikit-build-core` (make setup does this)")


def _module_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
