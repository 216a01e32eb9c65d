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
    ggml_backend_free(d.bank_copy);
    d.bank_copy = nullptr;
}

bool fc_bank_gctx_events(forecache_cache * c, fc_gctx & g) {
    g.freed.assign(c->devs.size(), nullptr);
    for (size_t k = 0; k < c->devs.size(); k++) {
        if (c->devs[k].bank_copy != nullptr) {
            g.freed[k] = ggml_backend_event_new(c->devs[k].dev);
            if (g.freed[k] == nullptr) {
                return false;
            }
        }
    }
    return true;
}

void fc_bank_gctx_free(fc_gctx & g) {
    for (ggml_backend_event_t & ev : g.freed) {
        if (ev != nullptr) {
            ggml_backend_event_free(ev);
            ev = nullptr;
        }
    }
}

void fc_bank_free(forecache_cache * c) {
    fc_bank_gctx_free(c->main);
    for (auto & g : c->attached) {
        fc_bank_gctx_free(*g);
    }
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
    for (ggml_backend_event_t & ev : d.bank_filled) {
        ev = d.bank_copy != nullptr ? ggml_backend_event_new(d.dev) : nullptr;
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
    if (!fc_bank_gctx_events(cache, cache->main)) {
        forecache_set_err(err, err_size, "cannot create the prompt banks' events");
        fc_bank_free(cache);
        return -1;
    }
    {
        std::lock_guard<std::mutex> lock(cache->mtx);
        cache->bank_tokens = min_tokens;
    }
    cache->main.lctx->reset_graph_reuse(); // the next graph is split anew, with its bank layers
    return 0;
}

// copies layer il's planned experts from host memory: run [e0, e1) of experts side by side, each into
// the bank region's place the plan gave it (side by side too), or each into its slot
static void fc_bank_copy(forecache_cache * c, int32_t il, const std::vector<std::pair<int32_t, int32_t>> & runs,
        const std::vector<std::pair<int32_t, int32_t>> & to_slots, ggml_backend_t copy, int32_t rows) {
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
        fc_span_add(c, FORECACHE_SPAN_BANK, il, -1, -1, -1, rows, bytes, t0, fc_clock::now());
    }
}

// layer m's fill for g's pass is issued (its region holds it, or is being filled with it; lock held)
static bool fc_bank_issued(const forecache_cache * c, const fc_gctx & g, int32_t m) {
    const fc_layer & M = c->layers[m];
    const fc_device & d = c->devs[M.dev];
    return d.bank_layer[M.bank_region] == m && d.bank_epoch[M.bank_region] == g.bank_id;
}

// whether layer m (-1: none) is to be filled ahead: not issued yet, and some expert of it is not
// resident (lock held)
static bool fc_bank_wants(const forecache_cache * c, const fc_gctx & g, int32_t m) {
    return m >= 0 && !fc_bank_issued(c, g, m) && !fc_complete(c, m);
}

// whether g's pass may fill layer m's region now: no pass still reads what it holds (lock held). A
// round's passes read each fill of the round, so a region of the round is filled anew once every
// pass of it has begun and launched the nodes of the layer it holds; any other fill is done with
// (the passes that read it have ended, as a pass that joins no round waits for)
static bool fc_bank_may_fill(const forecache_cache * c, const fc_gctx & g, int32_t m) {
    const fc_layer & M = c->layers[m];
    const fc_device & d = c->devs[M.dev];
    const int32_t r = M.bank_region;
    if (!d.bank_ready[r]) {
        return false; // a fill being issued into it
    }
    if (!g.member || d.bank_epoch[r] != g.bank_id) {
        return true;
    }
    if (c->round_joined < c->round_n) {
        return false; // a pass yet to begin reads every fill of its round
    }
    for (const fc_gctx * h : c->round_members) {
        if (h->member && h->at <= d.bank_layer[r]) {
            return false;
        }
    }
    return true;
}

