// forecache expert cache: slots and the chunked copy engine (the queue, its worker, schedules).
// See forecache-cache-impl.h for how the expert cache's files divide the work.

#include "forecache-cache-impl.h"

// the entries a streamed chunk waits for have computed its projection from its slot
bool fc_need_met(const forecache_cache * c, const fc_chunk & ch) {
    if (ch.need <= 0) {
        return true;
    }
    const fc_layer & L = c->layers[ch.layer];
    return L.consumed[ch.slot*L.n_proj + ch.proj] >= ch.need;
}

bool fc_eligible(const forecache_cache * c, const fc_chunk & ch) {
    const fc_layer & L = c->layers[ch.layer];
    if (L.n_host > 0 && !fc_host_ready(L, ch.expert)) {
        return false; // its expert is still on disk
    }
    return fc_need_met(c, ch);
}

// the device a chunk copies to: its layer's, or its stage slot's (the same one)
static int32_t fc_chunk_dev(const forecache_cache * c, const fc_chunk & ch) {
    const fc_layer & L = c->layers[ch.layer];
    const int32_t j = fc_stage_of(L, ch.slot);
    return j >= 0 ? c->st_dev[j] : L.dev;
}

// a queued chunk for device dev (-1: any) could be copied now (lock held)
bool fc_has_eligible(const forecache_cache * c, int32_t dev) {
    for (const auto & q : c->queue) {
        for (const auto & ch : q) {
            if ((dev < 0 || fc_chunk_dev(c, ch) == dev) && fc_eligible(c, ch)) {
                return true;
            }
        }
    }
    return false;
}

// removes and returns the first eligible chunk for device dev (-1: any) in priority order (lock held)
bool fc_pop(forecache_cache * c, fc_chunk & out, int32_t dev) {
    for (auto & q : c->queue) {
        for (auto it = q.begin(); it != q.end(); ++it) {
            if ((dev < 0 || fc_chunk_dev(c, *it) == dev) && fc_eligible(c, *it)) {
                out = *it;
                q.erase(it);
                return true;
            }
        }
    }
    return false;
}

// stage slot a chunk or schedule entry of L writes or reads, or -1 for a slot of L
int32_t fc_stage_of(const fc_layer & L, int32_t slot) {
    return slot >= L.n_slots ? slot - L.n_slots : -1;
}

// wakes the copy workers: every one when several devices share the queue (a chunk may be another's)
void fc_notify_work(forecache_cache * c) {
    if (c->devs.size() > 1) {
        c->cv_work.notify_all();
    } else {
        c->cv_work.notify_one();
    }
}

// adjusts the in-flight counters of the projections a chunk writes (lock held)
void fc_count(forecache_cache * c, const fc_chunk & ch, int32_t d) {
    fc_layer & L = c->layers[ch.layer];
    const int32_t p0 = ch.proj < 0 ? 0 : ch.proj;
    const int32_t p1 = ch.proj < 0 ? L.n_proj : ch.proj + 1;
    const int32_t j  = fc_stage_of(L, ch.slot);
    if (j >= 0) {
        for (int32_t p = p0; p < p1; p++) {
            c->st_pend[j*FC_MAX_PROJ + p] += d;
        }
        return;
    }
    for (int32_t p = p0; p < p1; p++) {
        if (ch.entry < 0) {
            L.pend_proj[ch.slot*L.n_proj + p] += d;
        } else {
            L.entry_pend[ch.entry*L.n_proj + p] += d;
        }
    }
    if (ch.entry < 0) {
        L.pending[ch.slot] += d;
    }
    if (L.n_host > 0) {
        L.hwant[ch.expert] += d;
        if (d < 0) {
            c->cv_read.notify_all(); // its host slot may be taken again
        }
    }
}

