// forecache expert cache: the graph hook (MUL_MAT_IDs rewritten to read slot pools).
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

// the layer is computed group by group (streamed, split between slots and host, reading stage slots,
// or routed by a little pass, whose repeated top-1 ids a gathered group computes as separate rows),
// not as rewritten; host entries computed whole on the CPU (fc_whole_start) leave it rewritten
bool fc_grouped(const fc_layer & L) {
    const bool whole = L.whole_epoch != 0 && L.whole_epoch == L.sch_epoch;
    return L.streams || L.staged || L.little || (L.n_dev < (int32_t) L.sch_e.size() && !whole);
}

ggml_tensor * fc_view(fc_device & d, int64_t ne0, int64_t ne1) {
    const auto key = std::make_pair(ne0, ne1);
    auto it = d.views.find(key);
    if (it != d.views.end()) {
        return it->second;
    }
    if (ggml_get_mem_size(d.view_ctx) - ggml_used_mem(d.view_ctx) < ggml_tensor_overhead()) {
        return nullptr;
    }
    ggml_tensor * v = ggml_view_2d(d.view_ctx, d.slot_ids, ne0, ne1, ne0*sizeof(int32_t), 0);
    ggml_format_name(v, "fc.slot_ids.%lldx%lld", (long long) ne0, (long long) ne1);
    if (ggml_backend_view_init(v) != GGML_STATUS_SUCCESS) {
        return nullptr;
    }
    d.views[key] = v;
    return v;
}

// the remap of a layer's routed ids to its slots, computed on the device: a table of the layer's
// (expert -> slot, or place in a span) read at each id (a view that repeats the map for every token, so the ids need no copy), shaped
// as the ids; nullptr when it cannot be made
static ggml_tensor * fc_remap(ggml_context * ctx, ggml_tensor * table, ggml_tensor * ids) {
    if (ctx == nullptr || ggml_get_mem_size(ctx) - ggml_used_mem(ctx) < 3*ggml_tensor_overhead() ||
            ids->ne[2] != 1 || ids->ne[3] != 1) {
        return nullptr;
    }
    ggml_tensor * map = ggml_view_2d(ctx, table, 1, table->ne[1], table->nb[1], 0);
    map->ne[2] = ids->ne[1]; // the same map for every token (ggml_view_3d would ask for a copy's bytes)
    map->nb[2] = 0;
    map->nb[3] = 0;
    if (ggml_backend_view_init(map) != GGML_STATUS_SUCCESS) {
        return nullptr;
    }
    ggml_tensor * rows = ggml_get_rows(ctx, map, ids);
    ggml_format_name(rows, "fc.remap.%s", ids->name);
    ggml_tensor * out = ggml_reshape_2d(ctx, rows, ids->ne[0], ids->ne[1]);
    // what ggml_build_forward_expand marks: backends skip nodes without it
    rows->flags |= GGML_TENSOR_FLAG_COMPUTE;
    out->flags  |= GGML_TENSOR_FLAG_COMPUTE;
    return out;
}

// puts the two nodes of remap r (its GET_ROWS, then r) into graph before node i
static void fc_insert_remap(ggml_cgraph * graph, int i, ggml_tensor * r) {
    ggml_graph_add_node(graph, r->src[0]);
    ggml_graph_add_node(graph, r);
    ggml_tensor ** nodes = ggml_graph_nodes(graph);
    const int n = ggml_graph_n_nodes(graph);
    std::rotate(nodes + i, nodes + n - 2, nodes + n);
}

// the bank layers of a graph whose ubatch is long enough for them (forecache_cache_set_bank): each
// product's remap node, and for each layer's first the next bank layer of its device
void fc_bank_graph(forecache_cache * c, fc_gctx & g, ggml_cgraph * graph) {
    g.bank_rm.clear();
    g.bank_first = -1;
    if (c->bank_map.empty()) {
        return;
    }
    std::vector<std::pair<ggml_tensor *, int32_t>> order; // first remap node, layer
    std::unordered_map<const ggml_tensor *, bool> seen;   // routed ids
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op != GGML_OP_MUL_MAT_ID) {
            continue;
        }
        auto bt = c->bank_map.find(node->src[0]);
        if (bt == c->bank_map.end()) {
            continue;
        }
        ggml_tensor * r = node->src[2]->src[0];
        g.bank_rm[r] = {bt->second.first, -2};
        if (seen.emplace(node->src[3], true).second) {
            order.emplace_back(r, bt->second.first);
            g.bank_rows = (int32_t) node->src[3]->ne[1];
        }
    }
    for (size_t k = 0; k < order.size(); k++) {
        const int32_t dev = c->layers[order[k].second].dev;
        int32_t next = -1;
        for (size_t j = k + 1; j < order.size() && next < 0; j++) {
            next = c->layers[order[j].second].dev == dev ? order[j].second : -1;
        }
        g.bank_rm[order[k].first] = {order[k].second, next};
    }
    g.bank_first = order.empty() ? -1 : order[0].second;
}

