"""ggml's RPC backend (ggml-rpc.h) through ctypes: another process's or machine's device as a
device of this one.

A server (``serve``, ``forecache rpc-server``) exposes this machine's CPU backend on HOST:PORT; a
client registers servers (``add_servers``, ``--rpc``) before a model loads, and llama.cpp's model
loader then splits layers over their devices as over GPUs (src/llama.cpp's default device list:
RPC devices first). Either side works with the patched build and with the unpatched reference:
both are built with ggml-rpc, and nothing here needs forecache's patches.
"""

from __future__ import annotations

import ctypes
import functools
import re
import socket
import threading
from pathlib import Path

# HOST:PORT as llama.cpp's --rpc spells each server
_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class RPCError(RuntimeError):
    """An RPC server that cannot be used: a bad endpoint, none listening, a build without RPC."""


def parse_endpoints(spec: str, what: str = "--rpc") -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` as a list, each checked (a one-line ValueError naming the
    bad one; ``what``: the option or argument it came from)."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        m = _ENDPOINT.match(part)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"{what} {spec!r}: {part!r} is not HOST:PORT "
                             "(e.g. 127.0.0.1:50052)")
        out.append(part)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} {spec!r}: a server is named twice")
    return out


def _lib_dir() -> Path:
    import llama_cpp  # the build on sys.path: the patched one, or a reference put first

    return Path(llama_cpp.__file__).parent / "lib"


def _load(name: str, missing: str, sigs: tuple[tuple[str, list, object], ...]) -> ctypes.CDLL:
    """ggml library ``name`` as libllama links it, with ``sigs`` (function, argtypes, restype)
    declared; RPCError ``missing`` when the build has none."""
    from forecache.native.libs import ggml_lib_path

    path = ggml_lib_path(name, _lib_dir())
    if path is None:
        raise RPCError(f"no {name} in {_lib_dir()}: {missing}")
    lib = ctypes.CDLL(str(path))
    for fn_name, args, res in sigs:
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = args, res
    return lib


_VP, _SZ = ctypes.c_void_p, ctypes.c_size_t


@functools.cache
def _ggml() -> ctypes.CDLL:
    return _load("libggml", "this llama-cpp-python is not a forecache build", (
        ("ggml_backend_register", [_VP], None),
        ("ggml_backend_dev_by_type", [ctypes.c_int], _VP)))


@functools.cache
def _rpc() -> ctypes.CDLL:
    return _load("libggml-rpc", "this build has no RPC backend; rebuild with `forecache build` "
                 "(forecache's builds keep ggml-rpc)", (
                     ("ggml_backend_rpc_start_server",
                      [ctypes.c_char_p, ctypes.c_char_p, _SZ, _SZ, ctypes.POINTER(_VP)], None),
                     ("ggml_backend_rpc_add_server", [ctypes.c_char_p], _VP)))


_added: dict[str, int] = {}  # endpoint -> the backend registry entry registered for it


def add_servers(endpoints: list[str]) -> None:
    """Register each server's devices with ggml (once per endpoint and process), so that the next
    model load splits its layers over them; RPCError naming the first server that does not
    answer."""
    _ggml()
    from forecache.native.libs import llama_cpp_module

    llama_cpp_module().llama_backend_init()
    add = _rpc().ggml_backend_rpc_add_server
    for ep in endpoints:
        if ep in _added:
            continue
        _reachable(ep)  # ggml-rpc aborts the process on a server it cannot connect to
        reg = add(ep.encode())
        if not reg:
            raise RPCError(f"RPC server {ep} does not answer: start one there "
                           f"(`forecache rpc-server {ep}`) or check the address")
        _ggml().ggml_backend_register(reg)
        _added[ep] = reg


def _reachable(endpoint: str, timeout_s: float = 5.0) -> None:
    """RPCError unless something listens on ``endpoint`` (a TCP connection opens)."""
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RPCError(f"RPC server {endpoint} does not answer ({e.strerror or e}): start one "
                       f"there (`forecache rpc-server {endpoint}`) or check the address") from None


def serve(endpoint: str, n_threads: int, cache_dir: str | None = None) -> None:
    """Serve this machine's CPU backend on ``endpoint`` until the process is stopped (ggml's RPC
    server: it prints its endpoint and devices, then takes one client at a time). The server
    runs on a thread of its own, so that Ctrl-C and SIGTERM still reach this one."""
    parse_endpoints(endpoint, "HOST:PORT")
    from forecache.native.libs import llama_cpp_module

    llama_cpp_module().llama_backend_init()
    cpu = _ggml().ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        raise RPCError("ggml reports no CPU device to serve")
    devs = (ctypes.c_void_p * 1)(cpu)
    start = _rpc().ggml_backend_rpc_start_server
    t = threading.Thread(target=start, name="rpc-server", daemon=True,
                         args=(endpoint.encode(), cache_dir.encode() if cache_dir else None,
                               n_threads, 1, devs))
    t.start()
    while t.is_alive():
        t.join(0.5)
    raise RPCError(f"the RPC server on {endpoint} stopped: is the port taken?")
