#pragma once

// forecache expert cache, internals its files share (not API): the cache's structures, the helpers
// every part reads, and the functions one part calls in another. The parts:
//   forecache-cache.cpp          the C API: init and free, loads, schedules, stage slots, stats
//   forecache-cache-copy.cpp     slots and the copy engine: the queue, its worker, schedules
//   forecache-cache-graph.cpp    the graph hook: MUL_MAT_IDs rewritten to read slot pools
//   forecache-cache-route.cpp    the node hook: routed ids read back, the gate, the decode gate,
//                                MoBiLE's little pass, gate events
//   forecache-cache-compute.cpp  expert compute outside the scheduler: host layers and entries,
//                                expert groups from slots
//   forecache-cache-bank.cpp     where each device's slots sit, and prompt banks: a long ubatch's
//                                layer computed over its slots and the experts they lack, copied
//                                while the layer before computes
//   forecache-cache-testing.cpp  the controls of forecache-testing.h

#include "forecache.h"
#include "forecache-impl.h"
#include "forecache-testing.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-backend-hooks.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

using fc_clock = std::chrono::steady_clock;

inline double fc_seconds(fc_clock::time_point t0) {
    return std::chrono::duration<double>(fc_clock::now() - t0).count();
}

struct fc_gctx;

constexpr int FC_MAX_PROJ     = 4;
constexpr int FC_N_PRIORITIES = 4;

// the thread that computes a split layer's host entries while the graph thread computes the
// slots: kept for the cache's lifetime (starting and joining one per projection cost ~40 us)
struct fc_host_thread {
    std::thread             th;
    std::mutex              mtx;
    std::condition_variable cv;
    std::function<void()>   job;
    bool                    busy = false;
    bool                    stop = false;

    void loop() {
        std::unique_lock<std::mutex> lock(mtx);
        for (;;) {
            cv.wait(lock, [this] { return busy || stop; });
            if (!busy) {
                return;
            }
            lock.unlock();
            job();
            lock.lock();
            job  = nullptr;
            busy = false;
            cv.notify_all();
        }
    }

    // runs fn on the kept thread (started on first use); one job at a time
    void run(std::function<void()> fn) {
        if (!th.joinable()) {
            th = std::thread([this] { loop(); });
        }
        {
            std::lock_guard<std::mutex> lock(mtx);
            job  = std::move(fn);
            busy = true;
        }
        cv.notify_all();
    }

    void wait() {
        std::unique_lock<std::mutex> lock(mtx);
        cv.wait(lock, [this] { return !busy; });
    }

    void finish() {
        if (!th.joinable()) {
            return;
        }
        {
            std::lock_guard<std::mutex> lock(mtx);
            stop = true;
        }
        cv.notify_all();
        th.join();
    }
};

struct fc_chunk {
    int32_t layer;
    int32_t slot;
    int32_t proj;     // -1: every projection of the expert
    int32_t expert;
    int32_t priority;
    int32_t entry;    // schedule entry of a streamed copy, -1 for a plain load
    int32_t need;     // streamed: entries of the slot that must have computed this projection first
    bool    first;    // first chunk of its copy
    size_t  offset;   // within one expert of the projection
    size_t  size;
    fc_clock::time_point queued_at;
};

// how a layer's routed experts are computed, as a graph made them, so that the CPU can compute an
// expert whole from host memory: the products (MUL_MAT_IDs over slots, all reading input x but
// the last) and the element-wise nodes between them, in graph order; the last product's result
// is read first by `tail`
struct fc_ffn {
    ggml_tensor * x    = nullptr;
    ggml_tensor * last = nullptr;
    ggml_tensor * tail = nullptr;
    std::vector<ggml_tensor *> nodes;
};

// a chunk copied on its device's copy stream, not yet known to be done
struct fc_inflight {
    fc_chunk             ch;
    int32_t              hs;    // the host slot it reads, -1
    size_t               bytes;
    ggml_backend_event_t ev;    // recorded on the copy stream after it
    fc_clock::time_point t0;
};

// chunks a copy stream holds in flight: one copying, one queued behind it (a demand copy waits
// for at most these)
constexpr int FC_COPY_DEPTH = 2;

struct fc_event {
    forecache_event      head = {};
    std::vector<int32_t> ids;
    std::vector<float>   x;
    std::vector<int32_t> tokens;
};

