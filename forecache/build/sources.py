"""The sources of a build: the pinned llama-cpp-python sdist (downloaded or local, checked against
its sha256), trimmed to the libraries forecache loads, with forecache's C/C++ added and the patch
series applied; and the hash of that series, which keys the build."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from forecache.build.base import BuildError, log
from forecache.build.info import CSRC_DIR, PATCH_DIR
from forecache.errors import setting
from forecache.paths import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

# Edits to llama-cpp-python's own Python package (paths relative to the sdist's root).
PYTHON_PATCH_DIR = PATCH_DIR / "python"
# Where the files of CSRC_DIR go in vendor/llama.cpp, by suffix (src/CMakeLists.txt, as patched,
# builds them into libllama).
CSRC_DEST = {".h": "include", ".cpp": "src"}

# Directories of vendor/llama.cpp that no part of the trimmed build reads.
TRIM_DIRS = [
    "docs", "models", "tools", "examples", "tests", "benches", "media", "gguf-py", "scripts",
    "pocs", "app", "grammars", "requirements", "conversion", ".devops", ".github", "skills", "ci",
]
TRIM_GGML_BACKENDS = [
    "ggml-cann", "ggml-hip", "ggml-musa", "ggml-metal", "ggml-opencl", "ggml-sycl", "ggml-vulkan",
    "ggml-webgpu", "ggml-zdnn", "ggml-kompute", "ggml-blas", "ggml-hexagon",
    "ggml-openvino", "ggml-zendnn", "ggml-virtgpu", "ggml-et",
]


def patch_files(patch_dir: Path = PATCH_DIR) -> list[Path]:
    """The patch series, in the order it is applied."""
    return sorted(patch_dir.glob("*.patch"))


def python_patch_files(patch_dir: Path = PYTHON_PATCH_DIR) -> list[Path]:
    """The patches to llama-cpp-python's Python package, in the order they are applied."""
    return sorted(patch_dir.glob("*.patch"))


def source_files(csrc_dir: Path = CSRC_DIR) -> list[Path]:
    """forecache's C/C++ sources that the build adds to vendor/llama.cpp."""
    return sorted(p for p in csrc_dir.iterdir() if p.suffix in CSRC_DEST)


