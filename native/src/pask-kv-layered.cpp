// pask-kv-layered.cpp - layered KV cache: one llama_kv_cache per attention layer, each with its own
// capacity, cells, n_kv and KQ mask, plus the C API of include/pask-kv.h.
//
// Invariants:
//  - layer il's cache holds only layer il (layer filter) and n_cells[il] cells per stream; K is stored
//    after RoPE, so a cell's position travels with it and holes left by eviction are refilled by
//    later tokens (llama_kv_cache::find_slot);
//  - a ubatch is accepted only if every layer finds a slot for it (prepare on each layer), so all
//    layers stay in lock-step; otherwise init_batch fails and llama_decode returns 1;
//  - SWA layers of the model get a cache with the model's n_swa/swa_type, so their masks and cell
//    reuse follow upstream sliding-window semantics;
//  - seq_pos_max() never moves back because of a per-layer eviction (pos_hw), so decoding continues
//    at the next position even if the newest token was evicted from every layer.
#include "pask-kv-layered.h"

#include "pask-kv.h"

#include "llama-batch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

//
// llama_kv_cache_layered
//

llama_kv_cache_layered::llama_kv_cache_layered(
        const llama_model & model,
                ggml_type   type_k,
                ggml_type   type_v,
                     bool   v_trans,
                     bool   offload,
                     bool   unified,
                 uint32_t   n_seq_max,
    const std::vector<uint32_t> & n_cells) :
    unified(unified), n_seq(n_seq_max), n_cells(n_cells) {
    const auto & hparams = model.hparams;
    const int32_t n_layer = (int32_t) hparams.n_layer();

    GGML_ASSERT((int32_t) n_cells.size() == n_layer);

    caches.resize(n_layer);
    pos_hw.assign(n_seq_ids(), -1);

    for (int32_t il = 0; il < n_layer; ++il) {
        GGML_ASSERT(n_cells[il] >= 1);

        const bool swa = hparams.is_swa(il);

        const layer_filter_cb filter = [il](int32_t i) { return i == il; };

        caches[il] = std::make_unique<llama_kv_cache>(
                model, hparams, type_k, type_v, v_trans, offload, unified,
                n_cells[il], n_seq_max, 1,
                swa ? hparams.n_swa    : 0,
                swa ? hparams.swa_type : LLAMA_SWA_TYPE_NONE,
                nullptr, filter, nullptr, nullptr);
    }

    LLAMA_LOG_INFO("%s: layered KV cache, %d layers\n", __func__, n_layer);
}

static bool pos_in_range(llama_pos p, llama_pos p0, llama_pos p1) {
    if (p < 0) {
        return false;
    }
    if (p0 < 0) {
        p0 = 0;
    }
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    return p >= p0 && p < p1;
}

llama_pos llama_kv_cache_layered::layers_pos_max(llama_seq_id seq_id) const {
    llama_pos res = -1;
    for (const auto & c : caches) {
        if (c) {
            res = std::max(res, c->seq_pos_max(seq_id));
        }
    }
    return res;
}

void llama_kv_cache_layered::refresh_hw(llama_seq_id seq_id) {
    for (llama_seq_id s = 0; s < (llama_seq_id) pos_hw.size(); ++s) {
        if (seq_id < 0 || s == seq_id) {
            pos_hw[s] = layers_pos_max(s);
        }
    }
}

void llama_kv_cache_layered::note_ubatch(const llama_ubatch & ubatch) {
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        for (int32_t s = 0; s < ubatch.n_seq_id[i]; ++s) {
            const llama_seq_id sid = ubatch.seq_id[i][s];
            if (sid >= 0 && (size_t) sid < pos_hw.size()) {
                pos_hw[sid] = std::max(pos_hw[sid], ubatch.pos[i]);
            }
        }
    }
}

void llama_kv_cache_layered::clear(bool data) {
    for (auto & c : caches) {
        if (c) {
            c->clear(data);
        }
    }
    std::fill(pos_hw.begin(), pos_hw.end(), -1);
}

bool llama_kv_cache_layered::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    bool res = true;
    for (auto & c : caches) {
        if (c) {
            res = c->seq_rm(seq_id, p0, p1) && res;
        }
    }
    for (llama_seq_id s = 0; s < (llama_seq_id) pos_hw.size(); ++s) {
        if ((seq_id < 0 || s == seq_id) && pos_in_range(pos_hw[s], p0, p1)) {
            // positions are decoded in order, so every position below p0 was decoded, even those evicted
            // from every layer (upstream's rollback of a failed ubatch removes [its first position, +inf))
            pos_hw[s] = std::max(layers_pos_max(s), p0 > 0 ? p0 - 1 : -1);
        }
    }
    return res;
}

