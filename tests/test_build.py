"""The patched build: what is installed, how builds are keyed, and how failures are reported."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from forecache import build
from forecache.build import BuildError, toolchain
from forecache.build import info as build_info
from forecache.paths import cache_dir


def test_installed_build_is_ours_and_current() -> None:
    import llama_cpp

    info = build.installed_build_info()
    assert info is not None, "llama_cpp in this environment was not built by forecache"
    assert info["patch_hash"] == build.patch_series_hash()
    assert info["patches"] == [p.name for p in build.patch_files()]
    expected = f"{build.LLAMA_CPP_PYTHON_VERSION}+forecache.{info['key']}"
    assert llama_cpp.__version__ == expected


def test_patch_hash_changes_with_series(tmp_path: Path) -> None:
    for p in build.patch_files():
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "python").mkdir()
    for p in build.python_patch_files():
        shutil.copy(p, tmp_path / "python" / p.name)
    h0 = build.patch_series_hash(tmp_path)
    assert h0 == build.patch_series_hash()
    (tmp_path / "python" / "0099-extra.patch").write_text("--- a/x\n+++ b/x\n")
    h1 = build.patch_series_hash(tmp_path)
    assert h1 != h0
    (tmp_path / "0099-extra.patch").write_text("--- a/x\n+++ b/x\n")
    assert build.patch_series_hash(tmp_path) not in (h0, h1)


def test_patch_hash_changes_with_sources(tmp_path: Path) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC_DIR, csrc)
    h0 = build.patch_series_hash(csrc_dir=csrc)
    assert h0 == build.patch_series_hash()
    cpp = csrc / "forecache-cache.cpp"
    cpp.write_text(cpp.read_text() + "\n")
    assert build.patch_series_hash(csrc_dir=csrc) != h0
    assert {p.name for p in build.source_files()} >= {"forecache.h", "forecache-testing.h",
                                                      "forecache.cpp", "forecache-cache.cpp"}


def test_build_key_depends_on_flags() -> None:
    a = build.BuildConfig("cpu", "h", ["p"], ["-DA=1"])
    b = build.BuildConfig("cuda", "h", ["p"], ["-DA=1"])
    c = build.BuildConfig("cpu", "h", ["p"], ["-DA=2"])
    assert len({a.key, b.key, c.key}) == 3
    assert a.key == build.BuildConfig("cpu", "h", ["p"], ["-DA=1"]).key


def _fake_tree(root: Path, text: str = "int x = 1;\n") -> Path:
    tree = root / "llama_cpp_python-0.3.36"
    (tree / "vendor" / "llama.cpp" / "src").mkdir(parents=True)
    (tree / "vendor" / "llama.cpp" / "src" / "f.c").write_text(text)
    return tree


def test_patch_that_does_not_apply_names_itself(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path, "something else\n")
    bad = tmp_path / "0002-broken.patch"
    bad.write_text("--- a/src/f.c\n+++ b/src/f.c\n@@ -1 +1 @@\n-int x = 1;\n+int x = 2;\n")
    with pytest.raises(BuildError, match="0002-broken.patch does not apply"):
        build.apply_patches(tree, [bad])


def test_patch_applies_in_order(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path)
    p1 = tmp_path / "0001-a.patch"
    p1.write_text("--- a/src/f.c\n+++ b/src/f.c\n@@ -1 +1 @@\n-int x = 1;\n+int x = 2;\n")
    p2 = tmp_path / "0002-b.patch"
    p2.write_text("--- a/src/f.c\n+++ b/src/f.c\n@@ -1 +1 @@\n-int x = 2;\n+int x = 3;\n")
    build.apply_patches(tree, [p1, p2])
    assert (tree / "vendor" / "llama.cpp" / "src" / "f.c").read_text() == "int x = 3;\n"


@pytest.fixture(scope="module")
def pinned_source() -> Path:
    """The pinned llama-cpp-python source, found without a network: the sdist where
    build.fetch_sdist keeps it (cache_dir()/sdist; CI's `make test` runs `python -m forecache.build
    --reference` first, which puts it there), else $FORECACHE_LLAMA_SOURCE (an offline machine's
    sdist or exported tree). Under CI its absence fails the test: the series must be applied to
    the real source there, not skipped."""
    sdist = cache_dir() / "sdist" / build.SDIST_NAME
    if sdist.is_file():
        return sdist
    env = os.environ.get("FORECACHE_LLAMA_SOURCE")
    if env and Path(env).expanduser().exists():
        return Path(env).expanduser()
    why = (f"the pinned sdist is not at {sdist} (a `python -m forecache.build` that builds "
           f"downloads it there) and FORECACHE_LLAMA_SOURCE names no source")
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(why)
    pytest.skip(why)


def test_real_series_applies_to_pinned_sdist(tmp_path: Path, pinned_source: Path) -> None:
    tree = build.unpack_source(pinned_source, tmp_path)
    build.trim_tree(tree)
    build.add_sources(tree, build.source_files())
    build.apply_patches(tree, build.patch_files())
    build.apply_patches(tree, build.python_patch_files(), into=".")
    assert "output_all_rows" in (tree / "llama_cpp" / "llama.py").read_text()
    vendor = tree / "vendor" / "llama.cpp"
    assert (vendor / "include" / "forecache.h").exists()
    # every source lands in src/, where the patched CMakeLists.txt builds forecache*.cpp
    for src in build.source_files():
        if src.suffix == ".cpp":
            assert (vendor / "src" / src.name).exists() and src.name.startswith("forecache")
    cmake = (vendor / "src" / "CMakeLists.txt").read_text()
    assert 'GLOB FORECACHE_SOURCES "forecache*.cpp"' in cmake
    assert not (vendor / "docs").exists()


def test_wrong_sdist_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / build.SDIST_NAME
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = b"not llama"
        info = tarfile.TarInfo("x/readme")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    fake.write_bytes(buf.getvalue())
    assert hashlib.sha256(fake.read_bytes()).hexdigest() != build.SDIST_SHA256
    with pytest.raises(BuildError, match="expected " + build.SDIST_SHA256):
        build.unpack_source(fake, tmp_path / "work")


def test_source_tree_of_wrong_shape_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src" / "nothing").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    with pytest.raises(BuildError, match="not a llama-cpp-python source tree"):
        build.unpack_source(tmp_path / "src", tmp_path / "work")


def test_backend_choice_follows_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORECACHE_CUDA", "0")
    assert build.choose_backend() == "cpu"
    monkeypatch.setenv("FORECACHE_CUDA", "1")
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: None)
    with pytest.raises(BuildError, match="nvcc was not found"):
        build.choose_backend()
    assert "-DGGML_CUDA=OFF" in build.backend_cmake_args("cpu")
    assert "-DLLAVA_BUILD=OFF" in build.backend_cmake_args("cpu")


def test_missing_compiler_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain.shutil, "which", lambda name: None)
    with pytest.raises(BuildError, match="no C/C.. compiler found"):
        build.check_toolchain("cpu")


def test_exported_tree_is_a_valid_offline_source(tmp_path: Path, pinned_source: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    exported = build.export_source(pinned_source, tmp_path / "src")
    assert not (exported / "vendor" / "llama.cpp" / "docs").exists()
    for p in build.source_files():
        dest = exported / "vendor" / "llama.cpp" / build.CSRC_DEST[p.suffix] / p.name
        assert dest.read_bytes() == p.read_bytes()
    with pytest.raises(BuildError, match="exists"):
        build.export_source(pinned_source, exported)
    monkeypatch.setenv("FORECACHE_LLAMA_SOURCE", str(exported))
    (tmp_path / "work").mkdir()
    tree = build.unpack_source(None, tmp_path / "work")
    assert tree.parent == tmp_path / "work"
    assert build.llama_cpp_commit(tree) == build.llama_cpp_commit(exported)
    build.add_sources(tree, build.source_files())
    build.apply_patches(tree, build.patch_files())


def test_cpu_features_key_the_cache_and_guard_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    cpuinfo = ("processor\t: 0\nflags\t\t: fpu sse sse2 pni ssse3 fma avx avx2 avx512f avx512bw "
               "amx_tile amx_int8 hypervisor smep\nprocessor\t: 1\n")
    feats = build.cpu_features(cpuinfo)
    assert feats == ["amx_int8", "amx_tile", "avx", "avx2", "avx512bw", "avx512f", "fma", "pni",
                     "sse", "sse2", "ssse3"]
    a = build.BuildConfig("cpu", "h", ["p"], ["-DA=1"], cpu_features=feats)
    b = build.BuildConfig("cpu", "h", ["p"], ["-DA=1"], cpu_features=feats[2:])
    assert a.key != b.key  # a cache carried to a CPU without AMX is not used there
    # the installed build records what it was compiled for; a CPU that lacks some is refused
    assert build.installed_build_info()["cpu_features"] == build.cpu_features()
    from forecache.native import libs

    monkeypatch.setattr(build_info, "installed_build_info",
                        lambda: {"cpu_features": ["avx2", "isa_this_cpu_lacks"]})
    monkeypatch.setattr(build_info, "cpu_features",
                        lambda cpuinfo=None, isa_only=True: ["avx2", "fma"])
    libs.check_build_cpu.cache_clear()
    try:
        with pytest.raises(libs.PatchedBuildError, match="isa_this_cpu_lacks, which this CPU"):
            libs.check_build_cpu()
    finally:
        libs.check_build_cpu.cache_clear()


def test_reference_build_is_unpatched_and_apart() -> None:
    """The lossless tests' reference: the same sdist without the series, outside the venv."""
    site = build.reference_dir()
    info = json.loads((site / "llama_cpp" / build.BUILD_INFO_NAME).read_text())
    assert info["patches"] == [] and info["patch_hash"] == build.STOCK
    assert info["cmake_args"] == build.backend_cmake_args("cpu")
    code = ("import llama_cpp, llama_cpp.llama_cpp as l; "
            "print(llama_cpp.__version__, hasattr(l._lib, 'forecache_patch_version'))")
    res = subprocess.run([sys.executable, "-c", code],
                         env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True,
                         text=True, check=True)
    version, patched = res.stdout.split()
    assert version.startswith("0.3.36+stock.") and patched == "False"


def test_portable_build_is_keyed_by_the_instruction_sets_it_names() -> None:
    """A build with GGML_NATIVE=OFF (the CUDA wheel carried to a GPU machine) records the
    instruction sets its flags name, so any CPU that has them may load it."""
    args = ["-DGGML_CUDA=ON", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
            "-DGGML_F16C=ON", "-DGGML_CUDA_NO_VMM=ON"]
    assert build.build_cpu_features(args) == ["avx2", "f16c", "fma"]
    assert build.build_cpu_features(["-DGGML_CUDA=OFF"]) == build.cpu_features()


def test_carried_reference_is_used_as_it_is(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """FORECACHE_REFERENCE_DIR names a reference built elsewhere (the GPU check's bundle); one
    that holds no build is refused in one line instead of building another."""
    site = build.reference_dir()
    monkeypatch.setenv("FORECACHE_REFERENCE_DIR", str(site))
    assert build.build_reference(backend="cuda") == site  # no CUDA build is attempted
    monkeypatch.setenv("FORECACHE_REFERENCE_DIR", str(tmp_path))
    with pytest.raises(build.BuildError, match="holds no llama_cpp build"):
        build.build_reference()


def test_series_leaves_the_backends_headers_alone() -> None:
    """The scheduler hooks are declared in a header of their own: the headers every backend's
    sources include stay unpatched, so the patched and the unpatched CUDA builds share ggml's
    compiled kernels (ccache) and differ in a few files."""
    touched = set()
    for patch in build.patch_files():
        touched |= set(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.MULTILINE))
    assert "ggml/include/ggml-backend-hooks.h" in touched
    assert not {t for t in touched if t.startswith("ggml/include/") and
                t != "ggml/include/ggml-backend-hooks.h"}
    assert not {t for t in touched if t.startswith("ggml/src/ggml-cuda")}
