// forecache: a sequence's KV cells moved from one context of a model to another (a batch job's
// prompt fed in one context, decoded in another), whatever each context's number of KV streams.
//
// llama_state_seq_get_data writes a sequence as its cache's streams, each a count of cells and,
// for the one stream that holds the sequence, its cells; llama_state_seq_set_data reads them back
// only into a cache of as many streams. Here the source's writing is read into the destination as
// a cache of the destination's streams: the sequence's stream first, then empty ones.

#include "forecache.h"
#include "forecache-impl.h"

#include "llama-io.h"
#include "llama-kv-cache.h"

#include "ggml-backend.h"

#include <cstring>
#include <exception>
#include <vector>

namespace {

struct fc_write_buf : llama_io_write_i {
    std::vector<uint8_t> buf;

    void write(const void * src, size_t size) override {
        const auto * p = (const uint8_t *) src;
        buf.insert(buf.end(), p, p + size);
    }

    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        const size_t at = buf.size();
        buf.resize(at + size);
        ggml_backend_tensor_get(tensor, buf.data() + at, offset, size);
    }

    size_t n_bytes() override { return buf.size(); }
};

// reads `rec` (the sequence's stream as the source wrote it) after a stream count of n_stream; past
// its end every read is zeros: the destination's other streams, empty
struct fc_read_restream : llama_io_read_i {
    const uint8_t * rec;
    size_t          n_rec;
    uint32_t        n_stream;
    size_t          pos   = 0;
    size_t          total = 0;
    bool            head  = true;

    fc_read_restream(const uint8_t * rec, size_t n_rec, uint32_t n_stream) : rec(rec), n_rec(n_rec), n_stream(n_stream) {}

    void take(void * dst, size_t size) {
        const size_t n = pos < n_rec ? std::min(size, n_rec - pos) : 0;
        if (n > 0) {
            memcpy(dst, rec + pos, n);
        }
        memset((uint8_t *) dst + n, 0, size - n);
        pos   += size;
        total += size;
    }

    void read(void * dst, size_t size) override {
        if (head && size == sizeof(uint32_t)) {
            memcpy(dst, &n_stream, sizeof(n_stream));
            head   = false;
            total += size;
            return;
        }
        take(dst, size);
    }

    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        std::vector<uint8_t> tmp(size);
        take(tmp.data(), size);
        ggml_backend_tensor_set(tensor, tmp.data(), offset, size);
    }

    size_t n_bytes() override { return total; }
};

llama_kv_cache * fc_kv_cache(llama_context * ctx) {
    return dynamic_cast<llama_kv_cache *>(llama_get_memory(ctx));
}

} // namespace

int32_t forecache_seq_move(struct llama_context * src, int32_t src_seq, struct llama_context * dst, int32_t dst_seq,
        char * err, size_t err_size) {
    llama_kv_cache * from = fc_kv_cache(src);
    llama_kv_cache * to   = fc_kv_cache(dst);
    if (from == nullptr || to == nullptr) {
        forecache_set_err(err, err_size, "the model's memory is not one KV cache (sliding-window or recurrent layers)");
        return -1;
    }
    if (llama_get_model(src) != llama_get_model(dst)) {
        forecache_set_err(err, err_size, "the contexts are of different models");
        return -1;
    }
    fc_write_buf out;
    try {
        from->state_write(out, src_seq);
    } catch (const std::exception & e) {
        forecache_set_err(err, err_size, "cannot read sequence %d: %s", src_seq, e.what());
        return -1;
    }
    // the source's stream count, then each stream's cell count: the sequence's stream is the one
    // that is not empty, and the empty ones after it end the writing
    const std::vector<uint8_t> & b = out.buf;
    uint32_t n_src = 0;
    if (b.size() < sizeof(n_src)) {
        forecache_set_err(err, err_size, "sequence %d: nothing written", src_seq);
        return -1;
    }
    memcpy(&n_src, b.data(), sizeof(n_src));
    size_t at = sizeof(n_src);
    uint32_t lead = 0;
    for (; lead < n_src && at + sizeof(uint32_t) <= b.size(); lead++, at += sizeof(uint32_t)) {
        uint32_t cells = 0;
        memcpy(&cells, b.data() + at, sizeof(cells));
        if (cells != 0) {
            break;
        }
    }
    const size_t tail = lead < n_src ? (size_t) (n_src - 1 - lead)*sizeof(uint32_t) : 0;
    if (at + tail > b.size()) {
        forecache_set_err(err, err_size, "sequence %d: unexpected state layout", src_seq);
        return -1;
    }
    for (size_t k = b.size() - tail; k < b.size(); k++) {
        if (b[k] != 0) {
            forecache_set_err(err, err_size, "sequence %d: unexpected state layout", src_seq);
            return -1;
        }
    }
    llama_memory_seq_rm(llama_get_memory(dst), dst_seq, -1, -1);
    fc_read_restream in(b.data() + at, b.size() - tail - at, to->get_n_stream());
    try {
        to->state_read(in, dst_seq);
    } catch (const std::exception & e) {
        forecache_set_err(err, err_size, "cannot write sequence %d: %s", dst_seq, e.what());
        return -1;
    }
    return 0;
}