void llama_kv_cache_layered::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    for (auto & c : caches) {
        if (c) {
            c->seq_cp(seq_id_src, seq_id_dst, p0, p1);
        }
    }
    if (seq_id_src == seq_id_dst || seq_id_src < 0 || seq_id_dst < 0 ||
        (size_t) seq_id_src >= pos_hw.size() || (size_t) seq_id_dst >= pos_hw.size()) {
        return;
    }
    pos_hw[seq_id_dst] = std::max(pos_hw[seq_id_dst], layers_pos_max(seq_id_dst));
    if (pos_in_range(pos_hw[seq_id_src], p0, p1)) {
        pos_hw[seq_id_dst] = std::max(pos_hw[seq_id_dst], pos_hw[seq_id_src]);
    }
}

void llama_kv_cache_layered::seq_keep(llama_seq_id seq_id) {
    for (auto & c : caches) {
        if (c) {
            c->seq_keep(seq_id);
        }
    }
    // upstream's seq_keep only touches the stream of seq_id: sequences in other streams keep their cells
    for (llama_seq_id s = 0; s < (llama_seq_id) pos_hw.size(); ++s) {
        if (s != seq_id && stream_of(s) == stream_of(seq_id)) {
            pos_hw[s] = -1;
        }
    }
}

void llama_kv_cache_layered::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    for (auto & c : caches) {
        if (c) {
            c->seq_add(seq_id, p0, p1, shift);
        }
    }
    for (llama_seq_id s = 0; s < (llama_seq_id) pos_hw.size(); ++s) {
        if ((seq_id < 0 || s == seq_id) && pos_in_range(pos_hw[s], p0, p1)) {
            pos_hw[s] = std::max(-1, pos_hw[s] + shift);
        }
    }
}

void llama_kv_cache_layered::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    for (auto & c : caches) {
        if (c) {
            c->seq_div(seq_id, p0, p1, d);
        }
    }
    for (llama_seq_id s = 0; s < (llama_seq_id) pos_hw.size(); ++s) {
        if ((seq_id < 0 || s == seq_id) && pos_in_range(pos_hw[s], p0, p1) && d > 0) {
            pos_hw[s] = pos_hw[s] / d;
        }
    }
}

llama_pos llama_kv_cache_layered::seq_pos_min(llama_seq_id seq_id) const {
    llama_pos res = -1;
    for (const auto & c : caches) {
        if (c) {
            const llama_pos p = c->seq_pos_min(seq_id);
            if (p >= 0 && (res < 0 || p < res)) {
                res = p;
            }
        }
    }
    return res;
}

llama_pos llama_kv_cache_layered::seq_pos_max(llama_seq_id seq_id) const {
    llama_pos res = layers_pos_max(seq_id);
    if (seq_id >= 0 && (size_t) seq_id < pos_hw.size()) {
        res = std::max(res, pos_hw[seq_id]);
    }
    return res;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_kv_cache_layered::memory_breakdown() const {
    std::map<ggml_backend_buffer_type_t, size_t> mb;
    for (const auto & c : caches) {
        if (c) {
            for (const auto & [buft, size] : c->memory_breakdown()) {
                mb[buft] += size;
            }
        }
    }
    return mb;
}

// One sequence's state, stream-agnostic, so that a prefix saved from a one-sequence context restores
// into any sequence of a pool (another stream count). Layout (host byte order):
//   u32 magic 'PKVL', u32 version, u32 n_layer, i32 pos_hw, then per layer: u8 has_kv and, if it has,
//   u32 cell_count, u64 n_bytes, n_bytes of that layer's upstream per-stream state (cell meta + data,
//   as llama_kv_cache::state_write writes one stream's, without its stream header).
// Whole-context state (seq_id < 0) is not supported: it throws, as before.
namespace {

constexpr uint32_t PKVL_MAGIC   = 0x4c564b50; // "PKVL"
constexpr uint32_t PKVL_VERSION = 1;

// collects what one per-layer cache writes (tensor rows copied out of the backend)
class pkvl_vec_writer : public llama_io_write_i {
public:
    std::vector<uint8_t> buf;

    void write(const void * src, size_t size) override {
        const auto * p = static_cast<const uint8_t *>(src);
        buf.insert(buf.end(), p, p + size);
    }
    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        const size_t at = buf.size();
        buf.resize(at + size);
        ggml_backend_tensor_get(tensor, buf.data() + at, offset, size);
    }
    size_t n_bytes() override { return buf.size(); }
};

// presents one layer's saved stream to a per-layer cache as upstream's multi-stream layout:
// [n_stream][cell_count][payload from the outer reader][0 for every other stream]
class pkvl_stream_reader : public llama_io_read_i {
public:
    pkvl_stream_reader(llama_io_read_i & outer, uint32_t n_stream, uint32_t cell_count, uint64_t n_payload)
        : outer(outer), payload_left(n_payload) {
        head.resize(8 + 4 * (size_t) (n_stream - 1), 0);
        std::memcpy(head.data(), &n_stream, 4);
        std::memcpy(head.data() + 4, &cell_count, 4);
    }

    void read(void * dst, size_t size) override {
        if (head_at < 8) { // the stream count and the cell count
            take_head(dst, size, 8);
        } else if (payload_left > 0) {
            take_payload(size);
            outer.read(dst, size);
        } else { // the other streams' zero cell counts
            take_head(dst, size, head.size());
        }
        n_read += size;
    }
    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        if (head_at < 8) {
            throw std::runtime_error("layer state: tensor data before the cell count");
        }
        take_payload(size);
        outer.read_tensor(tensor, offset, size);
        n_read += size;
    }
    void discard() override { outer.discard(); }
    size_t n_bytes() override { return n_read; }

    bool done() const { return payload_left == 0 && head_at == head.size(); }

private:
    void take_head(void * dst, size_t size, size_t end) {
        if (head_at + size > end) {
            throw std::runtime_error("layer state: read past its stream header");
        }
        std::memcpy(dst, head.data() + head_at, size);
        head_at += size;
    }
    void take_payload(size_t size) {
        if (size > payload_left) {
            throw std::runtime_error("layer state: read past its recorded size");
        }
        payload_left -= size;
    }

    llama_io_read_i & outer;
    std::vector<uint8_t> head;
    size_t   head_at = 0;
    uint64_t payload_left;
    size_t   n_read = 0;
};

