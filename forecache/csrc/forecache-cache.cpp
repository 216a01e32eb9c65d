// forecache expert cache: the C API (init and free, loads, schedules, stage slots, stats, timeline).
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

// the scheduler's backend of device d, or nullptr when the context does not use d
static ggml_backend_t fc_sched_backend(ggml_backend_sched_t sched, ggml_backend_dev_t d) {
    for (int i = 0; d != nullptr && i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t be = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(be) == d) {
            return be;
        }
    }
    return nullptr;
}

// the ggml device of each layer's non-expert weights where llama.cpp put them on a device of the
// context's scheduler (a GPU, an RPC server's device), else nullptr (host memory)
static std::vector<ggml_backend_dev_t> fc_layer_devs(llama_context * ctx, int32_t n_layer) {
    const llama_model & model = ctx->get_model();
    ggml_backend_sched_t sched = ctx->get_sched();
    std::vector<ggml_backend_dev_t> out(n_layer, nullptr);
    for (const auto & [name, t] : model.tensors_by_name) {
        int il = -1;
        if (sscanf(name.c_str(), "blk.%d.", &il) != 1 || il < 0 || il >= n_layer || forecache_expert_layer(name.c_str()) >= 0 ||
                t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer)) {
            continue;
        }
        ggml_backend_dev_t d = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
        if (fc_sched_backend(sched, d) != nullptr) {
            out[il] = d;
        }
    }
    return out;
}

