"""Greedy runs on a plain llama-cpp-python, in a process of its own.

The lossless tests compare forecache with the unpatched llama-cpp-python built from the same sdist
(``forecache build --reference``). That build cannot share a process with the patched one, so the
tests run this file with the reference first on PYTHONPATH:

    python stock_runner.py JOB.json OUT.npz

JOB.json: {"model": PATH, "params": {llama_cpp.Llama keywords}, "repack": false,
"runs": [{"prompt": [token ids], "n_gen": N}, ...]}; with "loader": "forecache" the model is
loaded by ``forecache.Llama`` instead (its own default placement, or "cache": a CacheConfig's
fields), so a crash of either build
is seen as this process's exit status. OUT.npz holds, for run i, ``tokens_i``
(the greedy tokens) and ``logits_i`` ([n_gen, n_vocab]: the logits each token was picked from);
with forecache's expert cache, ``cache_info`` (JSON bytes: its stats, the device name of each
layer's slots and each layer's slot count).
``repack`` false loads as forecache's policies do (use_extra_bufts = false: no CPU weight
repacking); true keeps llama.cpp's default. "rpc": [HOST:PORT, ...] registers those RPC servers'
devices first, as llama.cpp's --rpc does, so that the model's layers split over them.

Apart from that loader, this file imports nothing of forecache: only llama_cpp and numpy.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np


def load(path: str, params: dict[str, Any], repack: bool) -> Any:
    """A llama_cpp.Llama of ``path``; without ``repack``, CPU weight repacking is off."""
    import llama_cpp
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def no_repack():  # type: ignore[no-untyped-def]
        p = original()
        p.use_extra_bufts = False
        return p

    if not repack:
        low.llama_model_default_params = no_repack
    try:
        return llama_cpp.Llama(path, verbose=False, **params)
    finally:
        low.llama_model_default_params = original


def add_rpc_servers(endpoints: list[str]) -> None:
    """Register RPC servers' devices with ggml before a model loads (common/arg.cpp's
    add_rpc_devices, through ctypes)."""
    import ctypes
    from pathlib import Path

    import llama_cpp
    import llama_cpp.llama_cpp as low

    low.llama_backend_init()
    lib = Path(llama_cpp.__file__).parent / "lib"
    # the files libllama links (their sonames): a copy under another name is another library
    ggml, rpc = ctypes.CDLL(str(lib / "libggml.so.0")), ctypes.CDLL(str(lib / "libggml-rpc.so.0"))
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    for ep in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(ep.encode())
        if not reg:
            raise RuntimeError(f"RPC server {ep} does not answer")
        ggml.ggml_backend_register(reg)


def greedy(llm: Any, prompt: list[int], n_gen: int) -> tuple[list[int], np.ndarray]:
    """``n_gen`` greedy tokens after ``prompt`` from a fresh context, and the logits of each
    step (argmax; the first of equal maxima, as llama.cpp's greedy sampler picks)."""
    import llama_cpp.llama_cpp as low

    llm.reset()
    llm._ctx.kv_cache_clear()
    n_vocab = llm.n_vocab()
    tokens: list[int] = []
    steps = np.empty((n_gen, n_vocab), dtype=np.float32)
    llm.eval(prompt)
    for i in range(n_gen):
        logits = np.ctypeslib.as_array(low.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        steps[i] = logits
        tokens.append(int(np.argmax(logits)))
        if i + 1 < n_gen:
            llm.eval([tokens[-1]])
    return tokens, steps


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[1]).read())
    if job.get("loader") == "forecache":
        from forecache import Llama

        rpc = {"rpc": job["rpc"]} if job.get("rpc") else {}
        params = dict(job.get("params", {}))
        if isinstance(params.get("cache"), dict):  # a CacheConfig's fields
            from forecache.cache.prefetcher import Features
            from forecache.placement.options import CacheConfig

            fields = dict(params["cache"])
            if isinstance(fields.get("features"), dict):
                fields["features"] = Features(**fields["features"])
            params["cache"] = CacheConfig(**fields)
        llm = Llama(job["model"], verbose=False, **params, **rpc)
    else:
        if job.get("rpc"):
            add_rpc_servers(job["rpc"])
        llm = load(job["model"], job.get("params", {}), job.get("repack", False))
    out: dict[str, np.ndarray] = {}
    for i, run in enumerate(job["runs"]):
        tokens, logits = greedy(llm, run["prompt"], run["n_gen"])
        out[f"tokens_{i}"] = np.asarray(tokens, dtype=np.int32)
        out[f"logits_{i}"] = logits
    cache = getattr(llm, "expert_cache", None)
    if cache is not None:  # forecache's cache: its counters and the device of each layer's slots
        from forecache.native.ggml_devices import devices

        names = {d.index: d.name for d in devices()}
        info = {"stats": cache.stats(),
                "layer_devices": {il: names.get(li.device, "") for il, li in cache.layers.items()
                                  if li.n_slots > 0},
                "n_slots": [cache.layers[il].n_slots if il in cache.layers else 0
                            for il in range(llm.model_file.n_layer)],
                "devices": cache.device_stats(names),
                "copy_streams": cache.copy_streams,
                "split_costs": llm.split_costs()}
        out["cache_info"] = np.frombuffer(json.dumps(info).encode(), dtype=np.uint8)
    elif getattr(llm, "placement", None) is not None:  # stock's placements: where experts live
        info = {"host_layers": llm.placement.host_layers}
        out["cache_info"] = np.frombuffer(json.dumps(info).encode(), dtype=np.uint8)
    np.savez(argv[2], **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
