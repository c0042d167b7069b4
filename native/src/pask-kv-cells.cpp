// pask-kv-cells.cpp - cell -> position map of a layer's KV cells (see include/pask-kv-cells.h).
#include "pask-kv-cells.h"

#include "pask-kv.h"

#include "llama-cparams.h"
#include "llama-kv-cache.h"
#include "llama-kv-cells.h"
#include "pask-kv-layered.h"

#include <algorithm>
#include <string>

static int32_t write_cells(const llama_kv_cache * kv, llama_seq_id seq_id, llama_pos * out, int32_t cap) {
    const llama_kv_cells & cells = kv->get_cells(seq_id);
    const int32_t n = (int32_t) cells.size();
    const int32_t m = std::min(n, cap);
    for (int32_t i = 0; i < m; ++i) {
        out[i] = (!cells.is_empty(i) && cells.seq_has(i, seq_id)) ? cells.pos_get(i) : -1;
    }
    return n;
}

static int32_t bad_seq(llama_seq_id seq_id, uint32_t n_ids) {
    return pask_kv_fail(PASK_KV_E_SEQ, "sequence id " + std::to_string(seq_id) + " out of range [0, " + std::to_string(n_ids) + ")");
}

int32_t pask_kv_cell_positions(const struct llama_context * ctx, int32_t il, llama_seq_id seq_id,
                               llama_pos * out, int32_t cap) {
    if (!ctx) {
        return pask_kv_fail(PASK_KV_E_ARG, "ctx must not be NULL");
    }
    if (cap < 0 || (cap > 0 && !out)) {
        return pask_kv_fail(PASK_KV_E_ARG, "out must hold cap >= 0 positions");
    }
    llama_memory_t mem = llama_get_memory(ctx);
    if (auto * layered = dynamic_cast<llama_kv_cache_layered *>(mem)) {
        if (il < 0 || il >= layered->n_layer() || !layered->layer(il)) {
            return pask_kv_fail(PASK_KV_E_LAYER, "layer " + std::to_string(il) + " out of range [0, " + std::to_string(layered->n_layer()) + ")");
        }
        if (seq_id < 0 || (uint32_t) seq_id >= layered->n_seq_ids()) {
            return bad_seq(seq_id, layered->n_seq_ids());
        }
        return write_cells(layered->layer(il), seq_id, out, cap);
    }
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        // upstream maps every sequence id to stream 0 when there is one stream, else seq id s to stream s
        const uint32_t n_ids = kv->get_n_stream() > 1 ? kv->get_n_stream() : LLAMA_MAX_SEQ;
        if (seq_id < 0 || (uint32_t) seq_id >= n_ids) {
            return bad_seq(seq_id, n_ids);
        }
        return write_cells(kv, seq_id, out, cap);
    }
    return pask_kv_fail(PASK_KV_E_NOT_LAYERED, "the context's memory is neither a layered nor a standard KV cache");
}