int32_t forecache_layer_devices(struct llama_context * ctx, int32_t * dev_index, int32_t n_layer) {
    if (n_layer != (int32_t) ctx->get_model().hparams.n_layer()) {
        return -1;
    }
    const std::vector<ggml_backend_dev_t> devs = fc_layer_devs(ctx, n_layer);
    for (int32_t il = 0; il < n_layer; il++) {
        dev_index[il] = -1;
        for (size_t i = 0; devs[il] != nullptr && i < ggml_backend_dev_count(); i++) {
            if (ggml_backend_dev_get(i) == devs[il]) {
                dev_index[il] = (int32_t) i;
            }
        }
    }
    return 0;
}

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
    if (fc_sched_backend(sched, dev) == nullptr) {
        forecache_set_err(err, err_size, "device %s is not used by this context", ggml_backend_dev_name(dev));
        return nullptr;
    }

    auto * c = new forecache_cache();
    c->main.c      = c;
    c->main.lctx   = ctx;
    c->main.sched  = sched;
    c->main.main   = true;
    c->chunk_bytes = chunk_bytes;
    c->layers.resize(n_layer);

    for (const auto & [name, t] : model.tensors_by_name) {
        const int il = forecache_expert_layer(name.c_str());
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

    // each layer's slots go on the device llama.cpp put its other weights on when that is a device of
    // this context (another GPU, an RPC server's device), else on the device asked for
    std::vector<ggml_backend_dev_t> layer_dev = fc_layer_devs(ctx, n_layer);
    for (ggml_backend_dev_t & d : layer_dev) {
        d = d != nullptr ? d : dev;
    }
    c->devs.resize(1);
    c->devs[0].dev = dev;
    std::vector<int> n_pool_of(1, 1); // tensors of each device's context: its pools and slot ids
    for (int il = 0; il < n_layer; il++) {
        fc_layer & L = c->layers[il];
        if (L.n_slots == 0) {
            continue;
        }
        int32_t k = 0;
        while (k < (int32_t) c->devs.size() && c->devs[k].dev != layer_dev[il]) {
            k++;
        }
        if (k == (int32_t) c->devs.size()) {
            c->devs.emplace_back();
            c->devs[k].dev = layer_dev[il];
            n_pool_of.push_back(1);
        }
        L.dev = k;
        n_pool_of[k] += L.n_proj + 1; // its pools and its map
    }

    const int64_t n_ids = (int64_t) model.hparams.n_expert_used_max() * ctx->get_cparams().n_ubatch;
    for (size_t k = 0; k < c->devs.size(); k++) {
        fc_device & d = c->devs[k];
        ggml_init_params params = {
            /*.mem_size   =*/ (size_t) n_pool_of[k]*ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        d.pool_ctx = ggml_init(params);
        for (int il = 0; il < n_layer; il++) {
            fc_layer & L = c->layers[il];
            for (int p = 0; L.n_slots > 0 && L.dev == (int32_t) k && p < L.n_proj; p++) {
                const ggml_tensor * h = L.host[p];
                L.pool[p] = ggml_new_tensor_3d(d.pool_ctx, h->type, h->ne[0], h->ne[1], L.n_slots);
                ggml_format_name(L.pool[p], "fc.pool.%s", h->name);
                c->pool_map[L.pool[p]] = {il, p};
            }
            if (L.n_slots > 0 && L.dev == (int32_t) k) {
                L.map = ggml_new_tensor_2d(d.pool_ctx, GGML_TYPE_I32, 1, L.n_expert);
                ggml_format_name(L.map, "fc.map.%d", il);
            }
        }
        d.slot_ids = ggml_new_tensor_1d(d.pool_ctx, GGML_TYPE_I32, std::max<int64_t>(n_ids, 1));
        ggml_set_name(d.slot_ids, "fc.slot_ids");

        // the slots in a buffer of their own (prompt banks place them anew), the tables in another
        if (!fc_place_pools(c, (int32_t) k, 0, err, err_size)) {
            forecache_cache_free(c);
            return nullptr;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(d.dev);
        d.pool_buf = ggml_backend_alloc_ctx_tensors_from_buft(d.pool_ctx, buft);
        if (d.pool_buf == nullptr) {
            forecache_set_err(err, err_size, "cannot allocate the expert slot tables on %s", ggml_backend_dev_name(d.dev));
            forecache_cache_free(c);
            return nullptr;
        }
        ggml_backend_buffer_set_usage(d.pool_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        for (fc_layer & L : c->layers) {
            if (L.map != nullptr && L.dev == (int32_t) k) {
                // every entry a valid slot before any expert lands: a product never reads past the pool
                L.map_dev.assign(L.n_expert, 0);
                ggml_backend_tensor_set(L.map, L.map_dev.data(), 0, ggml_nbytes(L.map));
            }
        }

        params.mem_size = (ctx->get_cparams().n_ubatch + 16)*ggml_tensor_overhead();
        d.view_ctx = ggml_init(params);

        d.backend = fc_sched_backend(sched, d.dev);
        if (ggml_backend_dev_type(d.dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            // the scheduler's CPU backend would start its threads for every expert group
            d.cpu = fc_cpu_backend(c, ctx->get_cparams().n_threads, d.cpu_pool);
            if (d.cpu != nullptr) {
                d.backend = d.cpu;
            }
        }
        // expert groups are computed where the pool lives, with scratch that grows to the largest group
        d.group_alloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(d.backend));
    }

    c->cpu = fc_cpu_backend(c, ctx->get_cparams().n_threads, c->cpu_pool);
    if (c->cpu == nullptr) {
        forecache_set_err(err, err_size, "cannot start the CPU backend");
        forecache_cache_free(c);
        return nullptr;
    }

    for (size_t k = 0; k < c->devs.size(); k++) {
        c->devs[k].worker = std::thread(fc_worker, c, (int32_t) k);
        c->main.backend.push_back(fc_sched_backend(sched, c->devs[k].dev));
    }
    ggml_backend_sched_set_node_hooks(sched, fc_graph_hook, fc_node_hook, &c->main);
    ctx->reset_graph_reuse();
    return c;
}

void forecache_cache_free(struct forecache_cache * cache) {
    if (cache == nullptr) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(cache->mtx);
        cache->stop = true;
    }
    cache->cv_work.notify_all();
    for (fc_device & d : cache->devs) {
        if (d.worker.joinable()) {
            d.worker.join();
        }
    }
    while (!cache->attached.empty()) {
        forecache_cache_detach(cache, cache->attached.back()->lctx);
    }
    fc_copy_streams_free(cache);
    fc_disk_stop(cache);
    cache->host.finish();
    if (cache->main.sched != nullptr) {
        ggml_backend_sched_synchronize(cache->main.sched);
        ggml_backend_sched_set_node_hooks(cache->main.sched, nullptr, nullptr, nullptr);
        cache->main.lctx->reset_graph_reuse();
    }
    fc_bank_free(cache);
    ggml_backend_free(cache->cpu);
    if (cache->cpu_pool != nullptr) {
        cache->pool_free(cache->cpu_pool);
    }
    for (fc_device & d : cache->devs) {
        if (d.group_alloc) {
            ggml_gallocr_free(d.group_alloc);
        }
        ggml_backend_free(d.cpu);
        if (d.cpu_pool != nullptr) {
            cache->pool_free(d.cpu_pool);
        }
        ggml_backend_buffer_free(d.pool_buf);
        ggml_backend_buffer_free(d.slot_buf);
        ggml_backend_buffer_free(d.stage_buf);
        if (d.stage_ctx) {
            ggml_free(d.stage_ctx);
        }
        if (d.view_ctx) {
            ggml_free(d.view_ctx);
        }
        if (d.pool_ctx) {
            ggml_free(d.pool_ctx);
        }
    }
    for (ggml_context * ctx : cache->main.remap_ctx) {
        ggml_free(ctx);
    }
    delete cache;
}

int32_t forecache_cache_attach(struct forecache_cache * cache, struct llama_context * ctx, char * err, size_t err_size) {
    if (&ctx->get_model() != &cache->main.lctx->get_model()) {
        forecache_set_err(err, err_size, "the context is of another model than the cache's");
        return -1;
    }
    if (ctx == cache->main.lctx || std::any_of(cache->attached.begin(), cache->attached.end(),
            [&](const auto & g) { return g->lctx == ctx; })) {
        forecache_set_err(err, err_size, "the context already reads this cache");
        return -1;
    }
    if (cache->bank_ctx == nullptr) {
        forecache_set_err(err, err_size, "an attached context reads the prompt banks only: set them first (forecache_cache_set_bank)");
        return -1;
    }
    ggml_backend_sched_t sched = ctx->get_sched();
    ggml_backend_sched_graph_hook graph_hook = nullptr;
    ggml_backend_sched_node_hook  node_hook  = nullptr;
    void * ud = nullptr;
    ggml_backend_sched_get_node_hooks(sched, &graph_hook, &node_hook, &ud);
    if (graph_hook != nullptr || node_hook != nullptr) {
        forecache_set_err(err, err_size, "the context has hooks already (a routing replay, another cache): attach it first");
        return -1;
    }
    auto g = std::make_unique<fc_gctx>();
    g->c     = cache;
    g->lctx  = ctx;
    g->sched = sched;
    for (const fc_device & d : cache->devs) {
        g->backend.push_back(fc_sched_backend(sched, d.dev));
        if (g->backend.back() == nullptr) {
            forecache_set_err(err, err_size, "device %s is not used by the context", ggml_backend_dev_name(d.dev));
            return -1;
        }
    }
    if (!fc_bank_gctx_events(cache, *g)) {
        fc_bank_gctx_free(*g);
        forecache_set_err(err, err_size, "cannot create the context's events");
        return -1;
    }
    ggml_backend_sched_set_node_hooks(sched, fc_graph_hook, fc_node_hook, g.get());
    ctx->reset_graph_reuse();
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->attached.push_back(std::move(g));
    fc_bank_end_pass(cache, cache->main); // its passes before have ended (nothing decodes now)
    return 0;
}

int32_t forecache_cache_detach(struct forecache_cache * cache, struct llama_context * ctx) {
    auto it = std::find_if(cache->attached.begin(), cache->attached.end(), [&](const auto & g) { return g->lctx == ctx; });
    if (it == cache->attached.end()) {
        return -1;
    }
    fc_gctx & g = **it;
    ggml_backend_sched_graph_hook graph_hook = nullptr;
    ggml_backend_sched_node_hook  node_hook  = nullptr;
    void * ud = nullptr;
    ggml_backend_sched_get_node_hooks(g.sched, &graph_hook, &node_hook, &ud);
    if (ud != &g) {
        return -2; // a routing replay sits on top of its hooks
    }
    ggml_backend_sched_synchronize(g.sched);
    ggml_backend_sched_set_node_hooks(g.sched, nullptr, nullptr, nullptr);
    ctx->reset_graph_reuse();
    {
        std::lock_guard<std::mutex> lock(cache->mtx);
        fc_bank_end_pass(cache, g);
        auto & m = cache->round_members;
        m.erase(std::remove(m.begin(), m.end(), &g), m.end());
    }
    for (fc_device & d : cache->devs) {
        if (d.bank_copy != nullptr) {
            ggml_backend_synchronize(d.bank_copy); // no fill waits for its events any more
        }
    }
    fc_bank_gctx_free(g);
    for (ggml_context * rctx : g.remap_ctx) {
        ggml_free(rctx);
    }
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->attached.erase(it);
    return 0;
}

int32_t forecache_cache_begin_round(struct forecache_cache * cache, int32_t n_passes) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    if (n_passes < 1 || cache->round_joined < cache->round_n || cache->round_active > 0) {
        return -1;
    }
    cache->round_id     = ++cache->bank_ids;
    cache->round_n      = n_passes;
    cache->round_joined = 0;
    cache->round_active = 0;
    cache->round_members.clear();
    return 0;
}

int32_t forecache_cache_end_pass(struct forecache_cache * cache, struct llama_context * ctx) {
    fc_gctx * g = ctx == cache->main.lctx ? &cache->main : nullptr;
    for (auto & a : cache->attached) {
        g = a->lctx == ctx ? a.get() : g;
    }
    if (g == nullptr) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(cache->mtx);
    if (cache->round_joined < cache->round_n && g->round != cache->round_id) {
        g->round = cache->round_id; // its place in the round: it computes nothing more in it
        cache->round_joined++;
    }
    fc_bank_end_pass(cache, *g);
    return 0;
}

void forecache_cache_set_hook(struct forecache_cache * cache, forecache_gate_hook hook, void * user_data, bool gate_input) {
    cache->hook            = hook;
    cache->hook_ud         = user_data;
    cache->want_gate_input = gate_input;
}

int32_t forecache_cache_layer_device(const struct forecache_cache * cache, int32_t layer) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || cache->layers[layer].n_slots == 0) {
        return -1;
    }
    ggml_backend_dev_t dev = cache->devs[cache->layers[layer].dev].dev;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        if (ggml_backend_dev_get(i) == dev) {
            return (int32_t) i;
        }
    }
    return -1;
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
    // n_stage on each device holding slots, lent to the layers of that device
    std::vector<int32_t> st_dev;
    for (size_t k = 0; k < cache->devs.size(); k++) {
        fc_device & d = cache->devs[k];
        bool holds = false;
        for (const fc_layer & L : cache->layers) {
            holds = holds || (L.n_slots > 0 && L.dev == (int32_t) k);
        }
        if (!holds) {
            continue;
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
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_buffer_get_type(d.pool_buf));
        if (buf == nullptr) {
            forecache_set_err(err, err_size, "cannot allocate %.1f MiB of stage slots on %s",
                    n_stage*first->expert_bytes/1048576.0, ggml_backend_dev_name(d.dev));
            ggml_free(ctx);
            for (fc_device & e : cache->devs) {
                ggml_backend_buffer_free(e.stage_buf);
                if (e.stage_ctx) {
                    ggml_free(e.stage_ctx);
                }
                e.stage_buf = nullptr;
                e.stage_ctx = nullptr;
            }
            return -1;
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        d.stage_ctx = ctx;
        d.stage_buf = buf;
        d.stage_j0  = (int32_t) st_dev.size();
        std::copy(stage, stage + FC_MAX_PROJ, d.stage);
        st_dev.insert(st_dev.end(), n_stage, (int32_t) k);
    }
    const int32_t total = (int32_t) st_dev.size();
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->st_dev = std::move(st_dev);
    cache->st_layer.assign(total, -1);
    cache->st_expert.assign(total, -1);
    cache->st_pend.assign((size_t) total*FC_MAX_PROJ, 0);
    cache->st_started.assign(total, 0);
    cache->st_in_use.assign(total, 0);
    cache->n_stage = total;
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
        if (free_j < 0 && cache->st_layer[j] < 0 && cache->st_dev[j] == L.dev) {
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

void forecache_cache_set_quiet(struct forecache_cache * cache, bool quiet) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->quiet = quiet;
}

void forecache_cache_set_gather(struct forecache_cache * cache, int32_t min_tokens, int32_t min_entries) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    cache->gather_tokens  = std::max(min_tokens, 0);
    cache->gather_entries = min_entries > 1 ? min_entries : 0;
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
    for (auto & L : cache->layers) {
        L.dg_host_k.clear();
        L.dg_host_s.clear();
    }
}