template <typename T> T pkvl_read(llama_io_read_i & io) {
    T v;
    io.read(&v, sizeof(v));
    return v;
}

} // namespace

void llama_kv_cache_layered::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    if (seq_id < 0 || (size_t) seq_id >= pos_hw.size()) {
        throw std::runtime_error("the pask layered KV cache saves one sequence's state only");
    }
    const uint32_t n_layer_ = (uint32_t) caches.size();
    io.write(&PKVL_MAGIC, sizeof(PKVL_MAGIC));
    io.write(&PKVL_VERSION, sizeof(PKVL_VERSION));
    io.write(&n_layer_, sizeof(n_layer_));
    const llama_pos hw = pos_hw[seq_id];
    io.write(&hw, sizeof(hw));
    for (const auto & c : caches) {
        const uint8_t has = c ? 1 : 0;
        io.write(&has, 1);
        if (!c) {
            continue;
        }
        pkvl_vec_writer w;
        c->state_write(w, seq_id, flags);
        // upstream layout: [n_stream] then per stream [cell_count][meta + data if cell_count > 0];
        // one sequence lives in one stream, so at most one count is non-zero
        const auto & b = w.buf;
        uint32_t ns = 0;
        std::memcpy(&ns, b.data(), 4);
        size_t at = 4;
        uint32_t cc = 0;
        size_t p0 = 0, p1 = 0;
        for (uint32_t s = 0; s < ns; ++s) {
            uint32_t n = 0;
            std::memcpy(&n, b.data() + at, 4);
            at += 4;
            if (n == 0) {
                continue;
            }
            if (cc != 0) {
                throw std::runtime_error("layer state: a sequence in two streams");
            }
            cc = n;
            p0 = at;
            p1 = b.size() - 4 * (size_t) (ns - 1 - s); // the rest are the later streams' zero counts
            at = p1;
        }
        const uint64_t n_payload = cc ? (uint64_t) (p1 - p0) : 0;
        io.write(&cc, sizeof(cc));
        io.write(&n_payload, sizeof(n_payload));
        if (n_payload) {
            io.write(b.data() + p0, n_payload);
        }
    }
}

