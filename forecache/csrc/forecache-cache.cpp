// forecache expert cache: device slot pool, MUL_MAT_ID rewrite, gate hook, chunked copy engine.
// See forecache.h for the contract and forecache-testing.h for the controls tests use.

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
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using fc_clock = std::chrono::steady_clock;

double fc_seconds(fc_clock::time_point t0) {
    return std::chrono::duration<double>(fc_clock::now() - t0).count();
}

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

struct fc_event {
    forecache_event      head = {};
    std::vector<int32_t> ids;
    std::vector<float>   x;
    std::vector<int32_t> tokens;
};

struct fc_layer {
    int32_t n_expert = 0;
    int32_t n_slots  = 0;
    int32_t n_proj   = 0;
    size_t  expert_bytes = 0;

    ggml_tensor * host[FC_MAX_PROJ] = {};
    ggml_tensor * pool[FC_MAX_PROJ] = {};

    std::vector<int32_t> slot_of;     // expert -> slot, -1 if none
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
    bool     stage_ok  = false;       // its experts have the stage slots' layout
    std::vector<uint8_t> early_drop;  // positions a little pass dropped before the weights' normalization
    uint64_t             early_epoch = 0;

    forecache_cache_stats stats = {};

    // routing of the current ubatch
    uint64_t            epoch     = 0;
    uint64_t            routed_pass = 0; // epoch of the last routing, set before its gate decides
    const ggml_tensor * ids_src   = nullptr;
    bool                host_mode = false;
};

// "blk.<il>.<name>_exps.weight" -> il, or -1
int fc_expert_layer(const std::string & name) {
    int il = -1;
    int n  = 0;
    if (sscanf(name.c_str(), "blk.%d.%n", &il, &n) != 1 || n == 0) {
        return -1;
    }
    const std::string suffix = "_exps.weight";
    if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
        return -1;
    }
    return il;
}

// how the router weights a MUL_MAT_ID's ids were read with reach the expert outputs, which decides
// how a little pass drops an expert: weight 0 where they multiply the outputs as they are (qwen2moe,
// olmoe) or are first divided by their sum (the kept ones are renormalized: mixtral, qwen3moe,
// deepseek2), -inf where a softmax over them comes first (gpt-oss)
enum fc_weights_use { FC_WEIGHTS_UNKNOWN, FC_WEIGHTS_DIRECT, FC_WEIGHTS_NORMALIZED, FC_WEIGHTS_SOFTMAXED };

// the tensor t views (through reshapes, views, permutes), or t itself
const ggml_tensor * fc_viewed(const ggml_tensor * t) {
    while (t != nullptr && (t->op == GGML_OP_RESHAPE || t->op == GGML_OP_VIEW ||
                            t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE)) {
        t = t->src[0];
    }
    return t;
}

} // namespace

struct forecache_cache {
    llama_context      * lctx  = nullptr;
    ggml_backend_sched_t sched = nullptr;

    std::vector<fc_layer> layers;
    std::unordered_map<const ggml_tensor *, std::pair<int32_t, int32_t>> host_map; // expert tensor -> (layer, proj)
    std::unordered_map<const ggml_tensor *, std::pair<int32_t, int32_t>> pool_map; // pool tensor   -> (layer, proj)
    std::unordered_map<const ggml_tensor *, ggml_tensor *>               weights_of; // routed ids -> router weights
    std::unordered_map<const ggml_tensor *, fc_weights_use>              weights_use; // router weights -> how they reach the expert outputs
    std::unordered_map<const ggml_tensor *, ggml_tensor *>               little_before; // node -> router weights a little pass drops in before it
    std::unordered_map<const ggml_tensor *, int32_t>                     layer_of_ids; // routed ids -> layer
    std::atomic<int32_t> little{0};           // forecache_cache_set_little: experts a little pass keeps
    std::atomic<bool>    little_resident{false}; // ... of those already resident, and the top-1

    ggml_context        * pool_ctx = nullptr;
    ggml_backend_buffer_t pool_buf = nullptr;
    ggml_tensor         * slot_ids = nullptr; // storage shared by all layers: one layer routes at a time

    ggml_context * view_ctx = nullptr;
    std::map<std::pair<int64_t, int64_t>, ggml_tensor *> views;

    size_t   chunk_bytes = 0;
    uint64_t epoch       = 1;
    bool     reorder     = true;
    int32_t  in_use_layer = -1;
    bool     bad_ids_logged = false;

    forecache_gate_hook hook    = nullptr;
    void              * hook_ud = nullptr;
    bool                want_gate_input = false;

    ggml_backend_t cpu = nullptr;
    ggml_threadpool_t cpu_pool = nullptr;     // host compute's threads, kept across calls
    ggml_backend_t dev_cpu = nullptr;         // CPU build: the group compute's own CPU backend
    ggml_threadpool_t dev_cpu_pool = nullptr;
    decltype(ggml_threadpool_free) * pool_free = nullptr;
    ggml_backend_t dev_backend = nullptr; // the scheduler's backend of the pool's device
    ggml_gallocr_t group_alloc = nullptr; // scratch of expert-group compute

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
    // one expert of one layer at a time; a chunk or schedule entry of layer il with slot
    // n_slots + j is stage slot j (lock held)
    int32_t               n_stage   = 0;
    ggml_context        * stage_ctx = nullptr;
    ggml_backend_buffer_t stage_buf = nullptr;
    ggml_tensor         * stage[FC_MAX_PROJ] = {};
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
    int                     running = 0;
    bool                    paused  = false;
    bool                    stop    = false;
    fc_clock::time_point    low_start; // when the last lower-priority chunk started
    fc_clock::time_point    low_end;   // and finished
    std::thread             worker;
};

