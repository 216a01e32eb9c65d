"""ggml backend registry and device queries (ggml-backend.h), through ctypes."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from forecache.native.libs import api, libggml

# enum ggml_backend_dev_type in ggml-backend.h
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass
class Device:
    """One ggml backend device."""

    index: int
    name: str
    description: str
    type: str
    backend: str
    memory_total: int
    memory_free: int


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = libggml()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "ggml_backend_dev_count": ([], sz),
        "ggml_backend_dev_get": ([sz], vp),
        "ggml_backend_dev_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_description": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_memory": ([vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
        "ggml_backend_dev_type": ([vp], ctypes.c_int),
        "ggml_backend_dev_backend_reg": ([vp], vp),
        "ggml_backend_dev_host_buffer_type": ([vp], vp),
        "ggml_backend_dev_buffer_type": ([vp], vp),
        "ggml_backend_reg_name": ([vp], ctypes.c_char_p),
        "ggml_backend_reg_count": ([], sz),
        "ggml_backend_reg_get": ([sz], vp),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


def _ensure_backends_loaded() -> None:
    # llama_backend_init registers the backends compiled into libggml.
    from forecache.native.libs import llama_cpp_module

    llama_cpp_module().llama_backend_init()


def backends() -> list[str]:
    """Names of the registered ggml backends (CPU, CUDA, ...)."""
    _ensure_backends_loaded()
    lib = _lib()
    return [lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode()
            for i in range(lib.ggml_backend_reg_count())]


def devices() -> list[Device]:
    """All ggml backend devices with their memory."""
    _ensure_backends_loaded()
    lib = _lib()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        out.append(Device(
            index=i,
            name=lib.ggml_backend_dev_name(dev).decode(),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode(),
            type=DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "unknown"),
            backend=lib.ggml_backend_reg_name(reg).decode() if reg else "",
            memory_total=total.value,
            memory_free=free.value,
        ))
    return out


def host_buffer_type(index: int) -> int:
    """Buffer type for host-resident weights next to device ``index``: its pinned host buffer
    type when it has one, else the device's own (CPU) buffer type."""
    lib = _lib()
    dev = lib.ggml_backend_dev_get(index)
    return lib.ggml_backend_dev_host_buffer_type(dev) or lib.ggml_backend_dev_buffer_type(dev)


def is_rpc(d: Device) -> bool:
    """The device is another process's or machine's, through ggml's RPC backend (``--rpc``)."""
    return d.backend.startswith("RPC")


def cache_device() -> Device:
    """The device expert slots live on: the first local GPU, else the CPU (an RPC server's
    device is not one: forecache's cache runs on a device of this machine)."""
    devs = [d for d in devices() if not is_rpc(d)]
    for kind in ("gpu", "cpu"):
        for d in devs:
            if d.type == kind:
                return d
    raise RuntimeError("ggml reports no GPU and no CPU device")


def local_gpus() -> list[Device]:
    """This machine's GPUs, in ggml's order (the order llama.cpp splits layers over them)."""
    return [d for d in devices() if d.type == "gpu" and not is_rpc(d)]


def rpc_devices() -> list[Device]:
    """The RPC servers' devices registered in this process (``native.rpc.add_servers``)."""
    return [d for d in devices() if is_rpc(d)]


def model_devices() -> list[Device]:
    """The devices llama.cpp's default device selection gives a model, in its order: the RPC
    servers' first (fewer network transfers), then this machine's GPUs, then its integrated
    GPUs where it has no other."""
    devs = devices()
    gpus = [d for d in devs if d.type == "gpu" and not is_rpc(d)]
    return [d for d in devs if is_rpc(d)] + (gpus or [d for d in devs if d.type == "igpu"])


def layer_split(n_layer: int, n_gpu_layers: int = -1,
                tensor_split: Sequence[float] | None = None) -> list[int]:
    """The ggml device index of each layer (and, last, the output head) as llama.cpp's layer
    split puts them over ``model_devices()`` (``llama_model::load_tensors``): the last
    ``n_gpu_layers`` of the ``n_layer + 1`` (-1: all) on the devices, in contiguous runs
    proportional to ``tensor_split`` or else to each device's free memory; -1 for one on the
    CPU. Computed in float32, as llama.cpp computes it."""
    devs = model_devices()
    if not devs:
        return [-1] * (n_layer + 1)
    if tensor_split is not None and any(x != 0 for x in tensor_split[:len(devs)]):
        weights = [float(x) for x in list(tensor_split[:len(devs)]) +
                   [0.0] * (len(devs) - len(tensor_split))]
    else:
        host = next((d for d in devices() if d.type == "cpu"), None)
        weights = [float(d.memory_free) if d.memory_free or d.memory_total or host is None
                   else float(host.memory_free) for d in devs]
    splits = np.cumsum(np.asarray(weights, dtype=np.float32), dtype=np.float32)
    splits = splits / splits[-1]
    n_gpu = (1 << 31) - 1 if n_gpu_layers < 0 else n_gpu_layers
    start = max(n_layer + 1 - n_gpu, 0)
    active = min(n_gpu, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= active:
            out.append(-1)
            continue
        at = np.float32(il - start) / np.float32(active)
        out.append(devs[int(np.searchsorted(splits, at, side="right"))].index)
    return out


@dataclass
class CopyBandwidth:
    """Measured copy bandwidth between host memory and a device buffer, GB/s."""

    h2d_gbps: float
    d2h_gbps: float
    pinned: bool
    nbytes: int


class CopyProbeError(RuntimeError):
    """The bandwidth probe could not run (bad device, no pinned memory, allocation failure)."""


_PROBE_ERRORS = {-1: "bad device index", -2: "pinned host memory unavailable",
                 -3: "allocation failed"}


def measure_copy(index: int, nbytes: int = 256 << 20, n_iter: int = 5,
                 pinned: bool = True) -> CopyBandwidth:
    """Copy nbytes host->device and back n_iter times and return the bandwidth
    (forecache_measure_copy)."""
    _ensure_backends_loaded()
    h2d, d2h = ctypes.c_double(0), ctypes.c_double(0)
    rc = api().measure_copy(index, nbytes, n_iter, pinned, ctypes.byref(h2d), ctypes.byref(d2h))
    if rc != 0:
        raise CopyProbeError(_PROBE_ERRORS.get(rc, f"error {rc}"))
    return CopyBandwidth(h2d.value, d2h.value, pinned, nbytes)