void llama_kv_cache_layered::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    if (seq_id < 0 || (size_t) seq_id >= pos_hw.size()) {
        throw std::runtime_error("the pask layered KV cache restores one sequence's state only");
    }
    if (pkvl_read<uint32_t>(io) != PKVL_MAGIC) {
        throw std::runtime_error("not a pask layered KV state");
    }
    if (pkvl_read<uint32_t>(io) != PKVL_VERSION) {
        throw std::runtime_error("pask layered KV state: unsupported version");
    }
    if (pkvl_read<uint32_t>(io) != (uint32_t) caches.size()) {
        throw std::runtime_error("pask layered KV state: another layer count");
    }
    const llama_pos hw = pkvl_read<llama_pos>(io);
    seq_rm(seq_id, -1, -1);
    try {
        for (size_t il = 0; il < caches.size(); ++il) {
            auto & c = caches[il];
            if (pkvl_read<uint8_t>(io) != (c ? 1 : 0)) {
                throw std::runtime_error("pask layered KV state: layer " + std::to_string(il) + " differs");
            }
            if (!c) {
                continue;
            }
            const uint32_t cc = pkvl_read<uint32_t>(io);
            const uint64_t n_payload = pkvl_read<uint64_t>(io);
            if (cc > n_cells[il]) {
                throw std::runtime_error("pask layered KV state: layer " + std::to_string(il) + " holds " +
                                         std::to_string(cc) + " cells, this context " + std::to_string(n_cells[il]));
            }
            if ((cc == 0) != (n_payload == 0)) {
                throw std::runtime_error("pask layered KV state: layer " + std::to_string(il) + " is inconsistent");
            }
            if (cc == 0) {
                continue;
            }
            pkvl_stream_reader r(io, n_stream(), cc, n_payload);
            c->state_read(r, seq_id, flags);
            if (!r.done()) {
                throw std::runtime_error("pask layered KV state: layer " + std::to_string(il) + " has extra bytes");
            }
        }
    } catch (...) {
        seq_rm(seq_id, -1, -1); // nothing half-restored
        throw;
    }
    if (hw < -1) {
        seq_rm(seq_id, -1, -1);
        throw std::runtime_error("pask layered KV state: bad position");
    }
    pos_hw[seq_id] = std::max(layers_pos_max(seq_id), hw);
}

bool llama_kv_cache_layered::get_can_shift() const {
    for (const auto & c : caches) {
        if (c && !c->get_can_shift()) {
            return false;
        }
    }
    return true;
}

llama_memory_context_ptr llama_kv_cache_layered::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);

    // same splitting strategy as llama_kv_cache_iswa: simple split for a unified cache, else equal split
    for (int attempt = 0; attempt < 2; ++attempt) {
        if (attempt == 0 && !unified) {
            continue;
        }

        balloc.split_reset();

        std::vector<llama_ubatch> ubatches;
        while (true) {
            auto ubatch = attempt == 0 ? balloc.split_simple(n_ubatch) : balloc.split_equal(n_ubatch, !unified, 0);
            if (ubatch.n_tokens == 0) {
                break;
            }
            ubatches.push_back(std::move(ubatch)); // NOLINT
        }

        if (balloc.get_n_used() < balloc.get_n_tokens()) {
            continue;
        }

        std::vector<llama_kv_cache::slot_info_vec_t> sinfos(caches.size());
        bool ok = true;
        for (size_t il = 0; il < caches.size() && ok; ++il) {
            if (!caches[il]) {
                continue;
            }
            sinfos[il] = caches[il]->prepare(ubatches);
            ok = !sinfos[il].empty();
        }

        if (ok) {
            return std::make_unique<llama_kv_cache_layered_context>(this, std::move(sinfos), std::move(ubatches));
        }
    }

    return std::make_unique<llama_kv_cache_layered_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
}

llama_memory_context_ptr llama_kv_cache_layered::init_full() {
    return std::make_unique<llama_kv_cache_layered_context>(this);
}

llama_memory_context_ptr llama_kv_cache_layered::init_update(llama_context * lctx, bool optimize) {
    return std::make_unique<llama_kv_cache_layered_context>(this, lctx, optimize);
}

int32_t llama_kv_cache_layered::evict(int32_t il, llama_seq_id seq_id, const std::vector<llama_pos> & pos) {
    llama_kv_cache * c = caches[il].get();
    if (!c || pos.empty()) {
        return 0;
    }

    const size_t before = c->get_cells(seq_id).seq_pos_get(seq_id).size();

    // merge runs of consecutive positions into ranges: one seq_rm per range
    size_t i = 0;
    while (i < pos.size()) {
        size_t j = i + 1;
        while (j < pos.size() && pos[j] == pos[j - 1] + 1) {
            ++j;
        }
        c->seq_rm(seq_id, pos[i], pos[j - 1] + 1);
        i = j;
    }

    const size_t after = c->get_cells(seq_id).seq_pos_get(seq_id).size();

    return (int32_t) (before - after);
}

//
// llama_kv_cache_layered_context
//

static llama_memory_status combine_all(const std::vector<llama_memory_context_ptr> & ctxs, llama_memory_status init) {
    llama_memory_status res = init;
    for (const auto & c : ctxs) {
        if (c) {
            res = llama_memory_status_combine(res, c->get_status());
        }
    }
    return res;
}

llama_kv_cache_layered_context::llama_kv_cache_layered_context(llama_memory_status status) : status(status) {}