namespace {

// a CPU backend with n_threads and its own pool of threads, kept across graph computes and not
// polling while idle (its computes are small and share the cores with the model's own threads)
ggml_backend_t fc_cpu_backend(forecache_cache * c, int n_threads, ggml_threadpool_t & pool) {
    ggml_backend_t be = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (be == nullptr) {
        return nullptr;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(be));
    auto set_n_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (set_n_threads) {
        set_n_threads(be, n_threads);
    }
    auto tp_new = (decltype(ggml_threadpool_new) *) ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new");
    auto tp_set = (decltype(ggml_backend_cpu_set_threadpool) *) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_set_threadpool");
    c->pool_free = (decltype(ggml_threadpool_free) *) ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_free");
    if (tp_new && tp_set && c->pool_free) {
        ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
        tpp.poll = 0;
        pool = tp_new(&tpp);
        if (pool != nullptr) {
            tp_set(be, pool);
        }
    }
    return be;
}

bool fc_eligible(const forecache_cache * c, const fc_chunk & ch) {
    if (ch.need <= 0) {
        return true;
    }
    const fc_layer & L = c->layers[ch.layer];
    return L.consumed[ch.slot*L.n_proj + ch.proj] >= ch.need;
}

bool fc_has_eligible(const forecache_cache * c) {
    for (const auto & q : c->queue) {
        for (const auto & ch : q) {
            if (fc_eligible(c, ch)) {
                return true;
            }
        }
    }
    return false;
}

// removes and returns the first eligible chunk in priority order (lock held)
bool fc_pop(forecache_cache * c, fc_chunk & out) {
    for (auto & q : c->queue) {
        for (auto it = q.begin(); it != q.end(); ++it) {
            if (fc_eligible(c, *it)) {
                out = *it;
                q.erase(it);
                return true;
            }
        }
    }
    return false;
}

// stage slot a chunk or schedule entry of L writes or reads, or -1 for a slot of L
int32_t fc_stage_of(const fc_layer & L, int32_t slot) {
    return slot >= L.n_slots ? slot - L.n_slots : -1;
}

// adjusts the in-flight counters of the projections a chunk writes (lock held)
void fc_count(forecache_cache * c, const fc_chunk & ch, int32_t d) {
    fc_layer & L = c->layers[ch.layer];
    const int32_t p0 = ch.proj < 0 ? 0 : ch.proj;
    const int32_t p1 = ch.proj < 0 ? L.n_proj : ch.proj + 1;
    const int32_t j  = fc_stage_of(L, ch.slot);
    if (j >= 0) {
        for (int32_t p = p0; p < p1; p++) {
            c->st_pend[j*FC_MAX_PROJ + p] += d;
        }
        return;
    }
    for (int32_t p = p0; p < p1; p++) {
        if (ch.entry < 0) {
            L.pend_proj[ch.slot*L.n_proj + p] += d;
        } else {
            L.entry_pend[ch.entry*L.n_proj + p] += d;
        }
    }
    if (ch.entry < 0) {
        L.pending[ch.slot] += d;
    }
}

// copies one chunk; called with the lock held, releases it during the copy
void fc_run(forecache_cache * c, const fc_chunk & ch, std::unique_lock<std::mutex> & lock) {
    fc_layer & L = c->layers[ch.layer];
    const int32_t j = fc_stage_of(L, ch.slot);
    if (j >= 0) {
        c->st_started[j] = 1;
    } else if (ch.entry < 0) {
        L.started[ch.slot] = 1;
    }
    if (ch.first && ch.priority == 0) {
        const double w = fc_seconds(ch.queued_at);
        L.stats.hi_wait_s    += w;
        L.stats.hi_wait_max_s = std::max(L.stats.hi_wait_max_s, w);
        // the part of the wait spent behind the last lower-priority chunk copying (a chunk
        // that waited for its slot to be consumed may see lower ones start after it was queued)
        const double b = std::chrono::duration<double>(c->low_end - std::max(ch.queued_at, c->low_start)).count();
        if (b > 0) {
            L.stats.hi_block_s    += b;
            L.stats.hi_block_max_s = std::max(L.stats.hi_block_max_s, b);
        }
    }
    c->running++;
    lock.unlock();

    const auto t0 = fc_clock::now();
    const int32_t p0 = ch.proj < 0 ? 0 : ch.proj;
    const int32_t p1 = ch.proj < 0 ? L.n_proj : ch.proj + 1;
    size_t bytes = 0;
    for (int32_t p = p0; p < p1; p++) {
        const ggml_tensor * src = L.host[p];
        ggml_tensor * dst = j >= 0 ? c->stage[p] : L.pool[p];
        const size_t size = ch.proj < 0 ? src->nb[2] : ch.size;
        ggml_backend_tensor_set(dst, (const uint8_t *) src->data + ch.expert*src->nb[2] + ch.offset,
                (j >= 0 ? j : ch.slot)*dst->nb[2] + ch.offset, size);
        bytes += size;
    }
    const auto   t1 = fc_clock::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();

    lock.lock();
    if (ch.priority > 0) {
        c->low_start = t0;
        c->low_end   = t1;
    }
    c->running--;
    fc_count(c, ch, -1);
    L.stats.h2d_bytes  += bytes;
    L.stats.n_chunks   += 1;
    L.stats.copy_s     += dt;
    L.stats.chunk_max_s = std::max(L.stats.chunk_max_s, dt);
    c->cv_done.notify_all();
}

void fc_worker(forecache_cache * c) {
    std::unique_lock<std::mutex> lock(c->mtx);
    while (true) {
        c->cv_work.wait(lock, [c] { return c->stop || (!c->paused && fc_has_eligible(c)); });
        if (c->stop) {
            return;
        }
        fc_chunk ch;
        if (fc_pop(c, ch)) {
            fc_run(c, ch, lock);
        }
    }
}

// queues the copy of `expert` into `slot`: projection `proj` (-1: all) in chunks (lock held)
void fc_queue_copy(forecache_cache * c, int32_t il, int32_t expert, int32_t slot, int32_t proj,
        int32_t priority, int32_t entry, int32_t need) {
    fc_layer & L = c->layers[il];
    const auto now = fc_clock::now();
    bool first = true;
    if (proj < 0 && c->chunk_bytes == FORECACHE_CHUNK_EXPERT) {
        fc_chunk ch = {il, slot, -1, expert, priority, entry, need, true, 0, 0, now};
        fc_count(c, ch, +1);
        c->queue[priority].push_back(ch);
    } else {
        for (int32_t p = proj < 0 ? 0 : proj; p < (proj < 0 ? L.n_proj : proj + 1); p++) {
            const size_t nb = L.host[p]->nb[2];
            const size_t step = c->chunk_bytes == FORECACHE_CHUNK_PROJECTION || c->chunk_bytes == FORECACHE_CHUNK_EXPERT ? nb : c->chunk_bytes;
            for (size_t off = 0; off < nb; off += step) {
                fc_chunk ch = {il, slot, p, expert, priority, entry, need, first, off, std::min(step, nb - off), now};
                fc_count(c, ch, +1);
                c->queue[priority].push_back(ch);
                first = false;
            }
        }
    }
    if (priority == 0) {
        L.stats.hi_tasks++;
    }
    c->cv_work.notify_one();
}

void fc_empty_slot(fc_layer & L, int32_t slot) {
    const int32_t e = L.expert_of[slot];
    if (e >= 0) {
        L.slot_of[e] = -1;
    }
    L.expert_of[slot] = -1;
    L.last_entry[slot] = -1;
}

// stage slot j is free (lock held)
void fc_free_stage(forecache_cache * c, int32_t j) {
    c->st_layer[j]  = -1;
    c->st_in_use[j] = 0;
}

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

// stage slot j is free again, its queued chunks dropped (lock held)
void fc_release_stage(forecache_cache * c, int32_t j) {
    const int32_t il = c->st_layer[j];
    if (il < 0) {
        return;
    }
    const int32_t slot = c->layers[il].n_slots + j;
    fc_drop_queued(c, 0, [&](const fc_chunk & ch) { return ch.layer == il && ch.slot == slot; });
    fc_free_stage(c, j);
}

// stage slots lent to layer il that its schedule does not read go back (lock held)
void fc_release_unused_stage(forecache_cache * c, int32_t il) {
    for (int32_t j = 0; j < c->n_stage; j++) {
        if (c->st_layer[j] == il && !c->st_in_use[j]) {
            fc_release_stage(c, j);
        }
    }
}

// enum forecache_slot_state of stage slot j (lock held)
int32_t fc_stage_state(const forecache_cache * c, int32_t j) {
    if (c->st_layer[j] < 0) {
        return FORECACHE_SLOT_EMPTY;
    }
    int32_t left = 0;
    for (int32_t p = 0; p < FC_MAX_PROJ; p++) {
        left += c->st_pend[j*FC_MAX_PROJ + p];
    }
    return left == 0 ? FORECACHE_SLOT_READY : c->st_started[j] ? FORECACHE_SLOT_COPYING : FORECACHE_SLOT_QUEUED;
}

// forgets the schedule of layer il, dropping streamed copies that were never needed (lock held)
void fc_clear_schedule(forecache_cache * c, int32_t il) {
    fc_layer & L = c->layers[il];
    if (L.streams) {
        fc_drop_queued(c, 0, [&](const fc_chunk & ch) { return ch.layer == il && ch.entry >= 0; });
    }
    std::fill(L.last_entry.begin(), L.last_entry.end(), -1);
    for (int32_t e : L.sch_e) {
        L.entry_of[e] = -1;
    }
    for (int32_t j = 0; j < c->n_stage; j++) {
        if (c->st_layer[j] == il) {
            c->st_in_use[j] = 0;
        }
    }
    L.staged = false;
    L.sch_e.clear();
    L.sch_s.clear();
    L.sch_first.clear();
    L.sch_epoch = 0;
    L.streams   = false;
    L.n_dev     = 0;
}

// maps expert to slot, emptying the slot and the expert's previous slot and dropping their queued
// copies (lock held); the copy itself is queued by the caller
void fc_map_slot(forecache_cache * c, int32_t il, int32_t expert, int32_t slot) {
    fc_layer & L = c->layers[il];
    const int32_t prev = L.slot_of[expert];
    for (int32_t s : {slot, prev}) {
        if (s >= 0) {
            fc_drop_queued(c, 0, [&](const fc_chunk & ch) { return ch.layer == il && ch.slot == s; });
            fc_empty_slot(L, s);
        }
    }
    L.expert_of[slot] = expert;
    L.slot_of[expert] = slot;
    L.started[slot]   = 0;
}

// puts expert into slot as a plain load (lock held); false if a slot involved is in use
bool fc_assign(forecache_cache * c, int32_t il, int32_t expert, int32_t slot, int32_t priority) {
    fc_layer & L = c->layers[il];
    if (L.expert_of[slot] == expert) {
        return true;
    }
    const int32_t prev = L.slot_of[expert];
    if (L.in_use[slot] || (prev >= 0 && L.in_use[prev])) {
        L.stats.refused_loads++;
        return false;
    }
    fc_map_slot(c, il, expert, slot);
    fc_queue_copy(c, il, expert, slot, -1, priority, -1, 0);
    L.stamp[slot] = ++c->clock;
    return true;
}

// sets the schedule of layer il for the current epoch (lock held); false for an invalid schedule
bool fc_set_schedule(forecache_cache * c, int32_t il, const int32_t * experts, const int32_t * slots, int32_t n, int32_t priority) {
    fc_layer & L = c->layers[il];
    if (n <= 0 || n > L.n_expert || L.n_slots == 0) {
        return false;
    }
    fc_clear_schedule(c, il);
    int32_t n_dev = n;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = experts[i];
        const int32_t s = slots[i];
        if (s < 0 && n_dev == n) {
            n_dev = i; // host entries from here on
        }
        const int32_t j = i < n_dev ? fc_stage_of(L, s) : -1;
        const bool staged = j >= 0 && j < c->n_stage && c->st_layer[j] == il && c->st_expert[j] == e;
        const bool bad_slot = i < n_dev ? s >= L.n_slots && !staged : s != -1;
        if (e < 0 || e >= L.n_expert || bad_slot || L.entry_of[e] >= 0 || (s < 0 && c->group_alloc == nullptr)) {
            for (int32_t k = 0; k < i; k++) {
                L.entry_of[experts[k]] = -1;
            }
            return false;
        }
        L.entry_of[e] = i;
    }
    const int32_t np = L.n_proj;
    L.sch_e.assign(experts, experts + n);
    L.sch_s.assign(slots, slots + n);
    L.sch_first.assign(n, 0);
    L.n_dev = n_dev;
    L.stats.host_entries += n - n_dev;
    n = n_dev; // only slot entries copy, stream and hold slots
    L.entry_pend.assign((size_t) n*np, 0);
    L.consumed.assign((size_t) L.n_slots*np, 0);
    std::fill(L.in_use.begin(), L.in_use.end(), 0);

    std::vector<int32_t> uses(L.n_slots, 0);
    std::vector<int32_t> need(n, 0);
    std::vector<uint8_t> copy(n, 0);
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = L.sch_s[i];
        const int32_t j = fc_stage_of(L, s);
        if (j >= 0) {
            // read from the stage slot its expert was staged into: nothing to copy
            L.sch_first[i]  = 1;
            L.staged        = true;
            c->st_in_use[j] = 1;
            L.stats.stage_used++;
            continue;
        }
        need[i] = uses[s]++;
        if (need[i] == 0) {
            L.sch_first[i] = 1;
            copy[i] = L.expert_of[s] != L.sch_e[i];
        } else {
            L.streams = true;
            copy[i] = 1;
            L.stats.streamed++;
        }
    }
    fc_release_unused_stage(c, il); // stage slots the schedule does not read go back
    // first uses become plain loads; in_use is still clear, so nothing is refused
    for (int32_t i = 0; i < n; i++) {
        if (L.sch_first[i] && copy[i]) {
            fc_map_slot(c, il, L.sch_e[i], L.sch_s[i]);
        }
    }
    // copies in compute order, projection by projection (the order the MUL_MAT_IDs consume them)
    const bool whole = c->chunk_bytes == FORECACHE_CHUNK_EXPERT;
    for (int32_t p = 0; p < (whole ? 1 : np); p++) {
        for (int32_t i = 0; i < n; i++) {
            if (!copy[i]) {
                continue;
            }
            if (L.sch_first[i]) {
                fc_queue_copy(c, il, L.sch_e[i], L.sch_s[i], whole ? -1 : p, priority, -1, 0);
            }
        }
        for (int32_t i = 0; i < n; i++) {
            if (copy[i] && !L.sch_first[i]) {
                for (int32_t q = whole ? 0 : p; q < (whole ? np : p + 1); q++) {
                    fc_queue_copy(c, il, L.sch_e[i], L.sch_s[i], q, priority, i, need[i]);
                }
            }
        }
    }
    // the slot table describes the end of the layer: the last entry of each slot holds it
    for (int32_t i = 0; i < n; i++) {
        if (L.sch_s[i] >= L.n_slots) {
            continue;
        }
        if (!L.sch_first[i]) {
            const int32_t s = L.sch_s[i];
            const int32_t old = L.expert_of[s];
            if (old >= 0 && L.slot_of[old] == s) {
                L.slot_of[old] = -1;
            }
            L.expert_of[s] = L.sch_e[i];
            L.slot_of[L.sch_e[i]] = s;
            L.last_entry[s] = i;
        }
        L.in_use[L.sch_s[i]] = 1;
        L.stamp[L.sch_s[i]] = ++c->clock; // a slot's last entry leaves the latest stamp
    }
    L.sch_epoch = c->epoch;
    c->in_use_layer = il;
    return true;
}

// entry i of the schedule can be computed for projection p (lock held)
bool fc_entry_ready(const forecache_cache * c, const fc_layer & L, int32_t i, int32_t p) {
    const int32_t j = fc_stage_of(L, L.sch_s[i]);
    if (j >= 0) {
        return c->st_pend[j*FC_MAX_PROJ + p] == 0;
    }
    if (L.sch_first[i]) {
        return L.pend_proj[L.sch_s[i]*L.n_proj + p] == 0;
    }
    return L.entry_pend[i*L.n_proj + p] == 0;
}

bool fc_all_ready(const forecache_cache * c, const fc_layer & L, int32_t p0, int32_t p1) {
    for (int32_t i = 0; i < L.n_dev; i++) {
        for (int32_t p = p0; p < p1; p++) {
            if (!fc_entry_ready(c, L, i, p)) {
                return false;
            }
        }
    }
    return true;
}

// the layer is computed group by group (streamed, split between slots and host, reading stage slots,
// or routed by a little pass, whose repeated top-1 ids a gathered group computes as separate rows),
// not as rewritten
bool fc_grouped(const fc_layer & L) {
    return L.streams || L.staged || L.little || L.n_dev < (int32_t) L.sch_e.size();
}

ggml_tensor * fc_view(forecache_cache * c, int64_t ne0, int64_t ne1) {
    const auto key = std::make_pair(ne0, ne1);
    auto it = c->views.find(key);
    if (it != c->views.end()) {
        return it->second;
    }
    if (ggml_get_mem_size(c->view_ctx) - ggml_used_mem(c->view_ctx) < ggml_tensor_overhead()) {
        return nullptr;
    }
    ggml_tensor * v = ggml_view_2d(c->view_ctx, c->slot_ids, ne0, ne1, ne0*sizeof(int32_t), 0);
    ggml_format_name(v, "fc.slot_ids.%lldx%lld", (long long) ne0, (long long) ne1);
    if (ggml_backend_view_init(v) != GGML_STATUS_SUCCESS) {
        return nullptr;
    }
    c->views[key] = v;
    return v;
}

// rewrites every MUL_MAT_ID that reads a cached expert tensor to read the layer's slot pool
void fc_graph_hook(ggml_cgraph * graph, void * user_data) {
    auto * c = (forecache_cache *) user_data;
    std::unordered_map<const ggml_tensor *, int> first_use; // routed ids -> first node index

    c->layer_of_ids.clear();
    const int n_nodes = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n_nodes; i++) {
        ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op != GGML_OP_MUL_MAT_ID) {
            continue;
        }
        auto pit = c->pool_map.find(node->src[0]);
        if (pit != c->pool_map.end()) {
            first_use.emplace(node->src[3], i); // rewritten already
            c->layer_of_ids[node->src[3]] = pit->second.first;
            continue;
        }
        auto it = c->host_map.find(node->src[0]);
        if (it == c->host_map.end()) {
            continue;
        }
        const fc_layer & L = c->layers[it->second.first];
        if (L.n_slots == 0 || node->src[3] != nullptr) {
            continue;
        }
        ggml_tensor * ids = node->src[2];
        if (ids->ne[0]*ids->ne[1] > ggml_nelements(c->slot_ids)) {
            continue;
        }
        ggml_tensor * view = fc_view(c, ids->ne[0], ids->ne[1]);
        if (view == nullptr) {
            continue;
        }
        node->src[3] = ids; // keeps the routed ids alive until the matmul and tells the hook where they are
        node->src[2] = view;
        node->src[0] = L.pool[it->second.second];
        first_use.emplace(ids, i);
        c->layer_of_ids[ids] = it->second.first;
    }

    // the router weights of each routed layer (the F32 rows its ids select before its matmul),
    // how they reach the expert outputs, and where a little pass that must drop experts before
    // a normalization does so: before the first node reading them (after them in graph order)
    c->weights_of.clear();
    c->weights_use.clear();
    c->little_before.clear();
    std::unordered_map<const ggml_tensor *, ggml_tensor *> first_reader;
    for (int i = 0; i < n_nodes; i++) {
        ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op == GGML_OP_GET_ROWS && node->type == GGML_TYPE_F32) {
            auto it = first_use.find(node->src[1]);
            if (it != first_use.end() && i < it->second && ggml_is_contiguous(node)) {
                c->weights_of[node->src[1]] = node;
                c->weights_use[node] = FC_WEIGHTS_UNKNOWN;
                continue;
            }
        }
        if (c->weights_use.empty() || node->op == GGML_OP_RESHAPE || node->op == GGML_OP_VIEW ||
                node->op == GGML_OP_PERMUTE || node->op == GGML_OP_TRANSPOSE) {
            continue;
        }
        for (int j = 0; j < GGML_MAX_SRC && node->src[j] != nullptr; j++) {
            auto it = c->weights_use.find(fc_viewed(node->src[j]));
            if (it == c->weights_use.end()) {
                continue;
            }
            first_reader.emplace(it->first, node);
            if (it->second != FC_WEIGHTS_UNKNOWN) {
                continue;
            }
            if (node->op == GGML_OP_MUL && j == 1 && node->src[1] == it->first) {
                it->second = FC_WEIGHTS_DIRECT;
            } else if (node->op == GGML_OP_DIV && j == 0) {
                it->second = FC_WEIGHTS_NORMALIZED;
            } else if (node->op == GGML_OP_SOFT_MAX && j == 0) {
                it->second = FC_WEIGHTS_SOFTMAXED;
            }
        }
    }
    for (const auto & [ids, w] : c->weights_of) {
        const fc_weights_use use = c->weights_use.at(w);
        if (use != FC_WEIGHTS_NORMALIZED && use != FC_WEIGHTS_SOFTMAXED) {
            continue;
        }
        c->little_before[first_reader.at(w)] = w;
        // consumed before the experts: kept allocated until the layer's first matmul, where the
        // hook reads them back (where they multiply the outputs as they are, that product keeps
        // them: adding a use would also stop a backend fusing the routing's ops)
        ggml_tensor * mm = ggml_graph_node(graph, first_use.at(ids));
        if (mm->src[4] == nullptr) {
            mm->src[4] = w;
        }
    }
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

// computes node t (a rewritten MUL_MAT_ID) on the CPU from the host copy of the experts
bool fc_host_compute(forecache_cache * c, fc_layer & L, int32_t proj, ggml_tensor * t) {
    ggml_tensor * b = t->src[1];
    if (b->type != GGML_TYPE_F32 || !ggml_is_contiguous(b) || !ggml_is_contiguous(t)) {
        LLAMA_LOG_ERROR("%s: unsupported expert input layout for %s\n", __func__, t->name);
        return false;
    }
    const auto t0 = fc_clock::now();
    const int64_t n_used   = t->src[3]->ne[0];
    const int64_t n_tokens = t->src[3]->ne[1];

    ggml_tensor * x   = nullptr;
    ggml_tensor * ids = nullptr;
    const bool ok = fc_mini_graph(c->cpu, nullptr,
        [&](ggml_context * ctx) {
            x   = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, b->ne);
            ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_tokens);
            ggml_tensor * out = ggml_mul_mat_id(ctx, L.host[proj], x, ids);
            return ggml_nbytes(out) == ggml_nbytes(t) ? out : nullptr;
        },
        [&] {
            ggml_backend_tensor_get(b, x->data, 0, ggml_nbytes(b));
            memcpy(ids->data, c->ids.data(), ggml_nbytes(ids));
        },
        [&](ggml_tensor * out) {
            ggml_backend_tensor_set(t, out->data, 0, ggml_nbytes(out));
        });
    L.stats.host_s += fc_seconds(t0);
    return ok;
}

// a new 2D tensor over the memory of contiguous tensor src
ggml_tensor * fc_alias_2d(ggml_context * ctx, ggml_tensor * src, int64_t ne0, int64_t ne1) {
    ggml_tensor * a = ggml_new_tensor_2d(ctx, src->type, ne0, ne1);
    a->data   = src->data;
    a->buffer = src->buffer != nullptr ? src->buffer : src->view_src->buffer;
    return a;
}

// computes the rows of node t (projection p) that schedule entries [i0, i1) route to, on the pool's
// device: gathers their inputs, runs MUL_MAT_ID over the slots (or the stage slots, when the entries
// read those) and scatters the results into t
bool fc_group_compute(forecache_cache * c, fc_layer & L, int32_t p, ggml_tensor * t, int32_t i0, int32_t i1) {
    const bool stage = fc_stage_of(L, L.sch_s[i0]) >= 0;
    ggml_tensor * as = stage ? c->stage[p] : L.pool[p];
    const int32_t base = stage ? L.n_slots : 0;
    ggml_tensor * b = t->src[1];
    const int64_t n_used   = t->src[3]->ne[0];
    const int64_t n_tokens = t->src[3]->ne[1];
    const int64_t b_rows   = b->ne[1]; // 1 when every expert of a token reads the same input row

    c->g_rows.clear();
    c->g_slots.clear();
    c->g_idx.clear();
    for (int64_t it = 0; it < n_tokens; it++) {
        for (int64_t iu = 0; iu < n_used; iu++) {
            const int32_t k = L.entry_of[c->ids[it*n_used + iu]];
            if (k >= i0 && k < i1) {
                c->g_rows.push_back((int32_t) (it*b_rows + (b_rows == 1 ? 0 : iu)));
                c->g_slots.push_back(L.sch_s[k] - base);
                c->g_idx.push_back((int32_t) (it*n_used + iu));
            }
        }
    }
    const int64_t n = (int64_t) c->g_rows.size();
    if (n == 0) {
        return true;
    }
    // rows, slots and destinations in one tensor: one upload (each is a synchronous copy on a GPU)
    c->g_rows.insert(c->g_rows.end(), c->g_slots.begin(), c->g_slots.end());
    c->g_rows.insert(c->g_rows.end(), c->g_idx.begin(), c->g_idx.end());

    ggml_tensor * idx = nullptr;
    const bool ok = fc_mini_graph(c->dev_backend, c->group_alloc,
        [&](ggml_context * ctx) {
            // b and t as leaves over the same memory: views would pull the whole model graph into this one
            ggml_tensor * b2 = fc_alias_2d(ctx, b, b->ne[0], b->ne[1]*b->ne[2]);
            ggml_tensor * t2 = fc_alias_2d(ctx, t, t->ne[0], n_used*n_tokens);
            idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 3*n);
            ggml_tensor * rows = ggml_view_1d(ctx, idx, n, 0);
            ggml_tensor * sl   = ggml_view_2d(ctx, idx, 1, n, sizeof(int32_t), n*sizeof(int32_t));
            ggml_tensor * dst  = ggml_view_1d(ctx, idx, n, 2*n*sizeof(int32_t));
            ggml_tensor * x = ggml_get_rows(ctx, b2, rows);
            ggml_tensor * y = ggml_mul_mat_id(ctx, as, ggml_reshape_3d(ctx, x, b->ne[0], 1, n), sl);
            return ggml_set_rows(ctx, t2, ggml_reshape_2d(ctx, y, t->ne[0], n), dst);
        },
        [&] {
            ggml_backend_tensor_set(idx, c->g_rows.data(), 0, ggml_nbytes(idx));
        },
        [](ggml_tensor *) {});
    if (!ok) {
        LLAMA_LOG_ERROR("%s: expert group compute failed for %s\n", __func__, t->name);
    }
    return ok;
}

