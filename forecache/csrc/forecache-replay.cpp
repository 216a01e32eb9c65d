// forecache routing replay: expert matmuls read a recorded routing instead of the router's choice.
// See forecache.h for the contract.

#include "forecache.h"
#include "forecache-impl.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-backend-hooks.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <tuple>
#include <unordered_map>
#include <vector>

struct forecache_replay {
    llama_context      * lctx  = nullptr;
    ggml_backend_sched_t sched = nullptr;
    int32_t n_layer      = 0;
    int32_t n_used       = 0;
    int32_t n_tokens_max = 0;
    int32_t n_tokens     = 0; // of the routing set for the next ubatch

    // one buffer seen as I32 and as F32: an ubatch's ids [n_layer][n_tokens][n_used], then its router
    // weights in the same layout, packed for its n_tokens so that one copy sets both
    ggml_context        * table_ctx = nullptr;
    ggml_backend_buffer_t table_buf = nullptr;
    ggml_tensor         * ids       = nullptr;
    ggml_tensor         * weights   = nullptr;

    // views into the tables, by (is weights, layer, ubatch tokens, first row, rows); their contexts
    // live as long as the replay, since reused graphs keep reading them
    std::vector<ggml_context *> view_ctxs;
    std::map<std::tuple<int, int32_t, int32_t, int64_t, int64_t>, ggml_tensor *> views;

    // the hooks set before the replay's, called after its rewrite (the expert cache's)
    ggml_backend_sched_graph_hook prev_graph = nullptr;
    ggml_backend_sched_node_hook  prev_node  = nullptr;
    void                        * prev_ud    = nullptr;

    std::vector<int32_t> staging; // the next ubatch's ids and weights (as bits), copied at once

    // forecache_replay_set_rows: the batch's rows by (sequence, position), each row's ids then its
    // weights (as bits), [n_layer][n_used] each; laid out per ubatch as llama.cpp splits the batch
    bool by_rows = false;
    std::unordered_map<uint64_t, int32_t> row_of;
    std::vector<int32_t> rows;

    uint64_t rewritten = 0; // expert matmuls rewritten, over all graphs
    bool     failed    = false;
};

