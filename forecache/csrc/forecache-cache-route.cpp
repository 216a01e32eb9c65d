// forecache expert cache: the node hook (routed ids, the gate, the decode gate, the little pass, events).
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

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
    const bool own = !L.dg_host_k.empty(); // the layer's device has tables of its own
    const int32_t k = own ? L.dg_host_k[idx] : c->dg_host_k[idx];
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
    L.stats.model_host_s += own ? L.dg_host_s[idx] : c->dg_host_s[idx];
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
        L.stats.decode_gates++;
        L.stats.decode_gate_s += fc_seconds(t0);
    } else {
        fc_clear_schedule(c, il);
    }
    return rc;
}

// reads the routed ids of layer il from ids_t into c->ids; false (and the graph compute cancelled)
// if one is not an expert of the layer
bool fc_read_ids(forecache_cache * c, int32_t il, const ggml_tensor * ids_t) {
    fc_layer & L = c->layers[il];
    const int64_t n_used   = ids_t->ne[0];
    const int64_t n_tokens = ids_t->ne[1];
    c->raw.resize(ggml_nbytes(ids_t));
    const auto t0 = fc_clock::now();
    ggml_backend_tensor_get(ids_t, c->raw.data(), 0, c->raw.size());
    L.stats.readbacks++;
    if (c->tl_on.load(std::memory_order_relaxed)) {
        fc_span_add(c, FORECACHE_SPAN_IDS, il, -1, -1, -1, (int32_t) n_tokens, c->raw.size(), t0, fc_clock::now());
    }
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
    L.stats.readbacks++;
    const float gone = c->weights_use.at(w) == FC_WEIGHTS_SOFTMAXED ? -INFINITY : 0.0f;
    for (size_t i = 0; i < L.early_drop.size(); i++) {
        if (L.early_drop[i]) {
            c->weights[i] = gone;
        }
    }
    ggml_backend_tensor_set(w, c->weights.data(), 0, ggml_nbytes(w));
    L.stats.uploads++;
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
    const auto t_gate = fc_clock::now();

    // the router weights, read back only where something needs them: a little pass, or the hook
    const float * weights = nullptr;
    auto wit = c->weights_of.find(ids_t);
    const bool has_weights = wit != c->weights_of.end() && wit->second->src[1] == ids_t &&
                             ggml_nelements(wit->second) == n_used*n_tokens;
    auto read_weights = [&] {
        if (has_weights && weights == nullptr) {
            c->weights.resize(n_used*n_tokens);
            ggml_backend_tensor_get(wit->second, c->weights.data(), 0, ggml_nbytes(wit->second));
            L.stats.readbacks++;
            weights = c->weights.data();
        }
    };

    // little pass: the positions it drops take the top-1's id and weight 0 (written back where the
    // weights multiply the outputs as they are; dropped before their normalization otherwise)
    L.little = false;
    const fc_weights_use use = has_weights ? c->weights_use.at(wit->second) : FC_WEIGHTS_UNKNOWN;
    const int64_t little = std::min<int64_t>(c->little.load(), n_used);
    if (use != FC_WEIGHTS_UNKNOWN && little > 0 && (little < n_used || c->little_resident.load())) {
        read_weights();
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
            L.stats.uploads++;
        }
    }

    const float * gate_input = nullptr;
    int32_t n_embd = 0;
    ggml_tensor * x = t->src[1];
    if (c->want_gate_input && x->type == GGML_TYPE_F32 && ggml_is_contiguous(x)) {
        c->gate_input.resize(ggml_nelements(x));
        ggml_backend_tensor_get(x, c->gate_input.data(), 0, ggml_nbytes(x));
        L.stats.readbacks++;
        gate_input = c->gate_input.data();
        n_embd = (int32_t) x->ne[0];
    }

    // the previous routed layer has been computed (reading the ids synchronized the device)
    fc_begin_route(c, il, n_tokens);
    int32_t rc = fc_try_decode_gate(c, il, n_tokens, n_used); // 2: the hook decides
    if (rc == 2) {
        rc = 1;
        if (c->hook != nullptr) {
            read_weights();
            const auto t0 = fc_clock::now();
            rc = c->hook(c->hook_ud, il, (int32_t) n_tokens, (int32_t) n_used, c->ids.data(), weights, gate_input, n_embd);
            L.stats.hook_s += fc_seconds(t0);
            L.stats.hook_calls++;
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
    // host entries (or the whole layer on the host) computed whole on the CPU where the graph allows:
    // one hand-off for every projection, the device's products one a projection
    L.whole_epoch = 0;
    bool whole = false;
    if (!host) {
        for (int32_t e : c->ids) {
            host = host || L.entry_of[e] < 0;
        }
        whole = !host && L.n_dev < (int32_t) L.sch_e.size() && fc_whole_start(c, il, t, false);
        host = host || (L.streams && !c->reorder) || (fc_grouped(L) && c->devs[L.dev].group_alloc == nullptr);
    }
    if (host) {
        fc_clear_schedule(c, il);
        std::fill(L.in_use.begin(), L.in_use.end(), 0);
        L.stats.host_layers++;
        whole = fc_whole_start(c, il, t, true);
    }
    fc_release_unused_stage(c, il);
    fc_span(c, FORECACHE_SPAN_GATE, il, -1, (int32_t) n_tokens, t_gate, fc_clock::now());
    if (!host) {
        if (!c->reorder) {
            if (!fc_all_ready(c, L, 0, L.n_proj)) {
                const auto t0 = fc_clock::now();
                c->cv_done.wait(lock, [&] { return fc_all_ready(c, L, 0, L.n_proj) || c->disk_failed; });
                L.stats.copy_waits++;
                L.stats.stall_s += fc_seconds(t0);
                fc_span(c, FORECACHE_SPAN_WAIT, il, -1, 0, t0, fc_clock::now());
            }
            if (c->disk_failed) {
                return false;
            }
        }
        if (!fc_grouped(L) && fc_remapped(t)) {
            // the routed experts' slots into the layer's map, which the graph reads at each id
            c->slots = L.map_dev;
            for (int32_t e : c->routed) {
                const int32_t i = L.entry_of[e];
                c->slots[e] = i < L.n_dev ? L.sch_s[i] : c->w_slot[e];
            }
            lock.unlock(); // the map is the graph thread's
            if (whole) {
                fc_whole_launch(c, il);
            }
            fc_upload_map(c, il, c->slots);
        } else if (!fc_grouped(L)) {
            c->slots.resize(c->ids.size());
            for (size_t i = 0; i < c->ids.size(); i++) {
                c->slots[i] = L.sch_s[L.entry_of[c->ids[i]]];
            }
            L.stats.uploads++;
            lock.unlock();
            ggml_backend_tensor_set(t->src[2], c->slots.data(), 0, c->slots.size()*sizeof(int32_t));
        }
    }

    if (whole && host) {
        if (lock.owns_lock()) {
            lock.unlock();
        }
        fc_whole_launch(c, il);
    }
    L.epoch     = c->epoch;
    L.ids_src   = ids_t;
    L.host_mode = host;
    return true;
}

void fc_upload_map(forecache_cache * c, int32_t il, const std::vector<int32_t> & want) {
    fc_layer & L = c->layers[il];
    if (want == L.map_dev) {
        return;
    }
    ggml_backend_tensor_set(L.map, want.data(), 0, ggml_nbytes(L.map));
    L.map_dev = want;
    L.stats.uploads++;
}

bool fc_complete(const forecache_cache * c, int32_t il) {
    const fc_layer & L = c->layers[il];
    if (L.n_slots < L.n_expert || L.map == nullptr) {
        return false;
    }
    for (int32_t e = 0; e < L.n_expert; e++) {
        const int32_t s = L.slot_of[e];
        if (s < 0 || fc_slot_state(L, s) != FORECACHE_SLOT_READY) {
            return false;
        }
    }
    for (int32_t j = 0; j < c->n_stage; j++) {
        if (c->st_layer[j] == il) {
            return false;
        }
    }
    return true;
}

bool fc_quiet(forecache_cache * c, int32_t il, const ggml_tensor * ids) {
    if (!c->quiet || c->little.load() > 0 || !fc_complete(c, il)) {
        return false;
    }
    // the gate events or inputs of this layer feed the predictions for the next cached layer
    const bool heard = c->want_gate_input || c->ev_on;
    for (int32_t k = il + 1; heard && k < (int32_t) c->layers.size(); k++) {
        if (c->layers[k].n_slots > 0) {
            if (!fc_complete(c, k)) {
                return false;
            }
            break;
        }
    }
    fc_go_quiet(c, il, ids);
    return true;
}

void fc_go_quiet(forecache_cache * c, int32_t il, const ggml_tensor * ids) {
    fc_layer & L = c->layers[il];
    std::vector<int32_t> & want = c->slots;
    want.assign(L.slot_of.begin(), L.slot_of.end());
    fc_upload_map(c, il, want);
    L.quiet_epoch = c->epoch; // its slots stay as they are until the pass ends (fc_assign)
    L.stats.quiet++;
    if (c->tl_on.load(std::memory_order_relaxed)) {
        const auto now = fc_clock::now();
        fc_span_add(c, FORECACHE_SPAN_QUIET, il, -1, -1, -1, (int32_t) ids->ne[1], 0, now, now);
    }
    if (ids->ne[1] == 1) {
        // a token's top-k are distinct experts, all resident (a prompt's distinct count is not known)
        L.stats.hits        += (uint64_t) ids->ne[0];
        L.stats.decode_hits += (uint64_t) ids->ne[0];
    }
}

// the node that remaps layer il's routed ids to its slots (`mm`: the layer's first product): the
// layer's one stop, where the ids are read, the gate decides and the map is written, unless the
// layer is quiet
static int fc_remap_node(forecache_cache * c, ggml_tensor * mm, bool ask) {
    const int32_t il = c->pool_map.at(mm->src[0]).first;
    fc_layer & L = c->layers[il];
    if (ggml_nelements(mm->src[3]) == 0) {
        return 0; // no rows routed (a ubatch that asks for no outputs, in its last layer)
    }

    if (ask) {
        std::lock_guard<std::mutex> lock(c->mtx);
        return fc_quiet(c, il, mm->src[3]) ? 0 : 1;
    }
    L.stats.stops++;
    return fc_route(c, il, mm) ? 0 : -1;
}

// waits until projection p of layer il's schedule is in place (or a disk read failed), counted
// as compute waiting for copies (lock held)
static void fc_wait_proj(forecache_cache * c, int32_t il, int32_t p, std::unique_lock<std::mutex> & lock) {
    fc_layer & L = c->layers[il];
    if (fc_all_ready(c, L, p, p + 1)) {
        return;
    }
    const auto t0 = fc_clock::now();
    c->cv_done.wait(lock, [&] { return fc_all_ready(c, L, p, p + 1) || c->disk_failed; });
    L.stats.copy_waits++;
    L.stats.stall_s += fc_seconds(t0);
    fc_span(c, FORECACHE_SPAN_WAIT, il, p, 0, t0, fc_clock::now());
}

// with a copy stream: waits until projection p's copies are issued, then orders the compute stream
// after the last chunk issued, unless they have landed already (lock held)
static void fc_wait_proj_event(forecache_cache * c, int32_t il, int32_t p, std::unique_lock<std::mutex> & lock) {
    fc_layer & L = c->layers[il];
    if (!fc_proj_issued(c, il, p)) {
        const auto t0 = fc_clock::now();
        c->cv_done.wait(lock, [&] { return fc_proj_issued(c, il, p) || c->disk_failed; });
        L.stats.copy_waits++;
        L.stats.stall_s += fc_seconds(t0);
        fc_span(c, FORECACHE_SPAN_WAIT, il, p, 0, t0, fc_clock::now());
    }
    if (c->disk_failed || fc_all_ready(c, L, p, p + 1)) {
        return;
    }
    fc_device & d = c->devs[L.dev];
    ggml_backend_event_t ev = d.copy_ev[(d.issued - 1) % FC_COPY_DEPTH]; // the last one issued
    L.stats.event_waits++;
    if (c->tl_on.load(std::memory_order_relaxed)) {
        const auto now = fc_clock::now();
        fc_span_add(c, FORECACHE_SPAN_EVENT, il, p, -1, -1, 0, 0, now, now);
    }
    lock.unlock();
    ggml_backend_event_wait(d.backend, ev);
    lock.lock();
}

// node t of g's graph when it is a bank product's remap node (a bank layer's product in a long
// ubatch): the layer's first places its experts; false for any other node
static bool fc_bank_node(forecache_cache * c, fc_gctx & g, ggml_tensor * t, bool ask, int & ret) {
    if (t->op != GGML_OP_GET_ROWS || g.bank_rm.empty()) {
        return false;
    }
    auto br = g.bank_rm.find(t);
    if (br == g.bank_rm.end()) {
        return false;
    }
    ret = br->second.second == -2 || ggml_nelements(t->src[1]) == 0 ? 0 :
        fc_bank_remap(c, g, br->second.first, br->second.second, ask);
    return true;
}

int fc_node_hook(ggml_tensor * t, bool ask, void * user_data) {
    auto & g = *(fc_gctx *) user_data;
    forecache_cache * c = g.c;
    if (t == nullptr) {
        if (g.main) {
            fc_whole_wait(c);
            std::lock_guard<std::mutex> lock(c->mtx);
            c->epoch++;
        }
        if (c->bank_tokens > 0) {
            fc_bank_begin(c, g);
        }
        return 0;
    }
    int ret = 0;
    if (fc_bank_node(c, g, t, ask, ret)) {
        return ret;
    }
    if (!g.main) { // an attached context: its long ubatches' bank layers only
        auto bt = t->op == GGML_OP_MUL_MAT_ID && ask ? c->bank_map.find(t->src[0]) : c->bank_map.end();
        if (bt != c->bank_map.end()) {
            std::lock_guard<std::mutex> lock(c->mtx);
            c->layers[bt->second.first].stats.products++; // one product over its span
        }
        return 0;
    }
    if (t->op == GGML_OP_GET_ROWS && !c->remap_mm.empty()) {
        auto rm = c->remap_mm.find(t);
        if (rm != c->remap_mm.end()) {
            return fc_remap_node(c, rm->second, ask);
        }
    }
    if (c->whole_busy) { // a whole-expert job runs: its layer's tail is the only node to find
        auto ft = c->ffn_tail.find(t);
        if (ft != c->ffn_tail.end() && c->layers[ft->second].whole_epoch == c->epoch) {
            // the first reader of a layer whose host experts the CPU computed whole: their rows go
            // into the last product's result, ordered on the stream after it (no stop)
            return ask ? 2 : (fc_whole_finish(c, ft->second) ? 0 : -1);
        }
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
        auto bt = c->bank_map.find(t->src[0]);
        if (bt != c->bank_map.end() && ask) {
            std::lock_guard<std::mutex> lock(c->mtx); // an attached context's pass may count too
            c->layers[bt->second.first].stats.products++; // one product over its span
        }
        return 0;
    }
    if (ggml_nelements(t->src[3]) == 0) {
        // a ubatch that asks for no outputs routes no tokens through the last layer: nothing to place
        return 0;
    }
    fc_layer & L = c->layers[it->second.first];
    const int32_t p = it->second.second;
    if (L.quiet_epoch == c->epoch && fc_remapped(t)) {
        L.stats.products += ask; // resident: one product over the slots, as the map says
        return 0;
    }
    const bool routed = L.epoch == c->epoch && L.ids_src == t->src[3];
    if (routed && L.host_mode && L.whole_epoch == c->epoch) {
        return ask ? 2 : 1; // the CPU computes the layer's experts whole: skipped, without a stop
    }
    if (ask) {
        if (!routed || L.host_mode || fc_grouped(L)) {
            return 1;
        }
        std::lock_guard<std::mutex> lock(c->mtx);
        if (fc_all_ready(c, L, p, p + 1)) {
            L.stats.products++;
            return 0;
        }
        // a short ubatch (decode) waits on the host for this projection's copies while the nodes
        // before it run, then computes it as one product: no stop, no graph of its own (its rows
        // are too few for computing the resident experts first to hide the copies)
        if (fc_remapped(t) && t->src[3]->ne[1] < std::max<int64_t>(c->gather_tokens, 2)) {
            L.wait_node = t;
            return 2;
        }
        return 1;
    }
    if (L.wait_node == t) {
        L.wait_node = nullptr;
        std::unique_lock<std::mutex> lock(c->mtx);
        if (c->copy_stream && c->devs[L.dev].copy != nullptr) {
            fc_wait_proj_event(c, it->second.first, p, lock);
        } else {
            fc_wait_proj(c, it->second.first, p, lock);
        }
        if (c->disk_failed) {
            return -1; // an expert could not be read
        }
        L.stats.products++;
        return 0;
    }
    L.stats.stops++;
    if (!routed && !fc_route(c, it->second.first, t)) {
        return -1;
    }
    if (L.host_mode) {
        return fc_host_compute(c, L, p, t) ? 1 : -1;
    }
    const bool groupable = c->devs[L.dev].group_alloc != nullptr && t->src[1]->type == GGML_TYPE_F32 &&
            ggml_is_contiguous(t->src[1]) && ggml_is_contiguous(t);
    {
        std::unique_lock<std::mutex> lock(c->mtx);
        if (!fc_grouped(L) && !groupable) {
            fc_wait_proj(c, it->second.first, p, lock);
        }
        if (c->disk_failed) {
            return -1; // an expert could not be read
        }
        if (!fc_grouped(L) && fc_all_ready(c, L, p, p + 1)) {
            L.stats.n_groups++;
            L.stats.products++;
            return 0; // everything is in place: the node runs as rewritten, over the slot ids
        }
    }
    if (!groupable) {
        LLAMA_LOG_ERROR("%s: cannot stream experts through %s: unsupported layout\n", __func__, t->name);
        return -1;
    }
    return fc_slot_compute(c, L, p, t) ? 1 : -1;
}