// computes, on the CPU from host memory, the rows of projection p that the host entries of the schedule
// route to (b: the node's input, read back into c->h_in); results go to c->h_out, rows c->h_dst of t
bool fc_host_entries(forecache_cache * c, fc_layer & L, int32_t p, const ggml_tensor * t) {
    const auto t0 = fc_clock::now();
    const ggml_tensor * b = t->src[1];
    const int64_t n_used   = t->src[3]->ne[0];
    const int64_t n_tokens = t->src[3]->ne[1];
    const int64_t b_rows   = b->ne[1];
    std::vector<int32_t> rows;
    std::vector<int32_t> experts;
    c->h_dst.clear();
    for (int64_t it = 0; it < n_tokens; it++) {
        for (int64_t iu = 0; iu < n_used; iu++) {
            const int32_t e = c->ids[it*n_used + iu];
            if (L.entry_of[e] >= L.n_dev) {
                rows.push_back((int32_t) (it*b_rows + (b_rows == 1 ? 0 : iu)));
                experts.push_back(e);
                c->h_dst.push_back(it*n_used + iu);
            }
        }
    }
    const int64_t n = (int64_t) rows.size();
    ggml_tensor * x   = nullptr;
    ggml_tensor * ids = nullptr;
    const bool ok = fc_mini_graph(c->cpu, nullptr,
        [&](ggml_context * ctx) {
            x   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, b->ne[0], 1, n);
            ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n);
            ggml_tensor * out = ggml_mul_mat_id(ctx, L.host[p], x, ids);
            return out->ne[0] == t->ne[0] ? out : nullptr;
        },
        [&] {
            for (int64_t r = 0; r < n; r++) {
                memcpy((float *) x->data + r*b->ne[0], c->h_in.data() + rows[r]*b->ne[0], b->ne[0]*sizeof(float));
            }
            memcpy(ids->data, experts.data(), n*sizeof(int32_t));
        },
        [&](ggml_tensor * out) {
            c->h_out.resize(ggml_nelements(out));
            memcpy(c->h_out.data(), out->data, ggml_nbytes(out));
        });
    std::lock_guard<std::mutex> lock(c->mtx);
    L.stats.host_s += fc_seconds(t0);
    return ok;
}

// writes the host entries' result rows (c->h_out) into node t, on the pool's device
bool fc_scatter_host(forecache_cache * c, ggml_tensor * t) {
    const int64_t n = (int64_t) c->h_dst.size();
    const int64_t n_rows = t->src[3]->ne[0]*t->src[3]->ne[1];
    ggml_tensor * y   = nullptr;
    ggml_tensor * dst = nullptr;
    return fc_mini_graph(c->dev_backend, c->group_alloc,
        [&](ggml_context * ctx) {
            ggml_tensor * t2 = fc_alias_2d(ctx, t, t->ne[0], n_rows);
            y   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, t->ne[0], n);
            dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
            return ggml_set_rows(ctx, t2, y, dst);
        },
        [&] {
            ggml_backend_tensor_set(y,   c->h_out.data(), 0, ggml_nbytes(y));
            ggml_backend_tensor_set(dst, c->h_dst.data(), 0, ggml_nbytes(dst));
        },
        [](ggml_tensor *) {});
}

// computes node t (projection p of the routed layer) from slots, group by group in schedule order:
// each group is every entry whose projection is in place when the previous group is done. Host
// entries are computed meanwhile on a CPU thread and written into t at the end.
bool fc_slot_compute(forecache_cache * c, fc_layer & L, int32_t p, ggml_tensor * t) {
    const int32_t n = L.n_dev;
    const bool split = n < (int32_t) L.sch_e.size();
    bool host_ok = true;
    if (split) {
        c->h_in.resize(ggml_nelements(t->src[1]));
        ggml_backend_tensor_get(t->src[1], c->h_in.data(), 0, ggml_nbytes(t->src[1]));
        c->host.run([&] { host_ok = fc_host_entries(c, L, p, t); });
    }
    bool ok = true;
    int32_t i = 0;
    while (i < n) {
        std::unique_lock<std::mutex> lock(c->mtx);
        if (!fc_entry_ready(c, L, i, p)) {
            const auto t0 = fc_clock::now();
            c->cv_done.wait(lock, [&] { return fc_entry_ready(c, L, i, p); });
            L.stats.stall_s += fc_seconds(t0);
        }
        // a group reads the layer's slots or the stage slots, not both
        const bool stage = L.sch_s[i] >= L.n_slots;
        int32_t j = i + 1;
        while (j < n && fc_entry_ready(c, L, j, p) && (L.sch_s[j] >= L.n_slots) == stage) {
            j++;
        }
        lock.unlock();
        if (!fc_group_compute(c, L, p, t, i, j)) {
            ok = false;
            break;
        }
        lock.lock();
        for (int32_t k = i; k < j && !stage; k++) {
            L.consumed[L.sch_s[k]*L.n_proj + p]++;
        }
        L.stats.n_groups++;
        lock.unlock();
        c->cv_work.notify_one();
        i = j;
    }
    if (split) {
        c->host.wait();
        ok = ok && host_ok && fc_scatter_host(c, t);
        if (!host_ok) {
            LLAMA_LOG_ERROR("%s: host expert compute failed for %s\n", __func__, t->name);
        }
    }
    return ok;
}

// early preemption (forecache_cache_preempt) with the lock held; `wanted`: one flag per expert
int32_t fc_preempt(forecache_cache * cache, int32_t layer, const std::vector<uint8_t> & wanted) {
    fc_layer & L = cache->layers[layer];
    // wanted copies move to the front priority in their order; the others are dropped
    for (int p = 1; p < FC_N_PRIORITIES; p++) {
        auto & q = cache->queue[p];
        for (auto it = q.begin(); it != q.end();) {
            if (it->layer == layer && it->entry < 0 && wanted[it->expert]) {
                fc_chunk ch = *it;
                if (ch.first) {
                    ch.queued_at = fc_clock::now();
                    L.stats.hi_tasks++;
                }
                ch.priority = 0;
                cache->queue[0].push_back(ch);
                it = q.erase(it);
            } else {
                ++it;
            }
        }
    }
    return fc_drop_queued(cache, 1, [&](const fc_chunk & ch) { return ch.layer == layer && ch.entry < 0; });
}

// enum forecache_slot_state of slot s (lock held)
int32_t fc_slot_state(const fc_layer & L, int32_t s) {
    if (L.expert_of[s] < 0) {
        return FORECACHE_SLOT_EMPTY;
    }
    if (L.last_entry[s] >= 0) {
        int32_t left = 0;
        for (int32_t p = 0; p < L.n_proj; p++) {
            left += L.entry_pend[L.last_entry[s]*L.n_proj + p];
        }
        return left > 0 ? FORECACHE_SLOT_QUEUED : FORECACHE_SLOT_READY;
    }
    if (L.pending[s] == 0) {
        return FORECACHE_SLOT_READY;
    }
    return L.started[s] ? FORECACHE_SLOT_COPYING : FORECACHE_SLOT_QUEUED;
}

// slots of the layer's resident experts that `keep` does not mark, lowest eviction key first and least
// recently used first among equal keys (lock held)
void fc_lru_slots(const fc_layer & L, const std::vector<uint8_t> * keep, std::vector<int32_t> & out) {
    out.clear();
    for (int32_t s = 0; s < L.n_slots; s++) {
        const int32_t e = L.expert_of[s];
        if (e >= 0 && (keep == nullptr || !(*keep)[e])) {
            out.push_back(s);
        }
    }
    std::stable_sort(out.begin(), out.end(), [&](int32_t a, int32_t b) {
        const int64_t ka = L.key[L.expert_of[a]];
        const int64_t kb = L.key[L.expert_of[b]];
        return ka != kb ? ka < kb : L.stamp[a] < L.stamp[b];
    });
}

// the decode gate (forecache_cache_set_decode_gate) for a one-token routing begun by fc_begin_route
// (c->routed, flagged in c->seen; lock held): 0 compute from slots, 1 from host memory, 2 ask the hook
int32_t fc_decode_gate(forecache_cache * c, int32_t il) {
    fc_layer & L = c->layers[il];
    const std::vector<int32_t> & need = c->routed;
    const int32_t n_used = c->dg_n_used;
    if (c->dg_preempt) {
        fc_preempt(c, il, c->seen);
    }
    // cache-first rank of each routed expert: ready, copying, queued, missing
    std::vector<int32_t> & rank = c->dg_rank;
    rank.resize(need.size());
    int32_t n_miss = 0;
    int32_t in_flight = 0;
    for (size_t i = 0; i < need.size(); i++) {
        const int32_t s = L.slot_of[need[i]];
        const int32_t st = s < 0 ? FORECACHE_SLOT_EMPTY : fc_slot_state(L, s);
        rank[i] = st == FORECACHE_SLOT_EMPTY ? 3 : st == FORECACHE_SLOT_READY ? 0 :
                  st == FORECACHE_SLOT_COPYING ? 1 : 2;
        n_miss    += rank[i] == 3;
        in_flight += rank[i] == 1 || rank[i] == 2;
    }
    const size_t idx = (size_t) n_miss*(n_used + 1) + in_flight;
    const int32_t k = c->dg_host_k[idx];
    if (k < 0) {
        return 2;
    }
    // the k missing experts with the lowest ids are computed on the host
    std::vector<int32_t> & host = c->dg_host;
    host.clear();
    for (size_t i = 0; i < need.size(); i++) {
        if (rank[i] == 3) {
            host.push_back(need[i]);
        }
    }
    std::sort(host.begin(), host.end());
    host.resize(k);
    // compute order: by rank, first use first within a rank; then the host entries
    std::vector<int32_t> & order = c->dg_order;
    order.clear();
    for (int32_t r = 0; r <= 3; r++) {
        for (size_t i = 0; i < need.size(); i++) {
            if (rank[i] == r && (r < 3 || std::find(host.begin(), host.end(), need[i]) == host.end())) {
                order.push_back(need[i]);
            }
        }
    }
    // victims: free slots, then the slots the layer does not route to, in eviction order
    std::vector<int32_t> & victims = c->dg_victims;
    victims.clear();
    for (int32_t s = 0; s < L.n_slots; s++) {
        if (L.expert_of[s] < 0) {
            victims.push_back(s);
        }
    }
    fc_lru_slots(L, &c->seen, c->dg_lru);
    victims.insert(victims.end(), c->dg_lru.begin(), c->dg_lru.end());
    std::vector<int32_t> & slots = c->dg_slots;
    slots.clear();
    size_t next = 0;
    for (int32_t e : order) {
        const int32_t s = L.slot_of[e];
        if (s >= 0) {
            slots.push_back(s);
        } else if (next < victims.size()) {
            slots.push_back(victims[next++]);
        } else {
            return 2;
        }
    }
    for (int32_t e : host) {
        order.push_back(e);
        slots.push_back(-1);
    }
    if (!fc_set_schedule(c, il, order.data(), slots.data(), (int32_t) order.size(), 0)) {
        return 1;
    }
    // experts computed on the host still enter the cache, behind this layer's copies
    for (int32_t e : host) {
        if (next >= victims.size() || !fc_assign(c, il, e, victims[next], 1)) {
            break;
        }
        next++;
    }
    L.stats.model_host_s += c->dg_host_s[idx];
    return 0;
}

