"""The unpatched reference: llama-cpp-python from the same sdist without the patch series,
installed into the cache (not the environment), that forecache's lossless tests compare with."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from forecache.build.base import BuildError, log
from forecache.build.config import BuildConfig, build_config
from forecache.build.info import BUILD_INFO_NAME
from forecache.build.wheels import cached_wheel
from forecache.paths import cache_dir


def reference_dir(backend: str = "cpu") -> Path:
    """Where the unpatched reference build for ``backend`` is (or would be) installed: a
    directory to put first on PYTHONPATH, in a process of its own."""
    return _reference_dir(build_config(backend, stock=True))


def _reference_dir(cfg: BuildConfig) -> Path:
    return cache_dir() / "llama-build" / "reference" / cfg.key


def build_reference(source: Path | None = None, backend: str = "cpu", force: bool = False,
                    ) -> Path:
    """Build (or take from the cache) llama-cpp-python from the same sdist without the patch
    series, installed into :func:`reference_dir` (not into the environment): the reference that
    forecache's lossless tests compare with. Returns that directory."""
    carried = os.environ.get("FORECACHE_REFERENCE_DIR")
    if carried:
        # a reference built elsewhere and carried here (the GPU check's bundle)
        dest = Path(carried)
        if not (dest / "llama_cpp" / BUILD_INFO_NAME).exists():
            raise BuildError(f"FORECACHE_REFERENCE_DIR={carried} holds no llama_cpp build "
                             f"(no llama_cpp/{BUILD_INFO_NAME}): unset it to build one here")
        return dest
    cfg = build_config(backend, stock=True)
    dest = _reference_dir(cfg)
    if (dest / "llama_cpp" / BUILD_INFO_NAME).exists() and not force:
        log(f"unpatched reference llama-cpp-python {cfg.key} ({backend}) ready in {dest}")
        return dest
    wheel, _ = cached_wheel(cfg, source, force)
    log(f"installing the unpatched reference into {dest}")
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                          "-q", "--no-deps", "--target", str(tmp), str(wheel)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"pip could not install {wheel.name} into {tmp}:\n"
                         f"{res.stderr.strip()[-2000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest
