#pragma once

// forecache: controls of the expert cache's copy engine for tests. They make copies deterministic
// (the worker stopped, chunks run one at a time by the caller) and may change with any version;
// the runtime does not use them.

#include "forecache.h"

#ifdef __cplusplus
extern "C" {
#endif

// One chunk copy, as reported by forecache_cache_step.
struct forecache_chunk_info {
    int32_t layer;
    int32_t slot;
    int32_t proj;      // projection index, -1 for a whole-expert chunk
    int32_t expert;
    int32_t priority;
    size_t  size;
};

// Stops (true) or restarts the copy worker; while stopped, forecache_cache_step runs the copies.
LLAMA_API void forecache_cache_pause(struct forecache_cache * cache, bool paused);

// Runs the next eligible queued chunk on the calling thread and describes it in `out`.
// Returns 0, or 1 if no chunk can run now.
LLAMA_API int32_t forecache_cache_step(struct forecache_cache * cache, struct forecache_chunk_info * out);

// Number of queued (not started) chunks of `layer` (-1: all) with exactly `priority` (-1: any).
LLAMA_API int32_t forecache_cache_queued(const struct forecache_cache * cache, int32_t layer, int32_t priority);

// sizeof(struct forecache_chunk_info), for bindings that mirror it.
LLAMA_API size_t forecache_chunk_info_size(void);

// Seconds per empty job handed to the thread that computes host entries and waited for, over n
// jobs; with fresh_threads, per std::thread started and joined instead (what it replaced).
LLAMA_API double forecache_cache_host_handoff(struct forecache_cache * cache, int32_t n, bool fresh_threads);

// Routes `layer` as a one-token ubatch routed to `experts` would be, without computing it: the
// previous routed layer's slots are freed, hits counted and marked used, and with `decode_gate`
// the decode gate decides. Returns its result (0 slots, 1 host), 2 when it would call the hook
// (or `decode_gate` is false), -1 for bad arguments.
LLAMA_API int32_t forecache_cache_test_route(struct forecache_cache * cache, int32_t layer, const int32_t * experts, int32_t n, bool decode_gate);

// The schedule of `layer` (experts and their slots, -1 for host entries; arrays of n_expert entries).
// Returns its length, or -1 for a bad layer.
LLAMA_API int32_t forecache_cache_test_schedule(const struct forecache_cache * cache, int32_t layer, int32_t * experts, int32_t * slots);

// Seconds per MUL_MAT_ID of projection `proj` of `layer`'s host experts for n_rows token rows, each routed to
// n_used distinct experts (row r to experts r*n_used.. modulo n_expert), on a CPU backend of n_threads: the
// mean of n_iter computes after one warm-up. From the file's layout, as forecache keeps host experts, or
// with `repacked` from a copy in llama.cpp's CPU repack buffer type, as stock llama.cpp places them. Returns
// -1 for bad arguments, -2 when this CPU has no repacked kernel for the type, -3 when a step fails.
LLAMA_API double forecache_cache_expert_matmul(struct forecache_cache * cache, int32_t layer, int32_t proj,
        int32_t n_rows, int32_t n_used, bool repacked, int32_t n_threads, int32_t n_iter);

#ifdef __cplusplus
}
#endif