// queues a gate event of layer il for the prediction thread
void fc_record_event(forecache_cache * c, int32_t il, int64_t n_tokens, int64_t n_used, const float * x, int32_t n_embd, uint64_t pass) {
    std::lock_guard<std::mutex> lock(c->ev_mtx);
    if (!c->ev_on) {
        return;
    }
    if (c->ev_gates >= c->ev_cap) {
        c->ev_dropped++;
        return;
    }
    fc_event ev;
    ev.head.kind     = FORECACHE_EVENT_GATE;
    ev.head.layer    = il;
    ev.head.n_tokens = (int32_t) n_tokens;
    ev.head.n_used   = (int32_t) n_used;
    ev.head.pass     = pass;
    ev.ids = c->ids;
    if (x != nullptr) {
        ev.head.n_embd = n_embd;
        ev.x.assign(x, x + (size_t) n_tokens*n_embd);
    }
    if ((int64_t) c->tokens.size() == n_tokens) {
        ev.head.has_tokens = 1;
        ev.tokens = c->tokens;
    }
    c->events.push_back(std::move(ev));
    c->ev_gates++;
    c->ev_cv.notify_one();
}

// routing of layer il to c->ids begins (the previous routed layer is computed): frees that
// layer's slots, counts hits and misses over the distinct routed experts (first use first, into
// c->routed; flagged in c->seen) and marks the hits' slots used
void fc_begin_route(forecache_cache * c, int32_t il, int64_t n_tokens) {
    fc_layer & L = c->layers[il];
    std::lock_guard<std::mutex> lock(c->mtx);
    if (c->in_use_layer >= 0) {
        fc_layer & P = c->layers[c->in_use_layer];
        std::fill(P.in_use.begin(), P.in_use.end(), 0);
        for (int32_t j = 0; j < c->n_stage; j++) {
            if (c->st_in_use[j]) {
                fc_release_stage(c, j);
            }
        }
        c->in_use_layer = -1;
    }
    fc_clear_schedule(c, il);
    L.routed_pass = c->epoch;
    c->seen.assign(L.n_expert, 0);
    c->routed.clear();
    if (L.key_step != 0) {
        for (int32_t e : c->ids) {
            L.key[e] += L.key_step;
        }
    }
    for (int32_t e : c->ids) {
        if (!c->seen[e]) {
            c->seen[e] = 1;
            c->routed.push_back(e);
            const int32_t s = L.slot_of[e];
            if (s >= 0) {
                L.stamp[s] = ++c->clock;
            }
            (s >= 0 ? L.stats.hits : L.stats.misses)++;
            if (n_tokens == 1) {
                (s >= 0 ? L.stats.decode_hits : L.stats.decode_misses)++;
            }
        }
    }
}

// the decode gate for a routing begun by fc_begin_route: 0 slots, 1 host, 2 the hook decides
int32_t fc_try_decode_gate(forecache_cache * c, int32_t il, int64_t n_tokens, int64_t n_used) {
    fc_layer & L = c->layers[il];
    if (n_tokens != 1 || L.n_slots < n_used) {
        return 2;
    }
    const auto t0 = fc_clock::now();
    std::lock_guard<std::mutex> lock(c->mtx);
    if (n_used != c->dg_n_used) {
        return 2;
    }
    for (int32_t j = 0; j < c->n_stage; j++) {
        if (c->st_layer[j] == il) {
            return 2; // experts staged for this layer: the policy's gate reads them
        }
    }
    const int32_t rc = fc_decode_gate(c, il);
    if (rc != 2) {
        L.stats.fast_gates++;
        L.stats.fast_s += fc_seconds(t0);
    } else {
        fc_clear_schedule(c, il);
    }
    return rc;
}

// reads the routed ids of layer il from ids_t into c->ids; false (and the graph compute cancelled)
// if one is not an expert of the layer
bool fc_read_ids(forecache_cache * c, int32_t il, const ggml_tensor * ids_t) {
    const fc_layer & L = c->layers[il];
    const int64_t n_used   = ids_t->ne[0];
    const int64_t n_tokens = ids_t->ne[1];
    c->raw.resize(ggml_nbytes(ids_t));
    ggml_backend_tensor_get(ids_t, c->raw.data(), 0, c->raw.size());
    c->ids.resize(n_used*n_tokens);
    for (int64_t i1 = 0; i1 < n_tokens; i1++) {
        for (int64_t i0 = 0; i0 < n_used; i0++) {
            int32_t id;
            memcpy(&id, c->raw.data() + i1*ids_t->nb[1] + i0*ids_t->nb[0], sizeof(id));
            if (id < 0 || id >= L.n_expert) {
                // a bad id would index past the slot tables; cancel this compute instead of aborting the process
                if (!c->bad_ids_logged) {
                    c->bad_ids_logged = true;
                    LLAMA_LOG_ERROR("%s: layer %d routes to expert %d of %d (%s); cancelling the graph compute\n",
                            __func__, il, id, L.n_expert, ids_t->name);
                }
                return false;
            }
            c->ids[i1*n_used + i0] = id;
        }
    }
    return true;
}

// which positions of the routed ids in c->ids (layer L's) a little pass drops: those past the
// little count, and with little_resident those not resident (never the top-1); true if any
bool fc_little_drop(forecache_cache * c, fc_layer & L, int64_t n_used, int64_t n_tokens,
                    std::vector<uint8_t> & drop) {
    const int64_t little = std::min<int64_t>(c->little.load(), n_used);
    const bool resident = c->little_resident.load();
    drop.assign(n_used*n_tokens, 0);
    if (little <= 0 || (little >= n_used && !resident)) {
        return false;
    }
    std::unique_lock<std::mutex> lock(c->mtx, std::defer_lock);
    if (resident) {
        lock.lock(); // slot states
    }
    bool any = false;
    for (int64_t i1 = 0; i1 < n_tokens; i1++) {
        const int32_t * row = c->ids.data() + i1*n_used;
        for (int64_t iu = 1; iu < n_used; iu++) {
            const int32_t s = L.slot_of[row[iu]];
            const bool keep = iu < little && (!resident || (s >= 0 && fc_slot_state(L, s) == FORECACHE_SLOT_READY));
            drop[i1*n_used + iu] = !keep;
            any = any || !keep;
        }
    }
    return any;
}

// a little pass over weights that are normalized (or softmaxed) before they multiply the expert
// outputs drops its experts in the weights before that: 0 (the sum renormalizes the kept ones) or
// -inf (the softmax does); the layer's routing later repeats the same drops in its ids
bool fc_little_early(forecache_cache * c, ggml_tensor * w) {
    const ggml_tensor * ids_t = w->src[1];
    auto li = c->layer_of_ids.find(ids_t);
    if (li == c->layer_of_ids.end() || ggml_nelements(w) != ggml_nelements(ids_t)) {
        return true;
    }
    fc_layer & L = c->layers[li->second];
    if (!fc_read_ids(c, li->second, ids_t)) {
        return false;
    }
    L.early_epoch = c->epoch;
    if (!fc_little_drop(c, L, ids_t->ne[0], ids_t->ne[1], L.early_drop)) {
        return true;
    }
    c->weights.resize(ggml_nelements(w));
    ggml_backend_tensor_get(w, c->weights.data(), 0, ggml_nbytes(w));
    const float gone = c->weights_use.at(w) == FC_WEIGHTS_SOFTMAXED ? -INFINITY : 0.0f;
    for (size_t i = 0; i < L.early_drop.size(); i++) {
        if (L.early_drop[i]) {
            c->weights[i] = gone;
        }
    }
    ggml_backend_tensor_set(w, c->weights.data(), 0, ggml_nbytes(w));
    return true;
}

// reads the routed ids of layer il, runs the gate hook, and prepares slot or host compute
bool fc_route(forecache_cache * c, int32_t il, ggml_tensor * t) {
    fc_layer & L = c->layers[il];
    ggml_tensor * ids_t = t->src[3];
    const int64_t n_used   = ids_t->ne[0];
    const int64_t n_tokens = ids_t->ne[1];

    if (!fc_read_ids(c, il, ids_t)) {
        return false;
    }

    const float * weights = nullptr;
    auto wit = c->weights_of.find(ids_t);
    if (wit != c->weights_of.end() && wit->second->src[1] == ids_t && ggml_nelements(wit->second) == n_used*n_tokens) {
        c->weights.resize(n_used*n_tokens);
        ggml_backend_tensor_get(wit->second, c->weights.data(), 0, ggml_nbytes(wit->second));
        weights = c->weights.data();
    }

    // little pass: the positions it drops take the top-1's id and weight 0 (written back where the
    // weights multiply the outputs as they are; dropped before their normalization otherwise)
    L.little = false;
    const fc_weights_use use = weights != nullptr ? c->weights_use.at(wit->second) : FC_WEIGHTS_UNKNOWN;
    const int64_t little = std::min<int64_t>(c->little.load(), n_used);
    if (use != FC_WEIGHTS_UNKNOWN && little > 0 && (little < n_used || c->little_resident.load())) {
        L.little_ids.insert(L.little_ids.end(), c->ids.begin(), c->ids.end());
        std::vector<uint8_t> drop;
        if (use == FC_WEIGHTS_DIRECT) {
            fc_little_drop(c, L, n_used, n_tokens, drop);
        } else if (L.early_epoch == c->epoch && L.early_drop.size() == c->ids.size()) {
            drop = L.early_drop;
        }
        for (size_t i = 0; i < drop.size(); i++) {
            if (drop[i]) {
                c->ids[i] = c->ids[i - i % n_used];
                c->weights[i] = 0.0f;
                L.little = true; // repeated ids: computed group by group
            }
        }
        if (L.little && use == FC_WEIGHTS_DIRECT) {
            ggml_backend_tensor_set(wit->second, c->weights.data(), 0, ggml_nbytes(wit->second));
        }
    }

    const float * gate_input = nullptr;
    int32_t n_embd = 0;
    ggml_tensor * x = t->src[1];
    if (c->want_gate_input && x->type == GGML_TYPE_F32 && ggml_is_contiguous(x)) {
        c->gate_input.resize(ggml_nelements(x));
        ggml_backend_tensor_get(x, c->gate_input.data(), 0, ggml_nbytes(x));
        gate_input = c->gate_input.data();
        n_embd = (int32_t) x->ne[0];
    }

    // the previous routed layer has been computed (reading the ids synchronized the device)
    fc_begin_route(c, il, n_tokens);
    int32_t rc = fc_try_decode_gate(c, il, n_tokens, n_used); // 2: the hook decides
    if (rc == 2) {
        rc = 1;
        if (c->hook != nullptr) {
            const auto t0 = fc_clock::now();
            rc = c->hook(c->hook_ud, il, (int32_t) n_tokens, (int32_t) n_used, c->ids.data(), weights, gate_input, n_embd);
            L.stats.hook_s += fc_seconds(t0);
            L.stats.n_hook_calls++;
            if (rc < 0) {
                std::lock_guard<std::mutex> lock(c->mtx);
                fc_clear_schedule(c, il);
                return false;
            }
        }
    }
    fc_record_event(c, il, n_tokens, n_used, gate_input, n_embd, c->epoch);

    bool host = rc != 0;
    std::unique_lock<std::mutex> lock(c->mtx);
    if (!host && L.sch_epoch != c->epoch) {
        // no schedule from the hook: the routed experts in order of first use, from their slots
        c->slots.clear();
        for (int32_t e : c->routed) {
            c->slots.push_back(L.slot_of[e]);
            host = host || L.slot_of[e] < 0;
        }
        host = host || !fc_set_schedule(c, il, c->routed.data(), c->slots.data(), (int32_t) c->routed.size(), 0);
    }
    if (!host) {
        for (int32_t e : c->ids) {
            host = host || L.entry_of[e] < 0;
        }
        host = host || (L.streams && !c->reorder) || (fc_grouped(L) && c->group_alloc == nullptr);
    }
    if (host) {
        fc_clear_schedule(c, il);
        std::fill(L.in_use.begin(), L.in_use.end(), 0);
        L.stats.host_layers++;
    }
    fc_release_unused_stage(c, il);
    if (!host) {
        if (!c->reorder) {
            if (!fc_all_ready(c, L, 0, L.n_proj)) {
                const auto t0 = fc_clock::now();
                c->cv_done.wait(lock, [&] { return fc_all_ready(c, L, 0, L.n_proj); });
                L.stats.stall_s += fc_seconds(t0);
            }
        }
        if (!fc_grouped(L)) {
            c->slots.resize(c->ids.size());
            for (size_t i = 0; i < c->ids.size(); i++) {
                c->slots[i] = L.sch_s[L.entry_of[c->ids[i]]];
            }
            lock.unlock();
            ggml_backend_tensor_set(t->src[2], c->slots.data(), 0, c->slots.size()*sizeof(int32_t));
        }
    }

    L.epoch     = c->epoch;
    L.ids_src   = ids_t;
    L.host_mode = host;
    return true;
}