int32_t forecache_cache_set_layer_decode_gate(struct forecache_cache * cache, int32_t layer, const int32_t * host_k, const double * host_s) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || cache->dg_n_used <= 0) {
        return -1;
    }
    fc_layer & L = cache->layers[layer];
    const size_t n = host_k != nullptr && host_s != nullptr ? (size_t) (cache->dg_n_used + 1)*(cache->dg_n_used + 1) : 0;
    L.dg_host_k.assign(host_k, host_k + n);
    L.dg_host_s.assign(host_s, host_s + n);
    return 0;
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

void forecache_cache_wait_idle(struct forecache_cache * cache) {
    std::unique_lock<std::mutex> lock(cache->mtx);
    cache->cv_done.wait(lock, [cache] {
        return cache->disk_failed || (cache->running == 0 && (cache->paused || (!fc_has_eligible(cache) && !fc_disk_busy(cache))));
    });
}

// How forecache_cache_get_stats combines a field of the layers' stats (FORECACHE_CACHE_STATS_FIELDS).
template <typename T> static T fc_combine_SUM(T total, T layer) { return total + layer; }
template <typename T> static T fc_combine_MAX(T total, T layer) { return std::max(total, layer); }

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
#define FC_COMBINE_FIELD(type, name, combine) out->name = fc_combine_##combine(out->name, s.name);
        FORECACHE_CACHE_STATS_FIELDS(FC_COMBINE_FIELD)
