// forecache expert cache: the disk tier (host slots under the device slots, filled from the model file).
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

#include "gguf.h"

#include <cerrno>
#include <cstdlib>

#include <fcntl.h>
#include <unistd.h>

static std::atomic<bool> g_disk_experts{false};

void forecache_set_disk_experts(bool on) {
    g_disk_experts.store(on);
}

bool forecache_disk_experts() {
    return g_disk_experts.load();
}

bool fc_host_ready(const fc_layer & L, int32_t expert) {
    const int32_t s = L.hslot_of[expert];
    return s >= 0 && L.hready[s];
}

bool fc_disk_request(forecache_cache * c, int32_t il, int32_t expert, int32_t priority) {
    fc_layer & L = c->layers[il];
    if (L.n_host == 0 || L.hslot_of[expert] >= 0 || (L.hreq[expert] >= 0 && L.hreq[expert] <= priority)) {
        return false;
    }
    L.hreq[expert] = (int8_t) priority;
    c->rq[priority].emplace_back(il, expert);
    c->cv_read.notify_one();
    return true;
}

// whether a queued copy of `expert` of layer il could run but for its read
static bool fc_copy_waits_for(const forecache_cache * c, int32_t il, int32_t expert) {
    for (const auto & q : c->queue) {
        for (const auto & ch : q) {
            if (ch.layer == il && ch.expert == expert && fc_need_met(c, ch)) {
                return true;
            }
        }
    }
    return false;
}

// the host slot of layer il a read may take: an empty one, else the least used, least recently used
// expert whose read is done and that no copy or host compute reads or waits for; failing that, one
// whose queued copies all wait for their slot to be consumed (a schedule streaming more experts than
// the host slots hold: read again when their copy can run); -1 when none
static int32_t fc_host_victim(const forecache_cache * c, int32_t il) {
    const fc_layer & L = c->layers[il];
    auto better = [&](int32_t s, int32_t best) {
        const int32_t e = L.hexpert_of[s];
        const int32_t b = L.hexpert_of[best];
        return L.huses[e] < L.huses[b] || (L.huses[e] == L.huses[b] && L.hstamp[s] < L.hstamp[best]);
    };
    int32_t best = -1, blocked = -1;
    for (int32_t s = 0; s < L.n_host; s++) {
        const int32_t e = L.hexpert_of[s];
        if (e < 0) {
            return s;
        }
        if (!L.hready[s] || L.hbusy[s] > 0 || L.hhold[e] > 0) {
            continue;
        }
        if (L.hwant[e] == 0) {
            best = best < 0 || better(s, best) ? s : best;
        } else if (best < 0 && !fc_copy_waits_for(c, il, e)) {
            blocked = blocked < 0 || better(s, blocked) ? s : blocked;
        }
    }
    return best >= 0 ? best : blocked;
}

void fc_request_reads(forecache_cache * c) {
    if (c->readers.empty()) {
        return;
    }
    for (int32_t p = 0; p < FC_N_PRIORITIES; p++) {
        for (const auto & ch : c->queue[p]) {
            const fc_layer & L = c->layers[ch.layer];
            if (L.n_host > 0 && L.hslot_of[ch.expert] < 0 && fc_need_met(c, ch)) {
                fc_disk_request(c, ch.layer, ch.expert, p);
            }
        }
    }
}

bool fc_disk_busy(const forecache_cache * c) {
    if (c->reading > 0) {
        return true;
    }
    for (const auto & q : c->rq) {
        for (const auto & [il, e] : q) {
            const fc_layer & L = c->layers[il];
            if (L.hslot_of[e] < 0 && fc_host_victim(c, il) >= 0) {
                return true; // a queued read that can start
            }
        }
    }
    return false;
}

// takes the first queued read, in priority order, whose layer has a host slot for it (lock held)
static bool fc_disk_pop(forecache_cache * c, int32_t & il, int32_t & expert, int32_t & slot) {
    for (int32_t p = 0; p < FC_N_PRIORITIES; p++) {
        auto & q = c->rq[p];
        for (auto it = q.begin(); it != q.end();) {
            fc_layer & L = c->layers[it->first];
            if (L.hslot_of[it->second] >= 0 || L.hreq[it->second] != p) {
                it = q.erase(it); // read already, or queued again at a higher priority
                continue;
            }
            const int32_t s = fc_host_victim(c, it->first);
            if (s < 0) {
                ++it;
                continue;
            }
            il     = it->first;
            expert = it->second;
            slot   = s;
            q.erase(it);
            return true;
        }
    }
    return false;
}