int fc_node_hook(ggml_tensor * t, bool ask, void * user_data) {
    auto * c = (forecache_cache *) user_data;
    if (t == nullptr) {
        std::lock_guard<std::mutex> lock(c->mtx);
        c->epoch++;
        return 0;
    }
    if (t->op != GGML_OP_MUL_MAT_ID) {
        if (c->little_before.empty() || c->little.load() == 0) {
            return 0;
        }
        auto lb = c->little_before.find(t);
        if (lb == c->little_before.end()) {
            return 0;
        }
        return ask ? 1 : (fc_little_early(c, lb->second) ? 0 : -1);
    }
    auto it = c->pool_map.find(t->src[0]);
    if (it == c->pool_map.end()) {
        return 0;
    }
    if (ggml_nelements(t->src[3]) == 0) {
        // a ubatch that asks for no outputs routes no tokens through the last layer: nothing to place
        return 0;
    }
    fc_layer & L = c->layers[it->second.first];
    const int32_t p = it->second.second;
    const bool routed = L.epoch == c->epoch && L.ids_src == t->src[3];
    if (ask) {
        if (!routed || L.host_mode || fc_grouped(L)) {
            return 1;
        }
        std::lock_guard<std::mutex> lock(c->mtx);
        return fc_all_ready(c, L, p, p + 1) ? 0 : 1;
    }
    if (!routed && !fc_route(c, it->second.first, t)) {
        return -1;
    }
    if (L.host_mode) {
        return fc_host_compute(c, L, p, t) ? 1 : -1;
    }
    const bool groupable = c->group_alloc != nullptr && t->src[1]->type == GGML_TYPE_F32 &&
            ggml_is_contiguous(t->src[1]) && ggml_is_contiguous(t);
    {
        std::unique_lock<std::mutex> lock(c->mtx);
        if (!fc_grouped(L) && !groupable && !fc_all_ready(c, L, p, p + 1)) {
            const auto t0 = fc_clock::now();
            c->cv_done.wait(lock, [&] { return fc_all_ready(c, L, p, p + 1); });
            L.stats.stall_s += fc_seconds(t0);
        }
        if (!fc_grouped(L) && fc_all_ready(c, L, p, p + 1)) {
            L.stats.n_groups++;
            return 0; // everything is in place: the node runs as rewritten, over the slot ids
        }
    }
    if (!groupable) {
        LLAMA_LOG_ERROR("%s: cannot stream experts through %s: unsupported layout\n", __func__, t->name);
        return -1;
    }
    return fc_slot_compute(c, L, p, t) ? 1 : -1;
}

} // namespace

struct forecache_cache * forecache_cache_init(
        struct llama_context * ctx,
        const int32_t        * n_slots,
        int32_t                n_layer,
        size_t                 dev_index,
        size_t                 chunk_bytes,
        char                 * err,
        size_t                 err_size) {
    const llama_model & model = ctx->get_model();
    if (n_layer != (int32_t) model.hparams.n_layer()) {
        forecache_set_err(err, err_size, "n_layer is %d but the model has %u layers", n_layer, model.hparams.n_layer());
        return nullptr;
    }
    if (dev_index >= ggml_backend_dev_count()) {
        forecache_set_err(err, err_size, "no ggml device %zu", dev_index);
        return nullptr;
    }
    ggml_backend_dev_t dev = ggml_backend_dev_get(dev_index);

    ggml_backend_sched_t sched = ctx->get_sched();
    bool dev_in_sched = false;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        dev_in_sched = dev_in_sched || ggml_backend_get_device(ggml_backend_sched_get_backend(sched, i)) == dev;
    }
    if (!dev_in_sched) {
        forecache_set_err(err, err_size, "device %s is not used by this context", ggml_backend_dev_name(dev));
        return nullptr;
    }

    auto * c = new forecache_cache();
    c->lctx        = ctx;
    c->sched       = sched;
    c->chunk_bytes = chunk_bytes;
    c->layers.resize(n_layer);

    for (const auto & [name, t] : model.tensors_by_name) {
        const int il = fc_expert_layer(name);
        if (il < 0 || il >= n_layer || ggml_n_dims(t) != 3) {
            continue;
        }
        fc_layer & L = c->layers[il];
        if (L.n_proj == FC_MAX_PROJ || (L.n_expert != 0 && L.n_expert != t->ne[2])) {
            forecache_set_err(err, err_size, "unsupported expert tensor layout in layer %d", il);
            delete c;
            return nullptr;
        }
        if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
            forecache_set_err(err, err_size, "expert tensor %s is not in host memory (%s); load the model with its experts on the host",
                    name.c_str(), t->buffer ? ggml_backend_buffer_name(t->buffer) : "unallocated");
            delete c;
            return nullptr;
        }
        L.n_expert = (int32_t) t->ne[2];
        L.host[L.n_proj] = t;
        L.expert_bytes += t->nb[2];
        c->host_map[t] = {il, L.n_proj};
        L.n_proj++;
    }

    int n_pool = 0;
    for (int il = 0; il < n_layer; il++) {
        fc_layer & L = c->layers[il];
        if (n_slots[il] < 0 || (n_slots[il] > 0 && L.n_proj == 0)) {
            forecache_set_err(err, err_size, "layer %d: %d slots requested but it has %d experts", il, n_slots[il], L.n_expert);
            delete c;
            return nullptr;
        }
        L.n_slots = std::min(n_slots[il], L.n_expert);
        L.slot_of.assign(L.n_expert, -1);
        L.entry_of.assign(L.n_expert, -1);
        L.expert_of.assign(L.n_slots, -1);
        L.pending.assign(L.n_slots, 0);
        L.pend_proj.assign((size_t) L.n_slots*std::max(L.n_proj, 1), 0);
        L.started.assign(L.n_slots, 0);
        L.in_use.assign(L.n_slots, 0);
        L.last_entry.assign(L.n_slots, -1);
        L.stamp.assign(L.n_slots, 0);
        L.key.assign(L.n_expert, 0);
        n_pool += L.n_slots > 0 ? L.n_proj : 0;
    }
    if (n_pool == 0) {
        forecache_set_err(err, err_size, "no layer has expert slots");
        delete c;
        return nullptr;
    }

    ggml_init_params params = {
        /*.mem_size   =*/ (size_t) (n_pool + 1)*ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    c->pool_ctx = ggml_init(params);
    for (int il = 0; il < n_layer; il++) {
        fc_layer & L = c->layers[il];
        for (int p = 0; L.n_slots > 0 && p < L.n_proj; p++) {
            const ggml_tensor * h = L.host[p];
            L.pool[p] = ggml_new_tensor_3d(c->pool_ctx, h->type, h->ne[0], h->ne[1], L.n_slots);
            ggml_format_name(L.pool[p], "fc.pool.%s", h->name);
            c->pool_map[L.pool[p]] = {il, p};
        }
    }
    const int64_t n_ids = (int64_t) model.hparams.n_expert_used_max() * ctx->get_cparams().n_ubatch;
    c->slot_ids = ggml_new_tensor_1d(c->pool_ctx, GGML_TYPE_I32, std::max<int64_t>(n_ids, 1));
    ggml_set_name(c->slot_ids, "fc.slot_ids");

    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    const size_t pool_size = ggml_backend_alloc_ctx_tensors_from_buft_size(c->pool_ctx, buft);
    c->pool_buf = ggml_backend_alloc_ctx_tensors_from_buft(c->pool_ctx, buft);
    if (c->pool_buf == nullptr) {
        forecache_set_err(err, err_size, "cannot allocate %.1f MiB of expert slots on %s", pool_size/1048576.0, ggml_backend_dev_name(dev));
        forecache_cache_free(c);
        return nullptr;
    }
    ggml_backend_buffer_set_usage(c->pool_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    params.mem_size = (ctx->get_cparams().n_ubatch + 16)*ggml_tensor_overhead();
    c->view_ctx = ggml_init(params);

    c->cpu = fc_cpu_backend(c, ctx->get_cparams().n_threads, c->cpu_pool);
    if (c->cpu == nullptr) {
        forecache_set_err(err, err_size, "cannot start the CPU backend");
        forecache_cache_free(c);
        return nullptr;
    }

    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t be = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(be) == dev) {
            c->dev_backend = be;
            break;
        }
    }
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        // the scheduler's CPU backend would start its threads for every expert group
        c->dev_cpu = fc_cpu_backend(c, ctx->get_cparams().n_threads, c->dev_cpu_pool);
        if (c->dev_cpu != nullptr) {
            c->dev_backend = c->dev_cpu;
        }
    }
    // expert groups are computed where the pool lives, with scratch that grows to the largest group
    c->group_alloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(c->dev_backend));

    c->worker = std::thread(fc_worker, c);
    ggml_backend_sched_set_node_hooks(sched, fc_graph_hook, fc_node_hook, c);
    ctx->reset_graph_reuse();
    return c;
}

void forecache_cache_free(struct forecache_cache * cache) {
    if (cache == nullptr) {
        return;
    }
    if (cache->worker.joinable()) {
        {
            std::lock_guard<std::mutex> lock(cache->mtx);
            cache->stop = true;
        }
        cache->cv_work.notify_all();
        cache->worker.join();
    }
    cache->host.finish();
    if (cache->sched != nullptr) {
        ggml_backend_sched_synchronize(cache->sched);
        ggml_backend_sched_set_node_hooks(cache->sched, nullptr, nullptr, nullptr);
        cache->lctx->reset_graph_reuse();
    }
    if (cache->group_alloc) {
        ggml_gallocr_free(cache->group_alloc);
    }
    ggml_backend_free(cache->cpu);
    ggml_backend_free(cache->dev_cpu);
    for (ggml_threadpool_t tp : {cache->cpu_pool, cache->dev_cpu_pool}) {
        if (tp != nullptr) {
            cache->pool_free(tp);
        }
    }
    ggml_backend_buffer_free(cache->pool_buf);
    ggml_backend_buffer_free(cache->stage_buf);
    if (cache->stage_ctx) {
        ggml_free(cache->stage_ctx);
    }
    if (cache->view_ctx) {
        ggml_free(cache->view_ctx);
    }
    if (cache->pool_ctx) {
        ggml_free(cache->pool_ctx);
    }
    delete cache;
}