llama_kv_cache_layered_context::llama_kv_cache_layered_context(llama_kv_cache_layered * kv) : kv(kv) {
    ctxs.resize(kv->n_layer());
    for (int32_t il = 0; il < kv->n_layer(); ++il) {
        if (kv->layer(il)) {
            ctxs[il] = kv->layer(il)->init_full();
        }
    }
    status = combine_all(ctxs, LLAMA_MEMORY_STATUS_SUCCESS);
}

llama_kv_cache_layered_context::llama_kv_cache_layered_context(
        llama_kv_cache_layered * kv, llama_context * lctx, bool optimize) : kv(kv) {
    ctxs.resize(kv->n_layer());
    for (int32_t il = 0; il < kv->n_layer(); ++il) {
        if (kv->layer(il)) {
            ctxs[il] = kv->layer(il)->init_update(lctx, optimize);
        }
    }
    status = combine_all(ctxs, LLAMA_MEMORY_STATUS_NO_UPDATE);
}

llama_kv_cache_layered_context::llama_kv_cache_layered_context(
        llama_kv_cache_layered * kv,
        std::vector<slot_info_vec_t> sinfos,
        std::vector<llama_ubatch> ubatches) : kv(kv), ubatches(std::move(ubatches)) {
    ctxs.resize(kv->n_layer());
    for (int32_t il = 0; il < kv->n_layer(); ++il) {
        if (kv->layer(il)) {
            // note: each layer context keeps its own copy of the ubatches, as in the iSWA cache
            ctxs[il] = std::make_unique<llama_kv_cache_context>(kv->layer(il), std::move(sinfos[il]), this->ubatches);
        }
    }
    status = combine_all(ctxs, LLAMA_MEMORY_STATUS_SUCCESS);
}

llama_kv_cache_layered_context::~llama_kv_cache_layered_context() = default;

bool llama_kv_cache_layered_context::next() {
    assert(status == LLAMA_MEMORY_STATUS_SUCCESS);

    for (auto & c : ctxs) {
        if (c) {
            c->next();
        }
    }

    return ++i_next < ubatches.size();
}

bool llama_kv_cache_layered_context::apply() {
    assert(!llama_memory_status_is_fail(status));

    bool res = true;
    for (auto & c : ctxs) {
        if (c) {
            res = c->apply() && res;
        }
    }

    if (!ubatches.empty()) {
        kv->note_ubatch(ubatches[i_next]);
    }

    return res;
}

llama_memory_status llama_kv_cache_layered_context::get_status() const {
    return status;
}

const llama_ubatch & llama_kv_cache_layered_context::get_ubatch() const {
    assert(status == LLAMA_MEMORY_STATUS_SUCCESS);

    return ubatches[i_next];
}

const llama_kv_cache_context * llama_kv_cache_layered_context::layer(int32_t il) const {
    if (il < 0 || (size_t) il >= ctxs.size()) {
        return nullptr;
    }
    return static_cast<const llama_kv_cache_context *>(ctxs[il].get());
}

//
// pask_graph_input_attn_layered
//

pask_graph_input_attn_layered::pask_graph_input_attn_layered(const llama_hparams & hparams, const llama_cparams & cparams) {
    face_kv   = std::make_unique<llm_graph_input_attn_kv>(hparams, cparams, nullptr);
    face_iswa = std::make_unique<llm_graph_input_attn_kv_iswa>(hparams, cparams, nullptr);

    face_kv->pask_layered   = this;
    face_iswa->pask_layered = this;
}

void pask_graph_input_attn_layered::set_input(const llama_ubatch * ubatch) {
    for (auto & inp : layers) {
        if (inp) {
            inp->set_input(ubatch);
        }
    }
}

bool pask_graph_input_attn_layered::can_reuse(const llm_graph_params & params) {
    const auto * mctx = dynamic_cast<const llama_kv_cache_layered_context *>(params.mctx);
    if (!mctx || mctx->n_layer() != (int32_t) layers.size()) {
        return false;
    }

    const auto n_tokens = params.ubatch.n_tokens;
    const auto n_stream = params.cparams.kv_unified ? 1 : params.ubatch.n_seqs_unq;

    bool res = true;
    for (int32_t il = 0; il < (int32_t) layers.size(); ++il) {
        auto & inp = layers[il];
        if (!inp) {
            continue;
        }
        const auto * lctx = mctx->layer(il);
        if (!lctx) {
            return false;
        }
        inp->mctx = lctx;

        const ggml_tensor * mask = inp->self_kq_mask;
        res &= inp->self_k_idxs->ne[0] == n_tokens;
        res &= mask->ne[0] == (int64_t) lctx->get_n_kv();
        res &= mask->ne[1] == n_tokens/n_stream;
        res &= mask->ne[2] == 1;
        res &= mask->ne[3] == n_stream;
    }
    return res;
}