static bool fc_pread_full(int fd, uint8_t * dst, size_t size, uint64_t off, size_t need) {
    size_t got = 0;
    while (got < size) {
        const ssize_t r = pread(fd, dst + got, size - got, (off_t) (off + got));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return r == 0 && got >= need; // end of file past the bytes needed (an aligned read's tail)
        }
        got += (size_t) r;
    }
    return true;
}

// reads `size` bytes at `off` of model file `file` into dst, with direct I/O through `bounce` when the file
// allows it; *direct says which (lock not held)
static bool fc_read_range(forecache_cache * c, uint8_t * bounce, uint8_t * dst, int32_t file, uint64_t off, size_t size, bool * direct) {
    int dfd;
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        dfd = c->disk_dfd[file];
    }
    if (dfd >= 0) {
        const uint64_t a = c->disk_align;
        const uint64_t a0 = off & ~(a - 1);
        const uint64_t a1 = (off + size + a - 1) & ~(a - 1);
        if (fc_pread_full(dfd, bounce, a1 - a0, a0, off + size - a0)) {
            memcpy(dst, bounce + (off - a0), size);
            *direct = true;
            return true;
        }
        if (errno != EINVAL) {
            return false;
        }
        // the file system refuses direct I/O after all: read through the page cache from now on (another
        // reader may be using the descriptor still: it is closed with the others at the end)
        std::lock_guard<std::mutex> lock(c->mtx);
        c->disk_dfd[file] = -1;
    }
    *direct = false;
    const int fd = c->disk_fd[file];
    if (!fc_pread_full(fd, dst, size, off, size)) {
        return false;
    }
    // what was read lives in the host slot now; the page cache need not keep it
    posix_fadvise(fd, (off_t) off, (off_t) size, POSIX_FADV_DONTNEED);
    return true;
}

static void fc_reader(forecache_cache * c) {
    uint8_t * bounce = nullptr;
    if (posix_memalign((void **) &bounce, c->disk_align, c->disk_max + 2*c->disk_align) != 0) {
        bounce = nullptr;
    }
    std::unique_lock<std::mutex> lock(c->mtx);
    while (true) {
        int32_t il = -1, e = -1, s = -1;
        c->cv_read.wait(lock, [&] { return c->stop || fc_disk_pop(c, il, e, s); });
        if (c->stop) {
            break;
        }
        fc_layer & L = c->layers[il];
        const int32_t old = L.hexpert_of[s];
        if (old >= 0) {
            L.hslot_of[old] = -1;
            L.stats.host_evictions++;
        }
        L.hexpert_of[s] = e;
        L.hslot_of[e]   = s;
        L.hready[s]     = 0;
        L.hreq[e]       = -1;
        c->reading++;
        lock.unlock();

        const auto t0 = fc_clock::now();
        bool ok = bounce != nullptr;
        int32_t failed_file = 0;
        uint64_t bytes = 0, direct_bytes = 0;
        for (int32_t p = 0; ok && p < L.n_proj; p++) {
            const size_t nb = L.host[p]->nb[2];
            bool direct = false;
            ok = fc_read_range(c, bounce, (uint8_t *) L.hpool[p]->data + (size_t) s*nb, L.file_idx[p], L.file_off[p] + (uint64_t) e*nb, nb, &direct);
            failed_file = ok ? failed_file : L.file_idx[p];
            bytes        += nb;
            direct_bytes += direct ? nb : 0;
        }
        const auto t1 = fc_clock::now();

        lock.lock();
        c->reading--;
        if (!ok) {
            if (!c->disk_failed) {
                LLAMA_LOG_ERROR("%s: cannot read expert %d of layer %d from %s: %s\n", __func__, e, il,
                        c->disk_path[failed_file].c_str(), bounce == nullptr ? "out of memory" : strerror(errno));
            }
            c->disk_failed = true;
            L.hexpert_of[s] = -1;
            L.hslot_of[e]   = -1;
        } else {
            L.hready[s] = 1;
            L.hstamp[s] = ++c->hclock;
            L.stats.disk_reads++;
            L.stats.disk_bytes        += bytes;
            L.stats.disk_direct_bytes += direct_bytes;
            L.stats.disk_s            += std::chrono::duration<double>(t1 - t0).count();
        }
        if (c->tl_on.load(std::memory_order_relaxed)) {
            fc_span_add(c, FORECACHE_SPAN_READ, il, -1, e, s, 1, bytes, t0, t1);
        }
        c->cv_done.notify_all();
        c->cv_work.notify_all();
    }
    lock.unlock();
    free(bounce);
}

