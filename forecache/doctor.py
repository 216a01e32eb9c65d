"""What this machine and build offer: the inputs of every later performance model."""

from __future__ import annotations

import os
import time

import numpy as np

from forecache.diskprobe import measure_disk
from forecache.native import build_info, llama_cpp_module, patch_version
from forecache.native.ggml_devices import CopyProbeError, backends, devices, measure_copy
from forecache.paths import model_dir


def host_memory_bandwidth_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-N single-thread memcpy bandwidth (bytes read + written per second, GB/s)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def host_memory_bytes() -> int | None:
    """Total physical memory of the host."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def collect(measure: bool = True, probe_bytes: int = 256 << 20) -> dict:
    """Everything doctor reports, as one JSON-ready dict."""
    import llama_cpp

    info = build_info()
    report: dict = {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_commit": info.get("llama_cpp_commit"),
        "patch_version": patch_version(),
        "patch_series_hash": info.get("patch_hash"),
        "patches": info.get("patches"),
        "build": {"backend": info.get("backend"), "cmake_args": info.get("cmake_args"),
                  "key": info.get("key"), "built_at": info.get("built_at"),
                  "cpu_features": info.get("cpu_features")},
        "system_info": llama_cpp_module().llama_print_system_info().decode().strip(),
        "backends": backends(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": host_memory_bytes(),
        "devices": [],
    }
    for dev in devices():
        entry: dict = {
            "index": dev.index, "name": dev.name, "description": dev.description,
            "type": dev.type, "backend": dev.backend,
            "memory_total_bytes": dev.memory_total, "memory_free_bytes": dev.memory_free,
        }
        if dev.type in ("gpu", "igpu"):
            entry.update(_gpu_probe(dev.index, measure, probe_bytes))
        report["devices"].append(entry)
    if measure:
        report["host_memcpy_gbps"] = round(host_memory_bandwidth_gbps(probe_bytes), 2)
        try:  # where models are kept: the disk tier reads experts from there
            report["disk"] = measure_disk(model_dir(), probe_bytes)
        except OSError as e:
            report["disk"] = {"path": str(model_dir()), "error": str(e)}
    return report


def _gpu_probe(index: int, measure: bool, nbytes: int) -> dict:
    out: dict = {}
    try:
        bw = measure_copy(index, nbytes=nbytes if measure else 1 << 20, n_iter=5 if measure else 1,
                          pinned=True)
        out["pinned_host_memory"] = True
    except CopyProbeError as e:
        out["pinned_host_memory"] = False
        out["pinned_error"] = str(e)
        if not measure:
            return out
        bw = measure_copy(index, nbytes=nbytes, n_iter=5, pinned=False)
    if measure:
        key = "pinned" if bw.pinned else "pageable"
        out[f"h2d_gbps_{key}"] = round(bw.h2d_gbps, 2)
        out[f"d2h_gbps_{key}"] = round(bw.d2h_gbps, 2)
        out["probe_bytes"] = bw.nbytes
    return out


def format_report(r: dict) -> str:
    """Human-readable doctor output."""
    gib = 1 << 30
    lines = [
        f"llama-cpp-python   {r['llama_cpp_python']}",
        f"llama.cpp commit   {r['llama_cpp_commit'] or 'unknown'}",
        f"patch series       v{r['patch_version']} hash {r['patch_series_hash']} "
        f"({len(r['patches'] or [])} patches)",
        f"build              {r['build']['backend']} ({' '.join(r['build']['cmake_args'] or [])})",
        f"backends           {', '.join(r['backends'])}",
        f"system info        {r['system_info']}",
        f"CPUs               {r['cpu_count']}",
    ]
    if r.get("host_memory_bytes"):
        lines.append(f"host memory        {r['host_memory_bytes'] / gib:.1f} GiB")
    if "host_memcpy_gbps" in r:
        lines.append(f"host memcpy        {r['host_memcpy_gbps']:.1f} GB/s (1 thread, read+write)")
    disk = r.get("disk")
    if disk and "error" in disk:
        lines.append(f"disk               {disk['path']}: cannot measure ({disk['error']})")
    elif disk:
        rates = ", ".join(f"{k[2:-5]} in flight {v:.2f} GB/s" for k, v in disk.items()
                          if k.startswith("qd"))
        lines.append(f"disk               {disk['path']}: {rates} "
                     f"({disk['read_bytes'] >> 20} MiB reads, "
                     f"{'direct I/O' if disk['direct_io'] else 'through the page cache'})")
    lines.append("devices:")
    for d in r["devices"]:
        lines.append(f"  [{d['index']}] {d['name']} ({d['type']}, {d['backend']}): "
                     f"{d['description']}; {d['memory_free_bytes'] / gib:.1f} of "
                     f"{d['memory_total_bytes'] / gib:.1f} GiB free")
        if d["type"] in ("gpu", "igpu"):
            pinned = "yes" if d.get("pinned_host_memory") else "no"
            lines.append(f"      pinned host memory: {pinned}")
            for k in ("pinned", "pageable"):
                if f"h2d_gbps_{k}" in d:
                    lines.append(f"      H2D {d[f'h2d_gbps_{k}']:.1f} GB/s, D2H "
                                 f"{d[f'd2h_gbps_{k}']:.1f} GB/s ({k}, "
                                 f"{d['probe_bytes'] >> 20} MiB copies)")
    if not any(d["type"] in ("gpu", "igpu") for d in r["devices"]):
        lines.append("  no GPU: expert cache runs in host memory (CPU build)")
    return "\n".join(lines)
