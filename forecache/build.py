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

This module uses only the standard library: it runs before the project's dependencies exist.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forecache.errors import setting, use_flag_names
from forecache.paths import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
BUILD_INFO_NAME = "forecache_build.json"

# The series and the sources ship inside the package, so an installed wheel can build too.
PATCH_DIR = Path(__file__).resolve().parent / "data" / "patches"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
# Edits to llama-cpp-python's own Python package (paths relative to the sdist's root).
PYTHON_PATCH_DIR = PATCH_DIR / "python"
# Where the files of CSRC_DIR go in vendor/llama.cpp, by suffix (src/CMakeLists.txt, as patched,
# builds them into libllama).
CSRC_DEST = {".h": "include", ".cpp": "src"}

# What the Python package loads is libllama + libggml*; everything else in the tree is skipped.
TRIM_CMAKE_ARGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# Directories of vendor/llama.cpp that no part of the trimmed build reads.
TRIM_DIRS = [
    "docs", "models", "tools", "examples", "tests", "benches", "media", "gguf-py", "scripts",
    "pocs", "app", "grammars", "requirements", "conversion", ".devops", ".github", "skills", "ci",
]
TRIM_GGML_BACKENDS = [
    "ggml-cann", "ggml-hip", "ggml-musa", "ggml-metal", "ggml-opencl", "ggml-sycl", "ggml-vulkan",
    "ggml-webgpu", "ggml-zdnn", "ggml-kompute", "ggml-rpc", "ggml-blas", "ggml-hexagon",
    "ggml-openvino", "ggml-zendnn", "ggml-virtgpu", "ggml-et",
]


class BuildError(RuntimeError):
    """A build step failed; the message says which and what to do."""


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
        blob = json.dumps([self.version, self.patch_hash, self.backend, self.cmake_args,
                           self.cpu_features])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


STOCK = "stock"  # patch_hash of the unpatched reference build

# CPU flags (/proc/cpuinfo names) that name instruction sets a -march=native build may use. Two
# machines that differ in any of them get different cached builds: a wheel compiled for AVX-512
# or AMX dies with SIGILL on a CPU without them.
_ISA_FLAG = re.compile(r"^(sse\w*|ssse3|pni|avx\w*|amx\w*|fma\w*|f16c|bmi\w*|vnni\w*|gfni|vaes|"
                       r"vpclmulqdq|sha_ni|popcnt|movbe|adx|abm|lzcnt|xop|asimd\w*|sve\w*|i8mm|"
                       r"dotprod|fphp|bf16|sme\d*)$")


def cpu_features(cpuinfo: str | None = None, isa_only: bool = True) -> list[str]:
    """The instruction-set flags of this CPU, sorted (from /proc/cpuinfo; elsewhere the machine
    name, since the build cannot tell more); ``isa_only=False``: every flag."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            import platform

            return [platform.machine() or "unknown"]
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(f for f in value.split() if not isa_only or _ISA_FLAG.match(f))
    return sorted(flags)


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


def missing_cpu_features(info: dict) -> list[str]:
    """The instruction sets a build (its build info) was compiled for that this CPU lacks."""
    built = info.get("cpu_features")
    if not built:
        return []
    return sorted(set(built) - set(cpu_features(isa_only=False)))


def log(msg: str) -> None:
    """Print a progress line of the build to stderr."""
    print(f"[forecache build] {msg}", file=sys.stderr, flush=True)


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


def installed_build_info() -> dict | None:
    """The build-info of the llama_cpp package installed in this environment, if it is ours."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / BUILD_INFO_NAME
        if p.exists():
            try:
                return json.loads(p.read_text())
            except json.JSONDecodeError:
                return None
    return None


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


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m forecache.build`` (also ``forecache build``)."""
    ap = argparse.ArgumentParser(prog="forecache build", description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="local sdist (.tar.gz) or unpacked source tree "
                    "(default: $FORECACHE_LLAMA_SOURCE, else download)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--force", action="store_true", help="rebuild even when a cached wheel exists")
    ap.add_argument("--export-source", type=Path, metavar="DIR",
                    help="only write a trimmed source tree to DIR (for offline machines)")
    ap.add_argument("--reference", action="store_true",
                    help="build the unpatched reference the tests compare with, into the "
                    "cache, not into the environment")
    args = ap.parse_args(argv)
    use_flag_names()
    try:
        if args.export_source:
            out = export_source(args.source, args.export_source)
            log(f"wrote trimmed source tree to {out}")
            return 0
        if args.reference:
            build_reference(args.source, choose_backend(args.backend), force=args.force)
            return 0
        info = build(args.source, args.backend, args.force)
    except BuildError as e:
        print(f"forecache build: error: {e}", file=sys.stderr)
        return 1
    log(f"ready: llama-cpp-python {info['version']}+forecache.{info['key']} ({info['backend']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
