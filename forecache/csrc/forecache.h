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
#define FORECACHE_PATCH_VERSION 22

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
// Hidden-state capture (a draft model's per-layer states for speculative expert prefetch)
//

struct forecache_capture;

// A capture of the tensors named "<name>-<il>" (llama.cpp's graph names, e.g. "ffn_norm") for layers
// il < n_layer: rows of n_embd floats. Install it in a context by setting llama_context_params.cb_eval to
// forecache_capture_eval and cb_eval_user_data to the capture (before llama_init_from_model).
LLAMA_API struct forecache_capture * forecache_capture_init(const char * name, int32_t n_layer, int32_t n_embd);

LLAMA_API void forecache_capture_free(struct forecache_capture * capture);

// The eval callback: asks for the named F32 tensors of n_embd columns and copies the last token's row of
// each into the capture. Never stops the computation.
LLAMA_API bool forecache_capture_eval(struct ggml_tensor * t, bool ask, void * user_data);

// Copies the last row captured for `layer` into `out` (n_embd floats). Returns how many times that layer
// was captured so far (0: never, and `out` is untouched), -1 for a bad layer.
LLAMA_API int64_t forecache_capture_get(const struct forecache_capture * capture, int32_t layer, float * out);

// Moves sequence src_seq's KV cells from context src to sequence dst_seq of context dst (emptied
// first), two contexts of one model whose numbers of sequences (KV streams) may differ: a batch job's
// prompt fed in one context and decoded in another. The cells keep their positions and bytes. Returns
// 0, or -1 with a message in err (a model whose memory is not one KV cache).
LLAMA_API int32_t forecache_seq_move(
        struct llama_context * src,
        int32_t                src_seq,
        struct llama_context * dst,
        int32_t                dst_seq,
        char                 * err,
        size_t                 err_size);

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

