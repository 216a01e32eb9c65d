"""ctypes declarations of the expert-cache part of our C API (forecache/csrc/forecache.h), and of
the test-only controls of forecache/csrc/forecache-testing.h."""

from __future__ import annotations

import ctypes

# int32_t hook(void * ud, int32_t layer, int32_t n_tokens, int32_t n_used,
#              const int32_t * ids, const float * weights, const float * gate_input, int32_t n_embd)
GATE_HOOK = ctypes.CFUNCTYPE(
    ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
    ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_float),
    ctypes.c_int32,
)


class CacheStats(ctypes.Structure):
    """struct forecache_cache_stats."""

    _fields_ = [
        ("hits", ctypes.c_uint64),
        ("misses", ctypes.c_uint64),
        ("host_layers", ctypes.c_uint64),
        ("h2d_bytes", ctypes.c_uint64),
        ("n_chunks", ctypes.c_uint64),
        ("n_hook_calls", ctypes.c_uint64),
        ("copy_s", ctypes.c_double),
        ("stall_s", ctypes.c_double),
        ("hook_s", ctypes.c_double),
        ("host_s", ctypes.c_double),
        ("hi_tasks", ctypes.c_uint64),
        ("hi_wait_s", ctypes.c_double),
        ("hi_wait_max_s", ctypes.c_double),
        ("chunk_max_s", ctypes.c_double),
        ("dropped_chunks", ctypes.c_uint64),
        ("refused_loads", ctypes.c_uint64),
        ("n_groups", ctypes.c_uint64),
        ("streamed", ctypes.c_uint64),
        ("host_entries", ctypes.c_uint64),
        ("hi_block_s", ctypes.c_double),
        ("hi_block_max_s", ctypes.c_double),
        ("fast_gates", ctypes.c_uint64),
        ("fast_s", ctypes.c_double),
        ("model_host_s", ctypes.c_double),
        ("decode_hits", ctypes.c_uint64),
        ("decode_misses", ctypes.c_uint64),
        ("events_dropped", ctypes.c_uint64),
        ("staged", ctypes.c_uint64),
        ("stage_used", ctypes.c_uint64),
    ]

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, _ in self._fields_}