// a device the cache keeps slots on: the layers llama.cpp placed there (fc_layer::dev) keep their
// slot pools in its memory, and their expert groups are computed there
struct fc_device {
    ggml_backend_dev_t    dev         = nullptr;
    ggml_context        * pool_ctx    = nullptr;
    ggml_backend_buffer_t pool_buf    = nullptr;
    ggml_tensor         * slot_ids    = nullptr; // shared by its layers: one layer routes at a time
    ggml_context        * view_ctx    = nullptr;
    std::map<std::pair<int64_t, int64_t>, ggml_tensor *> views;
    ggml_backend_t        backend     = nullptr; // the scheduler's backend of dev
    ggml_backend_t        cpu         = nullptr; // a CPU device: the group compute's own CPU backend
    ggml_threadpool_t     cpu_pool    = nullptr;
    ggml_gallocr_t        group_alloc = nullptr; // scratch of expert-group compute
    ggml_context        * stage_ctx   = nullptr; // its stage slots (forecache_cache_set_stage)
    ggml_backend_buffer_t stage_buf   = nullptr;
    ggml_tensor         * stage[FC_MAX_PROJ] = {};
    int32_t               stage_j0    = 0;       // global index of its first stage slot
    std::thread           worker;                // copies the queue's chunks for its layers
    fc_clock::time_point  low_start;             // when its last lower-priority chunk started
    fc_clock::time_point  low_end;               // and finished

    ggml_backend_buffer_t slot_buf   = nullptr; // its layers' slots, behind its prompt banks' regions

    // the copy stream (forecache_cache_set_copy_stream): the worker issues chunks asynchronously on a
    // backend of its own, an event after each; compute waits on the device for the last one issued
    ggml_backend_t        copy       = nullptr;
    ggml_backend_event_t  copy_ev[FC_COPY_DEPTH] = {};
    std::deque<fc_inflight> inflight;            // issued, oldest first (lock held)
    uint64_t              issued     = 0;        // chunks issued on it (chunk k's event: copy_ev[k % FC_COPY_DEPTH])
    bool                  issuing    = false;    // a chunk taken from the queue is being issued ...
    fc_chunk              issuing_ch = {};       // ... this one (not yet on the stream)

    // prompt banks (forecache_cache_set_bank): two regions of bank_n experts each, in front of the
    // slots; consecutive bank layers of the device use different regions
    int32_t               bank_n     = 0;
    ggml_context        * bmap_ctx   = nullptr;  // its bank layers' tables
    ggml_backend_buffer_t bank_buf   = nullptr;  // ... their memory
    int32_t               bank_layer[2] = {-1, -1}; // the layer a region holds or is being filled with
    uint64_t              bank_epoch[2] = {0, 0};   // the bank pass (or round) it was filled for
    bool                  bank_ready[2] = {true, true}; // its fill is issued (events) or done (a thread)
    ggml_backend_t        bank_copy  = nullptr;  // a backend of its own (a second stream) for fills, where events work
    ggml_backend_event_t  bank_filled[2] = {};   // recorded on bank_copy after a region's fill
    std::unique_ptr<fc_host_thread> filler;      // without events: fills run on this thread
};

struct fc_layer {
    int32_t n_expert = 0;
    int32_t n_slots  = 0;
    int32_t n_proj   = 0;
    int32_t dev      = 0; // index in forecache_cache::devs of the device its slots are on
    size_t  expert_bytes = 0;

    ggml_tensor * host[FC_MAX_PROJ] = {};
    ggml_tensor * pool[FC_MAX_PROJ] = {};
    ggml_tensor * map = nullptr;      // expert -> slot on the layer's device: the graph remaps routed ids through it
    std::vector<int32_t> map_dev;     // what map holds now
    uint64_t quiet_epoch = 0;         // the pass computing the layer without a stop (forecache_cache_set_quiet)
    const ggml_tensor * wait_node = nullptr; // the product whose copies the host waits for, its nodes before launched
    // prompt banks (forecache_cache_set_bank): a bank layer's products in a long ubatch read span[p],
    // from its region's start to its last slot (slot s at unit[p] + s), through its tables bmap[p]
    int32_t  bank_region = -1;        // 0 or 1; -1: not a bank layer
    ggml_tensor * span[FC_MAX_PROJ] = {};
    ggml_tensor * bmap[FC_MAX_PROJ] = {};
    int32_t  unit[FC_MAX_PROJ]      = {};
    std::vector<int32_t> bmap_dev[FC_MAX_PROJ]; // what bmap[p] holds now
    std::vector<int32_t> plan_slot;   // this pass: expert -> the slot it is read from, -1
    std::vector<int32_t> plan_bank;   // ... its place in the region, -1
    bool     plan_copies = false;     // the plan copies some expert
    bool     plan_waits  = false;     // ... or writes its tables: its products wait for the fill
    const fc_gctx * bank_filler = nullptr; // the context whose pass made the plan
    uint64_t bank_gen    = 0;         // tables pointing at slots only, made in this hold (forecache_cache::bank_gen)