def patch_series_hash(patch_dir: Path = PATCH_DIR, csrc_dir: Path = CSRC_DIR) -> str:
    """sha256 over the names and contents of the patch series (llama.cpp's and the Python
    package's) and of the sources it builds (first 16 hex digits): a change to any is a new
    build."""
    h = hashlib.sha256()
    for p in patch_files(patch_dir):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for p in python_patch_files(patch_dir / "python"):
        h.update(b"python/" + p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for p in source_files(csrc_dir):
        h.update(b"csrc/" + p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(dest_dir: Path) -> Path:
    """The pinned sdist, from the cache or downloaded with pip from the configured index."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    sdist = dest_dir / SDIST_NAME
    if sdist.exists() and sha256_file(sdist) == SDIST_SHA256:
        return sdist
    log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist from the package index")
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", "-d", tmp,
               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SDIST_NAME
        if res.returncode != 0 or not got.exists():
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-5:])
            raise BuildError("could not download the llama-cpp-python sdist (no network? use "
                             f"`forecache build --source PATH`):\n{tail}")
        os.replace(got, sdist)
    verify_sdist(sdist)
    return sdist


def verify_sdist(sdist: Path) -> None:
    """Refuse an sdist whose sha256 is not the pinned one."""
    digest = sha256_file(sdist)
    if digest != SDIST_SHA256:
        raise BuildError(f"{sdist} has sha256 {digest}, expected {SDIST_SHA256}: it is not the "
                         f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist; delete it and retry")


def unpack_source(source: Path | None, work: Path) -> Path:
    """Copy or unpack the source into ``work`` and return the llama-cpp-python tree in it."""
    if source is None and os.environ.get("FORECACHE_LLAMA_SOURCE"):
        source = Path(os.environ["FORECACHE_LLAMA_SOURCE"])
    if source is None:
        source = fetch_sdist(cache_dir() / "sdist")
    source = source.expanduser().resolve()
    if not source.exists():
        raise BuildError(f"{setting('source', str(source))} does not exist")
    if source.is_file():
        verify_sdist(source)
        log(f"unpacking {source.name}")
        with tarfile.open(source) as tf:
            if sys.version_info >= (3, 12):
                tf.extractall(work, filter="data")
            else:
                tf.extractall(work)
        trees = [p for p in work.iterdir() if p.is_dir()]
        if len(trees) != 1:
            raise BuildError(f"{source} is not a llama-cpp-python sdist (no single top directory)")
        tree = trees[0]
    else:
        tree = work / source.name
        log(f"copying source tree {source}")
        shutil.copytree(source, tree, symlinks=True,
                        ignore=shutil.ignore_patterns("build", "_skbuild"))
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").exists() or not (
        tree / "llama_cpp" / "__init__.py"
    ).exists():
        raise BuildError(f"{source} is not a llama-cpp-python source tree "
                         "(vendor/llama.cpp missing)")
    version = _source_version(tree)
    if version != LLAMA_CPP_PYTHON_VERSION:
        raise BuildError(f"{source} is llama-cpp-python {version}, forecache needs "
                         f"{LLAMA_CPP_PYTHON_VERSION}")
    return tree


def _source_version(tree: Path) -> str:
    text = (tree / "llama_cpp" / "__init__.py").read_text()
    m = re.search(r'__version__\s*=\s*"([^"+]+)', text)
    return m.group(1) if m else "unknown"


def llama_cpp_commit(tree: Path) -> str | None:
    """Commit of the vendored llama.cpp, read from the submodule's git directory in the sdist."""
    head = tree / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    if head.exists():
        return head.read_text().strip()[:40]
    rec = tree / "vendor" / "llama.cpp" / ".forecache-commit"
    return rec.read_text().strip() if rec.exists() else None


def trim_tree(tree: Path) -> None:
    """Drop what the trimmed build never reads (docs, models, tools, other backends, git data)."""
    commit = llama_cpp_commit(tree)
    vendor = tree / "vendor" / "llama.cpp"
    if commit:
        (vendor / ".forecache-commit").write_text(commit + "\n")
    for name in TRIM_DIRS:
        shutil.rmtree(vendor / name, ignore_errors=True)
    for name in TRIM_GGML_BACKENDS:
        shutil.rmtree(vendor / "ggml" / "src" / name, ignore_errors=True)
    for git in (tree / ".git", vendor / ".git"):
        if git.is_dir():
            shutil.rmtree(git)
        elif git.exists():
            git.unlink()
    for name in ("docs", "examples", "tests", "docker"):
        shutil.rmtree(tree / name, ignore_errors=True)
    # The package sets LLAMA_BUILD_COMMON ON with FORCE; libcommon is never loaded from Python.
    cml = tree / "CMakeLists.txt"
    text = cml.read_text()
    cml.write_text(text.replace("set(LLAMA_BUILD_COMMON ON CACHE BOOL",
                                "set(LLAMA_BUILD_COMMON OFF CACHE BOOL"))


def add_sources(tree: Path, sources: list[Path]) -> None:
    """Copy forecache's sources into vendor/llama.cpp (headers to include/, the rest to src/),
    over the copies an exported tree carries: the package's sources are the ones built."""
    vendor = tree / "vendor" / "llama.cpp"
    for p in sources:
        shutil.copyfile(p, vendor / CSRC_DEST[p.suffix] / p.name)


def apply_patches(tree: Path, patches: list[Path], into: str = "vendor/llama.cpp") -> None:
    """Apply ``patches`` in order to the directory ``into`` of the sdist (llama.cpp, or "." for
    llama-cpp-python's own files); one that does not apply stops the build."""
    vendor = tree / into
    git = shutil.which("git")
    if not git:
        raise BuildError("git is needed to apply the patch series: install git")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    for p in patches:
        res = subprocess.run([git, "apply", "--whitespace=nowarn", str(p)], cwd=vendor, env=env,
                             capture_output=True, text=True)
        if res.returncode != 0:
            what = "llama.cpp in llama-cpp-python" if into != "." else "llama-cpp-python"
            raise BuildError(f"patch {p.name} does not apply to {what} "
                             f"{LLAMA_CPP_PYTHON_VERSION}:\n{res.stderr.strip()}")
        log(f"applied {p.name}")


def export_source(source: Path | None, out: Path) -> Path:
    """Write a trimmed, unpatched source tree (a few MB) for machines without network access,
    with forecache's sources in it (unused until the patch series is applied; a build from the
    tree copies the package's own sources over them)."""
    out = out.expanduser().resolve()
    if out.exists():
        raise BuildError(f"{out} exists; give a new directory")
    with tempfile.TemporaryDirectory() as tmp:
        tree = unpack_source(source, Path(tmp))
        trim_tree(tree)
        add_sources(tree, source_files())
        shutil.copytree(tree, out, symlinks=True)
    return out
