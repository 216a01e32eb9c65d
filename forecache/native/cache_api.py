"""forecache's C API (forecache/csrc/forecache.h) in Python: a typed stub of each function
(:class:`ForecacheAPI`, bound to libllama by ``forecache.native.api()``), the structs it mirrors
and its constants. The test controls of forecache-testing.h are in ``forecache.native.testing``."""

from __future__ import annotations

import ctypes
import re
from ctypes import (
    POINTER,
    c_bool,
    c_char_p,
    c_double,
    c_float,
    c_int32,
    c_int64,
    c_size_t,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from forecache.build.info import CSRC_DIR
from forecache.native.binding import CFunctions, c_function

if TYPE_CHECKING:
    from ctypes import _CArgObject, _Pointer
    from typing import TypeAlias

    _T = TypeVar("_T", bound="ctypes._CData")
    # A pointer argument: a ctypes array, a ctypes pointer (numpy's ``.ctypes.data_as``),
    # ``ctypes.byref`` of a scalar or struct, or None for NULL.
    Ptr: TypeAlias = ctypes.Array[_T] | _Pointer[_T] | _CArgObject | None

HEADER = CSRC_DIR / "forecache.h"

# Opaque handles: the address an init function returned (ctypes gives None for NULL).
CachePtr = int  # struct forecache_cache *
CapturePtr = int  # struct forecache_capture *
ReplayPtr = int  # struct forecache_replay *
ContextPtr = int  # struct llama_context * (llama-cpp-python's llama_context_p)

# int32_t hook(void * ud, int32_t layer, int32_t n_tokens, int32_t n_used,
#              const int32_t * ids, const float * weights, const float * gate_input, int32_t n_embd)
GATE_HOOK = ctypes.CFUNCTYPE(
    c_int32, c_void_p, c_int32, c_int32, c_int32, POINTER(c_int32), POINTER(c_float),
    POINTER(c_float), c_int32,
)

# the C types FORECACHE_CACHE_STATS_FIELDS may use
_STATS_CTYPES = {"uint64_t": c_uint64, "int64_t": c_int64, "double": c_double}


def stats_fields(header: Path = HEADER) -> list[tuple[str, type]]:
    """The ctypes fields of struct forecache_cache_stats, in order: the X-macro list
    FORECACHE_CACHE_STATS_FIELDS of ``header`` (the list the C side makes the struct from)."""
    m = re.search(r"^#define FORECACHE_CACHE_STATS_FIELDS\(X\)((?:.*\\\n)*.*)$", header.read_text(),
                  re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{header} does not define FORECACHE_CACHE_STATS_FIELDS")
    rows = re.findall(r"\bX\(\s*(\w+)\s*,\s*(\w+)\s*,\s*\w+\s*\)",
                      re.sub(r"/\*.*?\*/", "", m.group(1)))
    unknown = sorted({ty for ty, _ in rows} - _STATS_CTYPES.keys())
    if not rows or unknown:
        raise RuntimeError(f"FORECACHE_CACHE_STATS_FIELDS in {header}: no fields, or C types "
                           f"this binding does not map: {unknown}")
    return [(name, _STATS_CTYPES[ty]) for ty, name in rows]


class CacheStats(ctypes.Structure):
    """struct forecache_cache_stats, its fields read from forecache.h (stats_fields)."""

    _fields_ = stats_fields()

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, _ in self._fields_}


class Event(ctypes.Structure):
    """struct forecache_event: a gate event or a marker (forecache_cache_next_event)."""

    _fields_ = [
        ("kind", c_int32),
        ("layer", c_int32),
        ("n_tokens", c_int32),
        ("n_used", c_int32),
        ("n_embd", c_int32),
        ("has_tokens", c_int32),
        ("pass_id", c_uint64),
        ("marker", c_int64),
    ]


class Span(ctypes.Structure):
    """struct forecache_span: a span of the cache's work on its timeline
    (forecache_cache_timeline)."""

    _fields_ = [
        ("kind", c_int32),
        ("layer", c_int32),
        ("proj", c_int32),
        ("expert", c_int32),
        ("slot", c_int32),
        ("n", c_int32),
        ("pass_id", c_uint64),
        ("bytes", c_uint64),
        ("t0", c_double),
        ("t1", c_double),
    ]


# enum forecache_span_kind, in order
SPAN_KINDS = ("ids", "gate", "wait", "host", "group", "copy", "read", "quiet", "bank", "event")
# enum forecache_event_kind
EVENT_GATE, EVENT_MARKER = 0, 1
# copy priorities (0 is the highest): a layer's misses, predicted experts
HIGH, LOW = 0, 1
# enum forecache_slot_state
SLOT_EMPTY, SLOT_READY, SLOT_COPYING, SLOT_QUEUED = -1, 0, 1, 2
# chunk_bytes of forecache_cache_init: one chunk per expert projection / per whole expert
CHUNK_PROJECTION, CHUNK_EXPERT = 0, (1 << 64) - 1


class ForecacheAPI(CFunctions):
    """forecache.h's functions: ``api.cache_load(...)`` calls ``forecache_cache_load``. Each
    docstring is the header's comment in short; the header has the whole contract."""

    prefix = "forecache_"

    @c_function([], c_int32)
    def patch_version() -> int:
        """FORECACHE_PATCH_VERSION of the library."""

    @c_function([c_size_t, c_size_t, c_int32, c_bool, POINTER(c_double), POINTER(c_double)],
                c_int32)
    def measure_copy(dev_index: int, nbytes: int, n_iter: int, pinned: bool,
                     h2d_gbps: Ptr[c_double], d2h_gbps: Ptr[c_double]) -> int:
        """Copy bandwidth host <-> device ``dev_index`` in GB/s: 0, or -1 bad device, -2 no
        pinned memory, -3 allocation failed."""

    # -- hidden-state capture ------------------------------------------------------------------
    @c_function([c_char_p, c_int32, c_int32], c_void_p)
    def capture_init(name: bytes, n_layer: int, n_embd: int) -> CapturePtr | None:
        """A capture of the tensors ``name-<il>`` (rows of n_embd floats) for layers < n_layer."""

    @c_function([c_void_p], None)
    def capture_free(capture: CapturePtr) -> None:
        """Free a capture."""

    @c_function([c_void_p, c_bool, c_void_p], c_bool)
    def capture_eval(t: int, ask: bool, user_data: CapturePtr) -> bool:
        """The eval callback (cb_eval) that fills a capture; handed to llama.cpp, not called."""

    @c_function([c_void_p, c_int32, POINTER(c_float)], c_int64)
    def capture_get(capture: CapturePtr, layer: int, out: Ptr[c_float]) -> int:
        """Copy ``layer``'s last captured row into ``out``: times captured (0: never), -1 bad
        layer."""

    # -- expert cache ----------------------------------------------------------------------------
    @c_function([c_void_p, POINTER(c_int32), c_int32, c_size_t, c_size_t, c_char_p, c_size_t],
                c_void_p)
    def cache_init(ctx: ContextPtr, n_slots: Ptr[c_int32], n_layer: int, dev_index: int,
                   chunk_bytes: int, err: ctypes.Array[ctypes.c_char], err_size: int,
                   ) -> CachePtr | None:
        """The cache of ``ctx`` with n_slots[il] slots per layer on device ``dev_index``, or
        None (message in ``err``)."""

    @c_function([c_void_p], None)
    def cache_free(cache: CachePtr) -> None:
        """Detach the cache from its context and free it."""

    @c_function([c_void_p, GATE_HOOK, c_void_p, c_bool], None)
    def cache_set_hook(cache: CachePtr, hook: GATE_HOOK, user_data: int | None,
                       gate_input: bool) -> None:
        """Set the gate hook (``gate_input``: it also sees the expert input)."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_int32), POINTER(c_size_t)],
                c_int32)
    def cache_layer_info(cache: CachePtr, layer: int, n_expert: Ptr[c_int32],
                         n_slots: Ptr[c_int32], expert_bytes: Ptr[c_size_t]) -> int:
        """A layer's experts, slots and bytes per expert: 0, or -1 if not a MoE layer."""

    @c_function([c_void_p, POINTER(c_int32), c_int32], c_int32)
    def layer_devices(ctx: ContextPtr, dev_index: Ptr[c_int32], n_layer: int) -> int:
        """Fill dev_index[il] with the ggml device index of the device llama.cpp put layer
        ``il``'s non-expert weights on (-1: host memory): 0, or -1 for a wrong n_layer."""

    @c_function([c_void_p, c_int32], c_int32)
    def cache_layer_device(cache: CachePtr, layer: int) -> int:
        """The ggml device index of the device holding ``layer``'s slots, or -1 (no slots)."""

    @c_function([c_void_p, c_int32, c_int32], c_int32)
    def cache_slot_of(cache: CachePtr, layer: int, expert: int) -> int:
        """The slot holding ``expert`` (loaded or in flight), or -1."""

    @c_function([c_void_p, c_int32, c_int32, c_int32, c_int32], c_int32)
    def cache_load(cache: CachePtr, layer: int, expert: int, slot: int, priority: int) -> int:
        """Put ``expert`` into ``slot`` and queue its copy: 0, 1 if the slot is in use by the
        layer being computed, -1 for bad arguments."""

    @c_function([c_void_p, c_int32, c_int32], c_int32)
    def cache_cancel(cache: CachePtr, layer: int, min_priority: int) -> int:
        """Drop queued plain loads of ``layer`` (-1: all) with priority >= min_priority: the
        slots emptied."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), c_int32], c_int32)
    def cache_preempt(cache: CachePtr, layer: int, keep: Ptr[c_int32], n_keep: int) -> int:
        """Move ``layer``'s queued low-priority copies of ``keep`` to priority 0, drop the rest:
        the slots emptied."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_int32), c_int32, c_int32],
                c_int32)
    def cache_schedule(cache: CachePtr, layer: int, experts: Ptr[c_int32], slots: Ptr[c_int32],
                       n: int, priority: int) -> int:
        """From the gate hook: ``layer``'s compute order, a slot per expert (-1: host): 0, or -1
        for bad arguments."""

    @c_function([c_void_p, c_int32, c_char_p, c_size_t], c_int32)
    def cache_set_stage(cache: CachePtr, n_stage: int, err: ctypes.Array[ctypes.c_char],
                        err_size: int) -> int:
        """Allocate ``n_stage`` stage slots: 0, or -1 (message in ``err``)."""

    @c_function([c_void_p, c_int32, c_int32, c_int32], c_int32)
    def cache_stage(cache: CachePtr, layer: int, expert: int, priority: int) -> int:
        """Queue ``expert``'s copy into a free stage slot: the stage slot, or -1."""

    @c_function([c_void_p, POINTER(c_int32), POINTER(c_int32), POINTER(c_int32)], c_int32)
    def cache_stage_state(cache: CachePtr, layer: Ptr[c_int32], expert: Ptr[c_int32],
                          state: Ptr[c_int32]) -> int:
        """Each stage slot's layer, expert (-1: free) and state: n_stage."""

    @c_function([c_void_p, c_int32, c_bool], None)
    def cache_set_little(cache: CachePtr, m: int, resident: bool) -> None:
        """MoBiLE's little pass: one-token ubatches route to their top ``m`` experts (0: off)."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), c_int32], c_int32)
    def cache_little_routing(cache: CachePtr, layer: int, ids: Ptr[c_int32], cap: int) -> int:
        """The little passes' full top-k for ``layer``'s tokens into ``ids``: their number (more
        than ``cap`` when cut), -1 bad layer."""

    @c_function([c_void_p, c_bool], None)
    def cache_set_reorder(cache: CachePtr, reorder: bool) -> None:
        """Compute a layer's experts in groups as their slots become ready (or wait for all)."""

    @c_function([c_void_p, c_bool], None)
    def cache_set_quiet(cache: CachePtr, quiet: bool) -> None:
        """Compute a layer whose every expert is resident without a stop (no routing read back,
        no gate hook, no gate event), except before a layer that is not while predictions
        listen."""

    @c_function([c_void_p, c_int32, c_int32], None)
    def cache_set_gather(cache: CachePtr, min_tokens: int, min_entries: int) -> None:
        """For ubatches of ``min_tokens`` or more, groups of fewer than ``min_entries`` entries
        wait for more to land while they can (<= 1: off)."""

    @c_function([c_void_p, c_int32, c_char_p, c_size_t], c_int32)
    def cache_set_bank(cache: CachePtr, min_tokens: int, err: ctypes.Array[ctypes.c_char],
                       err_size: int) -> int:
        """Prompt banks for ubatches of ``min_tokens`` or more: 0, or -1 (message in ``err``)."""

    @c_function([c_void_p, c_void_p, c_char_p, c_size_t], c_int32)
    def cache_attach(cache: CachePtr, ctx: ContextPtr, err: ctypes.Array[ctypes.c_char],
                     err_size: int) -> int:
        """Another context of the model reads the cache's prompt banks (its long ubatches' bank
        layers): 0, or -1 (message in ``err``)."""

    @c_function([c_void_p, c_int32, c_void_p, c_int32, c_char_p, c_size_t], c_int32)
    def seq_move(src: ContextPtr, src_seq: int, dst: ContextPtr, dst_seq: int,
                 err: ctypes.Array[ctypes.c_char], err_size: int) -> int:
        """Move a sequence's KV cells to another context of the model: 0, or -1 (message in
        ``err``)."""

    @c_function([c_void_p, c_void_p], c_int32)
    def cache_detach(cache: CachePtr, ctx: ContextPtr) -> int:
        """Take the cache off an attached context: 0, -1 not attached, -2 a replay on top."""

    @c_function([c_void_p, c_int32], c_int32)
    def cache_begin_round(cache: CachePtr, n_passes: int) -> int:
        """The next ``n_passes`` passes (one per context, each on its own thread) share each
        bank fill: 0, or -1 while the last round runs."""

    @c_function([c_void_p, c_void_p], c_int32)
    def cache_end_pass(cache: CachePtr, ctx: ContextPtr) -> int:
        """``ctx``'s llama_decode returned: 0, or -1 for a context that does not read the cache."""

    @c_function([c_void_p, c_bool], c_int32)
    def cache_set_copy_stream(cache: CachePtr, on: bool) -> int:
        """Chunks copied asynchronously on a stream of each device's own, ordered with compute by
        events, where the device has them: the number of devices that do."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_int32)], c_int32)
    def cache_layer_state(cache: CachePtr, layer: int, expert_of: Ptr[c_int32],
                          state: Ptr[c_int32]) -> int:
        """Each slot's expert (-1: empty) and state: n_slots, or -1 bad layer."""

    @c_function([c_void_p, c_int32, POINTER(c_int32)], c_int32)
    def cache_layer_order(cache: CachePtr, layer: int, slots: Ptr[c_int32]) -> int:
        """``layer``'s occupied slots in eviction order: the number written, -1 bad layer."""

    @c_function([c_void_p, c_int32, POINTER(c_int64), c_int32, c_int64], c_int32)
    def cache_set_keys(cache: CachePtr, layer: int, keys: Ptr[c_int64], n: int,
                       step: int) -> int:
        """Set ``layer``'s eviction keys and the step a routed row adds: 0, or -1."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_int64), c_int32], c_int32)
    def cache_add_keys(cache: CachePtr, layer: int, experts: Ptr[c_int32],
                       deltas: Ptr[c_int64], n: int) -> int:
        """Add deltas[i] to the eviction key of experts[i]: 0, or -1 bad layer."""

    @c_function([c_void_p, c_int32, POINTER(c_int64)], c_int32)
    def cache_layer_keys(cache: CachePtr, layer: int, keys: Ptr[c_int64]) -> int:
        """``layer``'s eviction keys: n_expert, or -1 bad layer."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), c_int32], None)
    def cache_touch(cache: CachePtr, layer: int, experts: Ptr[c_int32], n: int) -> None:
        """Mark the slots of ``experts`` used, in order (the last most recent)."""

    @c_function([c_void_p, c_int32, POINTER(c_uint64), POINTER(c_uint64)], c_int32)
    def cache_passes(cache: CachePtr, layer: int, current: Ptr[c_uint64],
                     routed: Ptr[c_uint64]) -> int:
        """The current forward pass and ``layer``'s last routed one (0: never); -1 bad layer."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_double), c_bool], None)
    def cache_set_decode_gate(cache: CachePtr, n_used: int, host_k: Ptr[c_int32],
                              host_s: Ptr[c_double], preempt: bool) -> None:
        """Decide one-token gates in C from the policy's tables (n_used <= 0: off); drops
        every layer's own tables."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_double)], c_int32)
    def cache_set_layer_decode_gate(cache: CachePtr, layer: int, host_k: Ptr[c_int32],
                                    host_s: Ptr[c_double]) -> int:
        """``layer``'s own decode-gate tables (its device's costs; null: the cache's again);
        -1 for a bad layer or no decode gate set."""

    # -- gate events -----------------------------------------------------------------------------
    @c_function([c_void_p, c_bool, c_int32], None)
    def cache_set_events(cache: CachePtr, enabled: bool, capacity: int) -> None:
        """Record gate events (at most ``capacity`` waiting; markers are never dropped)."""

    @c_function([c_void_p, POINTER(c_int32), c_int32], None)
    def cache_set_tokens(cache: CachePtr, tokens: Ptr[c_int32], n: int) -> None:
        """Token ids of the ubatch about to be decoded, for its gate events."""

    @c_function([c_void_p, c_int64], None)
    def cache_post(cache: CachePtr, marker: int) -> None:
        """Queue a marker event after the events recorded so far."""

    @c_function([c_void_p, c_int32, POINTER(Event), POINTER(c_int32), c_size_t, POINTER(c_float),
                 c_size_t, POINTER(c_int32), c_size_t], c_int32)
    def cache_next_event(cache: CachePtr, timeout_ms: int, ev: Ptr[Event], ids: Ptr[c_int32],
                         ids_cap: int, x: Ptr[c_float], x_cap: int, tokens: Ptr[c_int32],
                         tokens_cap: int) -> int:
        """Take the oldest event: 1, 0 on timeout, 2 when an array is too small (it stays)."""

    @c_function([], c_size_t)
    def event_size() -> int:
        """sizeof(struct forecache_event)."""

    # -- copies and statistics -------------------------------------------------------------------
    @c_function([c_void_p], None)
    def cache_wait_idle(cache: CachePtr) -> None:
        """Block until every queued copy that can run is done."""

    @c_function([c_void_p, c_int32, POINTER(CacheStats)], c_int32)
    def cache_get_stats(cache: CachePtr, layer: int, out: Ptr[CacheStats]) -> int:
        """Statistics of ``layer`` (-1: all layers) into ``out``: 0, or -1 bad layer."""

    @c_function([c_void_p], None)
    def cache_reset_stats(cache: CachePtr) -> None:
        """Zero the statistics."""

    @c_function([], c_size_t)
    def cache_stats_size() -> int:
        """sizeof(struct forecache_cache_stats)."""

    # -- disk tier -------------------------------------------------------------------------------
    @c_function([c_bool], None)
    def set_disk_experts(on: bool) -> None:
        """Models loaded while on leave their routed-expert tensors in the file (mapped, unread)."""

    @c_function([c_void_p, POINTER(c_char_p), c_int32, POINTER(c_int32), c_int32, c_int32,
                 c_char_p, c_size_t], c_int32)
    def cache_set_disk(cache: CachePtr, paths: Ptr[c_char_p], n_paths: int,
                       n_host: Ptr[c_int32], n_layer: int, n_readers: int,
                       err: ctypes.Array[ctypes.c_char], err_size: int) -> int:
        """Turn on the disk tier: ``n_host[il]`` host slots per layer, filled from the model's
        ``n_paths`` GGUF files (a split model's shards in order) by ``n_readers`` reads in
        flight: 0, or -1 (message in ``err``)."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), c_int32, c_int32], c_int32)
    def cache_disk_read(cache: CachePtr, layer: int, experts: Ptr[c_int32], n: int,
                        priority: int) -> int:
        """Queue reads of ``experts`` of ``layer`` into host slots: the number queued, or -1."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_int32)], c_int32)
    def cache_host_state(cache: CachePtr, layer: int, expert_of: Ptr[c_int32],
                         ready: Ptr[c_int32]) -> int:
        """Each host slot's expert (-1: empty) and whether its read is done: n_host (0 without a
        disk tier), or -1 bad layer."""

    # -- timeline --------------------------------------------------------------------------------
    @c_function([c_void_p, c_int32], c_int32)
    def cache_set_timeline(cache: CachePtr, capacity: int) -> int:
        """Record the last ``capacity`` spans from now (cleared, clock restarted), 0 stops: 0,
        or -1 for a negative capacity."""

    @c_function([c_void_p, POINTER(Span), c_int32, POINTER(c_uint64)], c_int32)
    def cache_timeline(cache: CachePtr, out: Ptr[Span], n_max: int,
                       dropped: Ptr[c_uint64]) -> int:
        """Move up to ``n_max`` spans, oldest first, into ``out``: how many; ``dropped``: spans
        lost for lack of room since the last call."""

    @c_function([], c_size_t)
    def span_size() -> int:
        """sizeof(struct forecache_span)."""

    # -- routing replay --------------------------------------------------------------------------
    @c_function([c_void_p, c_int32, c_size_t, c_char_p, c_size_t], c_void_p)
    def replay_init(ctx: ContextPtr, n_tokens_max: int, dev_index: int,
                    err: ctypes.Array[ctypes.c_char], err_size: int) -> ReplayPtr | None:
        """A routing replay for ``ctx`` (tables on device ``dev_index``), or None (message in
        ``err``)."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_float)], c_int32)
    def replay_set(replay: ReplayPtr, n_tokens: int, ids: Ptr[c_int32],
                   weights: Ptr[c_float]) -> int:
        """The next ubatch's ids and weights [n_layer][n_tokens][n_used]: 0, or -1."""

    @c_function([c_void_p, c_int32, POINTER(c_int32), POINTER(c_int32), POINTER(c_int32),
                 POINTER(c_float)], c_int32)
    def replay_set_rows(replay: ReplayPtr, n: int, seq_ids: Ptr[c_int32], pos: Ptr[c_int32],
                        ids: Ptr[c_int32], weights: Ptr[c_float]) -> int:
        """The next batch's rows by (sequence, position), ids and weights [n][n_layer][n_used]
        each, laid out per ubatch as llama.cpp splits the batch: 0, or -1."""

    @c_function([c_void_p], c_int64)
    def replay_rewritten(replay: ReplayPtr) -> int:
        """Expert matmuls rewritten so far, or -1 once a graph could not be rewritten."""

    @c_function([c_void_p], None)
    def replay_free(replay: ReplayPtr) -> None:
        """Remove the replay from its context and free it."""


# ctypes mirror -> the C function returning sizeof of the struct it mirrors
_MIRRORS: dict[type[ctypes.Structure], str] = {
    CacheStats: "forecache_cache_stats_size",
    Event: "forecache_event_size",
    Span: "forecache_span_size",
}


def struct_size_mismatches(lib: ctypes.CDLL) -> list[str]:
    """The mirrored structs whose ctypes size differs from the library's sizeof, described
    (``lib``'s API bound: ``ForecacheAPI.bind``)."""
    out = []
    for mirror, fn in _MIRRORS.items():
        size = int(getattr(lib, fn)())
        if size != ctypes.sizeof(mirror):
            out.append(f"{mirror.__name__}: {ctypes.sizeof(mirror)} bytes, C {size}")
    return out