#undef FC_COMBINE_FIELD
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

void fc_span_add(forecache_cache * c, int32_t kind, int32_t layer, int32_t proj, int32_t expert, int32_t slot,
        int32_t n, uint64_t bytes, fc_clock::time_point t0, fc_clock::time_point t1) {
    std::lock_guard<std::mutex> lock(c->tl_mtx);
    if (c->tl_ring.empty()) {
        return;
    }
    forecache_span sp = {};
    sp.kind   = kind;
    sp.layer  = layer;
    sp.proj   = proj;
    sp.expert = expert;
    sp.slot   = slot;
    sp.n      = n;
    sp.pass   = c->epoch; // the graph thread writes it; the copy thread calls with c->mtx held
    sp.bytes  = bytes;
    sp.t0     = std::chrono::duration<double>(t0 - c->tl_t0).count();
    sp.t1     = std::chrono::duration<double>(t1 - c->tl_t0).count();
    const size_t cap = c->tl_ring.size();
    if (c->tl_n == cap) {
        c->tl_head = (c->tl_head + 1) % cap; // the oldest goes
        c->tl_n--;
        c->tl_dropped++;
    }
    c->tl_ring[(c->tl_head + c->tl_n) % cap] = sp;
    c->tl_n++;
}

int32_t forecache_cache_set_timeline(struct forecache_cache * cache, int32_t capacity) {
    if (capacity < 0) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(cache->tl_mtx);
    cache->tl_on.store(false);
    cache->tl_ring.assign((size_t) capacity, forecache_span{});
    cache->tl_head    = 0;
    cache->tl_n       = 0;
    cache->tl_dropped = 0;
    cache->tl_t0      = fc_clock::now();
    cache->tl_on.store(capacity > 0);
    return 0;
}

int32_t forecache_cache_timeline(struct forecache_cache * cache, struct forecache_span * out, int32_t n_max, uint64_t * dropped) {
    std::lock_guard<std::mutex> lock(cache->tl_mtx);
    const size_t n = std::min(cache->tl_n, (size_t) std::max(n_max, 0));
    const size_t cap = cache->tl_ring.size();
    for (size_t i = 0; i < n; i++) {
        out[i] = cache->tl_ring[(cache->tl_head + i) % cap];
    }
    if (cap > 0) {
        cache->tl_head = (cache->tl_head + n) % cap;
    }
    cache->tl_n -= n;
    if (dropped != nullptr) {
        *dropped = cache->tl_dropped;
    }
    cache->tl_dropped = 0;
    return (int32_t) n;
}

size_t forecache_span_size(void) {
    return sizeof(forecache_span);
}
