// forecache expert cache: slot placement and prompt banks (forecache_cache_set_bank).
// See forecache-cache-impl.h for how the expert cache's files divide the work.
//
// A ubatch of a long prompt routes nearly every expert of every layer. Stock llama.cpp copies a layer's
// host experts to the device for such a ubatch and computes one product per projection. A bank layer
// computes one product per projection too, over its slots and a bank region that holds the experts its
// slots lack: each device keeps two regions in front of its slots, and a bank layer's product reads a
// tensor that spans from its region to the end of its slots, its routed ids mapped on the device
// through a table of where each expert is (a slot, or a place in the region). Only the experts the slots
// lack cross the bus, and the next bank layer's region fills while this one computes. No routed id is
// read back. Where the device has events, fills run on a backend (stream) of their own that waits for
// the compute stream's event and the compute stream waits for the fill's; elsewhere (the CPU, an RPC
// server) a thread fills the next region while the layer computes.

#include "forecache-cache-impl.h"

// the layer's experts can be banked: cached, in host memory (not a disk tier), each projection contiguous
static bool fc_bankable(const fc_layer & L) {
    if (L.n_slots == 0 || L.n_host > 0) {
        return false;
    }
    for (int32_t p = 0; p < L.n_proj; p++) {
        if (!ggml_is_contiguous(L.host[p]) || L.host[p]->data == nullptr) {
            return false;
        }
    }
    return true;
}

bool fc_place_pools(forecache_cache * c, int32_t k, int32_t n_bank, char * err, size_t err_size) {
    fc_device & d = c->devs[k];
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(d.dev);
    const size_t align = ggml_backend_buft_get_alignment(buft);
    std::vector<int32_t> mine;   // the device's cached layers
    std::vector<int32_t> region; // bank region of each, -1: none
    int32_t n_proj  = 0;
    int32_t n_banked = 0;
    for (int32_t il = 0; il < (int32_t) c->layers.size(); il++) {
        const fc_layer & L = c->layers[il];
        if (L.n_slots > 0 && L.dev == k) {
            mine.push_back(il);
            region.push_back(n_bank > 0 && fc_bankable(L) ? n_banked++ % 2 : -1);
            n_proj = std::max(n_proj, L.n_proj);
        }
    }
    // per projection: its two regions, then the bank layers' slots of region 0 and of region 1, each
    // placed a whole number of experts from its region's start (those of one size together), then the
    // other layers' slots
    std::vector<size_t> off(mine.size()*FC_MAX_PROJ, 0);
    size_t bank_at[2][FC_MAX_PROJ] = {};
    size_t cursor = 0;
    for (int32_t p = 0; p < n_proj; p++) {
        size_t widest = 0;
        for (size_t i = 0; i < mine.size(); i++) {
            const fc_layer & L = c->layers[mine[i]];
            widest = p < L.n_proj && region[i] >= 0 ? std::max(widest, L.host[p]->nb[2]) : widest;
        }
        cursor = GGML_PAD(cursor, align);
        for (int32_t r = 0; r < 2; r++) {
            bank_at[r][p] = cursor;
            cursor += GGML_PAD((size_t) n_bank*widest, align);
        }
        std::vector<size_t> order(mine.size());
        for (size_t i = 0; i < order.size(); i++) {
            order[i] = i;
        }
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
            const int32_t ra = region[a] < 0 ? 2 : region[a];
            const int32_t rb = region[b] < 0 ? 2 : region[b];
            const size_t na = p < c->layers[mine[a]].n_proj ? c->layers[mine[a]].host[p]->nb[2] : 0;
            const size_t nb = p < c->layers[mine[b]].n_proj ? c->layers[mine[b]].host[p]->nb[2] : 0;
            return ra != rb ? ra < rb : na < nb;
        });
        for (size_t i : order) {
            const fc_layer & L = c->layers[mine[i]];
            if (p >= L.n_proj) {
                continue;
            }
            const size_t nb2 = L.host[p]->nb[2];
            size_t at = GGML_PAD(cursor, align);
            if (region[i] >= 0) {
                const size_t base = bank_at[region[i]][p];
                at = base + (cursor - base + nb2 - 1)/nb2*nb2;
                for (size_t tries = 0; at % align != 0 && tries < align; tries++) {
                    at += nb2;
                }
                if (at % align != 0) {
                    forecache_set_err(err, err_size, "layer %d's experts (%zu bytes) cannot be placed at the device's alignment", mine[i], nb2);
                    return false;
                }
            }
            off[i*FC_MAX_PROJ + p] = at;
            cursor = at + ggml_backend_buft_get_alloc_size(buft, L.pool[p]);
        }
    }
    if (d.slot_buf != nullptr) {
        ggml_backend_buffer_free(d.slot_buf);
        d.slot_buf = nullptr;
    }
    d.slot_buf = ggml_backend_buft_alloc_buffer(buft, std::max<size_t>(cursor, 1));
    if (d.slot_buf == nullptr) {
        forecache_set_err(err, err_size, "cannot allocate %.1f MiB of expert slots%s on %s", cursor/1048576.0,
                n_bank > 0 ? " and prompt banks" : "", ggml_backend_dev_name(d.dev));
        return false;
    }
    ggml_backend_buffer_set_usage(d.slot_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    char * base = (char *) ggml_backend_buffer_get_base(d.slot_buf);
    for (size_t i = 0; i < mine.size(); i++) {
        fc_layer & L = c->layers[mine[i]];
        L.bank_region = region[i];
        for (int32_t p = 0; p < L.n_proj; p++) {
            L.pool[p]->buffer = nullptr;
            L.pool[p]->data   = nullptr;
            if (ggml_backend_tensor_alloc(d.slot_buf, L.pool[p], base + off[i*FC_MAX_PROJ + p]) != GGML_STATUS_SUCCESS) {
                forecache_set_err(err, err_size, "cannot place the slots of layer %d", mine[i]);
                return false;
            }
            if (region[i] >= 0) {
                L.unit[p] = (int32_t) ((off[i*FC_MAX_PROJ + p] - bank_at[region[i]][p])/L.host[p]->nb[2]);
            }
        }
    }
    d.bank_n = n_bank;
    return true;
}