namespace {

// a view of `table` with the shape of `like`, for layer il's rows [row0, row0 + rows) of an ubatch of
// n_tokens tokens; nullptr when it cannot be made
ggml_tensor * fr_view(forecache_replay * r, bool is_weights, int32_t il, int32_t n_tokens, int64_t row0, const ggml_tensor * like) {
    const int64_t rows = ggml_nelements(like) / r->n_used;
    const auto key = std::make_tuple((int) is_weights, il, n_tokens, row0, rows);
    auto it = r->views.find(key);
    if (it != r->views.end() && ggml_are_same_shape(it->second, like)) {
        return it->second;
    }
    ggml_context * vctx = r->view_ctxs.empty() ? nullptr : r->view_ctxs.back();
    if (vctx == nullptr || ggml_get_mem_size(vctx) - ggml_used_mem(vctx) < ggml_tensor_overhead()) {
        ggml_init_params params = { 256*ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
        vctx = ggml_init(params);
        if (vctx == nullptr) {
            return nullptr;
        }
        r->view_ctxs.push_back(vctx);
    }
    ggml_tensor * table = is_weights ? r->weights : r->ids;
    const size_t es = ggml_element_size(table);
    const size_t n_ids = (size_t) r->n_layer*n_tokens*r->n_used;
    const size_t offset = ((is_weights ? n_ids : 0) + ((size_t) il*n_tokens + row0)*r->n_used)*es;
    if (row0 < 0 || offset + (size_t) ggml_nelements(like)*es > ggml_nbytes(r->ids)) {
        LLAMA_LOG_ERROR("%s: layer %d: rows [%lld, %lld) of an ubatch of %d tokens lie outside the replay's tables (%d tokens)\n",
                        __func__, il, (long long) row0, (long long) (row0 + rows), n_tokens, r->n_tokens_max);
        return nullptr;
    }
    ggml_tensor * v = nullptr;
    // by the shape, not ggml_n_dims: a layer computed for no rows (an ubatch without outputs) has
    // weights [1, n_used, 0], which a 2-d view would read past the tables
    if (like->ne[2] == 1 && like->ne[3] == 1) {
        v = ggml_view_2d(vctx, table, like->ne[0], like->ne[1], like->ne[0]*es, offset);
    } else {
        v = ggml_view_3d(vctx, table, like->ne[0], like->ne[1], like->ne[2], like->ne[0]*es,
                         like->ne[0]*like->ne[1]*es, offset);
    }
    ggml_format_name(v, "fr.%s.%d.%lld", is_weights ? "weights" : "ids", il, (long long) row0);
    if (ggml_backend_view_init(v) != GGML_STATUS_SUCCESS) {
        return nullptr;
    }
    r->views[key] = v;
    return v;
}

// the first row read by a node that computes `rows` of an ubatch's n_tokens tokens: llama.cpp
// computes the last layer for the rows whose output is asked for only, the ubatch's last tokens as
// the callers of a replay decode them
int64_t fr_first_row(int32_t n_tokens, int64_t rows) {
    return n_tokens - rows;
}

// points every expert matmul (and bias) at the replayed ids, and the product of the expert outputs
// with the router weights at the replayed weights; then the hooks set before
void fr_graph_hook(ggml_cgraph * graph, void * user_data) {
    auto * r = (forecache_replay *) user_data;
    std::unordered_map<const ggml_tensor *, int32_t> layer_of;  // expert outputs -> layer
    std::unordered_map<const ggml_tensor *, ggml_tensor *> ids_view; // router ids -> replayed ids
    const int n_nodes = ggml_graph_n_nodes(graph);
    // the ubatch the graph computes: the one whose routing was set, except in graphs llama.cpp
    // only reserves memory with (the largest ubatch), which are never computed
    int64_t n_graph = 0;
    for (int i = 0; i < n_nodes; i++) {
        const ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op == GGML_OP_MUL_MAT_ID) {
            n_graph = std::max(n_graph, node->src[2]->ne[1]);
        }
    }
    if (n_graph > r->n_tokens_max) {
        // a graph llama.cpp only reserves memory with, its ubatch rounded up to whole sequences
        // (n_ubatch tokens over n_seq_max streams): never computed, left as built
        if (r->prev_graph != nullptr) {
            r->prev_graph(graph, r->prev_ud);
        }
        return;
    }
    const int32_t n_tokens = n_graph > r->n_tokens ? (int32_t) n_graph : r->n_tokens;
    for (int i = 0; i < n_nodes && !r->failed; i++) {
        ggml_tensor * node = ggml_graph_node(graph, i);
        if (node->op == GGML_OP_MUL_MAT_ID) {
            const int32_t il = forecache_expert_layer(node->src[0]->name);
            if (il < 0 || il >= r->n_layer) {
                continue;
            }
            // the down projection's output is what the router weights multiply
            const bool down = strstr(node->src[0]->name, ".ffn_down_exps.") != nullptr;
            ggml_tensor * ids = node->src[2];
            const int64_t rows = ids->ne[1];
            if (ids->ne[0] != r->n_used || rows > n_tokens) {
                LLAMA_LOG_ERROR("%s: layer %d routes %lld tokens to %lld experts; the replay has room for %d tokens and %d experts each\n",
                                __func__, il, (long long) rows, (long long) ids->ne[0], n_tokens, r->n_used);
                r->failed = true;
                break;
            }
            auto it = ids_view.find(ids);
            ggml_tensor * v = it != ids_view.end() ? it->second : fr_view(r, false, il, n_tokens, fr_first_row(n_tokens, rows), ids);
            if (v == nullptr) {
                r->failed = true;
                break;
            }
            ids_view[ids] = v;
            node->src[2] = v;
            r->rewritten++;
            if (down) {
                layer_of[node] = il;
            }
        } else if (node->op == GGML_OP_ADD_ID) {
            auto it = ids_view.find(node->src[2]);
            if (it != ids_view.end()) {
                node->src[2] = it->second;
            }
            auto lt = layer_of.find(node->src[0]);
            if (lt != layer_of.end()) {
                layer_of[node] = lt->second;
            }
        } else if (node->op == GGML_OP_MUL) {
            auto lt = layer_of.find(node->src[0]);
            ggml_tensor * w = node->src[1];
            if (lt == layer_of.end() || w->type != GGML_TYPE_F32 || ggml_nelements(w) % r->n_used != 0) {
                continue;
            }
            ggml_tensor * v = fr_view(r, true, lt->second, n_tokens, fr_first_row(n_tokens, ggml_nelements(w) / r->n_used), w);
            if (v == nullptr) {
                r->failed = true;
                break;
            }
            node->src[1] = v;
        }
    }
    if (r->prev_graph != nullptr) {
        r->prev_graph(graph, r->prev_ud);
    }
}

int fr_node_hook(ggml_tensor * t, bool ask, void * user_data) {
    auto * r = (forecache_replay *) user_data;
    if (t == nullptr && ask && r->failed) {
        LLAMA_LOG_ERROR("%s: the routing replay could not rewrite the graph\n", __func__);
    }
    if (r->failed && !ask) {
        return -1;
    }
    if (r->prev_node == nullptr) {
        return 0;
    }
    return r->prev_node(t, ask, r->prev_ud);
}

uint64_t fr_key(llama_seq_id seq, llama_pos pos) {
    return ((uint64_t) (uint32_t) seq << 32) | (uint32_t) pos;
}

// copies the staged ids and weights of an ubatch of n_tokens tokens to the tables, once the ubatch
// before has stopped reading them (llama_decode returns before the device is done)
void fr_upload(forecache_replay * r, int32_t n_tokens) {
    ggml_backend_sched_synchronize(r->sched);
    // the layout follows the ubatch's size: a graph built for another size reads other views
    r->n_tokens = n_tokens;
    const size_t n = (size_t) r->n_layer*n_tokens*r->n_used;
    ggml_backend_tensor_set(r->ids, r->staging.data(), 0, 2*n*sizeof(int32_t));
}

// before each ubatch of a batch set by rows: its tokens' rows, in the order llama.cpp computes them
void fr_ubatch_hook(const llama_ubatch & ubatch, void * user_data) {
    auto * r = (forecache_replay *) user_data;
    if (!r->by_rows || r->failed) {
        return;
    }
    const int32_t n_tokens = (int32_t) ubatch.n_tokens;
    if (n_tokens > r->n_tokens_max) {
        LLAMA_LOG_ERROR("%s: an ubatch of %d tokens is more than the replay's %d\n", __func__, n_tokens, r->n_tokens_max);
        r->failed = true;
        return;
    }
    const size_t per = (size_t) r->n_layer*r->n_used;
    const size_t n = per*n_tokens;
    r->staging.resize(2*n);
    for (int32_t i = 0; i < n_tokens; i++) {
        const auto it = r->row_of.find(fr_key(ubatch.seq_id[i][0], ubatch.pos[i]));
        if (it == r->row_of.end()) {
            LLAMA_LOG_ERROR("%s: no routing was set for sequence %d at position %d\n", __func__,
                            ubatch.seq_id[i][0], ubatch.pos[i]);
            r->failed = true;
            return;
        }
        const int32_t * row = r->rows.data() + 2*per*it->second;
        for (int32_t il = 0; il < r->n_layer; il++) {
            const size_t at = ((size_t) il*n_tokens + i)*r->n_used;
            memcpy(r->staging.data() + at,     row + (size_t) il*r->n_used,       r->n_used*sizeof(int32_t));
            memcpy(r->staging.data() + n + at, row + per + (size_t) il*r->n_used, r->n_used*sizeof(int32_t));
        }
    }
    fr_upload(r, n_tokens);
}

} // namespace

