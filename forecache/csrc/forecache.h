#pragma once

// forecache: C API for running MoE models with host-resident experts and a device expert cache.
// The Python runtime calls these functions through ctypes; mechanism lives here, policy in Python.

#include "llama.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Version of this API and of the patches it needs in llama.cpp; bumped whenever either changes.
// The Python side reads it from this header and refuses a library that reports another.
#define FORECACHE_PATCH_VERSION 6

// Returns FORECACHE_PATCH_VERSION of the library the caller is linked against.
LLAMA_API int32_t forecache_patch_version(void);

// Measures copy bandwidth between host memory and the buffer of ggml backend device `dev_index`:
// `nbytes` copied `n_iter` times in each direction after one warm-up copy, in GB/s (1e9 bytes).
// With `pinned`, the host side is the device's pinned host buffer type (fails when it has none).
// Returns 0 on success, -1 for a bad device index, -2 when pinned host memory is unavailable,
// -3 when an allocation fails.
LLAMA_API int32_t forecache_measure_copy(
        size_t   dev_index,
        size_t   nbytes,
        int32_t  n_iter,
        bool     pinned,
        double * h2d_gbps,
        double * d2h_gbps);

//
// Expert cache
//
// The routed-expert tensors (names ending in "_exps.weight", any architecture that computes them with
// MUL_MAT_ID) stay in host memory where the model loader put them. A pool of expert slots per layer is
// allocated on a device; every MUL_MAT_ID that reads a cached layer is rewritten, before the graph is
// split, to read the layer's pool through a slot-id tensor (the routed ids stay on the node as src[3]).
// Prefill and decode use the same graph shape. Before the first expert matmul of a layer the gate hook
// sees the routed ids; it assigns slots (forecache_cache_load) and chooses slot or host compute.
// Copies run on one worker thread in chunks, highest priority first, so a new high-priority copy waits
// for at most the one chunk in flight. A layer's experts are computed in the order of its schedule
// (forecache_cache_schedule): each MUL_MAT_ID waits only for the slots of the experts it computes next,
// and a schedule longer than the layer's slots streams experts through slots whose occupant is done.
// On a CPU-only build the pool is a CPU buffer and copies are memcpy.
// Errors in the hooks (a routed id out of range, an expert compute that fails) are logged and cancel the
// graph compute, so llama_decode returns 2 (aborted) instead of the process aborting.

struct forecache_cache;

// Called before the first expert matmul of a cached layer, once per ubatch.
// ids: [n_tokens][n_used] routed experts; weights: router weights in the same layout, or NULL when the
// graph computes them later; gate_input: [n_tokens][n_embd] expert input, or NULL unless requested.
// Return 0 to compute from slots (if a routed expert has no slot, the layer is computed from host memory),
// 1 to compute the whole layer from host memory, -1 to cancel the graph compute.
typedef int32_t (*forecache_gate_hook)(
        void          * user_data,
        int32_t         layer,
        int32_t         n_tokens,
        int32_t         n_used,
        const int32_t * ids,
        const float   * weights,
        const float   * gate_input,
        int32_t         n_embd);

struct forecache_cache_stats {
    uint64_t hits;          // routed experts (distinct per layer and ubatch) resident or in flight at the hook
    uint64_t misses;        // routed experts without a slot at the hook
    uint64_t host_layers;   // layer computations done from host memory
    uint64_t h2d_bytes;     // bytes copied host -> slots
    uint64_t n_chunks;      // chunk copies done
    uint64_t n_hook_calls;
    double   copy_s;        // time the copy worker spent copying
    double   stall_s;       // time compute waited for copies
    double   hook_s;        // time spent in the gate hook
    double   host_s;        // time spent computing experts from host memory
    uint64_t hi_tasks;      // high-priority copies (misses) queued
    double   hi_wait_s;     // time high-priority copies waited in the queue before their first chunk ran
    double   hi_wait_max_s;
    double   chunk_max_s;   // longest single chunk copy
    uint64_t dropped_chunks;// queued chunks dropped by eviction or cancel
    uint64_t refused_loads; // loads refused because the slot was in use by the layer being computed
    uint64_t n_groups;      // expert groups computed from slots (1 per MUL_MAT_ID when nothing waited)
    uint64_t streamed;      // schedule entries that reused a slot within one ubatch
    uint64_t host_entries;  // schedule entries computed from host memory beside the slots
    double   hi_block_s;    // time high-priority copies waited for a lower-priority chunk in flight
    double   hi_block_max_s;// longest such wait: bounded by one chunk copy
};

// Slot states reported by forecache_cache_layer_state.
enum forecache_slot_state {
    FORECACHE_SLOT_EMPTY   = -1,
    FORECACHE_SLOT_READY   = 0,  // resident
    FORECACHE_SLOT_COPYING = 1,  // some chunk of its copy has started
    FORECACHE_SLOT_QUEUED  = 2,  // no chunk of its copy has started
};