static void fc_close_all(const std::vector<int> & fds) {
    for (int fd : fds) {
        if (fd >= 0) {
            close(fd);
        }
    }
}

void fc_disk_stop(forecache_cache * c) {
    {
        std::lock_guard<std::mutex> lock(c->mtx);
        c->stop = true;
    }
    c->cv_read.notify_all();
    for (auto & th : c->readers) {
        th.join();
    }
    c->readers.clear();
    fc_close_all(c->disk_fd);
    fc_close_all(c->disk_open_dfd);
    c->disk_fd.clear();
    c->disk_dfd.clear();
    c->disk_open_dfd.clear();
    ggml_backend_buffer_free(c->host_buf);
    c->host_buf = nullptr;
    if (c->host_ctx) {
        ggml_free(c->host_ctx);
        c->host_ctx = nullptr;
    }
}

bool fc_host_rows(forecache_cache * c, fc_layer & L, int32_t p, const float * in, int64_t ne0,
        const int32_t * rows, const int32_t * experts, int64_t n, std::vector<float> & out, int64_t ne0_out) {
    out.resize((size_t) n*ne0_out);
    if (n == 0) {
        return true;
    }
    // computes the rows r of `todo` through `as` with ids ids_of(r)
    auto compute = [&](ggml_tensor * as, const std::vector<int32_t> & todo, const std::vector<int32_t> & ids_of) {
        const int64_t m = (int64_t) todo.size();
        ggml_tensor * x   = nullptr;
        ggml_tensor * ids = nullptr;
        return fc_mini_graph(c->cpu, nullptr,
            [&](ggml_context * ctx) {
                x   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ne0, 1, m);
                ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, m);
                ggml_tensor * y = ggml_mul_mat_id(ctx, as, x, ids);
                return y->ne[0] == ne0_out ? y : nullptr;
            },
            [&] {
                for (int64_t k = 0; k < m; k++) {
                    memcpy((float *) x->data + k*ne0, in + (size_t) rows[todo[k]]*ne0, ne0*sizeof(float));
                }
                memcpy(ids->data, ids_of.data(), m*sizeof(int32_t));
            },
            [&](ggml_tensor * y) {
                for (int64_t k = 0; k < m; k++) {
                    memcpy(out.data() + (size_t) todo[k]*ne0_out, (const float *) y->data + k*ne0_out, ne0_out*sizeof(float));
                }
            });
    };
    if (L.n_host == 0) {
        std::vector<int32_t> todo(n);
        for (int64_t r = 0; r < n; r++) {
            todo[r] = (int32_t) r;
        }
        return compute(L.host[p], todo, std::vector<int32_t>(experts, experts + n));
    }

    // a batch of at most half the host slots at a time, so that reads for copies still find room
    const int32_t cap = std::max(1, L.n_host/2);
    const int32_t il  = (int32_t) (&L - c->layers.data());
    std::vector<uint8_t> done(n, 0);
    std::vector<uint8_t> in_batch(L.n_expert, 0);
    std::vector<int32_t> batch, todo, ids_of;
    int64_t left = n;
    while (left > 0) {
        std::unique_lock<std::mutex> lock(c->mtx);
        batch.clear();
        for (int pass = 0; pass < 2; pass++) { // experts already held first
            for (int64_t r = 0; r < n && (int32_t) batch.size() < cap; r++) {
                const int32_t e = experts[r];
                if (!done[r] && !in_batch[e] && fc_host_ready(L, e) == (pass == 0)) {
                    in_batch[e] = 1;
                    batch.push_back(e);
                }
            }
        }
        for (int32_t e : batch) {
            L.hhold[e]++;
            L.huses[e]++;
            if (fc_host_ready(L, e)) {
                L.stats.host_hits++;
            } else {
                L.stats.host_misses++;
                fc_disk_request(c, il, e, 0);
            }
        }
        auto all_ready = [&] {
            return c->disk_failed || std::all_of(batch.begin(), batch.end(), [&](int32_t e) { return fc_host_ready(L, e); });
        };
        if (!all_ready()) {
            const auto t0 = fc_clock::now();
            c->cv_done.wait(lock, all_ready);
            L.stats.disk_wait_s += fc_seconds(t0);
        }
        const bool failed = c->disk_failed;
        if (!failed) {
            for (int32_t e : batch) {
                L.hbusy[L.hslot_of[e]]++;
            }
            // the next batch's reads run while this one computes
            int32_t ahead = 0;
            for (int64_t r = 0; r < n && ahead < cap; r++) {
                const int32_t e = experts[r];
                if (!done[r] && !in_batch[e] && L.hreq[e] < 0 && fc_disk_request(c, il, e, 0)) {
                    ahead++;
                }
            }
        }
        lock.unlock();

        bool ok = !failed;
        if (ok) {
            todo.clear();
            ids_of.clear();
            for (int64_t r = 0; r < n; r++) {
                if (!done[r] && in_batch[experts[r]]) {
                    todo.push_back((int32_t) r);
                    ids_of.push_back(L.hslot_of[experts[r]]); // held: no read or eviction moves it
                }
            }
            ok = compute(L.hpool[p], todo, ids_of);
            for (int32_t r : todo) {
                done[r] = 1;
            }
            left -= (int64_t) todo.size();
        }

        lock.lock();
        for (int32_t e : batch) {
            if (!failed) {
                const int32_t s = L.hslot_of[e];
                L.hbusy[s]--;
                L.hstamp[s] = ++c->hclock;
            }
            L.hhold[e]--;
            in_batch[e] = 0;
        }
        c->cv_read.notify_all();
        if (!ok) {
            return false;
        }
    }
    return true;
}

