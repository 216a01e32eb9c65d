#include "forecache.h"
#include "forecache-impl.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

void forecache_set_err(char * err, size_t err_size, const char * fmt, ...) {
    if (err == nullptr || err_size == 0) {
        return;
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, err_size, fmt, args);
    va_end(args);
}

int forecache_expert_layer(const char * name) {
    int il = -1;
    int n  = 0;
    if (sscanf(name, "blk.%d.%n", &il, &n) != 1 || n == 0) {
        return -1;
    }
    const char * suffix = "_exps.weight";
    const size_t len = strlen(name), len_suffix = strlen(suffix);
    if (len < (size_t) n + len_suffix || strcmp(name + len - len_suffix, suffix) != 0) {
        return -1;
    }
    return il;
}

int32_t forecache_patch_version(void) {
    return FORECACHE_PATCH_VERSION;
}

int32_t forecache_measure_copy(
        size_t   dev_index,
        size_t   nbytes,
        int32_t  n_iter,
        bool     pinned,
        double * h2d_gbps,
        double * d2h_gbps) {
    if (dev_index >= ggml_backend_dev_count() || nbytes == 0 || n_iter < 1) {
        return -1;
    }
    ggml_backend_dev_t dev = ggml_backend_dev_get(dev_index);

    ggml_backend_buffer_t host_buf = nullptr;
    void * host = nullptr;
    if (pinned) {
        ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);
        if (host_buft == nullptr) {
            return -2;
        }
        host_buf = ggml_backend_buft_alloc_buffer(host_buft, nbytes);
        if (host_buf == nullptr) {
            return -2;
        }
        host = ggml_backend_buffer_get_base(host_buf);
    } else {
        host = malloc(nbytes);
        if (host == nullptr) {
            return -3;
        }
    }

    ggml_backend_buffer_t dev_buf = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), nbytes);

    ggml_init_params params = { ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    ggml_context * ctx = ggml_init(params);

    int32_t status = -3;
    if (dev_buf != nullptr && ctx != nullptr) {
        ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) nbytes);
        if (ggml_backend_tensor_alloc(dev_buf, t, ggml_backend_buffer_get_base(dev_buf)) == GGML_STATUS_SUCCESS) {
            memset(host, 1, nbytes);

            // tensor_set/get return once the copy is complete on every backend
            ggml_backend_tensor_set(t, host, 0, nbytes);
            int64_t t0 = ggml_time_us();
            for (int32_t i = 0; i < n_iter; i++) {
                ggml_backend_tensor_set(t, host, 0, nbytes);
            }
            int64_t t1 = ggml_time_us();
            ggml_backend_tensor_get(t, host, 0, nbytes);
            int64_t t2 = ggml_time_us();
            for (int32_t i = 0; i < n_iter; i++) {
                ggml_backend_tensor_get(t, host, 0, nbytes);
            }
            int64_t t3 = ggml_time_us();

            const double total = (double) nbytes * n_iter;
            *h2d_gbps = total / (double) (t1 - t0 > 0 ? t1 - t0 : 1) * 1e-3;
            *d2h_gbps = total / (double) (t3 - t2 > 0 ? t3 - t2 : 1) * 1e-3;
            status = 0;
        }
    }

    if (ctx != nullptr) {
        ggml_free(ctx);
    }
    if (dev_buf != nullptr) {
        ggml_backend_buffer_free(dev_buf);
    }
    if (host_buf != nullptr) {
        ggml_backend_buffer_free(host_buf);
    } else {
        free(host);
    }
    return status;
}

struct forecache_capture {
    std::string           prefix; // "<name>-"
    int32_t               n_layer = 0;
    int32_t               n_embd  = 0;
    std::vector<float>    rows;   // n_layer x n_embd: the last token's row of each layer
    std::vector<int64_t>  count;  // captures per layer
};

struct forecache_capture * forecache_capture_init(const char * name, int32_t n_layer, int32_t n_embd) {
    if (name == nullptr || n_layer <= 0 || n_embd <= 0) {
        return nullptr;
    }
    auto * c = new forecache_capture();
    c->prefix  = std::string(name) + "-";
    c->n_layer = n_layer;
    c->n_embd  = n_embd;
    c->rows.assign((size_t) n_layer*n_embd, 0.0f);
    c->count.assign(n_layer, 0);
    return c;
}

void forecache_capture_free(struct forecache_capture * capture) {
    delete capture;
}

// layer of a tensor named "<prefix><il>", or -1
static int32_t fc_capture_layer(const forecache_capture * c, const char * name) {
    if (strncmp(name, c->prefix.c_str(), c->prefix.size()) != 0) {
        return -1;
    }
    int il = -1;
    int n  = 0;
    if (sscanf(name + c->prefix.size(), "%d%n", &il, &n) != 1 || name[c->prefix.size() + n] != '\0') {
        return -1;
    }
    return il >= 0 && il < c->n_layer ? il : -1;
}

bool forecache_capture_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * c = (forecache_capture *) user_data;
    const int32_t il = fc_capture_layer(c, ggml_get_name(t));
    const bool wanted = il >= 0 && t->type == GGML_TYPE_F32 && t->ne[0] == c->n_embd && t->nb[0] == sizeof(float);
    if (ask) {
        return wanted;
    }
    if (wanted && t->ne[1] > 0) {
        const size_t offset = (size_t) (t->ne[1] - 1)*t->nb[1];
        ggml_backend_tensor_get(t, c->rows.data() + (size_t) il*c->n_embd, offset, (size_t) c->n_embd*sizeof(float));
        c->count[il]++;
    }
    return true;
}

int64_t forecache_capture_get(const struct forecache_capture * capture, int32_t layer, float * out) {
    if (capture == nullptr || layer < 0 || layer >= capture->n_layer) {
        return -1;
    }
    if (capture->count[layer] > 0) {
        memcpy(out, capture->rows.data() + (size_t) layer*capture->n_embd, (size_t) capture->n_embd*sizeof(float));
    }
    return capture->count[layer];
}
