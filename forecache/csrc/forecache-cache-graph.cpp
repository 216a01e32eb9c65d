// forecache expert cache: the graph hook (MUL_MAT_IDs rewritten to read slot pools).
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

// the layer is computed group by group (streamed, split between slots and host, reading stage slots,
// or routed by a little pass, whose repeated top-1 ids a gathered group computes as separate rows),
// not as rewritten
bool fc_grouped(const fc_layer & L) {
    return L.streams || L.staged || L.little || L.n_dev < (int32_t) L.sch_e.size();
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
        fc_device & d = c->devs[L.dev];
        if (ids->ne[0]*ids->ne[1] > ggml_nelements(d.slot_ids)) {
            continue;
        }
        ggml_tensor * view = fc_view(d, ids->ne[0], ids->ne[1]);
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