struct forecache_replay * forecache_replay_init(
        struct llama_context * ctx,
        int32_t                n_tokens_max,
        size_t                 dev_index,
        char                 * err,
        size_t                 err_size) {
    if (ctx == nullptr || n_tokens_max < 1 || dev_index >= ggml_backend_dev_count()) {
        forecache_set_err(err, err_size, "bad arguments");
        return nullptr;
    }
    const llama_model & model = ctx->get_model();
    auto * r = new forecache_replay();
    r->lctx = ctx;
    r->sched = ctx->get_sched();
    r->n_layer = (int32_t) model.hparams.n_layer();
    r->n_used = (int32_t) model.hparams.n_expert_used_max();
    r->n_tokens_max = n_tokens_max;
    if (r->n_used < 1) {
        forecache_set_err(err, err_size, "the model routes no experts (expert_used_count is 0)");
        delete r;
        return nullptr;
    }
    ggml_init_params params = { 2*ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    r->table_ctx = ggml_init(params);
    const int64_t n = 2*(int64_t) r->n_layer*n_tokens_max*r->n_used;
    r->ids = ggml_new_tensor_1d(r->table_ctx, GGML_TYPE_I32, n);
    r->weights = ggml_new_tensor_1d(r->table_ctx, GGML_TYPE_F32, n);
    ggml_set_name(r->ids, "fr.ids");
    ggml_set_name(r->weights, "fr.weights");
    // where the router's ids would be: on the device that computes the layers (the CPU without one)
    ggml_backend_dev_t dev = ggml_backend_dev_get(dev_index);
    r->table_buf = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), ggml_nbytes(r->ids));
    if (r->table_buf == nullptr ||
            ggml_backend_tensor_alloc(r->table_buf, r->ids, ggml_backend_buffer_get_base(r->table_buf)) != GGML_STATUS_SUCCESS ||
            ggml_backend_tensor_alloc(r->table_buf, r->weights, ggml_backend_buffer_get_base(r->table_buf)) != GGML_STATUS_SUCCESS) {
        forecache_set_err(err, err_size, "cannot allocate the replay tables (%.1f MiB) on %s", n*4/1048576.0,
                   ggml_backend_dev_name(dev));
        ggml_backend_buffer_free(r->table_buf);
        ggml_free(r->table_ctx);
        delete r;
        return nullptr;
    }
    ggml_backend_sched_get_node_hooks(r->sched, &r->prev_graph, &r->prev_node, &r->prev_ud);
    ggml_backend_sched_set_node_hooks(r->sched, fr_graph_hook, r->prev_node ? fr_node_hook : nullptr, r);
    ctx->set_ubatch_hook(fr_ubatch_hook, r);
    ctx->reset_graph_reuse();
    return r;
}

