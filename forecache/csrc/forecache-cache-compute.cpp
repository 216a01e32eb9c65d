// forecache expert cache: expert compute outside the scheduler (host layers and entries, expert groups).
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

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
    const int32_t il       = (int32_t) (&L - c->layers.data());

    if (L.n_host > 0) {
        // the layer's experts are on disk: every row through its expert's host slot, as they are read
        const int64_t b_rows = b->ne[1];
        std::vector<float> in(ggml_nelements(b));
        ggml_backend_tensor_get(b, in.data(), 0, ggml_nbytes(b));
        L.stats.readbacks++;
        std::vector<int32_t> rows(n_used*n_tokens);
        for (int64_t it = 0; it < n_tokens; it++) {
            for (int64_t iu = 0; iu < n_used; iu++) {
                rows[it*n_used + iu] = (int32_t) (it*b_rows + (b_rows == 1 ? 0 : iu));
            }
        }
        std::vector<float> out;
        const bool ok = fc_host_rows(c, L, proj, in.data(), b->ne[0], rows.data(), c->ids.data(), n_used*n_tokens, out, t->ne[0]);
        if (ok) {
            ggml_backend_tensor_set(t, out.data(), 0, ggml_nbytes(t));
            L.stats.uploads++;
        }
        std::lock_guard<std::mutex> lock(c->mtx);
        L.stats.host_s += fc_seconds(t0);
        fc_span(c, FORECACHE_SPAN_HOST, il, proj, (int32_t) (n_used*n_tokens), t0, fc_clock::now());
        return ok;
    }

    ggml_tensor * x   = nullptr;
    ggml_tensor * ids = nullptr;
    L.stats.mini_graphs++;
    L.stats.readbacks++; // its input, and its result written back
    L.stats.uploads++;
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
    fc_span(c, FORECACHE_SPAN_HOST, il, proj, (int32_t) (n_used*n_tokens), t0, fc_clock::now());
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
// read those) and scatters the results into t; *n_rows: the rows it computed
bool fc_group_compute(forecache_cache * c, fc_layer & L, int32_t p, ggml_tensor * t, int32_t i0, int32_t i1, int64_t * n_rows) {
    const int32_t j0 = fc_stage_of(L, L.sch_s[i0]);
    const bool stage = j0 >= 0;
    int32_t local = 0;
    ggml_tensor * as = stage ? fc_stage_tensor(c, j0, p, local) : L.pool[p];
    const int32_t base = stage ? L.n_slots + (j0 - local) : 0; // stage entries: index in their device's stage
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
    *n_rows = n;
    if (n == 0) {
        return true;
    }
    // rows, slots and destinations in one tensor: one upload (each is a synchronous copy on a GPU)
    c->g_rows.insert(c->g_rows.end(), c->g_slots.begin(), c->g_slots.end());
    c->g_rows.insert(c->g_rows.end(), c->g_idx.begin(), c->g_idx.end());

    ggml_tensor * idx = nullptr;
    const fc_device & d = c->devs[L.dev];
    L.stats.mini_graphs++;
    L.stats.uploads++; // its indices
    const bool ok = fc_mini_graph(d.backend, d.group_alloc,
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
    const bool ok = fc_host_rows(c, L, p, c->h_in.data(), b->ne[0], rows.data(), experts.data(), n, c->h_out, t->ne[0]);
    fc_span(c, FORECACHE_SPAN_HOST, (int32_t) (&L - c->layers.data()), p, (int32_t) n, t0, fc_clock::now());
    std::lock_guard<std::mutex> lock(c->mtx);
    L.stats.host_s += fc_seconds(t0);
    return ok;
}

// writes the host entries' result rows (c->h_out) into node t, on the pool's device
bool fc_scatter_host(forecache_cache * c, fc_layer & L, ggml_tensor * t) {
    const int64_t n = (int64_t) c->h_dst.size();
    const int64_t n_rows = t->src[3]->ne[0]*t->src[3]->ne[1];
    ggml_tensor * y   = nullptr;
    ggml_tensor * dst = nullptr;
    const fc_device & d = c->devs[L.dev];
    L.stats.mini_graphs++;
    L.stats.uploads += 2; // the rows, and where they go
    return fc_mini_graph(d.backend, d.group_alloc,
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

// whether entry i's projection p can still become ready without the group being gathered: no queued
// copy of it waits for a slot that an entry not yet computed must free first (lock held)
static bool fc_entry_can_land(const forecache_cache * c, const fc_layer & L, int32_t i, int32_t p) {
    const int32_t il = (int32_t) (&L - c->layers.data());
    for (const auto & q : c->queue) {
        for (const auto & ch : q) {
            if (ch.layer == il && ch.slot == L.sch_s[i] && (ch.proj == p || ch.proj < 0) &&
                    (ch.entry == i || ch.entry < 0) && !fc_eligible(c, ch)) {
                return false;
            }
        }
    }
    return true;
}

// computes node t (projection p of the routed layer) from slots, group by group in schedule order:
// each group is every entry whose projection is in place when the previous group is done (for a long
// ubatch, at least gather_entries of them while more can land: forecache_cache_set_gather). Host
// entries are computed meanwhile on a CPU thread and written into t at the end.
bool fc_slot_compute(forecache_cache * c, fc_layer & L, int32_t p, ggml_tensor * t) {
    const int32_t n = L.n_dev;
    const bool split = n < (int32_t) L.sch_e.size();
    const bool gather = c->gather_entries > 1 && L.n_host == 0 &&
        t->src[3]->ne[1] >= std::max<int64_t>(c->gather_tokens, 1);
    bool host_ok = true;
    if (split) {
        c->h_in.resize(ggml_nelements(t->src[1]));
        ggml_backend_tensor_get(t->src[1], c->h_in.data(), 0, ggml_nbytes(t->src[1]));
        L.stats.readbacks++;
        c->host.run([&] { host_ok = fc_host_entries(c, L, p, t); });
    }
    bool ok = true;
    int32_t i = 0;
    while (i < n) {
        std::unique_lock<std::mutex> lock(c->mtx);
        if (!fc_entry_ready(c, L, i, p)) {
            const auto t0 = fc_clock::now();
            c->cv_done.wait(lock, [&] { return fc_entry_ready(c, L, i, p) || c->disk_failed; });
            L.stats.copy_waits++;
            L.stats.stall_s += fc_seconds(t0);
            fc_span(c, FORECACHE_SPAN_WAIT, (int32_t) (&L - c->layers.data()), p, 0, t0, fc_clock::now());
        }
        if (c->disk_failed) {
            ok = false; // an expert could not be read
            break;
        }
        // a group reads the layer's slots or the stage slots, not both
        const bool stage = L.sch_s[i] >= L.n_slots;
        auto same = [&](int32_t k) { return (L.sch_s[k] >= L.n_slots) == stage; };
        int32_t j = i + 1;
        while (j < n && fc_entry_ready(c, L, j, p) && same(j)) {
            j++;
        }
        if (gather && j < n && j - i < c->gather_entries && same(j)) {
            const auto t0 = fc_clock::now();
            while (j < n && j - i < c->gather_entries && same(j) && !c->disk_failed &&
                   fc_entry_can_land(c, L, j, p)) {
                c->cv_done.wait(lock, [&] { return fc_entry_ready(c, L, j, p) || c->disk_failed; });
                L.stats.copy_waits++;
                while (j < n && fc_entry_ready(c, L, j, p) && same(j)) {
                    j++;
                }
            }
            L.stats.stall_s += fc_seconds(t0);
            fc_span(c, FORECACHE_SPAN_WAIT, (int32_t) (&L - c->layers.data()), p, 0, t0, fc_clock::now());
        }
        lock.unlock();
        const auto t0 = fc_clock::now();
        int64_t rows = 0;
        if (!fc_group_compute(c, L, p, t, i, j, &rows)) {
            ok = false;
            break;
        }
        const auto t1 = fc_clock::now();
        fc_span(c, FORECACHE_SPAN_GROUP, (int32_t) (&L - c->layers.data()), p, j - i, t0, t1);
        lock.lock();
        for (int32_t k = i; k < j && !stage; k++) {
            L.consumed[L.sch_s[k]*L.n_proj + p]++;
        }
        L.stats.n_groups++;
        L.stats.group_s       += std::chrono::duration<double>(t1 - t0).count();
        L.stats.group_entries += (uint64_t) (j - i);
        L.stats.group_rows    += (uint64_t) rows;
        lock.unlock();
        fc_notify_work(c);
        i = j;
    }
    if (split) {
        c->host.wait();
        ok = ok && host_ok && fc_scatter_host(c, L, t);
        if (!host_ok) {
            LLAMA_LOG_ERROR("%s: host expert compute failed for %s\n", __func__, t->name);
        }
    }
    return ok;
}

// element-wise ops the CPU recomputes between a layer's products (the activation and its parts)
static bool fc_ffn_op(const ggml_tensor * t) {
    switch (t->op) {
        case GGML_OP_GLU:
        case GGML_OP_UNARY:
        case GGML_OP_MUL:
        case GGML_OP_ADD:
        case GGML_OP_SCALE:
        case GGML_OP_CLAMP:
        case GGML_OP_SQR:
            return true;
        default:
            return false;
    }
}

// nodes of a layer's experts the CPU graph holds at most (with its input and ids: FC_MINI_GRAPH_SIZE)
constexpr size_t FC_FFN_MAX_NODES = FC_MINI_GRAPH_SIZE - 2;

void fc_ffn_graph(forecache_cache * c, ggml_cgraph * graph) {
    c->ffn.clear();
    c->ffn_tail.clear();
    const int n = ggml_graph_n_nodes(graph);
    std::unordered_map<const ggml_tensor *, std::pair<int, int>> span; // routed ids -> first, last product
    for (int i = 0; i < n; i++) {
        ggml_tensor * t = ggml_graph_node(graph, i);
        if (t->op == GGML_OP_MUL_MAT_ID && c->pool_map.count(t->src[0]) && fc_remapped(t)) {
            auto it = span.emplace(t->src[3], std::make_pair(i, i)).first;
            it->second.second = i;
        }
    }
    for (const auto & [ids, ij] : span) {
        ggml_tensor * first = ggml_graph_node(graph, ij.first);
        const int32_t il = c->pool_map.at(first->src[0]).first;
        fc_ffn f;
        f.x = first->src[1];
        bool ok = ij.second > ij.first && f.x->type == GGML_TYPE_F32 && f.x->ne[1] == 1 &&
                  ggml_is_contiguous(f.x) && c->layers[il].n_host == 0;
        std::unordered_map<const ggml_tensor *, bool> made;
        for (int j = ij.first; ok && j <= ij.second; j++) {
            ggml_tensor * t = ggml_graph_node(graph, j);
            ok = t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->view_src == nullptr &&
                 f.nodes.size() < FC_FFN_MAX_NODES;
            if (t->op == GGML_OP_MUL_MAT_ID) {
                auto pt = c->pool_map.find(t->src[0]);
                // the products read x, but the last, which reads what the nodes between made
                ok = ok && pt != c->pool_map.end() && pt->second.first == il && t->src[3] == ids &&
                     (j == ij.second ? made.count(t->src[1]) > 0 : t->src[1] == f.x);
            } else {
                ok = ok && fc_ffn_op(t);
                for (int k = 0; ok && k < GGML_MAX_SRC; k++) {
                    ok = t->src[k] == nullptr || (made.count(t->src[k]) && ggml_are_same_shape(t->src[k], t->src[0]));
                }
            }
            made[t] = true;
            f.nodes.push_back(t);
        }
        f.last = ggml_graph_node(graph, ij.second);
        for (int j = ij.second + 1; ok && f.tail == nullptr && j < n; j++) {
            ggml_tensor * t = ggml_graph_node(graph, j);
            if (t->op == GGML_OP_RESHAPE || t->op == GGML_OP_VIEW || t->op == GGML_OP_PERMUTE ||
                    t->op == GGML_OP_TRANSPOSE) {
                continue;
            }
            for (int k = 0; k < GGML_MAX_SRC && t->src[k] != nullptr; k++) {
                if (fc_viewed(t->src[k]) == f.last) {
                    f.tail = t;
                }
            }
        }
        if (ok && f.tail != nullptr) {
            c->ffn_tail[f.tail] = il;
            c->ffn[il] = std::move(f);
        }
    }
}

bool fc_whole_start(forecache_cache * c, int32_t il, const ggml_tensor * mm, bool all) {
    fc_layer & L = c->layers[il];
    auto it = c->ffn.find(il);
    if (it == c->ffn.end() || it->second.nodes[0] != mm || c->cpu == nullptr || L.little ||
            (!all && (L.streams || L.staged))) {
        return false;
    }
    const int64_t n_used   = mm->src[3]->ne[0];
    const int64_t n_tokens = mm->src[3]->ne[1];
    // the host experts read spare slots in the products (their rows are overwritten at the tail):
    // slots no device entry reads, so that a token's slot ids stay distinct
    c->w_slot.assign(L.n_expert, -1);
    if (!all) {
        std::vector<uint8_t> used(L.n_slots, 0);
        for (int32_t i = 0; i < L.n_dev; i++) {
            used[L.sch_s[i]] = 1;
        }
        int32_t s = 0;
        for (size_t i = L.n_dev; i < L.sch_e.size(); i++) {
            while (s < L.n_slots && used[s]) {
                s++;
            }
            if (s == L.n_slots) {
                return false;
            }
            c->w_slot[L.sch_e[i]] = s++;
        }
    }
    c->w_dst.clear();
    c->w_rows.clear();
    c->w_ids.clear();
    for (int64_t t = 0; t < n_tokens; t++) {
        for (int64_t u = 0; u < n_used; u++) {
            const int32_t e = c->ids[t*n_used + u];
            if (all || L.entry_of[e] >= L.n_dev) {
                c->w_dst.push_back(t*n_used + u);
                c->w_rows.push_back((int32_t) t);
                c->w_ids.push_back(e);
            }
        }
    }
    L.whole_epoch = c->epoch;
    return true;
}

// computes the host rows c->w_rows through experts c->w_ids of layer il's recorded nodes on the CPU,
// from input c->h_in, into c->h_out
static bool fc_whole_compute(forecache_cache * c, int32_t il) {
    const auto t0 = fc_clock::now();
    fc_layer & L = c->layers[il];
    const fc_ffn & f = c->ffn.at(il);
    const int64_t m   = (int64_t) c->w_rows.size();
    const int64_t ne0 = f.x->ne[0];
    ggml_tensor * x   = nullptr;
    ggml_tensor * ids = nullptr;
    const bool ok = fc_mini_graph(c->cpu, nullptr,
        [&](ggml_context * ctx) -> ggml_tensor * {
            x   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ne0, 1, m);
            ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, m);
            std::unordered_map<const ggml_tensor *, ggml_tensor *> made;
            for (const ggml_tensor * t : f.nodes) {
                ggml_tensor * y = nullptr;
                if (t->op == GGML_OP_MUL_MAT_ID) {
                    ggml_tensor * in = t->src[1] == f.x ? x : made.at(t->src[1]);
                    y = ggml_mul_mat_id(ctx, L.host[c->pool_map.at(t->src[0]).second], in, ids);
                } else {
                    // the node again, over these rows: its op and parameters, sources made here
                    const ggml_tensor * a = made.at(t->src[0]);
                    const int64_t ne[GGML_MAX_DIMS] = {t->ne[0], a->ne[1], a->ne[2], 1};
                    y = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, ne);
                    y->op = t->op;
                    memcpy(y->op_params, t->op_params, sizeof(t->op_params));
                    for (int k = 0; k < GGML_MAX_SRC && t->src[k] != nullptr; k++) {
                        y->src[k] = made.at(t->src[k]);
                    }
                }
                made[t] = y;
            }
            ggml_tensor * out = made.at(f.last);
            return out->ne[0] == f.last->ne[0] ? out : nullptr;
        },
        [&] {
            for (int64_t k = 0; k < m; k++) {
                memcpy((float *) x->data + k*ne0, c->h_in.data() + (size_t) c->w_rows[k]*ne0, ne0*sizeof(float));
            }
            memcpy(ids->data, c->w_ids.data(), m*sizeof(int32_t));
        },
        [&](ggml_tensor * out) {
            c->h_out.assign((const float *) out->data, (const float *) out->data + ggml_nelements(out));
        });
    fc_span(c, FORECACHE_SPAN_HOST, il, -1, (int32_t) m, t0, fc_clock::now());
    std::lock_guard<std::mutex> lock(c->mtx);
    L.stats.host_s += fc_seconds(t0);
    return ok;
}