llm_graph_input_attn_kv * pask_graph_input_attn_layered::layer(int32_t il) const {
    GGML_ASSERT(il >= 0 && (size_t) il < layers.size() && layers[il] && "pask: layer without a KV cache");
    return layers[il].get();
}

pask_graph_input_attn_layered * pask_kv_layered_build_input(const llm_graph_context & g) {
    const auto * mctx = dynamic_cast<const llama_kv_cache_layered_context *>(g.mctx);
    if (!mctx) {
        return nullptr;
    }

    auto inp = std::make_unique<pask_graph_input_attn_layered>(g.hparams, g.cparams);

    const auto n_tokens = g.ubatch.n_tokens;
    const auto n_stream = g.cparams.kv_unified ? 1 : g.ubatch.n_seqs_unq;

    // flash attention requires an f16 mask
    const ggml_type mask_type = g.cparams.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32;

    inp->layers.resize(mctx->n_layer());
    for (int32_t il = 0; il < mctx->n_layer(); ++il) {
        const auto * lctx = mctx->layer(il);
        if (!lctx) {
            continue;
        }

        auto li = std::make_unique<llm_graph_input_attn_kv>(g.hparams, g.cparams, lctx);

        li->self_k_idxs = lctx->build_input_k_idxs(g.ctx0, g.ubatch);
        li->self_v_idxs = lctx->build_input_v_idxs(g.ctx0, g.ubatch);

        li->self_kq_mask = ggml_new_tensor_4d(g.ctx0, mask_type, lctx->get_n_kv(), n_tokens/n_stream, 1, n_stream);
        ggml_set_input(li->self_kq_mask);
        ggml_format_name(li->self_kq_mask, "attn_inp_kq_mask-%d", il);
        li->self_kq_mask_cnv = li->self_kq_mask;

        li->self_k_rot = lctx->build_input_k_rot(g.ctx0);
        li->self_v_rot = lctx->build_input_v_rot(g.ctx0);

        inp->layers[il] = std::move(li);
    }

    return static_cast<pask_graph_input_attn_layered *>(g.res->add_input(std::move(inp)));
}

//
// creation hook
//

namespace {

struct pending_layered {
    std::vector<uint32_t> n_cells;
};

thread_local const pending_layered * g_pending = nullptr;
thread_local std::string g_last_error;

int32_t fail(int32_t code, const std::string & msg) {
    g_last_error = msg;
    return code;
}

} // namespace

int32_t pask_kv_fail(int32_t code, const std::string & msg) {
    return fail(code, msg);
}

std::string pask_kv_layered_unsupported(const llama_model & model) {
    const llm_arch arch = model.arch;
    const auto & hp = model.hparams;
    const std::string head = std::string("the layered KV cache does not support architecture '") + llm_arch_name(arch) + "': ";

    if (llm_arch_is_recurrent(arch)) {
        return head + "it is recurrent (a per-sequence state, no KV cache of token positions)";
    }
    if (llm_arch_is_hybrid(arch)) {
        return head + "it is a hybrid of recurrent and attention layers";
    }
    if (llm_arch_is_diffusion(arch)) {
        return head + "it is a diffusion model (non-causal, no KV cache)";
    }
    if (!hp.causal_attn || llama_model_has_encoder(&model)) {
        return head + "it is an encoder / non-causal model";
    }
    if (hp.is_mla()) {
        return head + "it uses multi-head latent attention (MLA, a compressed K-only cache)";
    }
    switch (arch) {
        // these get their own memory type in llama_model::create_memory (sparse / compressed attention)
        case LLM_ARCH_MINIMAX_M3:
        case LLM_ARCH_GLM_DSA:
        case LLM_ARCH_DEEPSEEK32:
        case LLM_ARCH_GLM5_NEXT:
        case LLM_ARCH_HY_V4:
        case LLM_ARCH_DOTS3NOTE:
        case LLM_ARCH_DEEPSEEK4:
        case LLM_ARCH_DFLASH:
            return head + "it needs its own sparse/compressed-attention KV cache";
        // these reuse or share KV cells across layers
        case LLM_ARCH_GEMMA3N:
        case LLM_ARCH_GEMMA4:
        case LLM_ARCH_GEMMA4_ASSISTANT:
            return head + "its layers share KV cells";
        default:
            break;
    }
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hp.n_head_kv(il) == 0 || hp.n_embd_k_gqa(il) == 0) {
            return head + "layer " + std::to_string(il) + " has no attention KV";
        }
    }
    return "";
}

void pask_kv_layered_refuse_input(const llm_graph_context & g, const char * what) {
    if (dynamic_cast<const llama_kv_cache_layered_context *>(g.mctx)) {
        throw std::runtime_error(std::string("pask layered KV cache: this model's graph uses ") + what +
                                 ", which the layered cache does not implement");
    }
}