// a chunk starts: its slot's state, its host slot held, the wait behind lower-priority chunks
// counted (lock held); returns the host slot it reads, -1
static int32_t fc_chunk_begin(forecache_cache * c, const fc_chunk & ch, fc_device & d) {
    fc_layer & L = c->layers[ch.layer];
    const int32_t j = fc_stage_of(L, ch.slot);
    if (j >= 0) {
        c->st_started[j] = 1;
    } else if (ch.entry < 0) {
        L.started[ch.slot] = 1;
    }
    const int32_t hs = L.n_host > 0 ? L.hslot_of[ch.expert] : -1; // eligible: its read is done
    if (hs >= 0) {
        L.hbusy[hs]++;
        L.hstamp[hs] = ++c->hclock;
    }
    if (ch.first && ch.priority == 0) {
        const double w = fc_seconds(ch.queued_at);
        L.stats.hi_wait_s    += w;
        L.stats.hi_wait_max_s = std::max(L.stats.hi_wait_max_s, w);
        // the part of the wait spent behind the last lower-priority chunk copying (a chunk
        // that waited for its slot to be consumed may see lower ones start after it was queued)
        const double b = std::chrono::duration<double>(d.low_end - std::max(ch.queued_at, d.low_start)).count();
        if (b > 0) {
            L.stats.hi_block_s    += b;
            L.stats.hi_block_max_s = std::max(L.stats.hi_block_max_s, b);
        }
    }
    c->running++;
    return hs;
}

// copies a chunk's bytes (lock not held): synchronously, or issued on backend `be`; returns them
static size_t fc_chunk_copy(forecache_cache * c, const fc_chunk & ch, int32_t hs, ggml_backend_t be) {
    const fc_layer & L = c->layers[ch.layer];
    const int32_t j = fc_stage_of(L, ch.slot);
    const int32_t p0 = ch.proj < 0 ? 0 : ch.proj;
    const int32_t p1 = ch.proj < 0 ? L.n_proj : ch.proj + 1;
    size_t bytes = 0;
    for (int32_t p = p0; p < p1; p++) {
        const ggml_tensor * src = L.host[p];
        int32_t at = ch.slot;
        ggml_tensor * dst = j >= 0 ? fc_stage_tensor(c, j, p, at) : L.pool[p];
        const size_t size = ch.proj < 0 ? src->nb[2] : ch.size;
        const uint8_t * from = hs >= 0 ? (const uint8_t *) L.hpool[p]->data + (size_t) hs*src->nb[2]
                                       : (const uint8_t *) src->data + ch.expert*src->nb[2];
        if (be != nullptr) {
            ggml_backend_tensor_set_async(be, dst, from + ch.offset, at*dst->nb[2] + ch.offset, size);
        } else {
            ggml_backend_tensor_set(dst, from + ch.offset, at*dst->nb[2] + ch.offset, size);
        }
        bytes += size;
    }
    return bytes;
}

// a chunk is done: counters, stats, its span, waiters woken (lock held)
static void fc_chunk_end(forecache_cache * c, const fc_chunk & ch, int32_t hs, size_t bytes, fc_device & d,
        fc_clock::time_point t0, fc_clock::time_point t1) {
    fc_layer & L = c->layers[ch.layer];
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    if (ch.priority > 0) {
        d.low_start = t0;
        d.low_end   = t1;
    }
    c->running--;
    if (hs >= 0) {
        L.hbusy[hs]--;
    }
    fc_count(c, ch, -1);
    L.stats.h2d_bytes  += bytes;
    L.stats.n_chunks   += 1;
    L.stats.copy_s     += dt;
    L.stats.chunk_max_s = std::max(L.stats.chunk_max_s, dt);
    if (c->tl_on.load(std::memory_order_relaxed)) {
        fc_span_add(c, FORECACHE_SPAN_COPY, ch.layer, ch.proj, ch.expert, ch.slot, 1, bytes, t0, t1);
    }
    c->cv_done.notify_all();
}

// copies one chunk; called with the lock held, releases it during the copy
void fc_run(forecache_cache * c, const fc_chunk & ch, std::unique_lock<std::mutex> & lock) {
    const fc_layer & L = c->layers[ch.layer];
    const int32_t j = fc_stage_of(L, ch.slot);
    fc_device & d = c->devs[j >= 0 ? c->st_dev[j] : L.dev];
    const int32_t hs = fc_chunk_begin(c, ch, d);
    lock.unlock();
    const auto   t0 = fc_clock::now();
    const size_t bytes = fc_chunk_copy(c, ch, hs, nullptr);
    const auto   t1 = fc_clock::now();
    lock.lock();
    fc_chunk_end(c, ch, hs, bytes, d, t0, t1);
}