// the device's fills' backend and events (after its fills are done)
static void fc_bank_stream_free(fc_device & d) {
    if (d.bank_copy != nullptr) {
        ggml_backend_synchronize(d.bank_copy);
    }
    for (ggml_backend_event_t & ev : d.bank_filled) {
        if (ev != nullptr) {
            ggml_backend_event_free(ev);
            ev = nullptr;
        }
    }
    if (d.bank_freed != nullptr) {
        ggml_backend_event_free(d.bank_freed);
        d.bank_freed = nullptr;
    }
    ggml_backend_free(d.bank_copy);
    d.bank_copy = nullptr;
}

void fc_bank_free(forecache_cache * c) {
    for (fc_device & d : c->devs) {
        if (d.filler) {
            d.filler->wait();
            d.filler->finish();
            d.filler.reset();
        }
        fc_bank_stream_free(d);
        ggml_backend_buffer_free(d.bank_buf);
        d.bank_buf = nullptr;
        if (d.bmap_ctx != nullptr) {
            ggml_free(d.bmap_ctx);
            d.bmap_ctx = nullptr;
        }
    }
    if (c->bank_ctx != nullptr) {
        ggml_free(c->bank_ctx);
        c->bank_ctx = nullptr;
    }
    for (fc_layer & L : c->layers) {
        std::fill(L.span, L.span + FC_MAX_PROJ, nullptr);
        std::fill(L.bmap, L.bmap + FC_MAX_PROJ, nullptr);
    }
    c->bank_map.clear();
    c->bank_tokens = 0;
}

// fills with events: a backend of the device's own (its stream) and events to order it with compute
static bool fc_bank_events(fc_device & d) {
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(d.dev, &props);
    if (ggml_backend_dev_type(d.dev) == GGML_BACKEND_DEVICE_TYPE_CPU || !props.caps.events || d.backend == nullptr) {
        return false;
    }
    d.bank_copy = ggml_backend_dev_init(d.dev, nullptr);
    d.bank_freed = d.bank_copy != nullptr ? ggml_backend_event_new(d.dev) : nullptr;
    for (ggml_backend_event_t & ev : d.bank_filled) {
        ev = d.bank_freed != nullptr ? ggml_backend_event_new(d.dev) : nullptr;
    }
    if (d.bank_filled[0] != nullptr && d.bank_filled[1] != nullptr) {
        return true;
    }
    fc_bank_stream_free(d);
    return false;
}