llama_memory_i * pask_kv_layered_create_memory(const llama_model & model, const llama_memory_params & params, const llama_cparams & cparams) {
    if (!g_pending) {
        return nullptr;
    }
    const std::string why = pask_kv_layered_unsupported(model);
    if (!why.empty()) {
        throw std::runtime_error(why);
    }
    if (params.ctx_type == LLAMA_CONTEXT_TYPE_MTP) {
        throw std::runtime_error("the layered KV cache does not support MTP draft contexts");
    }
    return new llama_kv_cache_layered(
            model, params.type_k, params.type_v,
            !cparams.flash_attn, cparams.offload_kqv, cparams.kv_unified,
            cparams.n_seq_max, g_pending->n_cells);
}

//
// C API
//

static llama_kv_cache_layered * layered_of(const llama_context * ctx) {
    if (!ctx) {
        return nullptr;
    }
    return dynamic_cast<llama_kv_cache_layered *>(llama_get_memory(ctx));
}

// validates ctx/il/seq_id; returns PASK_KV_OK or an error code (with g_last_error set)
static int32_t check(const llama_context * ctx, int32_t il, llama_seq_id seq_id, bool need_seq, llama_kv_cache_layered ** out) {
    llama_kv_cache_layered * kv = layered_of(ctx);
    if (!kv) {
        return fail(PASK_KV_E_NOT_LAYERED, "the context was not created with pask_init_from_model");
    }
    if (il < 0 || il >= kv->n_layer()) {
        return fail(PASK_KV_E_LAYER, "layer " + std::to_string(il) + " out of range [0, " + std::to_string(kv->n_layer()) + ")");
    }
    if (!kv->layer(il)) {
        return fail(PASK_KV_E_LAYER, "layer " + std::to_string(il) + " has no KV cache");
    }
    if (need_seq && (seq_id < 0 || (uint32_t) seq_id >= kv->n_seq_ids())) {
        return fail(PASK_KV_E_SEQ, "sequence id " + std::to_string(seq_id) + " out of range [0, " + std::to_string(kv->n_seq_ids()) + ")");
    }
    *out = kv;
    return PASK_KV_OK;
}

struct llama_context * pask_init_from_model(
        struct llama_model        * model,
        struct llama_context_params params,
        const uint32_t            * n_cells_per_layer,
        int32_t                     n_layer) {
    if (!model || !n_cells_per_layer) {
        fail(PASK_KV_E_ARG, "model and n_cells_per_layer must not be NULL");
        return nullptr;
    }
    if (pask_kv_model_supported(model) != PASK_KV_OK) {
        return nullptr;
    }
    if (n_layer != (int32_t) model->hparams.n_layer()) {
        fail(PASK_KV_E_ARG, "n_layer " + std::to_string(n_layer) + " != model layers " + std::to_string(model->hparams.n_layer()));
        return nullptr;
    }
    pending_layered pending;
    pending.n_cells.assign(n_cells_per_layer, n_cells_per_layer + n_layer);
    for (int32_t il = 0; il < n_layer; ++il) {
        if (pending.n_cells[il] < 1) {
            fail(PASK_KV_E_ARG, "capacity of layer " + std::to_string(il) + " must be >= 1");
            return nullptr;
        }
        if (pending.n_cells[il] > PASK_KV_MAX_CELLS) {
            fail(PASK_KV_E_ARG, "capacity of layer " + std::to_string(il) + " is " + std::to_string(pending.n_cells[il]) +
                                " cells, more than the limit " + std::to_string(PASK_KV_MAX_CELLS));
            return nullptr;
        }
    }

    g_pending = &pending;
    g_last_error.clear();
    llama_context * ctx = nullptr;
    std::string why;
    try {
        ctx = llama_init_from_model(model, params);
    } catch (const std::exception & e) {
        ctx = nullptr;
        why = e.what();
    } catch (...) {
        ctx = nullptr;
    }
    g_pending = nullptr;

    if (!ctx) {
        fail(PASK_KV_E_ARG, why.empty() ? "llama.cpp could not create the layered context (see its log)"
                                        : "llama.cpp could not create the layered context: " + why);
        return nullptr;
    }
    if (!layered_of(ctx)) {
        llama_free(ctx);
        fail(PASK_KV_E_ARG, "the context did not get a layered KV cache");
        return nullptr;
    }
    return ctx;
}

int32_t pask_kv_model_supported(const struct llama_model * model) {
    if (!model) {
        return fail(PASK_KV_E_ARG, "model must not be NULL");
    }
    const std::string why = pask_kv_layered_unsupported(*model);
    if (!why.empty()) {
        return fail(PASK_KV_E_ARCH, why);
    }
    return PASK_KV_OK;
}