int32_t forecache_replay_set(struct forecache_replay * replay, int32_t n_tokens, const int32_t * ids, const float * weights) {
    if (replay == nullptr || n_tokens < 1 || n_tokens > replay->n_tokens_max || ids == nullptr || weights == nullptr) {
        return -1;
    }
    replay->by_rows = false;
    const size_t n = (size_t) replay->n_layer*n_tokens*replay->n_used;
    replay->staging.resize(2*n);
    memcpy(replay->staging.data(), ids, n*sizeof(int32_t));
    memcpy(replay->staging.data() + n, weights, n*sizeof(float));
    fr_upload(replay, n_tokens);
    return 0;
}

int32_t forecache_replay_set_rows(struct forecache_replay * replay, int32_t n, const int32_t * seq_ids, const int32_t * pos,
                                  const int32_t * ids, const float * weights) {
    if (replay == nullptr || n < 1 || seq_ids == nullptr || pos == nullptr || ids == nullptr || weights == nullptr) {
        return -1;
    }
    const size_t per = (size_t) replay->n_layer*replay->n_used;
    std::unordered_map<uint64_t, int32_t> row_of;
    row_of.reserve(n);
    for (int32_t i = 0; i < n; i++) {
        if (!row_of.emplace(fr_key(seq_ids[i], pos[i]), i).second) {
            return -1;
        }
    }
    // the ubatches of the last batch have all run their hooks: llama_decode returned
    replay->row_of = std::move(row_of);
    replay->rows.resize(2*per*n);
    for (int32_t i = 0; i < n; i++) {
        memcpy(replay->rows.data() + 2*per*i,       ids     + per*i, per*sizeof(int32_t));
        memcpy(replay->rows.data() + 2*per*i + per, weights + per*i, per*sizeof(float));
    }
    replay->by_rows = true;
    return 0;
}

int64_t forecache_replay_rewritten(const struct forecache_replay * replay) {
    if (replay == nullptr || replay->failed) {
        return -1;
    }
    return (int64_t) replay->rewritten;
}

void forecache_replay_free(struct forecache_replay * replay) {
    if (replay == nullptr) {
        return;
    }
    ggml_backend_sched_synchronize(replay->sched);
    ggml_backend_sched_graph_hook g = nullptr;
    ggml_backend_sched_node_hook  nh = nullptr;
    void * ud = nullptr;
    ggml_backend_sched_get_node_hooks(replay->sched, &g, &nh, &ud);
    if (ud == replay) {
        ggml_backend_sched_set_node_hooks(replay->sched, replay->prev_graph, replay->prev_node, replay->prev_ud);
    }
    replay->lctx->set_ubatch_hook(nullptr, nullptr);
    replay->lctx->reset_graph_reuse();
    for (ggml_context * vctx : replay->view_ctxs) {
        ggml_free(vctx);
    }
    ggml_backend_buffer_free(replay->table_buf);
    ggml_free(replay->table_ctx);
    delete replay;
}
