#include "forecache.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdlib>
#include <cstring>

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