// fills layer m's region for g's pass: plans where each expert of the layer is (a resident expert is
// read from its slot; the others go into the region, side by side, and those beyond its size into
// empty slots, the layer's queued loads dropped and its running ones landed first where the two lack
// room), writes the layer's tables and issues the copies after every node launched so far by the
// passes that read the region. Returns 1 when this call issued it, 0 when it was issued already (by
// g's pass or another of its round), -1 when it may not be filled yet and !block (lock not held).
static int fc_bank_fill(forecache_cache * c, fc_gctx & g, int32_t m, bool block) {
    fc_layer & M = c->layers[m];
    const int32_t k = M.dev;
    fc_device & d = c->devs[k];
    const int32_t r = M.bank_region;
    std::vector<std::pair<int32_t, int32_t>> runs;
    std::vector<std::pair<int32_t, int32_t>> to_slots;
    std::vector<const fc_gctx *> readers;
    std::vector<int32_t> tables; // projections whose table changed
    {
        std::unique_lock<std::mutex> lock(c->mtx);
        for (;;) {
            if (fc_bank_issued(c, g, m) || c->stop) {
                return 0;
            }
            if (fc_bank_may_fill(c, g, m)) {
                break;
            }
            if (!block) {
                return -1;
            }
            c->cv_round.wait(lock);
        }
        d.bank_layer[r] = m;
        d.bank_epoch[r] = g.bank_id;
        d.bank_ready[r] = false;
        M.bank_filler   = &g;
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
                d.bank_ready[r] = true;
                c->cv_round.notify_all();
                return 0;
            }
        }
        // the tables the layer's products read its experts' places through
        for (int32_t p = 0; p < M.n_proj; p++) {
            std::vector<int32_t> & want = c->slots;
            want.resize(M.n_expert);
            for (int32_t e = 0; e < M.n_expert; e++) {
                want[e] = M.plan_slot[e] >= 0 ? M.unit[p] + M.plan_slot[e] : std::max(M.plan_bank[e], 0);
            }
            if (want != M.bmap_dev[p]) {
                M.bmap_dev[p] = want;
                M.stats.uploads++;
                tables.push_back(p);
            }
        }
        M.plan_waits = M.plan_copies || !tables.empty();
        if (M.plan_copies) {
            M.stats.banked++;
        }
        // every context: a pass that ended may still run on its stream (a decode returns
        // before its last nodes are done)
        readers.push_back(&c->main);
        for (const auto & a : c->attached) {
            readers.push_back(a.get());
        }
    }
    std::lock_guard<std::mutex> issue(c->fill_mtx);
    if (d.bank_copy != nullptr) {
        // the region and the tables are free once each context's compute stream has passed the
        // nodes it had launched when it last moved on or ended (this pass: now)
        ggml_backend_event_record(g.freed[k], g.backend[k]);
        for (const fc_gctx * h : readers) {
            ggml_backend_event_wait(d.bank_copy, h->freed[k]);
        }
        for (int32_t p : tables) {
            ggml_backend_tensor_set_async(d.bank_copy, M.bmap[p], M.bmap_dev[p].data(), 0, ggml_nbytes(M.bmap[p]));
        }
        fc_bank_copy(c, m, runs, to_slots, d.bank_copy, g.bank_rows);
        ggml_backend_event_record(d.bank_filled[r], d.bank_copy);
        std::lock_guard<std::mutex> lock(c->mtx);
        d.bank_ready[r] = true;
        c->cv_round.notify_all();
    } else {
        d.filler->wait(); // the thread's last fill (of the other region) is done: the tables are not read now
        for (int32_t p : tables) {
            ggml_backend_tensor_set(M.bmap[p], M.bmap_dev[p].data(), 0, ggml_nbytes(M.bmap[p]));
        }
        const int32_t rows = g.bank_rows;
        d.filler->run([c, m, r, &d, rows, runs = std::move(runs), to_slots = std::move(to_slots)] {
            fc_bank_copy(c, m, runs, to_slots, nullptr, rows);
            std::lock_guard<std::mutex> lock(c->mtx);
            d.bank_ready[r] = true;
            c->cv_round.notify_all();
        });
    }
    return 1;
}

void fc_bank_end_pass(forecache_cache * c, fc_gctx & g) {
    if (g.member || g.solo) {
        for (size_t k = 0; k < g.freed.size(); k++) {
            if (g.freed[k] != nullptr) {
                ggml_backend_event_record(g.freed[k], g.backend[k]); // everything it launched
            }
        }
    }
    if (g.member) {
        g.member = false;
        g.at     = INT32_MAX;
        c->round_active--;
    }
    if (g.solo) {
        g.solo = false;
        c->solo_busy = false;
    }
    if (g.main) {
        c->exclusive = false;
    }
    c->cv_round.notify_all();
}

// context g's next pass takes its place in the running round if it has not (lock held); false when
// the round has no place for it
static bool fc_round_take(forecache_cache * c, fc_gctx & g) {
    if (c->round_joined >= c->round_n || g.round == c->round_id) {
        return false;
    }
    g.round = c->round_id;
    c->round_joined++;
    return true;
}