// issues one chunk on device dev's copy stream, an event after it (lock held, released meanwhile)
static void fc_issue(forecache_cache * c, int32_t dev, const fc_chunk & ch, std::unique_lock<std::mutex> & lock) {
    fc_device & d = c->devs[dev];
    const int32_t hs = fc_chunk_begin(c, ch, d);
    ggml_backend_event_t ev = d.copy_ev[d.issued % FC_COPY_DEPTH]; // the chunk that used it is done
    const auto t0 = fc_clock::now();
    d.issuing    = true; // out of the queue, not yet on the stream: not issued for a waiter
    d.issuing_ch = ch;
    lock.unlock();
    const size_t bytes = fc_chunk_copy(c, ch, hs, d.copy);
    ggml_backend_event_record(ev, d.copy);
    lock.lock();
    d.issuing = false;
    d.inflight.push_back({ch, hs, bytes, ev, t0});
    d.issued++;
    c->cv_done.notify_all(); // a product may wait on the device now
}

// waits for the oldest chunk in flight on device dev's copy stream (lock held, released meanwhile)
static void fc_retire(forecache_cache * c, int32_t dev, std::unique_lock<std::mutex> & lock) {
    fc_device & d = c->devs[dev];
    const fc_inflight f = d.inflight.front();
    lock.unlock();
    ggml_backend_event_synchronize(f.ev);
    const auto t1 = fc_clock::now();
    lock.lock();
    d.inflight.pop_front();
    fc_chunk_end(c, f.ch, f.hs, f.bytes, d, f.t0, t1);
}

// copies the chunks for device dev, highest priority first, over that device's own link: one at a
// time, or with a copy stream up to FC_COPY_DEPTH in flight (a demand chunk issued once one lands)
void fc_worker(forecache_cache * c, int32_t dev) {
    std::unique_lock<std::mutex> lock(c->mtx);
    fc_device & d = c->devs[dev];
    while (true) {
        auto streamed = [c, &d] { return c->copy_stream && d.copy != nullptr; };
        c->cv_work.wait(lock, [c, dev, &d, &streamed] {
            if (c->stop || !d.inflight.empty()) {
                return true;
            }
            fc_request_reads(c); // copies that could run but for their expert's read
            return !c->paused && fc_has_eligible(c, dev);
        });
        const bool room = streamed() && (int) d.inflight.size() < FC_COPY_DEPTH;
        fc_chunk ch;
        if (!c->stop && !c->paused && (room || !streamed()) && fc_pop(c, ch, dev)) {
            if (room) {
                fc_issue(c, dev, ch, lock);
            } else {
                if (!d.inflight.empty()) {
                    fc_retire(c, dev, lock); // streams were turned off: the stream's chunks first
                }
                fc_run(c, ch, lock);
            }
            continue;
        }
        if (!d.inflight.empty()) {
            fc_retire(c, dev, lock);
            continue;
        }
        if (c->stop) {
            return;
        }
    }
}