void fc_whole_launch(forecache_cache * c, int32_t il) {
    fc_layer & L = c->layers[il];
    const fc_ffn & f = c->ffn.at(il);
    c->h_in.resize(ggml_nelements(f.x));
    ggml_backend_tensor_get(f.x, c->h_in.data(), 0, ggml_nbytes(f.x)); // computed: the layer's stop synchronized
    L.stats.readbacks++;
    L.stats.mini_graphs++;
    L.stats.whole++;
    c->whole_busy = true;
    c->whole_ok   = false;
    c->host.run([c, il] { c->whole_ok = fc_whole_compute(c, il); });
}

void fc_whole_wait(forecache_cache * c) {
    if (c->whole_busy) {
        c->host.wait();
        c->whole_busy = false;
    }
}

bool fc_whole_finish(forecache_cache * c, int32_t il) {
    fc_layer & L = c->layers[il];
    L.whole_epoch = 0;
    fc_whole_wait(c);
    if (!c->whole_ok) {
        LLAMA_LOG_ERROR("%s: host expert compute failed for layer %d\n", __func__, il);
        return false;
    }
    // the rows into the last product's result, on the compute stream after it (runs of adjacent rows at once)
    ggml_tensor * y = c->ffn.at(il).last;
    ggml_backend_t be = c->devs[L.dev].backend;
    const size_t row = y->nb[1];
    const size_t n = c->w_dst.size();
    for (size_t k = 0; k < n;) {
        size_t j = k + 1;
        while (j < n && c->w_dst[j] == c->w_dst[j - 1] + 1) {
            j++;
        }
        ggml_backend_tensor_set_async(be, y, c->h_out.data() + k*y->ne[0], c->w_dst[k]*row, (j - k)*row);
        k = j;
    }
    return true;
}