    std::vector<int32_t> slot_of;     // expert -> slot, -1 if none
    std::vector<int32_t> dg_host_k;   // its own decode gate tables (forecache_cache_set_layer_decode_gate;
    std::vector<double>  dg_host_s;   // empty: the cache's)
    std::vector<int32_t> expert_of;   // slot -> expert, -1 if empty
    std::vector<int32_t> pending;     // slot -> plain chunks queued or running
    std::vector<int32_t> pend_proj;   // slot*n_proj + p -> plain chunks queued or running that write projection p
    std::vector<uint8_t> started;     // slot -> a chunk of its current copy has started
    std::vector<uint8_t> in_use;      // slot -> read by the schedule being computed
    std::vector<uint64_t> stamp;      // slot -> when its expert was last used (recency)
    std::vector<int64_t>  key;        // expert -> eviction key: lower keys are evicted first
    int64_t               key_step = 0; // added to a routed expert's key per token row routed to it

    // schedule of the current ubatch: compute order and streaming state
    std::vector<int32_t> sch_e;
    std::vector<int32_t> sch_s;
    std::vector<uint8_t> sch_first;   // entry is the first use of its slot
    std::vector<int32_t> entry_pend;  // entry*n_proj + p -> streamed chunks queued or running
    std::vector<int32_t> consumed;    // slot*n_proj + p -> entries of the slot computed for projection p
    std::vector<int32_t> entry_of;    // expert -> entry, -1
    std::vector<int32_t> last_entry;  // slot -> streamed entry that holds it at the end, -1
    int32_t  n_dev     = 0;           // entries [0, n_dev) come from slots, the rest from host memory
    uint64_t sch_epoch = 0;           // epoch the schedule belongs to (0: none)
    bool     streams   = false;
    bool     staged    = false;       // some entry reads a stage slot (slot n_slots + j)
    bool     little    = false;       // routed by a little pass: computed group by group
    std::vector<int32_t> little_ids;  // the top-k little passes routed their tokens to, before they kept some
    uint64_t whole_epoch = 0;         // the pass whose host entries the CPU computes whole (fc_whole_start)
    bool     stage_ok  = false;       // its experts have the stage slots' layout
    std::vector<uint8_t> early_drop;  // positions a little pass dropped before the weights' normalization
    uint64_t             early_epoch = 0;

    forecache_cache_stats stats = {};

    // disk tier (forecache_cache_set_disk; lock held): n_host host slots of all projections, in hpool
    int32_t n_host = 0;
    ggml_tensor * hpool[FC_MAX_PROJ] = {};
    uint64_t file_off[FC_MAX_PROJ] = {}; // where host[p]'s data starts in its model file
    int32_t  file_idx[FC_MAX_PROJ] = {}; // which of the model's files (a split model's shards) holds it
    std::vector<int32_t>  hslot_of;   // expert -> host slot, -1
    std::vector<int32_t>  hexpert_of; // host slot -> expert, -1
    std::vector<uint8_t>  hready;     // host slot -> its read is done
    std::vector<int32_t>  hbusy;      // host slot -> copies and host computes reading it now
    std::vector<uint64_t> hstamp;     // host slot -> last use
    std::vector<int32_t>  hwant;      // expert -> queued or running chunks copying it
    std::vector<int32_t>  hhold;      // expert -> host computes that wait for it or read it
    std::vector<uint32_t> huses;      // expert -> times a copy or host compute needed it
    std::vector<int8_t>   hreq;       // expert -> priority its read is queued at, -1

    // routing of the current ubatch
    uint64_t            epoch     = 0;
    uint64_t            routed_pass = 0; // epoch of the last routing, set before its gate decides
    const ggml_tensor * ids_src   = nullptr;
    bool                host_mode = false;
};

// how the router weights a MUL_MAT_ID's ids were read with reach the expert outputs, which decides
// how a little pass drops an expert: weight 0 where they multiply the outputs as they are (qwen2moe,
// olmoe) or are first divided by their sum (the kept ones are renormalized: mixtral, qwen3moe,
// deepseek2), -inf where a softmax over them comes first (gpt-oss)
enum fc_weights_use { FC_WEIGHTS_UNKNOWN, FC_WEIGHTS_DIRECT, FC_WEIGHTS_NORMALIZED, FC_WEIGHTS_SOFTMAXED };