// The fields of struct forecache_cache_stats in order, as X(type, name, combine): `combine` is how
// forecache_cache_get_stats combines the layers' values (SUM or MAX). This list is the one place a
// field is named: it makes the struct and its combination over layers, and forecache's Python side
// reads it from this header to build its ctypes mirror of the struct.
#define FORECACHE_CACHE_STATS_FIELDS(X) \
    X(uint64_t, hits,           SUM) /* routed experts (distinct per layer and ubatch) resident or in flight at the hook (a quiet layer: a token's top-k in one-token ubatches) */ \
    X(uint64_t, misses,         SUM) /* routed experts without a slot at the hook */ \
    X(uint64_t, host_layers,    SUM) /* layer computations done from host memory */ \
    X(uint64_t, h2d_bytes,      SUM) /* bytes copied host -> slots */ \
    X(uint64_t, n_chunks,       SUM) /* chunk copies done */ \
    X(uint64_t, hook_calls,     SUM) /* gates handed to the gate hook (Python) */ \
    X(double,   copy_s,         SUM) /* time the copy worker spent copying */ \
    X(double,   stall_s,        SUM) /* time compute waited for copies */ \
    X(double,   hook_s,         SUM) /* time spent in the gate hook */ \
    X(double,   host_s,         SUM) /* time spent computing experts from host memory */ \
    X(uint64_t, hi_tasks,       SUM) /* high-priority copies (misses) queued */ \
    X(double,   hi_wait_s,      SUM) /* time high-priority copies waited in the queue before their first chunk ran */ \
    X(double,   hi_wait_max_s,  MAX) \
    X(double,   chunk_max_s,    MAX) /* longest single chunk copy */ \
    X(uint64_t, dropped_chunks, SUM) /* queued chunks dropped by eviction or cancel */ \
    X(uint64_t, refused_loads,  SUM) /* loads refused because the slot was in use by the layer being computed, or read by a prompt bank's fill */ \
    X(uint64_t, n_groups,       SUM) /* expert groups computed from slots (1 per MUL_MAT_ID when nothing waited) */ \
    X(uint64_t, streamed,       SUM) /* schedule entries that reused a slot within one ubatch */ \
    X(uint64_t, host_entries,   SUM) /* schedule entries computed from host memory beside the slots */ \
    X(double,   hi_block_s,     SUM) /* time high-priority copies waited for a lower-priority chunk in flight */ \
    X(double,   hi_block_max_s, MAX) /* longest such wait: bounded by one chunk copy */ \
    X(uint64_t, decode_gates,   SUM) /* gates decided in C by the decode gate (forecache_cache_set_decode_gate) */ \
    X(double,   decode_gate_s,  SUM) /* time spent deciding them */ \
    X(double,   model_host_s,   SUM) /* modelled host time of the experts the decode gate sent to the host */ \
    X(uint64_t, decode_hits,    SUM) /* hits and misses of one-token ubatches */ \
    X(uint64_t, decode_misses,  SUM) \
    X(uint64_t, events_dropped, SUM) /* gate events dropped because the queue was full (counted for the cache, not per layer) */ \
    X(uint64_t, staged,         SUM) /* experts copied into stage slots (forecache_cache_stage) */ \
    X(uint64_t, stage_used,     SUM) /* schedule entries computed from a stage slot */ \
    X(uint64_t, disk_reads,     SUM) /* experts read from the model file into the host tier (forecache_cache_set_disk) */ \
    X(uint64_t, disk_bytes,     SUM) /* bytes of experts read */ \
    X(uint64_t, disk_direct_bytes, SUM) /* of those, bytes read with direct I/O (past the kernel's page cache) */ \
    X(double,   disk_s,         SUM) /* time the reader threads spent reading */ \
    X(double,   disk_wait_s,    SUM) /* time host compute waited for reads */ \
    X(uint64_t, host_hits,      SUM) /* experts a copy or host compute needed that the host tier held */ \
    X(uint64_t, host_misses,    SUM) /* ... that had to be read first */ \
    X(uint64_t, host_evictions, SUM) /* experts evicted from the host tier */ \
    X(double,   group_s,        SUM) /* time expert groups took on their device, launch to results */ \
    X(uint64_t, group_entries,  SUM) /* schedule entries (expert projections) they computed */ \
    X(uint64_t, group_rows,     SUM) /* token rows they computed */ \
    X(uint64_t, stops,          SUM) /* times the scheduler stopped before a node of the layer for the cache (each synchronizes the device) */ \
    X(uint64_t, readbacks,      SUM) /* blocking device -> host reads: routed ids, router weights, gate input, expert inputs */ \
    X(uint64_t, uploads,        SUM) /* blocking host -> device writes: the slot table or slot ids, router weights, groups' indices, host results */ \
    X(uint64_t, mini_graphs,    SUM) /* graphs the cache computed itself: expert groups, experts from host memory, host results written back */ \
    X(uint64_t, products,       SUM) /* MUL_MAT_IDs computed by the scheduler as one product over the slots */ \
    X(uint64_t, copy_waits,     SUM) /* times compute waited for copies */ \
    X(uint64_t, quiet,          SUM) /* passes through the layer without a stop or a copy (every expert resident: forecache_cache_set_quiet, or a bank layer) */ \
    X(uint64_t, banked,         SUM) /* passes through the layer that copied experts into its prompt bank (forecache_cache_set_bank) */ \
    X(uint64_t, bank_bytes,     SUM) /* bytes its prompt bank fills copied from host memory */ \
    X(uint64_t, shared,         SUM) /* passes through the layer that read a prompt bank fill another pass of their round made (forecache_cache_begin_round) */ \
    X(uint64_t, whole,          SUM) /* passes through the layer whose host experts the CPU computed whole (every projection in one hand-off) beside one product a projection */ \
    X(uint64_t, event_waits,    SUM) /* products ordered after copies by an event on the device, the host waiting only until they were issued (forecache_cache_set_copy_stream) */