void forecache_cache_set_hook(struct forecache_cache * cache, forecache_gate_hook hook, void * user_data, bool gate_input) {
    cache->hook            = hook;
    cache->hook_ud         = user_data;
    cache->want_gate_input = gate_input;
}

int32_t forecache_cache_layer_info(
        const struct forecache_cache * cache, int32_t layer, int32_t * n_expert, int32_t * n_slots, size_t * expert_bytes) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || cache->layers[layer].n_proj == 0) {
        return -1;
    }
    const fc_layer & L = cache->layers[layer];
    *n_expert     = L.n_expert;
    *n_slots      = L.n_slots;
    *expert_bytes = L.expert_bytes;
    return 0;
}

int32_t forecache_cache_slot_of(const struct forecache_cache * cache, int32_t layer, int32_t expert) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || expert < 0 || expert >= cache->layers[layer].n_expert) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    return cache->layers[layer].slot_of[expert];
}

int32_t forecache_cache_load(struct forecache_cache * cache, int32_t layer, int32_t expert, int32_t slot, int32_t priority) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    fc_layer & L = cache->layers[layer];
    if (expert < 0 || expert >= L.n_expert || slot < 0 || slot >= L.n_slots) {
        return -1;
    }
    priority = std::min(std::max(priority, 0), FC_N_PRIORITIES - 1);
    std::lock_guard<std::mutex> lock(cache->mtx);
    return fc_assign(cache, layer, expert, slot, priority) ? 0 : 1;
}

int32_t forecache_cache_cancel(struct forecache_cache * cache, int32_t layer, int32_t min_priority) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    return fc_drop_queued(cache, min_priority, [&](const fc_chunk & ch) {
        return (layer < 0 || ch.layer == layer) && ch.entry < 0;
    });
}

int32_t forecache_cache_preempt(struct forecache_cache * cache, int32_t layer, const int32_t * keep, int32_t n_keep) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || n_keep < 0) {
        return -1;
    }
    std::vector<uint8_t> wanted(cache->layers[layer].n_expert, 0);
    for (int32_t i = 0; i < n_keep; i++) {
        if (keep[i] >= 0 && keep[i] < cache->layers[layer].n_expert) {
            wanted[keep[i]] = 1;
        }
    }
    std::lock_guard<std::mutex> lock(cache->mtx);
    return fc_preempt(cache, layer, wanted);
}

int32_t forecache_cache_schedule(struct forecache_cache * cache, int32_t layer, const int32_t * experts, const int32_t * slots, int32_t n, int32_t priority) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    priority = std::min(std::max(priority, 0), FC_N_PRIORITIES - 1);
    std::lock_guard<std::mutex> lock(cache->mtx);
    return fc_set_schedule(cache, layer, experts, slots, n, priority) ? 0 : -1;
}

int32_t forecache_cache_set_stage(struct forecache_cache * cache, int32_t n_stage, char * err, size_t err_size) {
    if (cache->n_stage != 0 || n_stage <= 0) {
        forecache_set_err(err, err_size, cache->n_stage != 0 ? "stage slots are already set" : "n_stage must be positive");
        return -1;
    }
    // stage slots hold experts of one layout (each projection's shape and type): the layout most
    // cached layers have; layers of another (a quantizer gave them more bits) stage nothing
    auto same_layout = [](const fc_layer & a, const fc_layer & b) {
        bool same = a.n_proj == b.n_proj;
        for (int32_t p = 0; same && p < a.n_proj; p++) {
            const ggml_tensor * x = a.host[p];
            const ggml_tensor * y = b.host[p];
            same = x->type == y->type && x->ne[0] == y->ne[0] && x->ne[1] == y->ne[1] && x->nb[2] == y->nb[2];
        }
        return same;
    };
    const fc_layer * first = nullptr;
    int32_t best = 0;
    for (const fc_layer & L : cache->layers) {
        int32_t n = 0;
        for (const fc_layer & M : cache->layers) {
            n += L.n_slots > 0 && M.n_slots > 0 && same_layout(L, M);
        }
        if (n > best) {
            best  = n;
            first = &L;
        }
    }
    if (first == nullptr) {
        forecache_set_err(err, err_size, "no layer has expert slots");
        return -1;
    }
    for (fc_layer & L : cache->layers) {
        L.stage_ok = L.n_slots > 0 && same_layout(L, *first);
    }
    ggml_init_params params = {
        /*.mem_size   =*/ (size_t) (first->n_proj + 1)*ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * stage[FC_MAX_PROJ] = {};
    for (int32_t p = 0; p < first->n_proj; p++) {
        const ggml_tensor * h = first->host[p];
        stage[p] = ggml_new_tensor_3d(ctx, h->type, h->ne[0], h->ne[1], n_stage);
        ggml_format_name(stage[p], "fc.stage.%d", p);
    }
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(cache->pool_buf);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (buf == nullptr) {
        forecache_set_err(err, err_size, "cannot allocate %.1f MiB of stage slots",
                n_stage*first->expert_bytes/1048576.0);
        ggml_free(ctx);
        return -1;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->stage_ctx = ctx;
    cache->stage_buf = buf;
    std::copy(stage, stage + FC_MAX_PROJ, cache->stage);
    cache->st_layer.assign(n_stage, -1);
    cache->st_expert.assign(n_stage, -1);
    cache->st_pend.assign((size_t) n_stage*FC_MAX_PROJ, 0);
    cache->st_started.assign(n_stage, 0);
    cache->st_in_use.assign(n_stage, 0);
    cache->n_stage = n_stage;
    return 0;
}

int32_t forecache_cache_stage(struct forecache_cache * cache, int32_t layer, int32_t expert, int32_t priority) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || priority < 0 || priority >= FC_N_PRIORITIES) {
        return -1;
    }
    fc_layer & L = cache->layers[layer];
    if (L.n_slots == 0 || !L.stage_ok || expert < 0 || expert >= L.n_expert) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(cache->mtx);
    if (L.slot_of[expert] >= 0) {
        return -1;
    }
    int32_t free_j = -1;
    for (int32_t j = 0; j < cache->n_stage; j++) {
        if (cache->st_layer[j] == layer && cache->st_expert[j] == expert) {
            return -1;
        }
        if (free_j < 0 && cache->st_layer[j] < 0) {
            free_j = j;
        }
    }
    if (free_j >= 0) {
        cache->st_layer[free_j]   = layer;
        cache->st_expert[free_j]  = expert;
        cache->st_started[free_j] = 0;
        fc_queue_copy(cache, layer, expert, L.n_slots + free_j, -1, priority, -1, 0);
        L.stats.staged++;
    }
    return free_j;
}

int32_t forecache_cache_stage_state(const struct forecache_cache * cache, int32_t * layer, int32_t * expert, int32_t * state) {
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    for (int32_t j = 0; j < cache->n_stage; j++) {
        layer[j]  = cache->st_layer[j];
        expert[j] = cache->st_layer[j] < 0 ? -1 : cache->st_expert[j];
        state[j]  = fc_stage_state(cache, j);
    }
    return cache->n_stage;
}

void forecache_cache_set_little(struct forecache_cache * cache, int32_t m, bool resident) {
    if (m > 0) {
        for (fc_layer & L : cache->layers) {
            L.little_ids.clear();
        }
    }
    cache->little          = std::max(m, 0);
    cache->little_resident = resident;
}

int32_t forecache_cache_little_routing(const struct forecache_cache * cache, int32_t layer, int32_t * ids, int32_t cap) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    const std::vector<int32_t> & src = cache->layers[layer].little_ids;
    std::copy(src.begin(), src.begin() + std::clamp<int32_t>((int32_t) src.size(), 0, cap), ids);
    return (int32_t) src.size();
}

void forecache_cache_set_reorder(struct forecache_cache * cache, bool reorder) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->reorder = reorder;
}

int32_t forecache_cache_layer_state(const struct forecache_cache * cache, int32_t layer, int32_t * expert_of, int32_t * state) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    const fc_layer & L = cache->layers[layer];
    for (int32_t s = 0; s < L.n_slots; s++) {
        expert_of[s] = L.expert_of[s];
        state[s] = fc_slot_state(L, s);
    }
    return L.n_slots;
}

int32_t forecache_cache_layer_order(const struct forecache_cache * cache, int32_t layer, int32_t * slots) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    std::vector<int32_t> order;
    fc_lru_slots(cache->layers[layer], nullptr, order);
    std::copy(order.begin(), order.end(), slots);
    return (int32_t) order.size();
}

int32_t forecache_cache_set_keys(struct forecache_cache * cache, int32_t layer, const int64_t * keys, int32_t n, int64_t step) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || n != cache->layers[layer].n_expert) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(cache->mtx);
    fc_layer & L = cache->layers[layer];
    L.key.assign(keys, keys + n);
    L.key_step = step;
    return 0;
}

int32_t forecache_cache_add_keys(struct forecache_cache * cache, int32_t layer, const int32_t * experts, const int64_t * deltas, int32_t n) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(cache->mtx);
    fc_layer & L = cache->layers[layer];
    for (int32_t i = 0; i < n; i++) {
        if (experts[i] >= 0 && experts[i] < L.n_expert) {
            L.key[experts[i]] += deltas[i];
        }
    }
    return 0;
}

int32_t forecache_cache_layer_keys(const struct forecache_cache * cache, int32_t layer, int64_t * keys) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    const fc_layer & L = cache->layers[layer];
    std::copy(L.key.begin(), L.key.end(), keys);
    return L.n_expert;
}

void forecache_cache_touch(struct forecache_cache * cache, int32_t layer, const int32_t * experts, int32_t n) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return;
    }
    std::lock_guard<std::mutex> lock(cache->mtx);
    fc_layer & L = cache->layers[layer];
    for (int32_t i = 0; i < n; i++) {
        if (experts[i] >= 0 && experts[i] < L.n_expert && L.slot_of[experts[i]] >= 0) {
            L.stamp[L.slot_of[experts[i]]] = ++cache->clock;
        }
    }
}

int32_t forecache_cache_passes(const struct forecache_cache * cache, int32_t layer, uint64_t * current, uint64_t * routed) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    *current = cache->epoch;
    *routed  = cache->layers[layer].routed_pass;
    return 0;
}

void forecache_cache_set_decode_gate(struct forecache_cache * cache, int32_t n_used, const int32_t * host_k, const double * host_s, bool preempt) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->dg_n_used  = std::max(n_used, 0);
    cache->dg_preempt = preempt;
    const size_t n = (size_t) (cache->dg_n_used + 1)*(cache->dg_n_used + 1);
    cache->dg_host_k.assign(host_k, host_k + (n_used > 0 ? n : 0));
    cache->dg_host_s.assign(host_s, host_s + (n_used > 0 ? n : 0));
}