// the tensor t views (through reshapes, views, permutes), or t itself
inline const ggml_tensor * fc_viewed(const ggml_tensor * t) {
    while (t != nullptr && (t->op == GGML_OP_RESHAPE || t->op == GGML_OP_VIEW ||
                            t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE)) {
        t = t->src[0];
    }
    return t;
}

// a context whose graphs read the cache: the one forecache_cache_init was given (every path), or
// one forecache_cache_attach added (its long ubatches' bank layers only; the rest of its graphs
// stay stock). Its hooks' user data.
struct fc_gctx {
    forecache_cache    * c     = nullptr;
    llama_context      * lctx  = nullptr;
    ggml_backend_sched_t sched = nullptr;
    bool                 main  = false;
    std::vector<ggml_backend_t>       backend; // per device (forecache_cache::devs): the scheduler's backend of it
    std::vector<ggml_backend_event_t> freed;   // per device with fill events: recorded on its backend, the nodes launched before done
    std::deque<ggml_context *> remap_ctx;      // the remap nodes of its last graphs (a reused graph keeps reading them)
    // the bank layers of the graph it computes: each bank product's remap node -> (layer, next bank layer
    // of its device or -1; -2: not the layer's first product)
    std::unordered_map<const ggml_tensor *, std::pair<int32_t, int32_t>> bank_rm;
    int32_t  bank_first = -1;   // that graph's first bank layer (-1: not such a graph)
    int32_t  bank_rows  = 0;    // ... and its ubatch's rows
    // the pass it computes (lock held): whose bank fills it reads (its round's, or its own), and
    // as a member of a round (forecache_cache_begin_round), how far it got
    uint64_t bank_id = 0;
    uint64_t round   = 0;       // the round it joined last (0: none)
    bool     member  = false;   // its pass is a member of the running round, not ended
    bool     solo    = false;   // its pass is a bank pass outside any round, not ended
    int32_t  at      = -1;      // ... the layers before `at` are launched
};

struct forecache_cache {
    fc_gctx                               main;      // the context forecache_cache_init was given
    std::vector<std::unique_ptr<fc_gctx>> attached;  // forecache_cache_attach's

    std::vector<fc_layer> layers;
    std::unordered_map<const ggml_tensor *, std::pair<int32_t, int32_t>> host_map; // expert tensor -> (layer, proj)
    std::unordered_map<const ggml_tensor *, std::pair<int32_t, int32_t>> pool_map; // pool tensor   -> (layer, proj)
    std::unordered_map<const ggml_tensor *, ggml_tensor *>               weights_of; // routed ids -> router weights
    std::unordered_map<const ggml_tensor *, fc_weights_use>              weights_use; // router weights -> how they reach the expert outputs
    std::unordered_map<const ggml_tensor *, ggml_tensor *>               little_before; // node -> router weights a little pass drops in before it
    std::unordered_map<const ggml_tensor *, int32_t>                     layer_of_ids; // routed ids -> layer
    std::unordered_map<const ggml_tensor *, ggml_tensor *>               remap_mm; // remap node (GET_ROWS of a layer's map) -> first MUL_MAT_ID reading it
    std::unordered_map<int32_t, fc_ffn> ffn;                  // the last graph's layers whose experts the CPU can compute whole
    std::unordered_map<const ggml_tensor *, int32_t> ffn_tail; // ... their tails -> layer
    bool whole_busy = false;              // a whole-expert job runs on the host thread (graph thread's)
    bool whole_ok   = true;               // ... and whether it succeeded
    std::vector<int64_t> w_dst;           // its rows of the last product: token*n_used + position
    std::vector<int32_t> w_rows;          // ... each row's token (its input row)
    std::vector<int32_t> w_ids;           // ... and expert
    std::vector<int32_t> w_slot;          // expert -> the spare slot its products read meanwhile, -1
    bool quiet = false;                   // forecache_cache_set_quiet
    // prompt banks (forecache_cache_set_bank): ubatches of at least bank_tokens tokens (0: never)
    int32_t bank_tokens = 0;
    ggml_context * bank_ctx = nullptr;    // every bank layer's spans
    std::unordered_map<const ggml_tensor *, std::pair<int32_t, int32_t>> bank_map; // span -> (layer, proj)
    bool     bank_hold  = false;          // fills write bank layers' slots: no other copies into them
    uint64_t bank_gen   = 1;              // holds so far
    uint64_t bank_ids   = 0;              // bank passes' identities handed out (fc_gctx::bank_id)
    // the running round (forecache_cache_begin_round): passes of several contexts that go through
    // each bank layer together, one fill serving them all (lock held)
    uint64_t round_id     = 0;            // its bank identity (0: none yet)
    int32_t  round_n      = 0;            // passes it was begun for
    int32_t  round_joined = 0;            // ... that joined it (or were left out: forecache_cache_end_pass)
    int32_t  round_active = 0;            // ... that joined and have not ended
    std::vector<fc_gctx *> round_members; // the contexts that joined it
    std::condition_variable cv_round;     // a member moved on or ended, a fill was issued
    bool     exclusive    = false;        // the main context computes a pass that is not a bank pass
    bool     solo_busy    = false;        // a bank pass outside any round runs
    std::mutex fill_mtx;                  // issuing a fill (not lock: a thread's fill takes lock when done)
    std::atomic<int32_t> little{0};           // forecache_cache_set_little: experts a little pass keeps
    std::atomic<bool>    little_resident{false}; // ... of those already resident, and the top-1

