// forecache expert cache: the controls of forecache-testing.h, for tests only.
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

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