// chunk_bytes for forecache_cache_init: one chunk per expert projection, or one per whole expert.
#define FORECACHE_CHUNK_PROJECTION ((size_t) 0)
#define FORECACHE_CHUNK_EXPERT     ((size_t) -1)

// Creates the cache for `ctx` with n_slots[il] slots for each of n_layer layers (0: the layer is not
// cached) on ggml backend device `dev_index`, copying in chunks of `chunk_bytes`.
// Returns NULL and writes a message to err (err_size bytes) on failure.
LLAMA_API struct forecache_cache * forecache_cache_init(
        struct llama_context * ctx,
        const int32_t        * n_slots,
        int32_t                n_layer,
        size_t                 dev_index,
        size_t                 chunk_bytes,
        char                 * err,
        size_t                 err_size);

// Detaches the cache from its context and frees it; the next ubatch builds a graph without it.
LLAMA_API void forecache_cache_free(struct forecache_cache * cache);

LLAMA_API void forecache_cache_set_hook(
        struct forecache_cache * cache,
        forecache_gate_hook      hook,
        void                   * user_data,
        bool                     gate_input);

// Per layer: number of experts, of slots, and bytes of one expert (all projections). -1 if not a MoE layer.
LLAMA_API int32_t forecache_cache_layer_info(
        const struct forecache_cache * cache, int32_t layer, int32_t * n_expert, int32_t * n_slots, size_t * expert_bytes);

// Slot holding `expert` (loaded or in flight), or -1.
LLAMA_API int32_t forecache_cache_slot_of(const struct forecache_cache * cache, int32_t layer, int32_t expert);

// Puts `expert` into `slot`, evicting its occupant and dropping its queued chunks, and queues the copy
// with `priority` (0 is the highest). Returns 0, 1 if the slot is in use by the layer being computed
// (nothing changes), or -1 for bad arguments.
LLAMA_API int32_t forecache_cache_load(struct forecache_cache * cache, int32_t layer, int32_t expert, int32_t slot, int32_t priority);

// Drops queued, not yet started chunks of plain loads of `layer` (-1: all layers) with priority >=
// min_priority; their slots become empty. Returns the number of slots emptied.
LLAMA_API int32_t forecache_cache_cancel(struct forecache_cache * cache, int32_t layer, int32_t min_priority);

// Early preemption of `layer`: its queued low-priority (> 0) copies of the experts in `keep` move to
// priority 0 in their order, the rest are dropped and their slots emptied. Returns the slots emptied.
LLAMA_API int32_t forecache_cache_preempt(struct forecache_cache * cache, int32_t layer, const int32_t * keep, int32_t n_keep);

// Called from the gate hook of `layer`: the order in which its experts are computed, each with the slot
// it is computed from. Every routed expert must appear once. An entry whose slot holds another expert
// queues that expert's copy with `priority`; when a slot appears again, its copy waits, projection by
// projection, until the previous entry's expert has been computed (streaming). Slots of the layer stay in
// use (loads into them are refused) until the next layer is routed. Entries with slot -1, all after the
// others, are computed on the CPU from host memory while the device computes the rest. Returns 0, or -1
// for bad arguments.
LLAMA_API int32_t forecache_cache_schedule(struct forecache_cache * cache, int32_t layer, const int32_t * experts, const int32_t * slots, int32_t n, int32_t priority);

// Cache-first compute: with `reorder`, a layer's experts are computed in groups as their slots become
// ready; without it, compute waits for every slot of the layer first (and nothing can be streamed).
LLAMA_API void forecache_cache_set_reorder(struct forecache_cache * cache, bool reorder);

// Copies slot -> expert (-1 empty) and slot states (enum forecache_slot_state) of `layer` into arrays of
// n_slots entries. Returns n_slots, or -1 for a bad layer.
LLAMA_API int32_t forecache_cache_layer_state(const struct forecache_cache * cache, int32_t layer, int32_t * expert_of, int32_t * state);

// Blocks until every queued copy that can run is done.
LLAMA_API void forecache_cache_wait_idle(struct forecache_cache * cache);

// Statistics of `layer`, or of all layers for -1. Returns -1 for a bad layer.
LLAMA_API int32_t forecache_cache_get_stats(const struct forecache_cache * cache, int32_t layer, struct forecache_cache_stats * out);
LLAMA_API void    forecache_cache_reset_stats(struct forecache_cache * cache);

// sizeof(struct forecache_cache_stats): lets a binding that mirrors the struct refuse a mismatch.
LLAMA_API size_t  forecache_cache_stats_size(void);

#ifdef __cplusplus
}
#endif