    // devs[0]: the device the cache was asked for; then each other device llama.cpp put a layer on
    std::vector<fc_device> devs;

    size_t   chunk_bytes = 0;
    uint64_t epoch       = 1;
    bool     reorder     = true;
    int32_t  gather_tokens  = 0; // forecache_cache_set_gather
    int32_t  gather_entries = 0;
    int32_t  in_use_layer = -1;
    bool     bad_ids_logged = false;

    forecache_gate_hook hook    = nullptr;
    void              * hook_ud = nullptr;
    bool                want_gate_input = false;

    ggml_backend_t cpu = nullptr;
    ggml_threadpool_t cpu_pool = nullptr;     // host compute's threads, kept across calls
    decltype(ggml_threadpool_free) * pool_free = nullptr;

    std::vector<uint8_t> raw;
    std::vector<int32_t> ids;
    std::vector<int32_t> slots;
    std::vector<float>   weights;
    std::vector<float>   gate_input;
    std::vector<uint8_t> seen;       // expert -> routed by the layer being routed
    std::vector<int32_t> g_rows;
    std::vector<int32_t> g_slots;
    std::vector<int32_t> g_idx;  // an expert group's indices: gathered rows, slots, destination rows
    std::vector<float>   h_in;   // host entries: the node's input, read back
    std::vector<float>   h_out;  // host entries: their rows of the result
    std::vector<int64_t> h_dst;  // host entries: destination row of each result row
    fc_host_thread       host;   // computes them

    uint64_t clock = 0; // recency stamps (lock held)

    // stage slots (forecache_cache_set_stage): device memory outside every layer's slots, lent to
    // one expert of one layer of their device at a time; a chunk or schedule entry of layer il with
    // slot n_slots + j is stage slot j, j counting over every device's (lock held)
    int32_t               n_stage   = 0;
    std::vector<int32_t>  st_dev;     // index in devs of the device holding it
    std::vector<int32_t>  st_layer;   // owner layer, -1 free
    std::vector<int32_t>  st_expert;
    std::vector<int32_t>  st_pend;    // j*FC_MAX_PROJ + p -> chunks queued or running
    std::vector<uint8_t>  st_started;
    std::vector<uint8_t>  st_in_use;  // read by the schedule being computed

    // decode gate (forecache_cache_set_decode_gate), read and written with the lock held
    int32_t             dg_n_used  = 0;
    bool                dg_preempt = true;
    std::vector<int32_t> dg_host_k;
    std::vector<double>  dg_host_s;
    std::vector<int32_t> routed;     // distinct experts of the layer being routed, first use first
    std::vector<int32_t> dg_rank;    // cache-first rank of each of them
    std::vector<int32_t> dg_order;
    std::vector<int32_t> dg_slots;
    std::vector<int32_t> dg_host;
    std::vector<int32_t> dg_victims;
    std::vector<int32_t> dg_lru;

    // gate events for the prediction thread
    std::mutex              ev_mtx;
    std::condition_variable ev_cv;
    std::deque<fc_event>    events;
    bool                    ev_on  = false;
    int32_t                 ev_cap = 0;
    int32_t                 ev_gates = 0; // gate events queued
    uint64_t                ev_dropped = 0;
    std::vector<int32_t>    tokens;

    // copy engine
    std::mutex              mtx;
    std::condition_variable cv_work;
    std::condition_variable cv_done;
    std::deque<fc_chunk>    queue[FC_N_PRIORITIES];
    int                     running = 0;       // chunks being copied, on every device
    bool                    paused  = false;
    bool                    stop    = false;
    bool                    copy_stream = false; // forecache_cache_set_copy_stream