struct forecache_cache_stats {
#define FORECACHE_CACHE_STATS_FIELD(type, name, combine) type name;
    FORECACHE_CACHE_STATS_FIELDS(FORECACHE_CACHE_STATS_FIELD)
#undef FORECACHE_CACHE_STATS_FIELD
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

// For each of the n_layer layers of ctx's model, the index in ggml's device list of the device
// llama.cpp put the layer's non-expert weights on, or -1 for host memory (the CPU). Returns 0, or
// -1 when n_layer is not the model's. Before forecache_cache_init: where its slots will go.
LLAMA_API int32_t forecache_layer_devices(struct llama_context * ctx, int32_t * dev_index, int32_t n_layer);

// Index in ggml's device list of the device holding `layer`'s slots (the device llama.cpp put the
// layer's other weights on when it is one of the context's own, else the one forecache_cache_init
// was given), or -1 for a layer without slots.
LLAMA_API int32_t forecache_cache_layer_device(const struct forecache_cache * cache, int32_t layer);

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
// it is computed from (n_slots + j: stage slot j, which must hold that expert of the layer; see
// forecache_cache_stage). Every routed expert must appear once. An entry whose slot holds another expert
// queues that expert's copy with `priority`; when a slot appears again, its copy waits, projection by
// projection, until the previous entry's expert has been computed (streaming). Slots of the layer stay in
// use (loads into them are refused) until the next layer is routed. Entries with slot -1, all after the
// others, are computed on the CPU from host memory while the device computes the rest. Returns 0, or -1
// for bad arguments.
LLAMA_API int32_t forecache_cache_schedule(struct forecache_cache * cache, int32_t layer, const int32_t * experts, const int32_t * slots, int32_t n, int32_t priority);

// Stage slots: device memory for n_stage experts outside every layer's slots, lent to one expert of one
// layer at a time. A layer that streams experts through its slots leaves the bus idle while its copies
// wait for the slots they reuse; copying the next layer's missing experts into stage slots meanwhile
// keeps it busy. A stage slot holds its expert until that expert's layer has been computed: those its
// schedule does not read go back when its gate has decided, the others when the next layer is routed.
// Layers whose experts have another shape or type than most cached layers' stage nothing. Allocated once:
// n_stage on each device holding slots, lent to that device's layers; stage slot indices count over
// every device's. Returns 0, or -1 (message in err).
LLAMA_API int32_t forecache_cache_set_stage(struct forecache_cache * cache, int32_t n_stage, char * err, size_t err_size);

// Queues the copy of `expert` of `layer` into a free stage slot with `priority`. Returns the stage slot,
// or -1 when none is free, the expert has a slot of the layer or a stage slot already, or for bad
// arguments.
LLAMA_API int32_t forecache_cache_stage(struct forecache_cache * cache, int32_t layer, int32_t expert, int32_t priority);

// Per stage slot: its layer and expert (-1 when free) and its state (enum forecache_slot_state) into
// arrays of one entry per stage slot of every device. Returns that count (0 without stage slots).
LLAMA_API int32_t forecache_cache_stage_state(const struct forecache_cache * cache, int32_t * layer, int32_t * expert, int32_t * state);

// Little pass (MoBiLE): while m > 0, every ubatch computed routes each token of each cached layer to its
// top m experts only (the first m of the router's sorted top-k); with `resident` ("cache-conditional"), to
// its top-1 and those of its top m whose slot holds them, copied (so it never waits for a copy; m may then
// be the whole top-k). The other positions get router weight 0 and are computed from the token's top-1
// expert (so they are finite and need no slot), and the gate hook sees the top-1's id in their place: each
// token's output is the model's over the experts kept, with their router weights. Only where the router
// weights are the expert outputs' multipliers (no renormalization after the top-k, as in qwen2moe: the
// model with m experts per token renormalizes nothing either); elsewhere the layer stays exact. Set it
// around the decodes of generated tokens only: a prompt computed while it is set is computed little too.
// m <= 0 (the default) turns it off.
LLAMA_API void forecache_cache_set_little(struct forecache_cache * cache, int32_t m, bool resident);

// The experts the little passes since forecache_cache_set_little last turned them on chose for `layer`'s
// tokens before keeping some of them (each token's full top-k in the router's order, token after token, in
// the order the ubatches were computed), into `ids` (`cap` entries): what the full model will likely route,
// for prefetching before it recomputes tokens. Returns their number (more than `cap` when only the first
// `cap` were written), -1 for a bad layer.
LLAMA_API int32_t forecache_cache_little_routing(const struct forecache_cache * cache, int32_t layer, int32_t * ids, int32_t cap);

// Cache-first compute: with `reorder`, a layer's experts are computed in groups as their slots become
// ready; without it, compute waits for every slot of the layer first (and nothing can be streamed).
LLAMA_API void forecache_cache_set_reorder(struct forecache_cache * cache, bool reorder);

// Quiet resident layers: with `quiet`, a layer whose every expert is resident is computed without a
// stop (its routed ids are not read back, the gate hook is not called and no gate event is queued;
// its products read the slots through the layer's expert -> slot table on the device), except the
// layer before one that is not, while gate events or the gate input are wanted. Off by default.
LLAMA_API void forecache_cache_set_quiet(struct forecache_cache * cache, bool quiet);

// Larger groups for long ubatches: for a ubatch of at least `min_tokens` tokens, a group of fewer than
// `min_entries` entries waits for more of the entries after it to become ready, while their copies can
// still land without it (a copy that waits for a slot this group would free ends the wait). Each group is
// a graph of its own, so fewer, larger groups cost fewer launches and synchronizations; the wait delays
// the experts already in place. min_entries <= 1 turns it off (the default).
LLAMA_API void forecache_cache_set_gather(struct forecache_cache * cache, int32_t min_tokens, int32_t min_entries);

// Prompt banks: a ubatch of at least `min_tokens` tokens (llama.cpp offloads a host layer's experts
// for 32) computes each cached layer whose experts are in host memory as one product per projection
// over its slots and a bank region holding the experts they lack: each device keeps two regions of as
// many experts as its layer with the fewest slots lacks, in front of its slots, and the product reads
// a span from the layer's region to its last slot through a table of where each expert is, on the
// device. Only the missing experts cross the bus (those beyond the region, in a cold cache, go into
// empty slots), and the next bank layer's region fills while the layer computes. No routed id is read
// back, no gate hook or event runs for it, and no resident expert leaves its slot: other copies into
// bank layers' slots are refused until a ubatch without them. Where the device has events, fills run
// on a stream of their own ordered by them, without a host synchronization; elsewhere a thread fills
// and the layer stops once. Must be called before any expert is loaded (the slots are placed anew
// behind the regions). Returns 0, or -1 with a message in err.
LLAMA_API int32_t forecache_cache_set_bank(struct forecache_cache * cache, int32_t min_tokens, char * err, size_t err_size);

// Micro-batches over one cache (MoE-Lightning's CGOPipe): another context of the same model reads the
// cache's prompt banks. Its ubatches of at least the banks' min_tokens compute every bank layer from
// the banks, as the cache's own context does; its other expert products stay stock llama.cpp's
// (host memory). Call after forecache_cache_set_bank and before anything else sets the context's
// hooks (a routing replay goes on top). Returns 0, or -1 with a message in err.
LLAMA_API int32_t forecache_cache_attach(struct forecache_cache * cache, struct llama_context * ctx, char * err, size_t err_size);

// Takes the cache off an attached context (forecache_cache_free does it for every one). Returns 0, -1
// when the context is not attached, -2 while a routing replay still sits on its hooks.
LLAMA_API int32_t forecache_cache_detach(struct forecache_cache * cache, struct llama_context * ctx);

// A round: the next n_passes passes, one from each of as many contexts (the cache's and attached
// ones), each computed by a thread of its own, go through the bank layers together, so that one fill
// of a layer's bank serves them all: a region is filled anew once every pass of the round has begun
// and launched the layer it holds. A pass that is not a bank pass takes its place in the round too;
// the cache's own context computes such a pass once the round's passes have ended, and a bank pass
// outside the round waits for them too. After each llama_decode of a context in a round, call
// forecache_cache_end_pass for it (also when the decode failed). Returns 0, or -1 while the last
// round still runs or n_passes < 1.
LLAMA_API int32_t forecache_cache_begin_round(struct forecache_cache * cache, int32_t n_passes);

// The context's pass ended (its llama_decode returned): it reads no bank any more, and when it had not
// taken its place in the running round, it takes it now, computing nothing in it. Returns 0, or -1
// for a context that does not read the cache.
LLAMA_API int32_t forecache_cache_end_pass(struct forecache_cache * cache, struct llama_context * ctx);

// Copy streams: with `on`, each device whose backend has events copies its chunks asynchronously on
// a stream of its own, at most two in flight, an event recorded after each; a one-token ubatch's
// product then waits on the device for its copies (the host only until they are issued), not on
// the host for them to land. On a device without events (a CPU) chunks are copied synchronously by
// the device's worker, as with `on` false. Returns the number of devices copying on a stream.
LLAMA_API int32_t forecache_cache_set_copy_stream(struct forecache_cache * cache, bool on);

// Copies slot -> expert (-1 empty) and slot states (enum forecache_slot_state) of `layer` into arrays of
// n_slots entries. Returns n_slots, or -1 for a bad layer.
LLAMA_API int32_t forecache_cache_layer_state(const struct forecache_cache * cache, int32_t layer, int32_t * expert_of, int32_t * state);

// Slots of `layer` holding an expert in eviction order, into `slots` (n_slots entries): lowest eviction
// key first, least recently used first among equal keys. An expert's slot is used when its layer routes
// to it, when a load or a schedule puts it there, and by forecache_cache_touch. Returns the number
// written, or -1 for a bad layer.
LLAMA_API int32_t forecache_cache_layer_order(const struct forecache_cache * cache, int32_t layer, int32_t * slots);

// Eviction keys of `layer` (one per expert, all 0 at first: least recently used first): sets all n_expert
// of them and the step added to a routed expert's key for every token row routed to it (0: none).
// Returns 0, or -1 for a bad layer or count.
LLAMA_API int32_t forecache_cache_set_keys(struct forecache_cache * cache, int32_t layer, const int64_t * keys, int32_t n, int64_t step);

// Adds deltas[i] to the eviction key of experts[i] of `layer`. Returns 0, or -1 for a bad layer.
LLAMA_API int32_t forecache_cache_add_keys(struct forecache_cache * cache, int32_t layer, const int32_t * experts, const int64_t * deltas, int32_t n);

// Copies the n_expert eviction keys of `layer` into `keys`. Returns n_expert, or -1 for a bad layer.
LLAMA_API int32_t forecache_cache_layer_keys(const struct forecache_cache * cache, int32_t layer, int64_t * keys);

// Marks the slots of `experts` of `layer` (those that have one) used, in order: the last is the most recent.
LLAMA_API void forecache_cache_touch(struct forecache_cache * cache, int32_t layer, const int32_t * experts, int32_t n);

// Forward passes: the current one (each graph compute starts a new one) and the last pass in which
// `layer` was routed (0: never). Returns -1 for a bad layer.
LLAMA_API int32_t forecache_cache_passes(const struct forecache_cache * cache, int32_t layer, uint64_t * current, uint64_t * routed);

//
// Decode gate: one-token ubatches routed in C, without the gate hook
//
// With a table set, a gate of one token whose n_used experts fit the layer's slots is decided here, as the
// proactive policy's gate does it, from tables the policy keeps current:
//   - with `preempt`, queued low-priority copies of the routed experts move to priority 0 and the layer's
//     other low-priority copies are dropped (forecache_cache_preempt);
//   - routed experts with a slot are computed first: ready, then copying, then queued;
//   - of the m routed experts without a slot, while f of those with one are still copying,
//     host_k[m*(n_used + 1) + f] are computed on the CPU beside the slots (the lowest expert ids), the
//     others are copied at priority 0 into free slots, then into the slots the layer does not route to
//     in eviction order (forecache_cache_layer_order); host_k < 0 calls the gate hook instead;
//   - the experts computed on the CPU are then queued at priority 1 into the next such slots.
// host_s[same index] is the modelled host time of that choice, summed into stats.model_host_s.
// n_used <= 0 turns the decode gate off. Setting the tables drops every layer's own (below).
LLAMA_API void forecache_cache_set_decode_gate(
        struct forecache_cache * cache,
        int32_t                  n_used,
        const int32_t          * host_k,
        const double           * host_s,
        bool                     preempt);

// Tables of layer `layer` alone, in place of the cache's (a layer whose slots are on a device with
// other costs: another link, another compute rate), of the size forecache_cache_set_decode_gate's
// n_used gives; null tables give the layer the cache's again. 0, or -1 for a bad layer or no
// decode gate set.
LLAMA_API int32_t forecache_cache_set_layer_decode_gate(
        struct forecache_cache * cache,
        int32_t                  layer,
        const int32_t          * host_k,
        const double           * host_s);

//
// Disk tier: experts in the model file, a host expert cache in memory, the slots above it
//
// For models whose experts do not fit in host memory. Load the model with forecache_set_disk_experts on:
// the loader then maps every routed-expert tensor from the file without reading it. The cache's disk tier
// keeps n_host[il] experts of each layer (all projections) in host slots (pinned where the device has a
// pinned host buffer type) and reads the others from the file when a copy into a slot or a host compute
// needs them, or ahead of need (forecache_cache_disk_read), by reader threads of its own: whole
// projections, with direct I/O where the file system allows it (else read and dropped from the page
// cache), several in flight, highest priority first. Copies into slots wait, chunk by chunk, for their
// expert's read; host compute waits for the reads of the experts it computes next. A host slot goes to
// the expert it is read for, evicting the least used expert (then the least recently used) that no
// queued copy or running compute needs. The expert tensors in the mapping are never read.

// Makes the loader leave routed-expert tensors in the file (see above) for the models loaded while set.
LLAMA_API void forecache_set_disk_experts(bool on);

// Turns on the disk tier of a cache whose model was loaded with forecache_set_disk_experts: `paths` are the
// model's n_paths GGUF files (one, or a split model's shards in order), n_host[il] the host slots of each of n_layer layers (every layer with
// experts needs at least one, and at least one device slot), n_readers the reads in flight. Call once,
// before the first ubatch. Returns 0, or -1 (message in err).
LLAMA_API int32_t forecache_cache_set_disk(
        struct forecache_cache * cache,
        const char * const     * paths,
        int32_t                  n_paths,
        const int32_t          * n_host,
        int32_t                  n_layer,
        int32_t                  n_readers,
        char                   * err,
        size_t                   err_size);

// Queues reads of `experts` of `layer` into its host slots with `priority` (those held or queued at a
// higher priority already are skipped). Returns the number queued, or -1 for bad arguments or without
// a disk tier.
LLAMA_API int32_t forecache_cache_disk_read(struct forecache_cache * cache, int32_t layer, const int32_t * experts, int32_t n, int32_t priority);

// Host slot -> expert (-1 empty) of `layer` and whether its read is done (1) or in flight (0), into arrays
// of n_host entries. Returns n_host (0 without a disk tier), or -1 for a bad layer.
LLAMA_API int32_t forecache_cache_host_state(const struct forecache_cache * cache, int32_t layer, int32_t * expert_of, int32_t * ready);

//
// Gate events: every routed layer, for a prediction thread
//

enum forecache_event_kind {
    FORECACHE_EVENT_GATE   = 0, // a layer was routed
    FORECACHE_EVENT_MARKER = 1, // posted with forecache_cache_post
};

struct forecache_event {
    int32_t  kind;
    int32_t  layer;
    int32_t  n_tokens;
    int32_t  n_used;
    int32_t  n_embd;     // columns of the gate input copied, 0 when not requested
    int32_t  has_tokens; // token ids of the ubatch copied (forecache_cache_set_tokens)
    uint64_t pass;       // forecache_cache_passes' current pass when the layer was routed
    int64_t  marker;
};

// Turns recording of gate events on or off; at most `capacity` gate events wait (more are dropped
// and counted in stats.events_dropped). Markers are never dropped.
LLAMA_API void forecache_cache_set_events(struct forecache_cache * cache, bool enabled, int32_t capacity);

// Token ids of the ubatch about to be decoded, attached to its gate events when their count matches.
LLAMA_API void forecache_cache_set_tokens(struct forecache_cache * cache, const int32_t * tokens, int32_t n);

// Queues a marker event after the events recorded so far.
LLAMA_API void forecache_cache_post(struct forecache_cache * cache, int64_t marker);

// Waits up to timeout_ms for the oldest event and removes it: its routed ids [n_tokens][n_used] into
// `ids`, gate input [n_tokens][n_embd] into `x`, token ids into `tokens` (arrays of the given capacities).
// Returns 1, 0 on timeout, or 2 when an array is too small: `ev` then describes the event, which stays
// queued for a call with larger arrays.
LLAMA_API int32_t forecache_cache_next_event(
        struct forecache_cache * cache,
        int32_t                  timeout_ms,
        struct forecache_event * ev,
        int32_t                * ids,
        size_t                   ids_cap,
        float                  * x,
        size_t                   x_cap,
        int32_t                * tokens,
        size_t                   tokens_cap);

// sizeof(struct forecache_event): lets a binding that mirrors the struct refuse a mismatch.
LLAMA_API size_t forecache_event_size(void);

// Blocks until every queued copy that can run is done.
LLAMA_API void forecache_cache_wait_idle(struct forecache_cache * cache);

// Statistics of `layer`, or of all layers for -1. Returns -1 for a bad layer.
LLAMA_API int32_t forecache_cache_get_stats(const struct forecache_cache * cache, int32_t layer, struct forecache_cache_stats * out);
LLAMA_API void    forecache_cache_reset_stats(struct forecache_cache * cache);

// sizeof(struct forecache_cache_stats): lets a binding that mirrors the struct refuse a mismatch.
LLAMA_API size_t  forecache_cache_stats_size(void);

//
// Timeline: spans of the cache's work, layer by layer, for finding where a pass's time goes
//

enum forecache_span_kind {
    FORECACHE_SPAN_IDS   = 0, // a layer's routed ids read back (waits for the device to reach them)
    FORECACHE_SPAN_GATE  = 1, // the gate: the decode gate or the hook, with the router weights and input read
    FORECACHE_SPAN_WAIT  = 2, // compute waiting for copies (one projection, or the layer)
    FORECACHE_SPAN_HOST  = 3, // experts computed on the CPU from host memory (the layer, or host entries)
    FORECACHE_SPAN_GROUP = 4, // an expert group computed from slots
    FORECACHE_SPAN_COPY  = 5, // a chunk copied host -> slot, on the copy thread
    FORECACHE_SPAN_READ  = 6, // an expert read from the model file into a host slot, on a reader thread
    FORECACHE_SPAN_QUIET = 7, // a layer computed without a stop (forecache_cache_set_quiet): no time of its own
    FORECACHE_SPAN_BANK  = 8, // a layer's prompt bank filled, n: the ubatch's rows (with events: the time issuing its copies)
    FORECACHE_SPAN_EVENT = 9, // a product ordered after its copies on the device (forecache_cache_set_copy_stream): no time of its own
};

struct forecache_span {
    int32_t  kind;
    int32_t  layer;
    int32_t  proj;     // projection, -1: every projection of the layer or expert
    int32_t  expert;   // copies, reads: the expert; -1 otherwise
    int32_t  slot;     // copies: the slot (n_slots + j: stage slot j); reads: the host slot; -1 otherwise
    int32_t  n;        // ids, gates, quiet: tokens routed; host: rows computed; groups: schedule entries
    uint64_t pass;     // the forward pass (forecache_cache_passes) it ran in
    uint64_t bytes;    // copies: bytes copied; reads: bytes read; ids: bytes read back
    double   t0;       // seconds since forecache_cache_set_timeline started recording
    double   t1;
};

// Starts recording spans, keeping the last `capacity` (older ones are dropped and counted), or stops
// for capacity 0. Starting clears what was recorded and restarts the clock. Returns 0, or -1 for a
// negative capacity.
LLAMA_API int32_t forecache_cache_set_timeline(struct forecache_cache * cache, int32_t capacity);

// Moves up to n_max recorded spans, oldest first, into `out` and returns how many; *dropped (when not
// NULL) is set to the spans dropped for lack of room since the previous call.
LLAMA_API int32_t forecache_cache_timeline(struct forecache_cache * cache, struct forecache_span * out, int32_t n_max, uint64_t * dropped);

// sizeof(struct forecache_span): lets a binding that mirrors the struct refuse a mismatch.
LLAMA_API size_t forecache_span_size(void);

//
// Routing replay: expert matmuls read a recorded routing instead of the router's choice
//
// For benchmarks that must see a real model's routing on a model whose weights route otherwise (made
// with random weights): every MUL_MAT_ID of a routed expert tensor ("blk.<il>.*_exps.weight") reads
// layer il's expert ids from a table, and the product of the expert outputs with the router weights
// reads the table's weights. The router still runs (its cost stays), its choice goes unused. The
// tables live in the buffer of device `dev_index`, where the router's ids would be, so a placement
// copies them to the CPU exactly where it copied the router's; one copy per ubatch sets them. The
// tokens computed are meaningless. Works beside the expert cache (create the replay after the cache,
// free it before): the cache then sees the replayed ids.
struct forecache_replay;

// Creates a replay for `ctx`, with tables for ubatches of up to n_tokens_max tokens. Returns NULL and
// writes a message to err on failure.
LLAMA_API struct forecache_replay * forecache_replay_init(
        struct llama_context * ctx,
        int32_t                n_tokens_max,
        size_t                 dev_index,
        char                 * err,
        size_t                 err_size);

// Sets the routing of the next ubatch, which must be the whole batch of the next llama_decode (n_tokens
// <= n_ubatch): ids and weights [n_layer][n_tokens][n_used] (llama.cpp's blocks; rows of layers without
// experts are not read). A layer computed for fewer rows (llama.cpp's last layer, for the rows whose
// output is asked for) reads the ubatch's last rows. Returns 0, or -1 for bad arguments.
LLAMA_API int32_t forecache_replay_set(struct forecache_replay * replay, int32_t n_tokens, const int32_t * ids, const float * weights);

// Sets the routing of the n rows of the next llama_decode's batch, which llama.cpp may split into
// several ubatches in an order of its own (a KV stream per sequence): row i is the token of sequence
// seq_ids[i] at position pos[i], and routes to ids and weights [n][n_layer][n_used]. Before each
// ubatch the replay finds each of its tokens' rows by (sequence, position); a token not among them
// fails the replay (forecache_replay_rewritten). Returns 0, or -1 for bad arguments or a
// (sequence, position) given twice.
LLAMA_API int32_t forecache_replay_set_rows(struct forecache_replay * replay, int32_t n, const int32_t * seq_ids, const int32_t * pos,
                                           const int32_t * ids, const float * weights);

// Expert matmuls rewritten so far, or -1 once a graph could not be rewritten (a layer routes another
// number of experts per token than the model's, or a view could not be made): its ubatch ran the
// router's own routing, and the run must be discarded. Graphs larger than the routing set (those
// llama.cpp reserves memory with, never computed) are rewritten for their own size, or left as
// built past n_tokens_max.
LLAMA_API int64_t forecache_replay_rewritten(const struct forecache_replay * replay);

// Removes the replay from its context (the next ubatch builds a graph without it) and frees it.
LLAMA_API void forecache_replay_free(struct forecache_replay * replay);

#ifdef __cplusplus
}
#endif
