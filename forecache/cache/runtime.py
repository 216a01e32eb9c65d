"""The expert cache of one llama.cpp context: C handle, gate-hook handler and statistics."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from forecache.bindings import libllama
from forecache.bindings.cache_api import GATE_HOOK, CacheStats
from forecache.cache.policies import Policy

# (layer, ids [n, k], router weights [n, k] | None, gate input [n, d] | None)
RouteCallback = Callable[[int, np.ndarray, "np.ndarray | None", "np.ndarray | None"], None]
HIGH, LOW = 0, 1  # copy priorities: misses, prefetch
DEFAULT_CHUNK_BYTES = 2 << 20


class CacheError(RuntimeError):
    """The expert cache could not be set up; the message says why."""


@dataclass
class LayerInfo:
    n_expert: int
    n_slots: int
    expert_bytes: int


class ExpertCache:
    """Device slots for the routed experts of a context, driven by a policy through the gate hook.

    ``on_route(layer, ids [n, k], weights [n, k] | None, gate_input [n, d] | None)`` sees every
    routing decision (the arrays are only valid during the call); ``gate_input=True`` asks the C
    side to read the router input back for it.
    """

    def __init__(self, ctx: int, n_slots: Sequence[int], policy: Policy, *, device: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_route: RouteCallback | None = None,
                 gate_input: bool = False) -> None:
        self._lib = libllama()
        arr = (ctypes.c_int32 * len(n_slots))(*n_slots)
        err = ctypes.create_string_buffer(512)
        handle = self._lib.forecache_cache_init(ctx, arr, len(n_slots), device, chunk_bytes,
                                                err, len(err))
        if not handle:
            raise CacheError(f"cannot set up the expert cache: {err.value.decode()}")
        self._handle: int | None = handle
        self.policy = policy
        self.on_route = on_route
        self.interrupt_pending = False
        self.layers: dict[int, LayerInfo] = {}
        for il in range(len(n_slots)):
            n_e, n_s, nb = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_size_t()
            found = self._lib.forecache_cache_layer_info(handle, il, ctypes.byref(n_e),
                                                         ctypes.byref(n_s), ctypes.byref(nb))
            if found == 0:
                self.layers[il] = LayerInfo(n_e.value, n_s.value, nb.value)
        self._hook = GATE_HOOK(self._on_gate)  # kept referenced: C holds the pointer
        self._lib.forecache_cache_set_hook(handle, self._hook, None, gate_input)
        for il, e, s in policy.initial_loads():
            self._lib.forecache_cache_load(handle, il, e, s, LOW)

    def _on_gate(self, _ud: int, layer: int, n_tokens: int, n_used: int, ids_p: object,
                 w_p: object, x_p: object, n_embd: int) -> int:
        try:
            ids = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,))
            if self.on_route is not None:
                w = np.ctypeslib.as_array(w_p, shape=(n_tokens, n_used)) if w_p else None
                x = np.ctypeslib.as_array(x_p, shape=(n_tokens, n_embd)) if x_p else None
                self.on_route(layer, ids.reshape(n_tokens, n_used), w, x)
            # distinct experts in order of first use
            uniq, first = np.unique(ids, return_index=True)
            experts = uniq[np.argsort(first, kind="stable")]
            loads = self.policy.on_gate(layer, experts)
            if loads is None:
                return 1
            for e, s in loads:
                self._lib.forecache_cache_load(self._handle, layer, e, s, HIGH)
            return 0
        except KeyboardInterrupt:
            # Ctrl-C/SIGTERM cannot cross the C frame either: finish this layer from host memory
            # (always correct) and let the caller raise it at the next token (check_interrupt).
            self.interrupt_pending = True
            return 1
        except Exception:  # an exception cannot cross the C frame: cancel the compute instead
            import traceback

            traceback.print_exc()
            return -1

    def check_interrupt(self) -> None:
        """Raise the KeyboardInterrupt that arrived while the gate hook ran, if any."""
        if self.interrupt_pending:
            self.interrupt_pending = False
            raise KeyboardInterrupt

    def slot_of(self, layer: int, expert: int) -> int:
        return int(self._lib.forecache_cache_slot_of(self._handle, layer, expert))

    def wait_idle(self) -> None:
        """Block until all queued copies are done."""
        self._lib.forecache_cache_wait_idle(self._handle)

    def stats(self, layer: int = -1) -> dict:
        """Counters of one layer or, for -1, of all layers."""
        s = CacheStats()
        if self._lib.forecache_cache_get_stats(self._handle, layer, ctypes.byref(s)) != 0:
            raise ValueError(f"no layer {layer}")
        return s.as_dict()

    def reset_stats(self) -> None:
        self._lib.forecache_cache_reset_stats(self._handle)

    @property
    def n_slots_total(self) -> int:
        return sum(info.n_slots for info in self.layers.values())

    def close(self) -> None:
        """Free the C side; the context's next ubatch builds a graph without the cache."""
        if self._handle is not None:
            self._lib.forecache_cache_free(self._handle)
            self._handle = None