int32_t pask_kv_n_seq_ids(const struct llama_context * ctx) {
    llama_kv_cache_layered * kv = layered_of(ctx);
    if (!kv) {
        return fail(PASK_KV_E_NOT_LAYERED, "the context was not created with pask_init_from_model");
    }
    return (int32_t) kv->n_seq_ids();
}

int32_t pask_kv_n_layer(const struct llama_context * ctx) {
    llama_kv_cache_layered * kv = layered_of(ctx);
    if (!kv) {
        return fail(PASK_KV_E_NOT_LAYERED, "the context was not created with pask_init_from_model");
    }
    return kv->n_layer();
}

int32_t pask_kv_capacity(const struct llama_context * ctx, int32_t il) {
    llama_kv_cache_layered * kv = nullptr;
    const int32_t rc = check(ctx, il, 0, false, &kv);
    if (rc != PASK_KV_OK) {
        return rc;
    }
    return (int32_t) kv->capacity(il);
}

int32_t pask_kv_evict(struct llama_context * ctx, int32_t il, llama_seq_id seq_id, const llama_pos * pos, int32_t n) {
    llama_kv_cache_layered * kv = nullptr;
    const int32_t rc = check(ctx, il, seq_id, true, &kv);
    if (rc != PASK_KV_OK) {
        return rc;
    }
    if (n < 0 || (n > 0 && !pos)) {
        return fail(PASK_KV_E_ARG, "pos must hold n >= 0 positions");
    }
    std::vector<llama_pos> v(pos, pos + n);
    for (llama_pos p : v) {
        if (p < 0) {
            return fail(PASK_KV_E_ARG, "negative position " + std::to_string(p));
        }
    }
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return kv->evict(il, seq_id, v);
}

int32_t pask_kv_used(const struct llama_context * ctx, int32_t il, llama_seq_id seq_id) {
    llama_kv_cache_layered * kv = nullptr;
    const int32_t rc = check(ctx, il, seq_id, true, &kv);
    if (rc != PASK_KV_OK) {
        return rc;
    }
    return (int32_t) kv->layer(il)->get_cells(seq_id).seq_pos_get(seq_id).size();
}

int32_t pask_kv_free(const struct llama_context * ctx, int32_t il, llama_seq_id seq_id) {
    llama_kv_cache_layered * kv = nullptr;
    const int32_t rc = check(ctx, il, seq_id, true, &kv);
    if (rc != PASK_KV_OK) {
        return rc;
    }
    const auto & cells = kv->layer(il)->get_cells(seq_id);
    return (int32_t) (cells.size() - cells.get_used());
}

int32_t pask_kv_positions(const struct llama_context * ctx, int32_t il, llama_seq_id seq_id, llama_pos * out, int32_t cap) {
    llama_kv_cache_layered * kv = nullptr;
    const int32_t rc = check(ctx, il, seq_id, true, &kv);
    if (rc != PASK_KV_OK) {
        return rc;
    }
    if (cap < 0 || (cap > 0 && !out)) {
        return fail(PASK_KV_E_ARG, "out must hold cap >= 0 positions");
    }
    const auto & cells = kv->layer(il)->get_cells(seq_id);
    int32_t count = 0;
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.is_empty(i) && cells.seq_has(i, seq_id)) {
            if (count < cap) {
                out[count] = cells.pos_get(i);
            }
            ++count;
        }
    }
    return count;
}

int32_t pask_kv_layer_bytes(const struct llama_context * ctx, int32_t il, int64_t * k_bytes, int64_t * v_bytes) {
    llama_kv_cache_layered * kv = nullptr;
    const int32_t rc = check(ctx, il, 0, false, &kv);
    if (rc != PASK_KV_OK) {
        return rc;
    }
    const llama_kv_cache * c = kv->layer(il);
    size_t total = 0;
    for (const auto & [buft, size] : c->memory_breakdown()) {
        total += size;
    }
    const size_t k = ggml_nbytes(c->get_k_storage(il));
    if (k_bytes) {
        *k_bytes = (int64_t) k;
    }
    if (v_bytes) {
        *v_bytes = (int64_t) (total - k);
    }
    return PASK_KV_OK;
}

int64_t pask_kv_total_bytes(const struct llama_context * ctx) {
    if (!ctx) {
        return -1;
    }
    const llama_memory_t mem = llama_get_memory(ctx);
    if (!mem) {
        return -1;
    }
    size_t total = 0;
    for (const auto & [buft, size] : mem->memory_breakdown()) {
        total += size;
    }
    return (int64_t) total;
}

const char * pask_kv_last_error(void) {
    return g_last_error.c_str();
}
