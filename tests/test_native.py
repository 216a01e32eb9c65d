"""ctypes bindings on the patched build: patch check, devices, the copy probe."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from forecache import native
from forecache.native import cache_api, libs
from forecache.native.ggml_devices import CopyProbeError, backends, devices, measure_copy


def test_patch_version_matches() -> None:
    assert native.patch_version() == native.EXPECTED_PATCH_VERSION


def test_stock_library_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # libc stands in for a stock libllama: a real library without forecache's symbols.
    stock = SimpleNamespace(_lib=ctypes.CDLL(ctypes.util.find_library("c")), _base_path=".")
    libs.libllama.cache_clear()
    monkeypatch.setattr(libs, "llama_cpp_module", lambda: stock)
    try:
        with pytest.raises(libs.PatchedBuildError, match="stock build without forecache's patches"):
            libs.libllama()
    finally:
        libs.libllama.cache_clear()


def test_patch_version_is_read_from_the_header(tmp_path: Path) -> None:
    # The constant follows the header it is given (a bump needs no second edit in Python), and a
    # header without the define is refused rather than read as some default.
    text = (libs.CSRC_DIR / "forecache.h").read_text()
    line = f"#define FORECACHE_PATCH_VERSION {native.EXPECTED_PATCH_VERSION}\n"
    bumped = tmp_path / "bumped.h"
    bumped.write_text(text.replace(line, "#define FORECACHE_PATCH_VERSION 9999\n"))
    assert libs._header_patch_version(bumped) == 9999
    gone = tmp_path / "gone.h"
    gone.write_text(text.replace(line, ""))
    with pytest.raises(RuntimeError, match="does not define FORECACHE_PATCH_VERSION"):
        libs._header_patch_version(gone)


def test_patch_version_is_the_value_the_compiler_sees(tmp_path: Path) -> None:
    """The regex reads the header's text; forecache_patch_version returns the macro as the C
    preprocessor expands it. Ask the preprocessor (the build's own compiler) independently, so a
    redefinition, an #if around the define or a value the regex misreads cannot slip through."""
    cc = shutil.which("cc")
    assert cc, "no C compiler (cc): the build needs one, and so does this test"
    (tmp_path / "llama.h").write_text("")  # stands in for llama.cpp's header
    probe = tmp_path / "probe.c"
    probe.write_text('#include "forecache.h"\nint forecache_probe = FORECACHE_PATCH_VERSION;\n')
    res = subprocess.run([cc, "-E", "-P", "-I", str(tmp_path), "-I", str(libs.CSRC_DIR),
                          str(probe)], capture_output=True, text=True, check=True)
    m = re.search(r"int forecache_probe = \(*\s*(\d+)\s*\)*;", res.stdout)
    assert m, f"the macro does not expand to an integer: {res.stdout[-300:]}"
    assert int(m.group(1)) == native.EXPECTED_PATCH_VERSION


def test_other_patch_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    libs.libllama.cache_clear()
    monkeypatch.setattr(libs, "EXPECTED_PATCH_VERSION", native.EXPECTED_PATCH_VERSION + 1)
    try:
        with pytest.raises(libs.PatchedBuildError, match="forecache patch version"):
            libs.libllama()
    finally:
        libs.libllama.cache_clear()


def test_struct_mirrors_match_the_library() -> None:
    assert cache_api.struct_size_mismatches(native.libllama()) == []


def test_struct_mirror_of_wrong_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class ShortStats(ctypes.Structure):
        _fields_ = cache_api.CacheStats._fields_[:-1]

    libs.libllama.cache_clear()
    monkeypatch.setattr(cache_api, "_MIRRORS", {ShortStats: "forecache_cache_stats_size"})
    try:
        full = ctypes.sizeof(cache_api.CacheStats)
        with pytest.raises(libs.PatchedBuildError,
                           match=f"ShortStats: {full - 8} bytes, C {full}"):
            libs.libllama()
    finally:
        libs.libllama.cache_clear()


def test_devices_include_cpu() -> None:
    assert "CPU" in backends()
    devs = devices()
    cpu = [d for d in devs if d.type == "cpu"]
    assert cpu and cpu[0].memory_total > 0


def test_copy_probe_on_cpu_device() -> None:
    cpu = next(d for d in devices() if d.type == "cpu")
    bw = measure_copy(cpu.index, nbytes=8 << 20, n_iter=2, pinned=False)
    assert bw.h2d_gbps > 0.05 and bw.d2h_gbps > 0.05
    if not any(d.type == "gpu" for d in devices()):
        with pytest.raises(CopyProbeError, match="pinned host memory unavailable"):
            measure_copy(cpu.index, nbytes=1 << 20, n_iter=1, pinned=True)
    with pytest.raises(CopyProbeError, match="bad device index"):
        measure_copy(len(devices()) + 5, nbytes=1 << 20, n_iter=1, pinned=False)


def test_build_info_recorded() -> None:
    info = native.build_info()
    assert info["backend"] in ("cpu", "cuda")
    assert info["llama_cpp_commit"] and len(info["llama_cpp_commit"]) == 40