void forecache_cache_set_events(struct forecache_cache * cache, bool enabled, int32_t capacity) {
    std::lock_guard<std::mutex> lock(cache->ev_mtx);
    cache->ev_on  = enabled;
    cache->ev_cap = std::max(capacity, 1);
}

void forecache_cache_set_tokens(struct forecache_cache * cache, const int32_t * tokens, int32_t n) {
    std::lock_guard<std::mutex> lock(cache->ev_mtx);
    cache->tokens.assign(tokens, tokens + std::max(n, 0));
}

void forecache_cache_post(struct forecache_cache * cache, int64_t marker) {
    std::lock_guard<std::mutex> lock(cache->ev_mtx);
    fc_event ev;
    ev.head.kind   = FORECACHE_EVENT_MARKER;
    ev.head.layer  = -1;
    ev.head.marker = marker;
    cache->events.push_back(std::move(ev));
    cache->ev_cv.notify_one();
}

int32_t forecache_cache_next_event(struct forecache_cache * cache, int32_t timeout_ms, struct forecache_event * ev,
        int32_t * ids, size_t ids_cap, float * x, size_t x_cap, int32_t * tokens, size_t tokens_cap) {
    std::unique_lock<std::mutex> lock(cache->ev_mtx);
    if (!cache->ev_cv.wait_for(lock, std::chrono::milliseconds(std::max(timeout_ms, 0)), [cache] { return !cache->events.empty(); })) {
        return 0;
    }
    const fc_event & front = cache->events.front();
    *ev = front.head;
    if (front.ids.size() > ids_cap || front.x.size() > x_cap || front.tokens.size() > tokens_cap) {
        return 2; // stays queued for a call with larger arrays
    }
    fc_event item = std::move(cache->events.front());
    cache->events.pop_front();
    if (item.head.kind == FORECACHE_EVENT_GATE) {
        cache->ev_gates--;
    }
    lock.unlock();
    std::copy(item.ids.begin(), item.ids.end(), ids);
    std::copy(item.x.begin(), item.x.end(), x);
    std::copy(item.tokens.begin(), item.tokens.end(), tokens);
    return 1;
}

size_t forecache_event_size(void) {
    return sizeof(forecache_event);
}

void forecache_cache_pause(struct forecache_cache * cache, bool paused) {
    std::unique_lock<std::mutex> lock(cache->mtx);
    cache->paused = paused;
    if (paused) {
        cache->cv_done.wait(lock, [cache] { return cache->running == 0; });
    } else {
        cache->cv_work.notify_all();
    }
}

int32_t forecache_cache_step(struct forecache_cache * cache, struct forecache_chunk_info * out) {
    std::unique_lock<std::mutex> lock(cache->mtx);
    fc_chunk ch;
    if (!cache->paused || !fc_pop(cache, ch)) {
        return 1;
    }
    if (out != nullptr) {
        *out = {ch.layer, ch.slot, ch.proj, ch.expert, ch.priority, ch.proj < 0 ? cache->layers[ch.layer].expert_bytes : ch.size};
    }
    fc_run(cache, ch, lock);
    return 0;
}

int32_t forecache_cache_queued(const struct forecache_cache * cache, int32_t layer, int32_t priority) {
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    int32_t n = 0;
    for (int p = 0; p < FC_N_PRIORITIES; p++) {
        if (priority >= 0 && p != priority) {
            continue;
        }
        for (const auto & ch : cache->queue[p]) {
            n += layer < 0 || ch.layer == layer;
        }
    }
    return n;
}

void forecache_cache_wait_idle(struct forecache_cache * cache) {
    std::unique_lock<std::mutex> lock(cache->mtx);
    cache->cv_done.wait(lock, [cache] { return cache->running == 0 && (cache->paused || !fc_has_eligible(cache)); });
}

int32_t forecache_cache_get_stats(const struct forecache_cache * cache, int32_t layer, struct forecache_cache_stats * out) {
    if (layer < -1 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    *out = {};
    for (int32_t il = 0; il < (int32_t) cache->layers.size(); il++) {
        if (layer >= 0 && il != layer) {
            continue;
        }
        const forecache_cache_stats & s = cache->layers[il].stats;
        out->hits         += s.hits;
        out->misses       += s.misses;
        out->host_layers  += s.host_layers;
        out->h2d_bytes    += s.h2d_bytes;
        out->n_chunks     += s.n_chunks;
        out->n_hook_calls += s.n_hook_calls;
        out->copy_s       += s.copy_s;
        out->stall_s      += s.stall_s;
        out->hook_s       += s.hook_s;
        out->host_s       += s.host_s;
        out->hi_tasks     += s.hi_tasks;
        out->hi_wait_s    += s.hi_wait_s;
        out->hi_wait_max_s = std::max(out->hi_wait_max_s, s.hi_wait_max_s);
        out->chunk_max_s   = std::max(out->chunk_max_s, s.chunk_max_s);
        out->dropped_chunks += s.dropped_chunks;
        out->refused_loads  += s.refused_loads;
        out->n_groups       += s.n_groups;
        out->streamed       += s.streamed;
        out->host_entries   += s.host_entries;
        out->hi_block_s     += s.hi_block_s;
        out->hi_block_max_s  = std::max(out->hi_block_max_s, s.hi_block_max_s);
        out->fast_gates     += s.fast_gates;
        out->fast_s         += s.fast_s;
        out->model_host_s   += s.model_host_s;
        out->decode_hits    += s.decode_hits;
        out->decode_misses  += s.decode_misses;
        out->staged         += s.staged;
        out->stage_used     += s.stage_used;
    }
    {
        std::lock_guard<std::mutex> ev_lock(const_cast<forecache_cache *>(cache)->ev_mtx);
        out->events_dropped = cache->ev_dropped;
    }
    return 0;
}

void forecache_cache_reset_stats(struct forecache_cache * cache) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    for (auto & L : cache->layers) {
        L.stats = {};
    }
    std::lock_guard<std::mutex> ev_lock(cache->ev_mtx);
    cache->ev_dropped = 0;
}

size_t forecache_cache_stats_size(void) {
    return sizeof(forecache_cache_stats);
}

size_t forecache_chunk_info_size(void) {
    return sizeof(forecache_chunk_info);
}

int32_t forecache_cache_test_route(struct forecache_cache * cache, int32_t layer, const int32_t * experts, int32_t n, bool decode_gate) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || n <= 0) {
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= cache->layers[layer].n_expert) {
            return -1;
        }
    }
    cache->ids.assign(experts, experts + n);
    fc_begin_route(cache, layer, 1);
    return decode_gate ? fc_try_decode_gate(cache, layer, 1, n) : 2;
}

int32_t forecache_cache_test_schedule(const struct forecache_cache * cache, int32_t layer, int32_t * experts, int32_t * slots) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    const fc_layer & L = cache->layers[layer];
    std::copy(L.sch_e.begin(), L.sch_e.end(), experts);
    std::copy(L.sch_s.begin(), L.sch_s.end(), slots);
    return (int32_t) L.sch_e.size();
}

double forecache_cache_expert_matmul(struct forecache_cache * cache, int32_t layer, int32_t proj,
        int32_t n_rows, int32_t n_used, bool repacked, int32_t n_threads, int32_t n_iter) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || n_rows <= 0 || n_threads <= 0 || n_iter <= 0) {
        return -1.0;
    }
    const fc_layer & L = cache->layers[layer];
    if (proj < 0 || proj >= L.n_proj || n_used <= 0 || n_used > L.n_expert) {
        return -1.0;
    }
    ggml_tensor * h = L.host[proj];

    // the repacked copy: llama.cpp repacks a weight when it is written into its CPU repack buffer
    ggml_context * rctx = nullptr;
    ggml_backend_buffer_t rbuf = nullptr;
    ggml_tensor * as = h;
    if (repacked) {
        ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        auto get_extra = cpu_dev == nullptr ? nullptr : (ggml_backend_dev_get_extra_bufts_t)
                ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu_dev), "ggml_backend_dev_get_extra_bufts");
        ggml_backend_buffer_type_t buft = nullptr;
        for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(cpu_dev) : nullptr; b && *b; b++) {
            if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
                buft = *b;
            }
        }
        if (buft == nullptr) {
            return -2.0;
        }
        ggml_init_params params = { ggml_tensor_overhead(), nullptr, true };
        rctx = ggml_init(params);
        as = ggml_new_tensor_3d(rctx, h->type, h->ne[0], h->ne[1], h->ne[2]);
        rbuf = ggml_backend_alloc_ctx_tensors_from_buft(rctx, buft);
        if (rbuf == nullptr) {
            ggml_free(rctx);
            return -3.0;
        }
        if (as->extra == nullptr) { // no repacked kernel for this type on this CPU
            ggml_backend_buffer_free(rbuf);
            ggml_free(rctx);
            return -2.0;
        }
        ggml_backend_tensor_set(as, h->data, 0, ggml_nbytes(h));
    }

    ggml_threadpool_t pool = nullptr;
    ggml_backend_t be = fc_cpu_backend(cache, n_threads, pool);
    std::vector<float>   x((size_t) h->ne[0]*n_rows);
    std::vector<int32_t> ids((size_t) n_used*n_rows);
    for (size_t i = 0; i < x.size(); i++) {
        x[i] = (float) ((i*2654435761u) % 2001) / 1000.0f - 1.0f;
    }
    for (size_t i = 0; i < ids.size(); i++) {
        ids[i] = (int32_t) (i % L.n_expert);
    }
    double total = 0.0;
    bool ok = be != nullptr;
    for (int32_t it = 0; ok && it <= n_iter; it++) {
        ggml_tensor * xt = nullptr;
        ggml_tensor * it_ids = nullptr;
        fc_clock::time_point t0;
        ok = fc_mini_graph(be, nullptr,
            [&](ggml_context * ctx) {
                xt     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, h->ne[0], 1, n_rows);
                it_ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_rows);
                return ggml_mul_mat_id(ctx, as, xt, it_ids);
            },
            [&] {
                memcpy(xt->data, x.data(), ggml_nbytes(xt));
                memcpy(it_ids->data, ids.data(), ggml_nbytes(it_ids));
                t0 = fc_clock::now();
            },
            [&](ggml_tensor *) {
                if (it > 0) { // the first compute is a warm-up
                    total += fc_seconds(t0);
                }
            });
    }
    ggml_backend_free(be);
    if (pool != nullptr) {
        cache->pool_free(pool);
    }
    ggml_backend_buffer_free(rbuf);
    if (rctx) {
        ggml_free(rctx);
    }
    return ok ? total / n_iter : -3.0;
}

double forecache_cache_host_handoff(struct forecache_cache * cache, int32_t n, bool fresh_threads) {
    const auto t0 = fc_clock::now();
    for (int32_t i = 0; i < n; i++) {
        if (fresh_threads) {
            std::thread th([] {});
            th.join();
        } else {
            cache->host.run([] {});
            cache->host.wait();
        }
    }
    return n > 0 ? fc_seconds(t0) / n : 0.0;
}
