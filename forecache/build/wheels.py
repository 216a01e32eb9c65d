"""The wheel cache: a build's wheel and record, built once per :class:`BuildConfig` key under the
user's cache directory (one build at a time), and installed into the running environment."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from forecache.build.base import BuildError, log
from forecache.build.config import STOCK, BuildConfig, build_config
from forecache.build.info import BUILD_INFO_NAME, CSRC_DIR, PATCH_DIR, installed_build_info
from forecache.build.sources import (
    PYTHON_PATCH_DIR,
    add_sources,
    apply_patches,
    llama_cpp_commit,
    trim_tree,
    unpack_source,
)
from forecache.build.toolchain import check_toolchain, choose_backend
from forecache.paths import cache_dir


@contextlib.contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """One build at a time per cache directory (two setups racing would corrupt the cache)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another forecache build holds the lock; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def stamp_tree(tree: Path, cfg: BuildConfig) -> dict:
    """Mark the package as ours: a local version label and a build-info file inside the wheel."""
    init = tree / "llama_cpp" / "__init__.py"
    text = init.read_text()
    label = "stock" if cfg.patch_hash == STOCK else "forecache"
    text = re.sub(r'__version__\s*=\s*"[^"]*"',
                  f'__version__ = "{cfg.version}+{label}.{cfg.key}"', text, count=1)
    init.write_text(text)
    info = {
        **asdict(cfg),
        "key": cfg.key,
        "llama_cpp_commit": llama_cpp_commit(tree),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tree / "llama_cpp" / BUILD_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _run_logged(cmd: list[str], env: dict[str, str], log_path: Path,
                on_line: Callable[[str], None] | None = None) -> int:
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            if on_line:
                on_line(line)
        return proc.wait()


def _progress_printer() -> Callable[[str], None]:
    """Turn ninja's [n/m] lines into a progress line every 10%."""
    state = {"last": -10}
    pat = re.compile(r"^\[(\d+)/(\d+)\]")

    def on_line(line: str) -> None:
        m = pat.match(line.strip())
        if not m:
            return
        n, total = int(m.group(1)), int(m.group(2))
        pct = 100 * n // max(total, 1)
        if pct >= state["last"] + 10 or n == total:
            state["last"] = pct
            log(f"compiling: {pct}% ({n}/{total})")

    return on_line


def build_wheel(tree: Path, cfg: BuildConfig, out_dir: Path, log_path: Path) -> Path:
    """Build the patched tree into a wheel in out_dir."""
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(cfg.cmake_args)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    env["FORCE_CMAKE"] = "1"
    env["SKBUILD_BUILD_DIR"] = str(tree.parent.parent / "cmake-build")
    if shutil.which("ninja"):
        env.setdefault("CMAKE_GENERATOR", "Ninja")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
           "-w", str(out_dir), str(tree)]
    log(f"building ({cfg.backend}) with {env['CMAKE_BUILD_PARALLEL_LEVEL']} jobs; log: {log_path}")
    t0 = time.time()
    rc = _run_logged(cmd, env, log_path, _progress_printer())
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise BuildError(f"llama.cpp build failed (exit {rc}); last lines of {log_path}:\n{tail}")
    wheels = sorted(out_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        raise BuildError(f"build finished but produced no wheel; see {log_path}")
    log(f"built {wheels[-1].name} in {time.time() - t0:.0f} s")
    return wheels[-1]


def install_wheel(wheel: Path) -> None:
    """Install the wheel over whatever llama-cpp-python the environment has."""
    base = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    res = subprocess.run(base + ["--force-reinstall", "--no-deps", str(wheel)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"pip could not install {wheel.name}:\n{res.stderr.strip()[-2000:]}")
    # Its own runtime dependencies (jinja2, diskcache, ...) when they are not there yet.
    res = subprocess.run(base + [str(wheel)], capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"pip could not install the dependencies of {wheel.name}:\n"
                         f"{res.stderr.strip()[-2000:]}")


def cached_wheel(cfg: BuildConfig, source: Path | None = None, force: bool = False,
                 ) -> tuple[Path, dict]:
    """The wheel of ``cfg`` and its build info: from the cache, else built (and cached)."""
    root = cache_dir() / "llama-build"
    wheel_dir = root / "wheels" / cfg.key
    with build_lock(root):
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
        if wheels and not force:
            log(f"using cached wheel {wheels[-1]}")
            return wheels[-1], json.loads((wheel_dir / BUILD_INFO_NAME).read_text())
        check_toolchain(cfg.backend)
        # Fixed paths (the build lock makes them private) keep the compiler's command lines alike
        # between builds, so ccache, where installed, serves the objects two builds share: the
        # reference and the patched build differ in a few files, not in ggml's CUDA kernels.
        work_root = root / "work"
        shutil.rmtree(work_root, ignore_errors=True)
        (work_root / "src").mkdir(parents=True)
        try:
            tree = unpack_source(source, work_root / "src")
            trim_tree(tree)
            add_sources(tree, [CSRC_DIR / name for name in cfg.sources])
            apply_patches(tree, [PATCH_DIR / name for name in cfg.patches])
            apply_patches(tree, [PYTHON_PATCH_DIR / name for name in cfg.python_patches], into=".")
            info = stamp_tree(tree, cfg)
            staging = work_root / "wheel"
            staging.mkdir()
            wheel_built = build_wheel(tree, cfg, staging, root / f"build-{cfg.key}.log")
            # Publish atomically: a half-copied wheel must never look like a cache hit.
            tmp_dir = root / "wheels" / f".{cfg.key}.tmp"
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir.mkdir(parents=True)
            shutil.copy2(wheel_built, tmp_dir / wheel_built.name)
            (tmp_dir / BUILD_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
            shutil.rmtree(wheel_dir, ignore_errors=True)
            os.replace(tmp_dir, wheel_dir)
            return wheel_dir / wheel_built.name, info
        finally:
            shutil.rmtree(work_root, ignore_errors=True)


def build(source: Path | None = None, backend: str = "auto", force: bool = False,
          install: bool = True) -> dict:
    """Build (or take from the cache) the patched wheel and install it; returns its build info."""
    backend = choose_backend(backend)
    cfg = build_config(backend)
    current = installed_build_info()
    if install and not force and current and current.get("key") == cfg.key:
        log(f"patched llama-cpp-python {cfg.key} ({backend}) already installed")
        return current
    wheel, info = cached_wheel(cfg, source, force)
    if install:
        log(f"installing {wheel.name}")
        install_wheel(wheel)
    return info