    // disk tier readers (forecache-cache-disk.cpp), under mtx
    std::vector<int>        disk_fd;               // each of the model's files (a split model's shards)
    std::vector<int>        disk_dfd;              // the same files opened for direct I/O, -1 when refused
    std::vector<int>        disk_open_dfd;         // every descriptor opened for direct I/O (closed at the end)
    size_t                  disk_align = 4096;
    size_t                  disk_max   = 0;        // largest projection of one expert
    std::vector<std::string> disk_path;
    std::deque<std::pair<int32_t, int32_t>> rq[FC_N_PRIORITIES]; // queued reads (layer, expert)
    std::condition_variable cv_read;
    std::vector<std::thread> readers;
    ggml_context          * host_ctx = nullptr;
    ggml_backend_buffer_t   host_buf = nullptr;
    bool                    disk_failed = false;
    int32_t                 reading     = 0;       // reads in flight
    uint64_t                hclock = 0;

    // timeline (forecache_cache_set_timeline): a ring of the last tl_cap spans
    std::atomic<bool>           tl_on{false};
    std::mutex                  tl_mtx;
    std::vector<forecache_span> tl_ring;
    size_t                      tl_head = 0;    // oldest span
    size_t                      tl_n    = 0;
    uint64_t                    tl_dropped = 0;
    fc_clock::time_point        tl_t0;
};

// records a span of the timeline when one is being recorded; cheap otherwise
void fc_span_add(forecache_cache * c, int32_t kind, int32_t layer, int32_t proj, int32_t expert, int32_t slot,
        int32_t n, uint64_t bytes, fc_clock::time_point t0, fc_clock::time_point t1);
inline void fc_span(forecache_cache * c, int32_t kind, int32_t layer, int32_t proj, int32_t n,
        fc_clock::time_point t0, fc_clock::time_point t1) {
    if (c->tl_on.load(std::memory_order_relaxed)) {
        fc_span_add(c, kind, layer, proj, -1, -1, n, 0, t0, t1);
    }
}

// forecache-cache-copy.cpp: slots and the copy engine (lock held unless said)
bool fc_eligible(const forecache_cache * c, const fc_chunk & ch);
bool fc_has_eligible(const forecache_cache * c, int32_t dev = -1);
bool fc_pop(forecache_cache * c, fc_chunk & out, int32_t dev = -1);
void fc_notify_work(forecache_cache * c);
int32_t fc_stage_of(const fc_layer & L, int32_t slot);
// stage slot j's tensor of projection p on its device, and j's index in it
inline ggml_tensor * fc_stage_tensor(const forecache_cache * c, int32_t j, int32_t p, int32_t & local) {
    const fc_device & d = c->devs[c->st_dev[j]];
    local = j - d.stage_j0;
    return d.stage[p];
}
void fc_count(forecache_cache * c, const fc_chunk & ch, int32_t d);
void fc_run(forecache_cache * c, const fc_chunk & ch, std::unique_lock<std::mutex> & lock);
void fc_worker(forecache_cache * c, int32_t dev);
// a copy stream for each device whose backend has events (on: made where missing; lock held)
int32_t fc_copy_streams(forecache_cache * c, bool on);
void fc_copy_streams_free(forecache_cache * c); // the workers joined
// the chunks of projection p the schedule of layer il copies into its slots are all issued on
// its device's copy stream (lock held)
bool fc_proj_issued(const forecache_cache * c, int32_t il, int32_t p);
void fc_queue_copy(forecache_cache * c, int32_t il, int32_t expert, int32_t slot, int32_t proj,
        int32_t priority, int32_t entry, int32_t need);
void fc_empty_slot(fc_layer & L, int32_t slot);
void fc_free_stage(forecache_cache * c, int32_t j);
void fc_release_stage(forecache_cache * c, int32_t j);
void fc_release_unused_stage(forecache_cache * c, int32_t il);
int32_t fc_stage_state(const forecache_cache * c, int32_t j);
void fc_clear_schedule(forecache_cache * c, int32_t il);
void fc_map_slot(forecache_cache * c, int32_t il, int32_t expert, int32_t slot);
bool fc_assign(forecache_cache * c, int32_t il, int32_t expert, int32_t slot, int32_t priority);
bool fc_set_schedule(forecache_cache * c, int32_t il, const int32_t * experts, const int32_t * slots, int32_t n, int32_t priority);
bool fc_entry_ready(const forecache_cache * c, const fc_layer & L, int32_t i, int32_t p);
bool fc_all_ready(const forecache_cache * c, const fc_layer & L, int32_t p0, int32_t p1);

