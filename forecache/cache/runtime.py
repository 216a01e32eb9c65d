"""The expert cache of one llama.cpp context: C handle, gate-hook handler and statistics."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from forecache.cache.cost import DEVICE_MIN_TOKENS
from forecache.cache.disk import DiskTier
from forecache.cache.forecast import Forecaster, ForecastWorker
from forecache.cache.policies import Policy, first_use
from forecache.cache.timeline import TIMELINE_CAPACITY, TimelineSpan
from forecache.native import api
from forecache.native.cache_api import (  # noqa: F401  (LOW re-exported)
    CHUNK_PROJECTION,
    EVENT_MARKER,
    GATE_HOOK,
    HIGH,
    LOW,
    CachePtr,
    CacheStats,
    Event,
    ForecacheAPI,
    Span,
)

# (layer, ids [n, k], router weights [n, k] | None, gate input [n, d] | None)
RouteCallback = Callable[[int, np.ndarray, "np.ndarray | None", "np.ndarray | None"], None]
DEFAULT_CHUNK_BYTES = CHUNK_PROJECTION
CALIBRATE_EVERY = 64  # gate calls between cost-model corrections from the measured rates
CALIBRATE_TOKENS = 8  # ubatches between corrections while the decode gate decides in C
EVENT_CAPACITY = 1024  # gate events waiting for the prediction thread (more are dropped)


class CacheError(RuntimeError):
    """The expert cache could not be set up; the message says why."""


@dataclass
class LayerInfo:
    n_expert: int
    n_slots: int
    expert_bytes: int  # one routed expert of this layer, all its projections
    device: int = -1  # ggml device index of the device holding its slots (-1: none)


class GateEvents:
    """The C cache's gate events as ``ForecastWorker`` items. The worker's own items (begin,
    end, sync, stop) go through C as markers, so they stay in order with the gates."""

    def __init__(self, c_api: ForecacheAPI, handle: CachePtr) -> None:
        self._api, self._handle = c_api, handle
        self._ev = Event()
        self._ids = (ctypes.c_int32 * 1)()
        self._x = (ctypes.c_float * 1)()
        self._tok = (ctypes.c_int32 * 1)()
        self._items: dict[int, tuple] = {}
        self._next = 0

    def put(self, item: tuple) -> None:
        self._next += 1
        self._items[self._next] = item
        self._api.cache_post(self._handle, self._next)

    def get(self) -> tuple:
        """The next item: a marker's, or ("gate", layer, ids, hidden, tokens, pass)."""
        ev = self._ev
        while True:
            rc = self._api.cache_next_event(
                self._handle, 200, ctypes.byref(ev), self._ids, len(self._ids), self._x,
                len(self._x), self._tok, len(self._tok))
            if rc == 0:
                continue
            if ev.kind == EVENT_MARKER:
                return self._items.pop(ev.marker)
            n, k, d = ev.n_tokens, ev.n_used, ev.n_embd
            if rc == 2:  # arrays too small: grow them and take it again
                self._ids = (ctypes.c_int32 * max(n * k, len(self._ids)))()
                self._x = (ctypes.c_float * max(n * d, len(self._x)))()
                self._tok = (ctypes.c_int32 * max(n, len(self._tok)))()
                continue
            ids = np.ctypeslib.as_array(self._ids)[:n * k].reshape(n, k).copy()
            h = np.ctypeslib.as_array(self._x)[:n * d].reshape(n, d).copy() if d else None
            toks = np.ctypeslib.as_array(self._tok)[:n].copy() if ev.has_tokens else None
            return ("gate", ev.layer, ids, h, toks, int(ev.pass_id))