// rewrites every MUL_MAT_ID that reads a cached expert tensor to read the layer's slot pool, through
// slot ids that a node before the layer's first product remaps on the device (or, where the graph has
// no room for it, that the hook writes)
// a context of its own for the remap nodes of a graph of g, a few graphs' worth (the one computed
// is always the last one split)
static ggml_context * fc_remap_ctx(forecache_cache * c, fc_gctx & g) {
    ggml_init_params params = {
        /*.mem_size   =*/ (size_t) (3*FC_MAX_PROJ*c->layers.size() + 8)*ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context * rctx = ggml_init(params);
    g.remap_ctx.push_back(rctx);
    while (g.remap_ctx.size() > 4) {
        ggml_free(g.remap_ctx.front());
        g.remap_ctx.pop_front();
    }
    return rctx;
}

// the product reads layer L's span through its table for projection p (a bank layer in a long ubatch;
// false when the graph has no room for the remap)
static bool fc_bank_rewrite(forecache_cache * c, fc_gctx & g, ggml_context *& rctx, ggml_cgraph * graph,
        int & i, ggml_tensor * node, const fc_layer & L, int32_t p) {
    ggml_tensor * ids = node->src[2];
    if (ggml_graph_size(graph) - ggml_graph_n_nodes(graph) < 2 || L.span[p] == nullptr ||
            c->bank_tokens <= 0 || ids->ne[1] < c->bank_tokens) {
        return false;
    }
    if (rctx == nullptr) {
        rctx = fc_remap_ctx(c, g);
    }
    // each projection through its own table (the span's places differ between projections)
    ggml_tensor * places = fc_remap(rctx, L.bmap[p], ids);
    if (places == nullptr) {
        return false;
    }
    fc_insert_remap(graph, i, places);
    i += 2;
    node->src[3] = ids;
    node->src[2] = places;
    node->src[0] = L.span[p];
    return true;
}

// the graph hook of an attached context: a long ubatch's bank layers read their spans; nothing else
// changes (its other expert products read host memory, as stock llama.cpp's do)
static void fc_attached_graph_hook(forecache_cache * c, fc_gctx & g, ggml_cgraph * graph) {
    ggml_context * rctx = nullptr;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op != GGML_OP_MUL_MAT_ID || node->src[3] != nullptr) {
            continue;
        }
        auto it = c->host_map.find(node->src[0]);
        if (it != c->host_map.end()) {
            fc_bank_rewrite(c, g, rctx, graph, i, node, c->layers[it->second.first], it->second.second);
        }
    }
    fc_bank_graph(c, g, graph);
}

void fc_graph_hook(ggml_cgraph * graph, void * user_data) {
    auto & g = *(fc_gctx *) user_data;
    forecache_cache * c = g.c;
    if (!g.main) {
        fc_attached_graph_hook(c, g, graph);
        return;
    }
    fc_whole_wait(c); // a cancelled compute's host job reads the nodes of the graph this one replaces
    std::unordered_map<const ggml_tensor *, int> first_use; // routed ids -> first node index
    std::unordered_map<const ggml_tensor *, ggml_tensor *> remap_of; // routed ids -> remapped ids

    c->layer_of_ids.clear();
    c->remap_mm.clear();
    ggml_context * rctx = nullptr; // this graph's remap nodes
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op != GGML_OP_MUL_MAT_ID) {
            continue;
        }
        auto pit = c->pool_map.find(node->src[0]);
        if (pit != c->pool_map.end()) {
            c->layer_of_ids[node->src[3]] = pit->second.first;
            if (fc_remapped(node)) {
                c->remap_mm.emplace(node->src[2]->src[0], node);
            }
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
        const int32_t p = it->second.second;
        const bool room = ggml_graph_size(graph) - ggml_graph_n_nodes(graph) >= 2;
        if (fc_bank_rewrite(c, g, rctx, graph, i, node, L, p)) {
            c->layer_of_ids[ids] = it->second.first;
            continue;
        }
        if (room && rctx == nullptr) {
            rctx = fc_remap_ctx(c, g);
        }
        ggml_tensor * slot_ids = nullptr;
        auto rit = remap_of.find(ids);
        if (rit != remap_of.end()) {
            slot_ids = rit->second; // nullptr: the layer's ids are written by the hook
        } else if (room) {
            slot_ids = fc_remap(rctx, L.map, ids);
            remap_of[ids] = slot_ids;
            if (slot_ids != nullptr) {
                fc_insert_remap(graph, i, slot_ids);
                i += 2;
                c->remap_mm.emplace(slot_ids->src[0], node);
            }
        } else {
            remap_of[ids] = nullptr;
        }
        if (slot_ids == nullptr) {
            fc_device & d = c->devs[L.dev];
            if (ids->ne[0]*ids->ne[1] > ggml_nelements(d.slot_ids)) {
                continue;
            }
            slot_ids = fc_view(d, ids->ne[0], ids->ne[1]);
            if (slot_ids == nullptr) {
                continue;
            }
        }
        node->src[3] = ids; // keeps the routed ids alive until the matmul and tells the hook where they are
        node->src[2] = slot_ids;
        node->src[0] = L.pool[it->second.second];
        c->layer_of_ids[ids] = it->second.first;
    }
    const int n_nodes = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n_nodes; i++) { // after the remap nodes went in
        ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op == GGML_OP_MUL_MAT_ID && c->pool_map.count(node->src[0])) {
            first_use.emplace(node->src[3], i);
        }
    }
    fc_bank_graph(c, g, graph);
    fc_ffn_graph(c, graph);

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