// forecache-cache-graph.cpp: the graph hook
bool fc_grouped(const fc_layer & L);
// node t (a rewritten MUL_MAT_ID) reads its slot ids from the layer's map on the device
inline bool fc_remapped(const ggml_tensor * t) {
    return t->src[2] != nullptr && t->src[2]->op == GGML_OP_RESHAPE;
}
// makes the device's map of layer il hold `want` (one blocking upload when it differs; lock held)
void fc_upload_map(forecache_cache * c, int32_t il, const std::vector<int32_t> & want);
// whether layer il is computed without a stop in this pass (forecache_cache_set_quiet; lock held)
bool fc_quiet(forecache_cache * c, int32_t il, const ggml_tensor * ids);
// every expert of layer il is in a slot whose copy is done, and no stage slot holds one (lock held)
bool fc_complete(const forecache_cache * c, int32_t il);
// computes layer il without a stop in this pass, its map holding every expert's slot (lock held)
void fc_go_quiet(forecache_cache * c, int32_t il, const ggml_tensor * ids);
ggml_tensor * fc_view(fc_device & d, int64_t ne0, int64_t ne1);
void fc_graph_hook(ggml_cgraph * graph, void * user_data);
// the bank layers of graph (a long ubatch's), for context g
void fc_bank_graph(forecache_cache * c, fc_gctx & g, ggml_cgraph * graph);

// forecache-cache-compute.cpp: expert compute outside the scheduler
// the layers of a graph whose host experts the CPU can compute whole (c->ffn, c->ffn_tail)
void fc_ffn_graph(forecache_cache * c, ggml_cgraph * graph);
// at layer il's stop (its routing decided, lock held): plans its host entries (every routed expert
// when `all`) computed whole on the CPU, the others' products reading spare slots meanwhile
// (c->w_slot); false when its graph or schedule does not allow it. fc_whole_launch (lock not
// held) reads the input back and starts the host thread.
bool fc_whole_start(forecache_cache * c, int32_t il, const ggml_tensor * mm, bool all);
void fc_whole_launch(forecache_cache * c, int32_t il);
// at the tail of a layer computed so: waits for the host thread, writes its rows into the last
// product's result on the compute stream (lock not held)
bool fc_whole_finish(forecache_cache * c, int32_t il);
// waits for a whole-expert job still running (a graph compute cancelled before its tail)
void fc_whole_wait(forecache_cache * c);
ggml_backend_t fc_cpu_backend(forecache_cache * c, int n_threads, ggml_threadpool_t & pool);
bool fc_host_compute(forecache_cache * c, fc_layer & L, int32_t proj, ggml_tensor * t);
ggml_tensor * fc_alias_2d(ggml_context * ctx, ggml_tensor * src, int64_t ne0, int64_t ne1);
bool fc_group_compute(forecache_cache * c, fc_layer & L, int32_t p, ggml_tensor * t, int32_t i0, int32_t i1, int64_t * n_rows);
bool fc_host_entries(forecache_cache * c, fc_layer & L, int32_t p, const ggml_tensor * t);
bool fc_scatter_host(forecache_cache * c, fc_layer & L, ggml_tensor * t);
bool fc_slot_compute(forecache_cache * c, fc_layer & L, int32_t p, ggml_tensor * t);

// forecache-cache-bank.cpp: slot placement and prompt banks
// places device k's slots in its slot buffer (anew), behind two regions of n_bank experts (0: none)
bool fc_place_pools(forecache_cache * c, int32_t k, int32_t n_bank, char * err, size_t err_size);
// a new graph's computation begins in context g (lock not held): its pass joins the running round
// or waits for it to end
void fc_bank_begin(forecache_cache * c, fc_gctx & g);
// bank layer il's first remap node (ask: whether to stop; !ask: its experts placed, its tables
// written, the next bank layer's fill issued, compute ordered after its own)
int fc_bank_remap(forecache_cache * c, fc_gctx & g, int32_t il, int32_t next, bool ask);
// context g's pass ended: it reads no bank region any more (lock held)
void fc_bank_end_pass(forecache_cache * c, fc_gctx & g);
// the per-device events of context g (fill events where its devices have them)
bool fc_bank_gctx_events(forecache_cache * c, fc_gctx & g);
void fc_bank_gctx_free(fc_gctx & g);
void fc_bank_free(forecache_cache * c);