int32_t forecache_cache_set_bank(struct forecache_cache * cache, int32_t min_tokens, char * err, size_t err_size) {
    if (cache->bank_ctx != nullptr || min_tokens <= 0) {
        forecache_set_err(err, err_size, cache->bank_ctx != nullptr ? "prompt banks are already set" : "min_tokens must be positive");
        return -1;
    }
    int32_t n_tensors = 0;
    {
        std::lock_guard<std::mutex> lock(cache->mtx);
        for (const fc_layer & L : cache->layers) {
            for (int32_t e : L.expert_of) {
                if (e >= 0) {
                    forecache_set_err(err, err_size, "prompt banks must be set before any expert is loaded");
                    return -1;
                }
            }
            n_tensors += fc_bankable(L) ? L.n_proj : 0;
        }
    }
    if (n_tensors == 0) {
        forecache_set_err(err, err_size, "no cached layer has its experts in host memory");
        return -1;
    }
    ggml_init_params params = {
        /*.mem_size   =*/ (size_t) n_tensors*ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    cache->bank_ctx = ggml_init(params);
    for (size_t k = 0; k < cache->devs.size(); k++) {
        fc_device & d = cache->devs[k];
        int32_t n_bank = 0;
        bool any = false;
        for (const fc_layer & L : cache->layers) {
            if (L.dev == (int32_t) k && fc_bankable(L)) {
                n_bank = std::max(n_bank, L.n_expert - L.n_slots);
                any = true;
            }
        }
        if (!any) {
            continue;
        }
        // the slots are placed anew behind the two regions (nothing is in them yet)
        if (!fc_place_pools(cache, (int32_t) k, std::max(n_bank, 1), err, err_size)) {
            fc_bank_free(cache);
            return -1;
        }
        ggml_init_params mparams = {
            /*.mem_size   =*/ (size_t) (n_tensors + 1)*ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        d.bmap_ctx = ggml_init(mparams);
        for (int32_t il = 0; il < (int32_t) cache->layers.size(); il++) {
            fc_layer & L = cache->layers[il];
            if (L.dev != (int32_t) k || L.bank_region < 0) {
                continue;
            }
            for (int32_t p = 0; p < L.n_proj; p++) {
                const ggml_tensor * h = L.host[p];
                ggml_tensor * t = ggml_new_tensor_3d(cache->bank_ctx, h->type, h->ne[0], h->ne[1], L.unit[p] + L.n_slots);
                ggml_format_name(t, "fc.span.%s", h->name);
                // from its region's start: unit[p] experts before its first slot
                char * from = (char *) L.pool[p]->data - (size_t) L.unit[p]*h->nb[2];
                if (ggml_backend_tensor_alloc(d.slot_buf, t, from) != GGML_STATUS_SUCCESS) {
                    forecache_set_err(err, err_size, "cannot place the prompt bank of layer %d", il);
                    fc_bank_free(cache);
                    return -1;
                }
                L.span[p] = t;
                cache->bank_map[t] = {il, p};
                L.bmap[p] = ggml_new_tensor_2d(d.bmap_ctx, GGML_TYPE_I32, 1, L.n_expert);
                ggml_format_name(L.bmap[p], "fc.bmap.%d.%d", il, p);
            }
            L.plan_slot.assign(L.n_expert, -1);
            L.plan_bank.assign(L.n_expert, -1);
        }
        d.bank_buf = ggml_backend_alloc_ctx_tensors_from_buft(d.bmap_ctx, ggml_backend_dev_buffer_type(d.dev));
        if (d.bank_buf == nullptr) {
            forecache_set_err(err, err_size, "cannot allocate the prompt banks' tables on %s", ggml_backend_dev_name(d.dev));
            fc_bank_free(cache);
            return -1;
        }
        for (fc_layer & L : cache->layers) {
            for (int32_t p = 0; L.dev == (int32_t) k && L.bank_region >= 0 && p < L.n_proj; p++) {
                L.bmap_dev[p].assign(L.n_expert, 0); // every entry a valid place before the first fill
                ggml_backend_tensor_set(L.bmap[p], L.bmap_dev[p].data(), 0, ggml_nbytes(L.bmap[p]));
            }
        }
        if (!fc_bank_events(d)) {
            d.filler = std::make_unique<fc_host_thread>();
        }
    }
    {
        std::lock_guard<std::mutex> lock(cache->mtx);
        cache->bank_tokens = min_tokens;
    }
    cache->lctx->reset_graph_reuse(); // the next graph is split anew, with its bank layers
    return 0;
}

// copies layer il's planned experts from host memory: run [e0, e1) of experts side by side, each into
// the bank region's place the plan gave it (side by side too), or each into its slot
static void fc_bank_copy(forecache_cache * c, int32_t il, const std::vector<std::pair<int32_t, int32_t>> & runs,
        const std::vector<std::pair<int32_t, int32_t>> & to_slots, ggml_backend_t copy) {
    fc_layer & L = c->layers[il];
    const auto t0 = fc_clock::now();
    uint64_t bytes = 0;
    auto put = [&](ggml_tensor * t, const void * data, size_t offset, size_t size) {
        if (copy != nullptr) {
            ggml_backend_tensor_set_async(copy, t, data, offset, size);
        } else {
            ggml_backend_tensor_set(t, data, offset, size);
        }
        bytes += size;
    };
    for (int32_t p = 0; p < L.n_proj; p++) {
        const ggml_tensor * h = L.host[p];
        const size_t nb2 = h->nb[2];
        for (const auto & [e0, e1] : runs) {
            put(L.span[p], (const char *) h->data + e0*nb2, L.plan_bank[e0]*nb2, (e1 - e0)*nb2);
        }
        for (const auto & [e, s] : to_slots) {
            put(L.pool[p], (const char *) h->data + e*nb2, s*nb2, nb2);
        }
    }
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        L.stats.bank_bytes += bytes;
    }
    if (c->tl_on.load(std::memory_order_relaxed)) {
        fc_span_add(c, FORECACHE_SPAN_BANK, il, -1, -1, -1, c->bank_rows, bytes, t0, fc_clock::now());
    }
}

// layer m's fill for this pass is issued (its region holds it, or is being filled with it; lock held)
static bool fc_bank_issued(const forecache_cache * c, int32_t m) {
    const fc_layer & M = c->layers[m];
    const fc_device & d = c->devs[M.dev];
    return d.bank_layer[M.bank_region] == m && d.bank_epoch[M.bank_region] == c->epoch;
}

// whether layer m (-1: none) is to be filled ahead: not issued yet, and some expert of it is not
// resident (lock held)
static bool fc_bank_wants(const forecache_cache * c, int32_t m) {
    return m >= 0 && !fc_bank_issued(c, m) && !fc_complete(c, m);
}

// plans where each expert of layer m is for this pass and issues the copies, after every node launched
// so far: a resident expert is read from its slot; the others go into the region, side by side, and
// those beyond its size into empty slots, the layer's queued loads dropped and its running ones
// landed first where the two lack room (lock not held)
static void fc_bank_fill(forecache_cache * c, int32_t m) {
    fc_layer & M = c->layers[m];
    fc_device & d = c->devs[M.dev];
    const int32_t r = M.bank_region;
    std::vector<std::pair<int32_t, int32_t>> runs;
    std::vector<std::pair<int32_t, int32_t>> to_slots;
    {
        std::unique_lock<std::mutex> lock(c->mtx);
        auto plan = [&]() {
            runs.clear();
            to_slots.clear();
            int32_t n_pending = 0; // missing, with a slot whose copy is in flight
            int32_t n_none    = 0; // missing, without a slot
            for (int32_t e = 0; e < M.n_expert; e++) {
                const int32_t s = M.slot_of[e];
                const bool ready = s >= 0 && fc_slot_state(M, s) == FORECACHE_SLOT_READY;
                M.plan_slot[e] = ready ? s : -1;
                M.plan_bank[e] = -1;
                n_pending += !ready && s >= 0;
                n_none    += s < 0;
            }
            int32_t n_empty = 0;
            for (int32_t s = 0; s < M.n_slots; s++) {
                n_empty += M.expert_of[s] < 0;
            }
            if (n_pending + std::max(n_none - n_empty, 0) > d.bank_n) {
                return false; // wait for the copies in flight into the layer's slots
            }
            // the first experts without a slot into empty slots (its copy is ordered before every
            // read of the slot), the rest into the region
            int32_t s = 0;
            for (int32_t e = 0; e < M.n_expert && n_empty > 0; e++) {
                if (M.slot_of[e] >= 0) {
                    continue;
                }
                while (M.expert_of[s] >= 0) {
                    s++;
                }
                fc_map_slot(c, m, e, s);
                M.plan_slot[e] = s;
                to_slots.emplace_back(e, s);
                n_empty--;
            }
            int32_t j = 0;
            for (int32_t e = 0; e < M.n_expert; e++) {
                if (M.plan_slot[e] >= 0) {
                    continue;
                }
                M.plan_bank[e] = j++;
                if (!runs.empty() && runs.back().second == e) {
                    runs.back().second = e + 1;
                } else {
                    runs.emplace_back(e, e + 1);
                }
            }
            M.plan_copies = !runs.empty() || !to_slots.empty();
            return true;
        };
        while (!plan()) {
            // the layer's queued loads give way (the fill copies their experts itself); copies
            // already running are waited for
            if (fc_drop_queued(c, 0, [&](const fc_chunk & ch) { return ch.layer == m; }) > 0) {
                continue;
            }
            c->cv_done.wait(lock, [&] {
                int32_t left = 0;
                for (int32_t s = 0; s < M.n_slots; s++) {
                    left += M.pending[s];
                }
                return left == 0 || c->stop;
            });
            if (c->stop) {
                return;
            }
        }
        d.bank_layer[r] = m;
        d.bank_epoch[r] = c->epoch;
    }
    if (d.bank_copy != nullptr) {
        // the region is free once the compute stream has passed the nodes launched so far
        ggml_backend_event_record(d.bank_freed, d.backend);
        ggml_backend_event_wait(d.bank_copy, d.bank_freed);
        fc_bank_copy(c, m, runs, to_slots, d.bank_copy);
        ggml_backend_event_record(d.bank_filled[r], d.bank_copy);
    } else {
        d.filler->wait();
        d.filler->run([c, m, runs = std::move(runs), to_slots = std::move(to_slots)] {
            fc_bank_copy(c, m, runs, to_slots, nullptr);
        });
    }
}

// the tables the layer's products read its experts' places through, as its plan has them (lock held)
static void fc_bank_tables(forecache_cache * c, int32_t il) {
    fc_layer & L = c->layers[il];
    for (int32_t p = 0; p < L.n_proj; p++) {
        std::vector<int32_t> & want = c->slots;
        want.resize(L.n_expert);
        for (int32_t e = 0; e < L.n_expert; e++) {
            want[e] = L.plan_slot[e] >= 0 ? L.unit[p] + L.plan_slot[e] : std::max(L.plan_bank[e], 0);
        }
        if (want != L.bmap_dev[p]) {
            fc_device & d = c->devs[L.dev];
            if (d.bank_copy != nullptr) {
                // on the compute stream: after the products of passes before that read the table
                ggml_backend_tensor_set_async(d.backend, L.bmap[p], want.data(), 0, ggml_nbytes(L.bmap[p]));
            } else {
                ggml_backend_tensor_set(L.bmap[p], want.data(), 0, ggml_nbytes(L.bmap[p]));
            }
            L.bmap_dev[p] = want;
            L.stats.uploads++;
        }
    }
}

void fc_bank_begin(forecache_cache * c) {
    for (fc_device & d : c->devs) {
        if (d.filler) {
            d.filler->wait(); // a fill of a pass that was cancelled
        }
    }
    if (c->bank_first >= 0) {
        bool wants = false;
        {
            std::lock_guard<std::mutex> lock(c->mtx);
            c->bank_hold = true;
            wants = fc_bank_wants(c, c->bank_first);
        }
        if (wants) {
            fc_bank_fill(c, c->bank_first); // beside the nodes before the first bank layer
        }
        return;
    }
    if (c->bank_hold) {
        // copies into slots start again: the last bank pass's products and fills are done first
        for (fc_device & d : c->devs) {
            if (d.bank_copy != nullptr) {
                ggml_backend_synchronize(d.bank_copy);
            }
            ggml_backend_synchronize(d.backend);
        }
        std::lock_guard<std::mutex> lock(c->mtx);
        c->bank_hold = false;
        c->bank_gen++; // the slots may change: tables are made anew
    }
}

int fc_bank_remap(forecache_cache * c, int32_t il, int32_t next, bool ask) {
    fc_layer & L = c->layers[il];
    fc_device & d = c->devs[L.dev];
    const bool events = d.bank_copy != nullptr;
    if (ask) {
        std::lock_guard<std::mutex> lock(c->mtx);
        if (!fc_bank_issued(c, il) && L.bank_gen == c->bank_gen && fc_complete(c, il) && !fc_bank_wants(c, next)) {
            L.stats.quiet++; // every expert resident and its tables pointing at their slots
            return 0;
        }
        if (!events) {
            L.stats.stops++; // the nodes before are computed: the region of the bank layer before is free
            return 1;
        }
        return 2;
    }
    bool fill = false;
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        fill = !fc_bank_issued(c, il);
    }
    if (fill) {
        fc_bank_fill(c, il); // not filled ahead: the layer before was complete, or this is the first
    }
    if (!events) {
        d.filler->wait(); // its region is filled
    }
    bool wants  = false;
    bool copies = false;
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        fc_bank_tables(c, il);
        copies = L.plan_copies;
        // tables that point at slots only stay right while the slots stay (this hold)
        L.bank_gen = copies ? 0 : c->bank_gen;
        (copies ? L.stats.banked : L.stats.quiet)++;
        wants = fc_bank_wants(c, next);
    }
    if (wants) {
        fc_bank_fill(c, next); // while this layer computes
    }
    if (events && copies) {
        ggml_backend_event_wait(d.backend, d.bank_filled[L.bank_region]);
    }
    return 0;
}