int32_t fc_copy_streams(forecache_cache * c, bool on) {
    c->copy_stream = on;
    int32_t n = 0;
    for (fc_device & d : c->devs) {
        if (on && d.copy == nullptr && d.backend != nullptr && ggml_backend_dev_type(d.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            ggml_backend_dev_props props;
            ggml_backend_dev_get_props(d.dev, &props);
            ggml_backend_t be = props.caps.events && props.caps.async ? ggml_backend_dev_init(d.dev, nullptr) : nullptr;
            bool ok = be != nullptr;
            for (int k = 0; k < FC_COPY_DEPTH; k++) {
                d.copy_ev[k] = ok ? ggml_backend_event_new(d.dev) : nullptr;
                ok = ok && d.copy_ev[k] != nullptr;
            }
            if (ok) {
                d.copy = be;
            } else {
                for (ggml_backend_event_t & ev : d.copy_ev) {
                    if (ev != nullptr) {
                        ggml_backend_event_free(ev);
                        ev = nullptr;
                    }
                }
                ggml_backend_free(be);
            }
        }
        n += d.copy != nullptr;
    }
    c->cv_work.notify_all();
    return on ? n : 0;
}

void fc_copy_streams_free(forecache_cache * c) {
    for (fc_device & d : c->devs) {
        if (d.copy == nullptr) {
            continue;
        }
        ggml_backend_synchronize(d.copy);
        for (ggml_backend_event_t & ev : d.copy_ev) {
            ggml_backend_event_free(ev);
            ev = nullptr;
        }
        ggml_backend_free(d.copy);
        d.copy = nullptr;
    }
}

bool fc_proj_issued(const forecache_cache * c, int32_t il, int32_t p) {
    const fc_layer & L = c->layers[il];
    auto needed = [&](const fc_chunk & ch) {
        return ch.layer == il && ch.slot < L.n_slots && L.in_use[ch.slot] && (ch.proj < 0 || ch.proj == p);
    };
    for (const fc_device & d : c->devs) {
        if (d.issuing && needed(d.issuing_ch)) {
            return false;
        }
    }
    for (const auto & q : c->queue) {
        for (const auto & ch : q) {
            if (needed(ch)) {
                return false;
            }
        }
    }
    return true;
}

int32_t forecache_cache_set_copy_stream(struct forecache_cache * cache, bool on) {
    std::lock_guard<std::mutex> lock(cache->mtx);
    return fc_copy_streams(cache, on);
}

// queues the copy of `expert` into `slot`: projection `proj` (-1: all) in chunks (lock held)
void fc_queue_copy(forecache_cache * c, int32_t il, int32_t expert, int32_t slot, int32_t proj,
        int32_t priority, int32_t entry, int32_t need) {
    fc_layer & L = c->layers[il];
    const auto now = fc_clock::now();
    bool first = true;
    if (L.n_host > 0) {
        L.huses[expert]++;
        if (fc_host_ready(L, expert)) {
            L.stats.host_hits++;
        } else {
            L.stats.host_misses++;
            fc_disk_request(c, il, expert, priority);
        }
    }
    if (proj < 0 && c->chunk_bytes == FORECACHE_CHUNK_EXPERT) {
        fc_chunk ch = {il, slot, -1, expert, priority, entry, need, true, 0, 0, now};
        fc_count(c, ch, +1);
        c->queue[priority].push_back(ch);
    } else {
        for (int32_t p = proj < 0 ? 0 : proj; p < (proj < 0 ? L.n_proj : proj + 1); p++) {
            const size_t nb = L.host[p]->nb[2];
            const size_t step = c->chunk_bytes == FORECACHE_CHUNK_PROJECTION || c->chunk_bytes == FORECACHE_CHUNK_EXPERT ? nb : c->chunk_bytes;
            for (size_t off = 0; off < nb; off += step) {
                fc_chunk ch = {il, slot, p, expert, priority, entry, need, first, off, std::min(step, nb - off), now};
                fc_count(c, ch, +1);
                c->queue[priority].push_back(ch);
                first = false;
            }
        }
    }
    if (priority == 0) {
        L.stats.hi_tasks++;
    }
    fc_notify_work(c);
}

void fc_empty_slot(fc_layer & L, int32_t slot) {
    const int32_t e = L.expert_of[slot];
    if (e >= 0) {
        L.slot_of[e] = -1;
    }
    L.expert_of[slot] = -1;
    L.last_entry[slot] = -1;
}

// stage slot j is free (lock held)
void fc_free_stage(forecache_cache * c, int32_t j) {
    c->st_layer[j]  = -1;
    c->st_in_use[j] = 0;
}

// stage slot j is free again, its queued chunks dropped (lock held)
void fc_release_stage(forecache_cache * c, int32_t j) {
    const int32_t il = c->st_layer[j];
    if (il < 0) {
        return;
    }
    const int32_t slot = c->layers[il].n_slots + j;
    fc_drop_queued(c, 0, [&](const fc_chunk & ch) { return ch.layer == il && ch.slot == slot; });
    fc_free_stage(c, j);
}

// stage slots lent to layer il that its schedule does not read go back (lock held)
void fc_release_unused_stage(forecache_cache * c, int32_t il) {
    for (int32_t j = 0; j < c->n_stage; j++) {
        if (c->st_layer[j] == il && !c->st_in_use[j]) {
            fc_release_stage(c, j);
        }
    }
}

// enum forecache_slot_state of stage slot j (lock held)
int32_t fc_stage_state(const forecache_cache * c, int32_t j) {
    if (c->st_layer[j] < 0) {
        return FORECACHE_SLOT_EMPTY;
    }
    int32_t left = 0;
    for (int32_t p = 0; p < FC_MAX_PROJ; p++) {
        left += c->st_pend[j*FC_MAX_PROJ + p];
    }
    return left == 0 ? FORECACHE_SLOT_READY : c->st_started[j] ? FORECACHE_SLOT_COPYING : FORECACHE_SLOT_QUEUED;
}

// forgets the schedule of layer il, dropping streamed copies that were never needed (lock held)
void fc_clear_schedule(forecache_cache * c, int32_t il) {
    fc_layer & L = c->layers[il];
    if (L.streams) {
        fc_drop_queued(c, 0, [&](const fc_chunk & ch) { return ch.layer == il && ch.entry >= 0; });
    }
    std::fill(L.last_entry.begin(), L.last_entry.end(), -1);
    for (int32_t e : L.sch_e) {
        L.entry_of[e] = -1;
    }
    for (int32_t j = 0; j < c->n_stage; j++) {
        if (c->st_layer[j] == il) {
            c->st_in_use[j] = 0;
        }
    }
    L.staged = false;
    L.sch_e.clear();
    L.sch_s.clear();
    L.sch_first.clear();
    L.sch_epoch = 0;
    L.streams   = false;
    L.n_dev     = 0;
}

// maps expert to slot, emptying the slot and the expert's previous slot and dropping their queued
// copies (lock held); the copy itself is queued by the caller
void fc_map_slot(forecache_cache * c, int32_t il, int32_t expert, int32_t slot) {
    fc_layer & L = c->layers[il];
    const int32_t prev = L.slot_of[expert];
    for (int32_t s : {slot, prev}) {
        if (s >= 0) {
            fc_drop_queued(c, 0, [&](const fc_chunk & ch) { return ch.layer == il && ch.slot == s; });
            fc_empty_slot(L, s);
        }
    }
    L.expert_of[slot] = expert;
    L.slot_of[expert] = slot;
    L.started[slot]   = 0;
}

// puts expert into slot as a plain load (lock held); false if a slot involved is in use
bool fc_assign(forecache_cache * c, int32_t il, int32_t expert, int32_t slot, int32_t priority) {
    fc_layer & L = c->layers[il];
    if (L.expert_of[slot] == expert) {
        return true;
    }
    const int32_t prev = L.slot_of[expert];
    if (L.in_use[slot] || (prev >= 0 && L.in_use[prev]) || L.quiet_epoch == c->epoch ||
            (c->bank_hold && L.bank_region >= 0)) {
        L.stats.refused_loads++;
        return false;
    }
    fc_map_slot(c, il, expert, slot);
    fc_queue_copy(c, il, expert, slot, -1, priority, -1, 0);
    L.stamp[slot] = ++c->clock;
    return true;
}

// sets the schedule of layer il for the current epoch (lock held); false for an invalid schedule
bool fc_set_schedule(forecache_cache * c, int32_t il, const int32_t * experts, const int32_t * slots, int32_t n, int32_t priority) {
    fc_layer & L = c->layers[il];
    if (n <= 0 || n > L.n_expert || L.n_slots == 0) {
        return false;
    }
    fc_clear_schedule(c, il);
    int32_t n_dev = n;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = experts[i];
        const int32_t s = slots[i];
        if (s < 0 && n_dev == n) {
            n_dev = i; // host entries from here on
        }
        const int32_t j = i < n_dev ? fc_stage_of(L, s) : -1;
        const bool staged = j >= 0 && j < c->n_stage && c->st_layer[j] == il && c->st_expert[j] == e;
        const bool bad_slot = i < n_dev ? s >= L.n_slots && !staged : s != -1;
        if (e < 0 || e >= L.n_expert || bad_slot || L.entry_of[e] >= 0 || (s < 0 && c->devs[L.dev].group_alloc == nullptr)) {
            for (int32_t k = 0; k < i; k++) {
                L.entry_of[experts[k]] = -1;
            }
            return false;
        }
        L.entry_of[e] = i;
    }
    const int32_t np = L.n_proj;
    L.sch_e.assign(experts, experts + n);
    L.sch_s.assign(slots, slots + n);
    L.sch_first.assign(n, 0);
    L.n_dev = n_dev;
    L.stats.host_entries += n - n_dev;
    n = n_dev; // only slot entries copy, stream and hold slots
    L.entry_pend.assign((size_t) n*np, 0);
    L.consumed.assign((size_t) L.n_slots*np, 0);
    std::fill(L.in_use.begin(), L.in_use.end(), 0);

    std::vector<int32_t> uses(L.n_slots, 0);
    std::vector<int32_t> need(n, 0);
    std::vector<uint8_t> copy(n, 0);
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = L.sch_s[i];
        const int32_t j = fc_stage_of(L, s);
        if (j >= 0) {
            // read from the stage slot its expert was staged into: nothing to copy
            L.sch_first[i]  = 1;
            L.staged        = true;
            c->st_in_use[j] = 1;
            L.stats.stage_used++;
            continue;
        }
        need[i] = uses[s]++;
        if (need[i] == 0) {
            L.sch_first[i] = 1;
            copy[i] = L.expert_of[s] != L.sch_e[i];
        } else {
            L.streams = true;
            copy[i] = 1;
            L.stats.streamed++;
        }
    }
    fc_release_unused_stage(c, il); // stage slots the schedule does not read go back
    // first uses become plain loads; in_use is still clear, so nothing is refused
    for (int32_t i = 0; i < n; i++) {
        if (L.sch_first[i] && copy[i]) {
            fc_map_slot(c, il, L.sch_e[i], L.sch_s[i]);
        }
    }
    // copies in compute order, projection by projection (the order the MUL_MAT_IDs consume them)
    const bool whole = c->chunk_bytes == FORECACHE_CHUNK_EXPERT;
    for (int32_t p = 0; p < (whole ? 1 : np); p++) {
        for (int32_t i = 0; i < n; i++) {
            if (!copy[i]) {
                continue;
            }
            if (L.sch_first[i]) {
                fc_queue_copy(c, il, L.sch_e[i], L.sch_s[i], whole ? -1 : p, priority, -1, 0);
            }
        }
        for (int32_t i = 0; i < n; i++) {
            if (copy[i] && !L.sch_first[i]) {
                for (int32_t q = whole ? 0 : p; q < (whole ? np : p + 1); q++) {
                    fc_queue_copy(c, il, L.sch_e[i], L.sch_s[i], q, priority, i, need[i]);
                }
            }
        }
    }
    // the slot table describes the end of the layer: the last entry of each slot holds it
    for (int32_t i = 0; i < n; i++) {
        if (L.sch_s[i] >= L.n_slots) {
            continue;
        }
        if (!L.sch_first[i]) {
            const int32_t s = L.sch_s[i];
            const int32_t old = L.expert_of[s];
            if (old >= 0 && L.slot_of[old] == s) {
                L.slot_of[old] = -1;
            }
            L.expert_of[s] = L.sch_e[i];
            L.slot_of[L.sch_e[i]] = s;
            L.last_entry[s] = i;
        }
        L.in_use[L.sch_s[i]] = 1;
        L.stamp[L.sch_s[i]] = ++c->clock; // a slot's last entry leaves the latest stamp
    }
    L.sch_epoch = c->epoch;
    c->in_use_layer = il;
    return true;
}

// entry i of the schedule can be computed for projection p (lock held)
bool fc_entry_ready(const forecache_cache * c, const fc_layer & L, int32_t i, int32_t p) {
    const int32_t j = fc_stage_of(L, L.sch_s[i]);
    if (j >= 0) {
        return c->st_pend[j*FC_MAX_PROJ + p] == 0;
    }
    if (L.sch_first[i]) {
        return L.pend_proj[L.sch_s[i]*L.n_proj + p] == 0;
    }
    return L.entry_pend[i*L.n_proj + p] == 0;
}

bool fc_all_ready(const forecache_cache * c, const fc_layer & L, int32_t p0, int32_t p1) {
    for (int32_t i = 0; i < L.n_dev; i++) {
        for (int32_t p = p0; p < p1; p++) {
            if (!fc_entry_ready(c, L, i, p)) {
                return false;
            }
        }
    }
    return true;
}