int32_t forecache_cache_set_disk(
        struct forecache_cache * cache,
        const char * const     * paths,
        int32_t                  n_paths,
        const int32_t          * n_host,
        int32_t                  n_layer,
        int32_t                  n_readers,
        char                   * err,
        size_t                   err_size) {
    forecache_cache * c = cache;
    if (!c->readers.empty() || c->host_buf != nullptr) {
        forecache_set_err(err, err_size, "the disk tier is already set");
        return -1;
    }
    if (n_layer != (int32_t) c->layers.size() || n_readers < 1 || paths == nullptr || n_paths < 1) {
        forecache_set_err(err, err_size, "bad arguments: %d layers (the model has %zu), %d readers, %d files",
                n_layer, c->layers.size(), n_readers, n_paths);
        return -1;
    }
    for (int32_t il = 0; il < n_layer; il++) {
        const fc_layer & L = c->layers[il];
        if (L.n_proj > 0 && (n_host[il] < 1 || L.n_slots < 1)) {
            forecache_set_err(err, err_size, "layer %d has %d host slots and %d device slots: the disk tier needs "
                    "at least one of each in every layer with experts", il, n_host[il], L.n_slots);
            return -1;
        }
    }

    // where each expert tensor lies: in whichever of the files (a split model's shards) holds it
    std::vector<gguf_context *> gs;
    auto free_gs = [&] { for (gguf_context * g : gs) { gguf_free(g); } };
    for (int32_t f = 0; f < n_paths; f++) {
        gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
        gguf_context * g = gguf_init_from_file(paths[f], gp);
        if (g == nullptr) {
            forecache_set_err(err, err_size, "cannot read the GGUF header of %s", paths[f]);
            free_gs();
            return -1;
        }
        gs.push_back(g);
    }
    size_t max_nb = 0;
    for (int32_t il = 0; il < n_layer; il++) {
        fc_layer & L = c->layers[il];
        for (int32_t p = 0; p < L.n_proj; p++) {
            const ggml_tensor * h = L.host[p];
            int32_t file = -1;
            int64_t id   = -1;
            for (int32_t f = 0; f < n_paths && id < 0; f++) {
                id   = gguf_find_tensor(gs[f], h->name);
                file = f;
            }
            if (id < 0 || gguf_get_tensor_size(gs[file], id) != ggml_nbytes(h)) {
                forecache_set_err(err, err_size, "%s%s has no tensor %s of %zu bytes", paths[0],
                        n_paths > 1 ? " (with its shards)" : "", h->name, ggml_nbytes(h));
                free_gs();
                return -1;
            }
            L.file_idx[p] = file;
            L.file_off[p] = gguf_get_data_offset(gs[file]) + gguf_get_tensor_offset(gs[file], id);
            max_nb = std::max(max_nb, (size_t) h->nb[2]);
        }
    }
    free_gs();

    int n_pool = 0;
    for (int32_t il = 0; il < n_layer; il++) {
        n_pool += c->layers[il].n_proj > 0 ? c->layers[il].n_proj : 0;
    }
    ggml_init_params params = {
        /*.mem_size   =*/ (size_t) (n_pool + 1)*ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context * ctx = ggml_init(params);
    size_t total = 0;
    for (int32_t il = 0; il < n_layer; il++) {
        fc_layer & L = c->layers[il];
        for (int32_t p = 0; p < L.n_proj; p++) {
            const ggml_tensor * h = L.host[p];
            L.hpool[p] = ggml_new_tensor_3d(ctx, h->type, h->ne[0], h->ne[1], std::min(n_host[il], L.n_expert));
            ggml_format_name(L.hpool[p], "fc.host.%s", h->name);
            total += ggml_nbytes(L.hpool[p]);
        }
    }
    // pinned where the slots' device has pinned host memory, so that copies into slots run at the bus's rate
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(c->devs[0].pool_buf));
    ggml_backend_buffer_type_t buft = dev != nullptr ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    if (buft == nullptr) {
        buft = ggml_backend_cpu_buffer_type();
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (buf == nullptr) {
        forecache_set_err(err, err_size, "cannot allocate %.1f MiB of host expert slots", total/1048576.0);
        ggml_free(ctx);
        return -1;
    }

    std::vector<int> fds, dfds;
    for (int32_t f = 0; f < n_paths; f++) {
        const int fd = open(paths[f], O_RDONLY);
        if (fd < 0) {
            forecache_set_err(err, err_size, "cannot open %s: %s", paths[f], strerror(errno));
            fc_close_all(fds);
            fc_close_all(dfds);
            ggml_backend_buffer_free(buf);
            ggml_free(ctx);
            return -1;
        }
        int dfd = -1;
#ifdef O_DIRECT
        dfd = open(paths[f], O_RDONLY | O_DIRECT);
#endif
        fds.push_back(fd);
        dfds.push_back(dfd);
    }

    std::lock_guard<std::mutex> lock(c->mtx);
    c->host_ctx      = ctx;
    c->host_buf      = buf;
    c->disk_fd       = fds;
    c->disk_dfd      = dfds;
    c->disk_open_dfd = dfds;
    c->disk_max      = max_nb;
    c->disk_path.assign(paths, paths + n_paths);
    for (int32_t il = 0; il < n_layer; il++) {
        fc_layer & L = c->layers[il];
        if (L.n_proj == 0) {
            continue;
        }
        L.n_host = std::min(n_host[il], L.n_expert);
        L.hslot_of.assign(L.n_expert, -1);
        L.hexpert_of.assign(L.n_host, -1);
        L.hready.assign(L.n_host, 0);
        L.hbusy.assign(L.n_host, 0);
        L.hstamp.assign(L.n_host, 0);
        L.hwant.assign(L.n_expert, 0);
        L.hhold.assign(L.n_expert, 0);
        L.huses.assign(L.n_expert, 0);
        L.hreq.assign(L.n_expert, -1);
    }
    for (int32_t i = 0; i < n_readers; i++) {
        c->readers.emplace_back(fc_reader, c);
    }
    return 0;
}

int32_t forecache_cache_disk_read(struct forecache_cache * cache, int32_t layer, const int32_t * experts, int32_t n, int32_t priority) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size() || cache->layers[layer].n_host == 0 || n < 0) {
        return -1;
    }
    priority = std::min(std::max(priority, 0), FC_N_PRIORITIES - 1);
    fc_layer & L = cache->layers[layer];
    std::lock_guard<std::mutex> lock(cache->mtx);
    int32_t queued = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = experts[i];
        queued += e >= 0 && e < L.n_expert && fc_disk_request(cache, layer, e, priority);
    }
    return queued;
}

int32_t forecache_cache_host_state(const struct forecache_cache * cache, int32_t layer, int32_t * expert_of, int32_t * ready) {
    if (layer < 0 || layer >= (int32_t) cache->layers.size()) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(const_cast<forecache_cache *>(cache)->mtx);
    const fc_layer & L = cache->layers[layer];
    for (int32_t s = 0; s < L.n_host; s++) {
        expert_of[s] = L.hexpert_of[s];
        ready[s]     = L.hready[s];
    }
    return L.n_host;
}
