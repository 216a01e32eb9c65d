"""ctypes bindings on the patched build: patch check, devices, the copy probe."""

from __future__ import annotations

import ctypes
import ctypes.util
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


def test_patch_version_is_read_from_the_header() -> None:
    header = (libs.CSRC_DIR / "forecache.h").read_text()
    assert f"#define FORECACHE_PATCH_VERSION {native.EXPECTED_PATCH_VERSION}\n" in header


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
