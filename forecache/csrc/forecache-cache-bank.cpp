// forecache expert cache: prompt banks (forecache_cache_set_bank).
// See forecache-cache-impl.h for how the expert cache's files divide the work.
//
// A ubatch of a long prompt routes nearly every expert of every layer. Stock llama.cpp copies a layer's
// host experts to the device for such a ubatch and computes one product per projection; a bank layer
// does the same with a copy of all its experts in one of two bank regions of its device: the experts
// its slots hold are copied within the device, only the others cross the bus, and the next bank layer's
// region fills while this one computes. No routed id is read back: the products read the bank through
// the routed ids as they are. Where the device has events, fills run on a backend (stream) of their own
// that waits for the compute stream's event and the compute stream waits for the fill's; elsewhere (the
// CPU, an RPC server) a thread fills the next region while the layer computes.

#include "forecache-cache-impl.h"

// the bytes a layer's bank takes: each projection's experts, aligned
static size_t fc_bank_bytes(const fc_layer & L, size_t align) {
    size_t n = 0;
    for (int32_t p = 0; p < L.n_proj; p++) {
        n += GGML_PAD(ggml_nbytes(L.host[p]), align);
    }
    return n;
}

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

void fc_bank_free(forecache_cache * c) {
    for (fc_device & d : c->devs) {
        if (d.filler) {
            d.filler->wait();
            d.filler->finish();
            d.filler.reset();
        }
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
        ggml_backend_buffer_free(d.bank_buf);
        d.bank_buf = nullptr;
        if (d.bank_views != nullptr) {
            ggml_free(d.bank_views);
            d.bank_views = nullptr;
        }
    }
    if (c->bank_ctx != nullptr) {
        ggml_free(c->bank_ctx);
        c->bank_ctx = nullptr;
    }
    for (fc_layer & L : c->layers) {
        std::fill(L.bank, L.bank + FC_MAX_PROJ, nullptr);
        L.bank_region = -1;
    }
    c->bank_map.clear();
    c->bank_tokens = 0;
}