void fc_bank_begin(forecache_cache * c, fc_gctx & g) {
    std::unique_lock<std::mutex> lock(c->mtx);
    fc_bank_end_pass(c, g); // its pass before ended
    if (g.bank_first >= 0) {
        // a bank pass: a member of the running round, or alone once no other pass reads the banks
        for (;;) {
            if (!c->exclusive && !c->solo_busy && fc_round_take(c, g)) {
                g.member  = true;
                g.at      = -1;
                g.bank_id = c->round_id;
                c->round_active++;
                c->round_members.push_back(&g);
                break;
            }
            if (!c->exclusive && !c->solo_busy && c->round_active == 0) {
                g.bank_id   = ++c->bank_ids;
                g.solo      = true;
                c->solo_busy = true;
                break;
            }
            c->cv_round.wait(lock);
        }
        c->bank_hold = true;
        const bool wants = fc_bank_wants(c, g, g.bank_first);
        lock.unlock();
        if (wants) {
            fc_bank_fill(c, g, g.bank_first, false); // beside the nodes before the first bank layer
        }
        return;
    }
    fc_round_take(c, g); // a pass of the round that banks nothing
    if (!g.main) {
        return; // an attached context's other graphs are stock llama.cpp's: they read no slot
    }
    // the main context's other passes change the slots: the round's passes end first
    c->cv_round.wait(lock, [&] {
        return c->round_joined >= c->round_n && c->round_active == 0 && !c->solo_busy;
    });
    c->exclusive = true;
    if (c->bank_hold) {
        // copies into slots start again: the last bank pass's products and fills are done first
        lock.unlock();
        for (size_t k = 0; k < c->devs.size(); k++) {
            if (c->devs[k].bank_copy != nullptr) {
                ggml_backend_synchronize(c->devs[k].bank_copy);
            }
            if (c->devs[k].filler) {
                std::lock_guard<std::mutex> issue(c->fill_mtx);
                c->devs[k].filler->wait();
            }
            ggml_backend_synchronize(c->devs[k].backend);
            for (const auto & a : c->attached) { // their last passes read the slots too
                ggml_backend_synchronize(a->backend[k]);
            }
        }
        lock.lock();
        c->bank_hold = false;
        c->bank_gen++; // the slots may change: tables are made anew
    }
}

int fc_bank_remap(forecache_cache * c, fc_gctx & g, int32_t il, int32_t next, bool ask) {
    fc_layer & L = c->layers[il];
    const int32_t k = L.dev;
    fc_device & d = c->devs[k];
    const bool events = d.bank_copy != nullptr;
    if (ask) {
        std::lock_guard<std::mutex> lock(c->mtx);
        if (!g.member && !fc_bank_issued(c, g, il) && L.bank_gen == c->bank_gen && fc_complete(c, il) &&
                !fc_bank_wants(c, g, next)) {
            L.stats.quiet++; // every expert resident and its tables pointing at their slots
            return 0;
        }
        if (!events) {
            L.stats.stops++; // the nodes before are computed: the region of the bank layer before is free
            return 1;
        }
        return 2;
    }
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        if (g.member) {
            if (events) {
                ggml_backend_event_record(g.freed[k], g.backend[k]);
            }
            g.at = il; // the layers before are launched: the round's fills of them may be replaced
            c->cv_round.notify_all();
        }
    }
    fc_bank_fill(c, g, il, true); // not filled ahead: the layer before was complete, or this is the first
    bool waits = false;
    bool wants = false;
    {
        std::unique_lock<std::mutex> lock(c->mtx);
        c->cv_round.wait(lock, [&] { return d.bank_ready[L.bank_region] || c->stop; });
        waits = L.plan_waits;
        // tables that point at slots only stay right while the slots stay (this hold)
        L.bank_gen = L.plan_copies ? 0 : c->bank_gen;
        if (!L.plan_copies) {
            L.stats.quiet++;
        } else if (L.bank_filler != &g) {
            L.stats.shared++; // its round's fill, made by another pass
        }
        wants = fc_bank_wants(c, g, next);
    }
    if (wants) {
        fc_bank_fill(c, g, next, false); // while this layer computes
    }
    if (events && waits) {
        ggml_backend_event_wait(g.backend[k], d.bank_filled[L.bank_region]);
    }
    return 0;
}