// forecache-cache-disk.cpp: the disk tier (lock held unless said)
// queues a read of `expert` into a host slot at `priority`; false when it is held, in flight or queued
// at that priority or higher already
bool fc_disk_request(forecache_cache * c, int32_t il, int32_t expert, int32_t priority);
bool fc_host_ready(const fc_layer & L, int32_t expert);
bool fc_need_met(const forecache_cache * c, const fc_chunk & ch);
void fc_request_reads(forecache_cache * c);
bool fc_disk_busy(const forecache_cache * c);
void fc_disk_stop(forecache_cache * c); // lock not held
// computes rows of projection p on the CPU from host memory: for each r < n, row rows[r] of `in`
// (n_in rows of ne0 floats) through expert experts[r] into row r of `out`; a layer with a disk tier
// reads its experts into host slots first, a batch at a time (lock not held)
bool fc_host_rows(forecache_cache * c, fc_layer & L, int32_t p, const float * in, int64_t ne0,
        const int32_t * rows, const int32_t * experts, int64_t n, std::vector<float> & out, int64_t ne0_out);

// forecache-cache-route.cpp: the node hook and the gate
int32_t fc_preempt(forecache_cache * cache, int32_t layer, const std::vector<uint8_t> & wanted);
int32_t fc_slot_state(const fc_layer & L, int32_t s);
void fc_lru_slots(const fc_layer & L, const std::vector<uint8_t> * keep, std::vector<int32_t> & out);
int32_t fc_decode_gate(forecache_cache * c, int32_t il);
void fc_record_event(forecache_cache * c, int32_t il, int64_t n_tokens, int64_t n_used, const float * x, int32_t n_embd, uint64_t pass);
void fc_begin_route(forecache_cache * c, int32_t il, int64_t n_tokens);
int32_t fc_try_decode_gate(forecache_cache * c, int32_t il, int64_t n_tokens, int64_t n_used);
bool fc_read_ids(forecache_cache * c, int32_t il, const ggml_tensor * ids_t);
bool fc_little_drop(forecache_cache * c, fc_layer & L, int64_t n_used, int64_t n_tokens,
                    std::vector<uint8_t> & drop);
bool fc_little_early(forecache_cache * c, ggml_tensor * w);
bool fc_route(forecache_cache * c, int32_t il, ggml_tensor * t);
int fc_node_hook(ggml_tensor * t, bool ask, void * user_data);

// drops queued chunks matching the predicate (lock held); empties the slots whose copy lost a chunk
template <typename F>
int32_t fc_drop_queued(forecache_cache * c, int min_priority, F match) {
    std::vector<std::pair<int32_t, int32_t>> emptied;
    for (int p = std::max(min_priority, 0); p < FC_N_PRIORITIES; p++) {
        auto & q = c->queue[p];
        for (auto it = q.begin(); it != q.end();) {
            if (!match(*it)) {
                ++it;
                continue;
            }
            fc_layer & L = c->layers[it->layer];
            fc_count(c, *it, -1);
            L.stats.dropped_chunks++;
            const int32_t j = fc_stage_of(L, it->slot);
            if (j >= 0) {
                fc_free_stage(c, j); // its copy lost a chunk
            } else if (it->entry < 0 || L.expert_of[it->slot] == it->expert) {
                emptied.emplace_back(it->layer, it->slot);
            }
            it = q.erase(it);
        }
    }
    std::sort(emptied.begin(), emptied.end());
    emptied.erase(std::unique(emptied.begin(), emptied.end()), emptied.end());
    for (const auto & [il, s] : emptied) {
        fc_empty_slot(c->layers[il], s);
    }
    c->cv_done.notify_all();
    return (int32_t) emptied.size();
}

// nodes of the small graphs the hook computes itself, outside the scheduler
constexpr int FC_MINI_GRAPH_SIZE = 16;

// computes a small graph on `backend`: build(ctx) creates its tensors and returns the output (nullptr
// to give up); they are allocated by `galloc`, or in a buffer of `backend` freed afterwards when it is
// nullptr; set() writes the inputs and get(out) reads the result. Returns false if any step fails.
template <typename Build, typename Set, typename Get>
bool fc_mini_graph(ggml_backend_t backend, ggml_gallocr_t galloc, Build && build, Set && set, Get && get) {
    ggml_init_params params = {
        /*.mem_size   =*/ FC_MINI_GRAPH_SIZE*ggml_tensor_overhead() + ggml_graph_overhead_custom(FC_MINI_GRAPH_SIZE, false),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context * ctx = ggml_init(params);
    if (ctx == nullptr) {
        return false;
    }
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor * out = build(ctx);
    bool ok = out != nullptr;
    if (ok) {
        ggml_cgraph * gf = ggml_new_graph_custom(ctx, FC_MINI_GRAPH_SIZE, false);
        ggml_build_forward_expand(gf, out);
        if (galloc != nullptr) {
            ok = ggml_gallocr_alloc_graph(galloc, gf);
        } else {
            buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
            ok = buf != nullptr;
        }
        if (ok) {
            set();
            ok = ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS;
        }
        if (ok) {
            get(out);
        }
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return ok;
}