// fills with events: a backend of the device's own (its stream) and events to order it with compute
static bool fc_bank_events(fc_device & d) {
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(d.dev, &props);
    if (ggml_backend_dev_type(d.dev) == GGML_BACKEND_DEVICE_TYPE_CPU || !props.caps.events || d.compute == nullptr) {
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
    return false;
}

int32_t forecache_cache_set_bank(struct forecache_cache * cache, int32_t min_tokens, char * err, size_t err_size) {
    if (cache->bank_ctx != nullptr || min_tokens <= 0) {
        forecache_set_err(err, err_size, cache->bank_ctx != nullptr ? "prompt banks are already set" : "min_tokens must be positive");
        return -1;
    }
    int32_t n_tensors = 0;
    for (const fc_layer & L : cache->layers) {
        n_tensors += fc_bankable(L) ? L.n_proj : 0;
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
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(d.pool_buf);
        const size_t align = ggml_backend_buft_get_alignment(buft);
        size_t region = 0;
        int32_t n_proj = 0;
        int32_t n_expert = 0;
        for (const fc_layer & L : cache->layers) {
            if (L.dev == (int32_t) k && fc_bankable(L)) {
                region   = std::max(region, fc_bank_bytes(L, align));
                n_proj   = std::max(n_proj, L.n_proj);
                n_expert = std::max(n_expert, L.n_expert);
            }
        }
        if (region == 0) {
            continue;
        }
        d.bank_buf = ggml_backend_buft_alloc_buffer(buft, 2*region);
        if (d.bank_buf == nullptr) {
            forecache_set_err(err, err_size, "cannot allocate %.1f MiB of prompt banks on %s",
                    2*region/1048576.0, ggml_backend_dev_name(d.dev));
            fc_bank_free(cache);
            return -1;
        }
        ggml_backend_buffer_set_usage(d.bank_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        char * base = (char *) ggml_backend_buffer_get_base(d.bank_buf);
        int32_t n_banked = 0;
        for (int32_t il = 0; il < (int32_t) cache->layers.size(); il++) {
            fc_layer & L = cache->layers[il];
            if (L.dev != (int32_t) k || !fc_bankable(L)) {
                continue;
            }
            L.bank_region = n_banked++ % 2; // consecutive bank layers alternate
            size_t off = L.bank_region*region;
            for (int32_t p = 0; p < L.n_proj; p++) {
                const ggml_tensor * h = L.host[p];
                ggml_tensor * t = ggml_new_tensor_3d(cache->bank_ctx, h->type, h->ne[0], h->ne[1], h->ne[2]);
                ggml_format_name(t, "fc.bank.%s", h->name);
                if (ggml_backend_tensor_alloc(d.bank_buf, t, base + off) != GGML_STATUS_SUCCESS) {
                    forecache_set_err(err, err_size, "cannot place the prompt bank of layer %d", il);
                    fc_bank_free(cache);
                    return -1;
                }
                off += GGML_PAD(ggml_nbytes(t), align);
                L.bank[p] = t;
                cache->bank_map[t] = {il, p};
            }
        }
        ggml_init_params vparams = {
            /*.mem_size   =*/ (size_t) (2*n_expert*n_proj + 8)*ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        d.bank_views = ggml_init(vparams);
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

int32_t forecache_cache_bank_events(const struct forecache_cache * cache) {
    int32_t n = 0;
    for (const fc_device & d : cache->devs) {
        n += d.bank_copy != nullptr;
    }
    return n;
}

// copies layer il's experts into its region: from the slot src[e] >= 0 holds, else from host memory
// (on `copy` asynchronously, or here); a run of experts that sit side by side is one copy
static void fc_bank_copy(forecache_cache * c, int32_t il, const std::vector<int32_t> & src, ggml_backend_t copy) {
    fc_layer & L = c->layers[il];
    fc_device & d = c->devs[L.dev];
    const auto t0 = fc_clock::now();
    uint64_t h2d = 0;
    uint64_t d2d = 0;
    ggml_reset(d.bank_views);
    for (int32_t p = 0; p < L.n_proj; p++) {
        const ggml_tensor * h = L.host[p];
        const size_t nb2 = h->nb[2];
        for (int32_t e0 = 0; e0 < L.n_expert;) {
            int32_t e1 = e0 + 1;
            if (src[e0] < 0) {
                while (e1 < L.n_expert && src[e1] < 0) {
                    e1++;
                }
                const char * data = (const char *) h->data + e0*nb2;
                if (copy != nullptr) {
                    ggml_backend_tensor_set_async(copy, L.bank[p], data, e0*nb2, (e1 - e0)*nb2);
                } else {
                    ggml_backend_tensor_set(L.bank[p], data, e0*nb2, (e1 - e0)*nb2);
                }
                h2d += (e1 - e0)*nb2;
            } else {
                while (e1 < L.n_expert && src[e1] == src[e1 - 1] + 1) {
                    e1++;
                }
                const int64_t n_el = (int64_t) (e1 - e0)*h->ne[0]*h->ne[1];
                ggml_tensor * from = ggml_view_1d(d.bank_views, L.pool[p], n_el, src[e0]*nb2);
                ggml_tensor * to   = ggml_view_1d(d.bank_views, L.bank[p], n_el, e0*nb2);
                ggml_backend_view_init(from);
                ggml_backend_view_init(to);
                if (copy != nullptr) {
                    ggml_backend_tensor_copy_async(copy, copy, from, to);
                } else {
                    ggml_backend_tensor_copy(from, to);
                }
                d2d += (e1 - e0)*nb2;
            }
            e0 = e1;
        }
    }
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        L.stats.bank_bytes     += h2d;
        L.stats.bank_d2d_bytes += d2d;
    }
    if (c->tl_on.load(std::memory_order_relaxed)) {
        fc_span_add(c, FORECACHE_SPAN_BANK, il, -1, -1, -1, L.n_expert, h2d, t0, fc_clock::now());
    }
}

// whether layer m (-1: none) is to be filled ahead: its region does not hold it for this pass yet and
// some expert of it is not resident (lock held)
static bool fc_bank_wants(const forecache_cache * c, int32_t m) {
    if (m < 0) {
        return false;
    }
    const fc_layer & M = c->layers[m];
    const fc_device & d = c->devs[M.dev];
    const bool issued = d.bank_layer[M.bank_region] == m && d.bank_epoch[M.bank_region] == c->epoch;
    return !issued && !fc_complete(c, m);
}

// issues the fill of layer m's region, after every node launched so far (lock not held)
static void fc_bank_fill(forecache_cache * c, int32_t m) {
    fc_layer & M = c->layers[m];
    fc_device & d = c->devs[M.dev];
    const int32_t r = M.bank_region;
    std::vector<int32_t> src(M.n_expert, -1);
    {
        // the slots read stay as they are until a pass without bank layers (bank_hold)
        std::lock_guard<std::mutex> lock(c->mtx);
        for (int32_t e = 0; e < M.n_expert; e++) {
            const int32_t s = M.slot_of[e];
            src[e] = s >= 0 && fc_slot_state(M, s) == FORECACHE_SLOT_READY ? s : -1;
        }
        d.bank_layer[r] = m;
        d.bank_epoch[r] = c->epoch;
    }
    if (d.bank_copy != nullptr) {
        // the region is free once the compute stream has passed the nodes launched so far
        ggml_backend_event_record(d.bank_freed, d.compute);
        ggml_backend_event_wait(d.bank_copy, d.bank_freed);
        fc_bank_copy(c, m, src, d.bank_copy);
        ggml_backend_event_record(d.bank_filled[r], d.bank_copy);
    } else {
        d.filler->wait();
        d.filler->run([c, m, src = std::move(src)] { fc_bank_copy(c, m, src, nullptr); });
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
            wants = c->quiet && c->little.load() == 0 && fc_bank_wants(c, c->bank_first);
        }
        if (wants) {
            fc_bank_fill(c, c->bank_first); // beside the nodes before the first bank layer
        }
        return;
    }
    if (c->bank_hold) {
        for (fc_device & d : c->devs) {
            if (d.bank_copy != nullptr) {
                ggml_backend_synchronize(d.bank_copy); // no fill reads a slot any more
            }
        }
        std::lock_guard<std::mutex> lock(c->mtx);
        c->bank_hold = false;
    }
}

int fc_bank_remap(forecache_cache * c, int32_t il, ggml_tensor * ids, int32_t next, bool ask) {
    fc_layer & L = c->layers[il];
    fc_device & d = c->devs[L.dev];
    const bool events = d.bank_copy != nullptr;
    if (ask) {
        std::lock_guard<std::mutex> lock(c->mtx);
        if (fc_complete(c, il)) {
            fc_go_quiet(c, il, ids); // the slots hold every expert: its products read them
        } else {
            L.bank_epoch = c->epoch;
        }
        if (L.bank_epoch != c->epoch && !fc_bank_wants(c, next)) {
            return 0;
        }
        if (!events) {
            L.stats.stops++; // the nodes before are computed, the region of the bank layer before is free
            return 1;
        }
        return 2;
    }
    const bool banked = L.bank_epoch == c->epoch;
    bool ahead = false;
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        if (banked && fc_bank_wants(c, il)) {
            ahead = true;
        }
    }
    if (ahead) {
        fc_bank_fill(c, il); // not filled ahead: the layer before was quiet, or this is the first
    }
    if (banked && !events) {
        d.filler->wait(); // its region is filled
    }
    bool wants = false;
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        wants = fc_bank_wants(c, next);
        if (banked) {
            L.stats.banked++;
        }
    }
    if (wants) {
        fc_bank_fill(c, next); // while this layer computes
    }
    if (banked && events) {
        ggml_backend_event_wait(d.compute, d.bank_filled[L.bank_region]);
    }
    return 0;
}

bool fc_bank_product(forecache_cache * c, ggml_tensor * t, ggml_tensor * remap, bool ask) {
    const auto [il, p] = c->pool_map.count(t->src[0]) ? c->pool_map.at(t->src[0]) : c->bank_map.at(t->src[0]);
    fc_layer & L = c->layers[il];
    if (L.bank_epoch != c->epoch) {
        t->src[0] = L.pool[p];
        t->src[2] = remap;
        return false;
    }
    t->src[0] = L.bank[p];
    t->src[2] = t->src[3]; // the routed ids as they are: the bank holds every expert
    L.stats.products += ask;
    return true;
}