class Event(ctypes.Structure):
    """struct forecache_event: a gate event or a marker (forecache_cache_next_event)."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("layer", ctypes.c_int32),
        ("n_tokens", ctypes.c_int32),
        ("n_used", ctypes.c_int32),
        ("n_embd", ctypes.c_int32),
        ("has_tokens", ctypes.c_int32),
        ("pass_id", ctypes.c_uint64),
        ("marker", ctypes.c_int64),
    ]


# enum forecache_event_kind
EVENT_GATE, EVENT_MARKER = 0, 1


class ChunkInfo(ctypes.Structure):
    """struct forecache_chunk_info (forecache-testing.h): one chunk copy run by
    forecache_cache_step."""

    _fields_ = [
        ("layer", ctypes.c_int32),
        ("slot", ctypes.c_int32),
        ("proj", ctypes.c_int32),
        ("expert", ctypes.c_int32),
        ("priority", ctypes.c_int32),
        ("size", ctypes.c_size_t),
    ]


# copy priorities (0 is the highest): a layer's misses, predicted experts
HIGH, LOW = 0, 1
# enum forecache_slot_state
SLOT_EMPTY, SLOT_READY, SLOT_COPYING, SLOT_QUEUED = -1, 0, 1, 2
# chunk_bytes of forecache_cache_init: one chunk per expert projection / per whole expert
CHUNK_PROJECTION, CHUNK_EXPERT = 0, (1 << 64) - 1


def declare(lib: ctypes.CDLL) -> None:
    """Set argument and result types of the expert-cache functions on libllama."""
    vp, i32, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t
    sigs = {
        "forecache_cache_init": ([vp, ctypes.POINTER(i32), i32, sz, sz, ctypes.c_char_p, sz], vp),
        "forecache_cache_free": ([vp], None),
        "forecache_cache_set_hook": ([vp, GATE_HOOK, vp, ctypes.c_bool], None),
        "forecache_cache_layer_info": ([vp, i32, ctypes.POINTER(i32), ctypes.POINTER(i32),
                                        ctypes.POINTER(sz)], i32),
        "forecache_cache_slot_of": ([vp, i32, i32], i32),
        "forecache_cache_load": ([vp, i32, i32, i32, i32], i32),
        "forecache_cache_cancel": ([vp, i32, i32], i32),
        "forecache_cache_preempt": ([vp, i32, ctypes.POINTER(i32), i32], i32),
        "forecache_cache_schedule": ([vp, i32, ctypes.POINTER(i32), ctypes.POINTER(i32), i32, i32],
                                     i32),
        "forecache_cache_set_reorder": ([vp, ctypes.c_bool], None),
        "forecache_cache_set_stage": ([vp, i32, ctypes.c_char_p, sz], i32),
        "forecache_cache_set_little": ([vp, i32, ctypes.c_bool], None),
        "forecache_capture_init": ([ctypes.c_char_p, i32, i32], vp),
        "forecache_capture_free": ([vp], None),
        "forecache_capture_get": ([vp, i32, ctypes.POINTER(ctypes.c_float)], ctypes.c_int64),
        "forecache_cache_little_routing": ([vp, i32, ctypes.POINTER(i32), i32], i32),
        "forecache_cache_stage": ([vp, i32, i32, i32], i32),
        "forecache_cache_stage_state": ([vp, ctypes.POINTER(i32), ctypes.POINTER(i32),
                                         ctypes.POINTER(i32)], i32),
        "forecache_cache_layer_state": ([vp, i32, ctypes.POINTER(i32), ctypes.POINTER(i32)], i32),
        "forecache_cache_wait_idle": ([vp], None),
        "forecache_cache_get_stats": ([vp, i32, ctypes.POINTER(CacheStats)], i32),
        "forecache_cache_reset_stats": ([vp], None),
        "forecache_cache_stats_size": ([], sz),
        "forecache_cache_layer_order": ([vp, i32, ctypes.POINTER(i32)], i32),
        "forecache_cache_touch": ([vp, i32, ctypes.POINTER(i32), i32], None),
        "forecache_cache_set_keys": ([vp, i32, ctypes.POINTER(ctypes.c_int64), i32,
                                      ctypes.c_int64], i32),
        "forecache_cache_add_keys": ([vp, i32, ctypes.POINTER(i32),
                                      ctypes.POINTER(ctypes.c_int64), i32], i32),
        "forecache_cache_layer_keys": ([vp, i32, ctypes.POINTER(ctypes.c_int64)], i32),
        "forecache_cache_passes": ([vp, i32, ctypes.POINTER(ctypes.c_uint64),
                                    ctypes.POINTER(ctypes.c_uint64)], i32),
        "forecache_cache_set_decode_gate": ([vp, i32, ctypes.POINTER(i32),
                                             ctypes.POINTER(ctypes.c_double), ctypes.c_bool], None),
        "forecache_cache_set_events": ([vp, ctypes.c_bool, i32], None),
        "forecache_cache_set_tokens": ([vp, ctypes.POINTER(i32), i32], None),
        "forecache_cache_post": ([vp, ctypes.c_int64], None),
        "forecache_cache_next_event": ([vp, i32, ctypes.POINTER(Event), ctypes.POINTER(i32), sz,
                                        ctypes.POINTER(ctypes.c_float), sz, ctypes.POINTER(i32),
                                        sz], i32),
        "forecache_event_size": ([], sz),
        "forecache_replay_init": ([vp, i32, sz, ctypes.c_char_p, sz], vp),
        "forecache_replay_set": ([vp, i32, ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_float)],
                                 i32),
        "forecache_replay_rewritten": ([vp], ctypes.c_int64),
        "forecache_replay_free": ([vp], None),
        # forecache-testing.h
        "forecache_cache_pause": ([vp, ctypes.c_bool], None),
        "forecache_cache_step": ([vp, ctypes.POINTER(ChunkInfo)], i32),
        "forecache_cache_queued": ([vp, i32, i32], i32),
        "forecache_chunk_info_size": ([], sz),
        "forecache_cache_host_handoff": ([vp, i32, ctypes.c_bool], ctypes.c_double),
        "forecache_cache_expert_matmul": ([vp, i32, i32, i32, i32, ctypes.c_bool, i32, i32],
                                          ctypes.c_double),
        "forecache_cache_test_route": ([vp, i32, ctypes.POINTER(i32), i32, ctypes.c_bool], i32),
        "forecache_cache_test_schedule": ([vp, i32, ctypes.POINTER(i32), ctypes.POINTER(i32)],
                                          i32),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


# ctypes mirror -> the C function returning sizeof of the struct it mirrors
_MIRRORS: dict[type[ctypes.Structure], str] = {
    CacheStats: "forecache_cache_stats_size",
    Event: "forecache_event_size",
    ChunkInfo: "forecache_chunk_info_size",
}


def struct_size_mismatches(lib: ctypes.CDLL) -> list[str]:
    """The mirrored structs whose ctypes size differs from the library's sizeof, described."""
    out = []
    for mirror, fn in _MIRRORS.items():
        size = int(getattr(lib, fn)())
        if size != ctypes.sizeof(mirror):
            out.append(f"{mirror.__name__}: {ctypes.sizeof(mirror)} bytes, C {size}")
    return out