class ExpertCache:
    """Device slots for the routed experts of a context, driven by a policy through the gate hook;
    the policy's copy engine (load, preempt, schedule, layer_state) is the C cache.

    ``on_route(layer, ids [n, k], weights [n, k] | None, gate_input [n, d] | None)`` sees every
    routing decision (the arrays are only valid during the call); ``gate_input=True`` asks the C
    side to read the router input back for it. With a ``forecaster``, every gate event also goes
    to a prediction thread whose forecasts become the policy's prefetches.
    """

    def __init__(self, ctx: int, n_slots: Sequence[int], policy: Policy, *, device: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_route: RouteCallback | None = None,
                 gate_input: bool = False, forecaster: Forecaster | None = None,
                 reorder: bool = True, stage_slots: int = 0,
                 disk: DiskTier | None = None, gather: int = 0, bank_tokens: int = 0,
                 copy_stream: bool = True) -> None:
        self._api = c_api = api()
        arr = (ctypes.c_int32 * len(n_slots))(*n_slots)
        err = ctypes.create_string_buffer(512)
        handle = c_api.cache_init(ctx, arr, len(n_slots), device, chunk_bytes, err, len(err))
        if not handle:
            raise CacheError(f"cannot set up the expert cache: {err.value.decode()}")
        self._handle: CachePtr | None = handle
        self.policy = policy
        self.on_route = on_route
        self.interrupt_pending = False
        self.layers: dict[int, LayerInfo] = {}
        for il in range(len(n_slots)):
            n_e, n_s, nb = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_size_t()
            found = c_api.cache_layer_info(handle, il, ctypes.byref(n_e), ctypes.byref(n_s),
                                           ctypes.byref(nb))
            if found == 0:
                self.layers[il] = LayerInfo(n_e.value, n_s.value, nb.value,
                                            c_api.cache_layer_device(handle, il))
        self.disk = disk
        if disk is not None:  # before any load: copies then read their experts from the file
            n_host = (ctypes.c_int32 * len(disk.n_host))(*disk.n_host)
            paths = (ctypes.c_char_p * len(disk.paths))(*(os.fsencode(p) for p in disk.paths))
            if c_api.cache_set_disk(handle, paths, len(disk.paths), n_host, len(disk.n_host),
                                    disk.n_readers, err, len(err)) != 0:
                c_api.cache_free(handle)
                self._handle = None
                raise CacheError(f"cannot set up the disk tier: {err.value.decode()}")
        self._state = {il: ((ctypes.c_int32 * max(info.n_slots, 1))(),
                            (ctypes.c_int32 * max(info.n_slots, 1))())
                       for il, info in self.layers.items()}
        self._little_ids = (ctypes.c_int32 * 64)()  # little_routing's buffer, grown on demand
        # sees (layer, distinct experts) of every gate the hook decides (a speculative
        # verification's routing, for the draft's prediction counts)
        self.route_observer: Callable[[int, np.ndarray], None] | None = None
        self._gates = 0
        self._ubatches = 0
        # decode (one-token) gates' hits and misses before the last reset_stats
        self._decode_kept = (0, 0)
        self._order = (ctypes.c_int32 * max((i.n_slots for i in self.layers.values()),
                                            default=1))()
        self._n_stage = 0
        self._stage_arrays: tuple = ()
        if stage_slots > 0:
            try:
                self.set_stage(stage_slots)
            except CacheError:
                c_api.cache_free(handle)
                self._handle = None
                raise
        if bank_tokens > 0 and c_api.cache_set_bank(handle, bank_tokens, err, len(err)) != 0:
            c_api.cache_free(handle)
            self._handle = None
            raise CacheError(f"cannot set up the prompt banks: {err.value.decode()}; turn them "
                             "off or lower the budget's slots")
        self.bank_tokens = bank_tokens
        # devices whose chunks are issued on a copy stream of their own (events: a GPU's)
        self.copy_streams = c_api.cache_set_copy_stream(handle, copy_stream)
        self._n_used = 0  # experts per token, known at the first gate
        self._decode_gate_on = True
        self.worker = None
        if forecaster is not None:
            c_api.cache_set_events(handle, True, EVENT_CAPACITY)
            self.worker = ForecastWorker(forecaster, self._prefetch,
                                         source=GateEvents(c_api, handle))
        want_x = gate_input or (forecaster is not None and forecaster.needs_hidden)
        c_api.cache_set_reorder(handle, reorder)
        # a layer with every expert resident needs no stop unless something must see its routing
        c_api.cache_set_quiet(handle, on_route is None and not policy.routes_every_layer)
        c_api.cache_set_gather(handle, DEVICE_MIN_TOKENS, gather)
        self._hook = GATE_HOOK(self._on_gate)  # kept referenced: C holds the pointer
        c_api.cache_set_hook(handle, self._hook, None, want_x)
        policy.attach(self)
        for il, e, s in policy.initial_loads():
            c_api.cache_load(handle, il, e, s, LOW)

    @property
    def handle(self) -> CachePtr | None:
        """The C cache (None once closed), for forecache.native.testing's controls."""
        return self._handle

    # -- the copy engine a policy drives --------------------------------------------------------
    def load(self, layer: int, expert: int, slot: int, priority: int) -> int:
        return self._api.cache_load(self._handle, layer, expert, slot, priority)

    def preempt(self, layer: int, keep: Sequence[int]) -> int:
        arr = (ctypes.c_int32 * max(len(keep), 1))(*keep)
        return self._api.cache_preempt(self._handle, layer, arr, len(keep))

    def schedule(self, layer: int, experts: Sequence[int], slots: Sequence[int],
                 priority: int) -> int:
        n = len(experts)
        return self._api.cache_schedule(self._handle, layer, (ctypes.c_int32 * n)(*experts),
                                        (ctypes.c_int32 * n)(*slots), n, priority)

    def layer_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        ex, st = self._state[layer]
        n = self._api.cache_layer_state(self._handle, layer, ex, st)
        return (np.ctypeslib.as_array(ex)[:n].copy(), np.ctypeslib.as_array(st)[:n].copy())

    def resident_order(self, layer: int) -> list[int]:
        n = self._api.cache_layer_order(self._handle, layer, self._order)
        return self._order[:max(n, 0)]

    def set_stage(self, n: int) -> None:
        """Allocate ``n`` stage slots beside the slots (once; CacheError if they do not fit or
        the layers' experts differ in shape)."""
        err = ctypes.create_string_buffer(512)
        if self._api.cache_set_stage(self._handle, n, err, len(err)) != 0:
            raise CacheError(f"cannot set up {n} stage slots: {err.value.decode()}")
        self._n_stage = n
        # n on each device holding slots: the C side reports every device's
        devices = {info.device for info in self.layers.values() if info.n_slots}
        self._stage_arrays = tuple((ctypes.c_int32 * (n * max(len(devices), 1)))()
                                   for _ in range(3))

    def stage_slots(self) -> int:
        """Stage slots on each device holding slots (0: none)."""
        return self._n_stage

    def host_state(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The disk tier's host slots of ``layer``: their experts (-1: empty) and whether each
        read is done (empty arrays without a disk tier)."""
        n = self.disk.n_host[layer] if self.disk is not None else 0
        ex, ready = (ctypes.c_int32 * max(n, 1))(), (ctypes.c_int32 * max(n, 1))()
        got = self._api.cache_host_state(self._handle, layer, ex, ready)
        return (np.ctypeslib.as_array(ex)[:max(got, 0)].copy(),
                np.ctypeslib.as_array(ready)[:max(got, 0)].astype(bool))

    def host_resident(self, layer: int) -> set[int] | None:
        """The experts of ``layer`` in host memory with a disk tier, None without one."""
        if self.disk is None or not self.disk.n_host[layer]:
            return None
        experts, ready = self.host_state(layer)
        return {int(e) for e in experts[ready].tolist()}

    def disk_read(self, layer: int, experts: Sequence[int], priority: int) -> int:
        """Queue reads of ``experts`` of ``layer`` into its host slots (the disk tier's
        prefetch): the number queued, -1 without a disk tier."""
        arr = (ctypes.c_int32 * max(len(experts), 1))(*experts)
        return self._api.cache_disk_read(self._handle, layer, arr, len(experts), priority)

    def little_routing(self, layer: int) -> list[int]:
        """The full top-k of each token the little passes since ``set_little`` turned them on
        routed through ``layer``, token after token."""
        cap = len(self._little_ids)
        n = self._api.cache_little_routing(self._handle, layer, self._little_ids, cap)
        if n > cap:
            self._little_ids = (ctypes.c_int32 * n)()
            n = self._api.cache_little_routing(self._handle, layer, self._little_ids, n)
        return self._little_ids[:max(n, 0)]

    def prefetch_little(self, n_used: int) -> int:
        """Before the full model recomputes tokens: every layer's experts the little passes'
        router chose (``n_used`` a token; llama.cpp may have reordered the tokens, so all of
        them) are queued at low priority where the policy prefetches (MoBiLE's training-free
        prefetch). Returns the copies queued."""
        warm = getattr(self.policy, "warm", None)
        if warm is None:
            return 0
        n = 0
        for il in self.layers:
            ids = self.little_routing(il)
            # rank by rank: every token's top-1 before any token's second
            best = [ids[r * n_used + i] for i in range(n_used) for r in range(len(ids) // n_used)]
            if best:
                n += warm(il, best, self)
        return n

    def set_little(self, m: int, resident: bool = False) -> None:
        """MoBiLE's little pass: one-token ubatches route each token to its top ``m`` experts
        only (the model with ``m`` experts per token; forecache_cache_set_little); with
        ``resident``, to its top-1 and those of its top ``m`` already copied to their slots, so
        the pass never waits for a copy. 0 for the exact model."""
        self._api.cache_set_little(self._handle, m, resident)

    def n_experts(self, layer: int) -> int:
        return self.layers[layer].n_expert

    def stage(self, layer: int, expert: int, priority: int) -> int:
        return self._api.cache_stage(self._handle, layer, expert, priority)

    def staged(self, layer: int) -> dict[int, tuple[int, int]]:
        if not self._n_stage:
            return {}
        lay, ex, st = self._stage_arrays
        n = self._api.cache_stage_state(self._handle, lay, ex, st)
        return {ex[j]: (j, st[j]) for j in range(n) if lay[j] == layer}

    def set_keys(self, layer: int, keys: Sequence[int], step: int) -> None:
        n = len(keys)
        if self._api.cache_set_keys(self._handle, layer, (ctypes.c_int64 * n)(*keys), n,
                                    step) != 0:
            raise ValueError(f"layer {layer}: {n} keys for {self.layers[layer].n_expert} experts")

    def add_keys(self, layer: int, experts: Sequence[int], deltas: Sequence[int]) -> None:
        n = len(experts)
        self._api.cache_add_keys(self._handle, layer, (ctypes.c_int32 * n)(*experts),
                                 (ctypes.c_int64 * n)(*deltas), n)

    def layer_keys(self, layer: int) -> np.ndarray:
        out = (ctypes.c_int64 * self.layers[layer].n_expert)()
        self._api.cache_layer_keys(self._handle, layer, out)
        return np.ctypeslib.as_array(out).copy()

    def touch(self, layer: int, experts: Sequence[int]) -> None:
        n = len(experts)
        self._api.cache_touch(self._handle, layer, (ctypes.c_int32 * n)(*experts), n)

    def passes(self, layer: int) -> tuple[int, int]:
        cur, routed = ctypes.c_uint64(), ctypes.c_uint64()
        self._api.cache_passes(self._handle, layer, ctypes.byref(cur), ctypes.byref(routed))
        return cur.value, routed.value

    def begin_ubatch(self, tokens: np.ndarray | None) -> None:
        """The token ids of the ubatch about to be decoded: they go with its gate events to the
        prediction thread. Every CALIBRATE_TOKENS ubatches the cost model is corrected."""
        if self._handle is None:
            return
        arr = np.ascontiguousarray(tokens if tokens is not None else [], dtype=np.int32)
        self._api.cache_set_tokens(
            self._handle, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(arr))
        self._ubatches += 1
        if self._ubatches % CALIBRATE_TOKENS == 0:
            self._calibrate_now()

    def _decode_gate(self, n_used: int) -> None:
        """Hand the policy's decode-gate tables to C (none: every gate calls the hook)."""
        self._n_used = n_used
        table = None
        if self.on_route is None and self._decode_gate_on:
            table = self.policy.decode_gate(n_used)
        if table is None:
            self._api.cache_set_decode_gate(self._handle, 0, None, None, False)
            return
        host_k, host_s, preempt = table
        self._api.cache_set_decode_gate(
            self._handle, n_used, (ctypes.c_int32 * len(host_k))(*host_k),
            (ctypes.c_double * len(host_s))(*host_s), preempt)
        # layers on a device with costs of its own (another link) decide by its tables
        for layers, host_k, host_s in self.policy.layer_decode_gates(n_used):
            k = (ctypes.c_int32 * len(host_k))(*host_k)
            s = (ctypes.c_double * len(host_s))(*host_s)
            for il in layers:
                self._api.cache_set_layer_decode_gate(self._handle, il, k, s)

    def use_decode_gate(self, on: bool) -> None:
        """Let C decide one-token gates from the policy's tables (the default), or call the
        policy for every gate (``on=False``: the same decisions, in Python)."""
        self._decode_gate_on = on
        if self._n_used:
            self._decode_gate(self._n_used)

    def _prefetch(self, layer: int, experts: np.ndarray, pass_id: int) -> None:
        if self._handle is not None:
            self.policy.prefetch(layer, experts.tolist(), pass_id, self)

    def _on_gate(self, _ud: int, layer: int, n_tokens: int, n_used: int, ids_p: object,
                 w_p: object, x_p: object, n_embd: int) -> int:
        try:
            if n_used != self._n_used:
                self._decode_gate(n_used)
            ids = np.ctypeslib.as_array(ids_p, shape=(n_tokens * n_used,))
            if self.on_route is not None:
                w = np.ctypeslib.as_array(w_p, shape=(n_tokens, n_used)) if w_p else None
                x = np.ctypeslib.as_array(x_p, shape=(n_tokens, n_embd)) if x_p else None
                self.on_route(layer, ids.reshape(n_tokens, n_used), w, x)
            experts, counts = first_use(ids)
            if self.route_observer is not None:
                self.route_observer(layer, experts)
            on_slots = self.policy.gate(layer, experts, self, counts, n_tokens)
            self._calibrate()
            return 0 if on_slots else 1
        except KeyboardInterrupt:
            # Ctrl-C/SIGTERM cannot cross the C frame either: finish this layer from host memory
            # (always correct) and let the caller raise it at the next token (check_interrupt).
            self.interrupt_pending = True
            return 1
        except Exception:  # an exception cannot cross the C frame: cancel the compute instead
            import traceback

            traceback.print_exc()
            return -1

    def _calibrate(self) -> None:
        """Every CALIBRATE_EVERY gates, give the policy's cost model the measured rates."""
        self._gates += 1
        if self._gates % CALIBRATE_EVERY == 0:
            self._calibrate_now()

    def _calibrate_now(self) -> None:
        """Give the policy's cost models the measured rates, each those of the layers it
        prices; the decode gate's tables follow."""
        groups = self.policy.cost_groups()
        if not groups:
            return
        for cost, layers in groups:
            if layers is None:
                s = self.stats()
            else:
                parts = [self.stats(il) for il in layers if il in self.layers]
                keys = ("h2d_bytes", "copy_s", "host_s", "model_host_s", "group_s",
                        "group_entries", "group_rows")
                s = {k: sum(p[k] for p in parts) for k in keys}
            cost.calibrate(s["h2d_bytes"], s["copy_s"], s["host_s"], s["model_host_s"],
                           s["group_s"], s["group_entries"], s["group_rows"])
        if self._n_used:
            self._decode_gate(self._n_used)

    def check_interrupt(self) -> None:
        """Raise the KeyboardInterrupt that arrived while the gate hook ran, if any."""
        if self.interrupt_pending:
            self.interrupt_pending = False
            raise KeyboardInterrupt

    def slot_of(self, layer: int, expert: int) -> int:
        return self._api.cache_slot_of(self._handle, layer, expert)

    def wait_idle(self) -> None:
        """Block until all queued copies are done."""
        self._api.cache_wait_idle(self._handle)

    def stats(self, layer: int = -1) -> dict:
        """Counters of one layer or, for -1, of all layers."""
        s = CacheStats()
        if self._api.cache_get_stats(self._handle, layer, ctypes.byref(s)) != 0:
            raise ValueError(f"no layer {layer}")
        return s.as_dict()

    def start_timeline(self, capacity: int | None = None) -> None:
        """Record a timeline of the cache's work from now (``cache.timeline``): the last
        ``capacity`` spans (default ``TIMELINE_CAPACITY``) are kept."""
        cap = TIMELINE_CAPACITY if capacity is None else capacity
        if cap < 1 or self._api.cache_set_timeline(self._handle, cap) != 0:
            raise ValueError(f"a timeline keeps at least one span (asked for {cap})")

    def timeline(self, *, stop: bool = True) -> tuple[list[TimelineSpan], int]:
        """The spans recorded since ``start_timeline`` (or the previous call), oldest first, and
        how many were dropped for lack of room; ``stop``: recording ends."""
        spans: list[TimelineSpan] = []
        dropped = 0
        buf = (Span * 4096)()
        lost = ctypes.c_uint64()
        while True:
            n = self._api.cache_timeline(self._handle, buf, len(buf), ctypes.byref(lost))
            dropped += lost.value
            spans.extend(TimelineSpan.from_c(buf[i]) for i in range(n))
            if n < len(buf):
                break
        if stop:
            self._api.cache_set_timeline(self._handle, 0)
        return spans, dropped

    def decode_counts(self) -> tuple[int, int]:
        """Hits and misses of decode gates (one token) since the cache was made."""
        hits, misses = self._decode_kept
        if self._handle is not None:
            s = self.stats()
            hits, misses = hits + s["decode_hits"], misses + s["decode_misses"]
        return hits, misses

    def reset_stats(self) -> None:
        self._decode_kept = self.decode_counts()
        self._api.cache_reset_stats(self._handle)
        for cost, _ in self.policy.cost_groups():
            cost.predicted_host_s = 0.0  # what calibration compares the reset host time with

    @property
    def n_slots_total(self) -> int:
        return sum(info.n_slots for info in self.layers.values())

    def device_stats(self, names: dict[int, str]) -> dict[str, dict]:
        """Per device holding slots (``names``: ggml device index -> name): its slots, hits,
        misses, bytes copied to it, experts copied into its stage slots, and the experts its
        layers' split computed on this machine's CPU instead (``host_entries``: schedule
        entries)."""
        keys = ("hits", "misses", "h2d_bytes", "staged", "host_entries")
        out: dict[str, dict] = {}
        for il, info in self.layers.items():
            if info.n_slots == 0:
                continue
            d = out.setdefault(names.get(info.device, str(info.device)),
                               {"slots": 0, **dict.fromkeys(keys, 0)})
            s = self.stats(il)
            d["slots"] += info.n_slots
            for k in keys:
                d[k] += s[k]
        return out

    def attach(self, ctx: int) -> None:
        """Let another context of the model read the prompt banks: its ubatches of
        ``bank_tokens`` rows or more compute their bank layers from them (a micro-batch of a
        round, ``begin_round``); its other expert products stay stock llama.cpp's."""
        err = ctypes.create_string_buffer(512)
        if self._api.cache_attach(self._handle, ctx, err, len(err)) != 0:
            raise CacheError(f"cannot attach a context to the expert cache: {err.value.decode()}")

    def detach(self, ctx: int) -> None:
        """Take the cache off a context ``attach`` added (its routing replay closed first)."""
        if self._handle is not None and self._api.cache_detach(self._handle, ctx) == -2:
            raise CacheError("close the context's routing replay before detaching it")

    def begin_round(self, n_passes: int) -> None:
        """The next ``n_passes`` passes, one from each context (this one and attached ones),
        each decoded on a thread of its own, share every bank fill; ``end_pass`` after each
        context's decode returns."""
        if self._api.cache_begin_round(self._handle, n_passes) != 0:
            raise CacheError("a round of micro-batches began before the last one ended")

    def end_pass(self, ctx: int) -> None:
        """``ctx``'s decode returned (or failed): it reads no bank any more."""
        if self._handle is not None:
            self._api.cache_end_pass(self._handle, ctx)

    def close(self) -> None:
        """Free the C side; the context's next ubatch builds a graph without the cache."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._handle is not None:
            self._api.cache_free(self._handle)
            self._handle = None
