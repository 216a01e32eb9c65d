"""What a build is keyed by (:class:`BuildConfig`) and the configuration of this machine's
patched build or of the unpatched reference."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from forecache.build.base import BuildError
from forecache.build.info import CSRC_DIR, PATCH_DIR
from forecache.build.sources import (
    LLAMA_CPP_PYTHON_VERSION,
    patch_files,
    patch_series_hash,
    python_patch_files,
    source_files,
)
from forecache.build.toolchain import backend_cmake_args, build_cpu_features


@dataclass
class BuildConfig:
    """What a build is keyed by: the pinned version, the patch series, the backend flags and the
    instruction sets of the CPU it was compiled for (ggml is built with -march=native)."""

    backend: str  # "cpu" or "cuda"
    patch_hash: str  # of the patches and sources; STOCK for the unpatched reference build
    patches: list[str]
    cmake_args: list[str] = field(default_factory=list)
    version: str = LLAMA_CPP_PYTHON_VERSION
    cpu_features: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # of CSRC_DIR
    python_patches: list[str] = field(default_factory=list)  # of PYTHON_PATCH_DIR

    @property
    def key(self) -> str:
        """The cache key: 16 hex digits of sha256 over what changes the compiled code."""
        blob = json.dumps([self.version, self.patch_hash, self.backend, self.cmake_args,
                           self.cpu_features])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


STOCK = "stock"  # patch_hash of the unpatched reference build


def build_config(backend: str, stock: bool = False) -> BuildConfig:
    """The configuration of the patched build (or, with ``stock``, of the unpatched reference)
    for ``backend`` on this machine."""
    patches = [] if stock else patch_files()
    sources = [] if stock else source_files()
    python_patches = [] if stock else python_patch_files()
    if not stock and not (patches and sources):
        raise BuildError(f"no patches in {PATCH_DIR} or no sources in {CSRC_DIR}")
    # A CUDA build is compiled for this machine's CPU too (its ggml-cpu backend), unless the
    # flags name the instruction sets (GGML_NATIVE=OFF).
    cmake_args = backend_cmake_args(backend)
    return BuildConfig(backend=backend, patch_hash=STOCK if stock else patch_series_hash(),
                       cmake_args=cmake_args, patches=[p.name for p in patches],
                       cpu_features=build_cpu_features(cmake_args),
                       sources=[p.name for p in sources],
                       python_patches=[p.name for p in python_patches])

