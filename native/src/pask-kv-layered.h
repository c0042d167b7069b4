// pask-kv-layered.h - internal classes of the layered KV cache (see include/pask-kv.h).
//
// llama_kv_cache_layered owns one llama_kv_cache per attention layer (layer filter = that layer),
// each sized by its own capacity and, for sliding-window layers, carrying the model's SWA params.
// llama_kv_cache_layered_context drives the per-layer contexts through a batch in lock-step, and
// pask_graph_input_attn_layered holds one attention input (cell indices + KQ mask built from that
// layer's own cells) per layer. The hooks at the end are called from llama-model.cpp/llama-graph.cpp.
#pragma once

#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-kv-cache.h"
#include "llama-memory.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

struct llama_cparams;
struct llama_model;
struct llm_graph_context;

class llama_kv_cache_layered : public llama_memory_i {
public:
    llama_kv_cache_layered(
            const llama_model & model,
                    ggml_type   type_k,
                    ggml_type   type_v,
                         bool   v_trans,
                         bool   offload,
                         bool   unified,
                     uint32_t   n_seq_max,
        const std::vector<uint32_t> & n_cells);

    ~llama_kv_cache_layered() override = default;

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) override;
    llama_memory_context_ptr init_full() override;
    llama_memory_context_ptr init_update(llama_context * lctx, bool optimize) override;

    bool get_can_shift() const override;

    void clear(bool data) override;

    bool seq_rm  (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1) override;
    void seq_cp  (llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) override;
    void seq_keep(llama_seq_id seq_id)                                                          override;
    void seq_add (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, llama_pos shift) override;
    void seq_div (llama_seq_id seq_id,                              llama_pos p0, llama_pos p1, int d) override;

    llama_pos seq_pos_min(llama_seq_id seq_id) const override;
    llama_pos seq_pos_max(llama_seq_id seq_id) const override;

    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

    // one sequence's state (llama_state_seq_*; stream-agnostic layout, see the .cpp); the whole
    // context's (seq_id < 0) throws, which llama_state_* catch and report
    void state_write(llama_io_write_i & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) const override;
    void state_read (llama_io_read_i  & io, llama_seq_id seq_id = -1, llama_state_seq_flags flags = 0) override;

    //
    // layered API
    //

    int32_t  n_layer()   const { return (int32_t) caches.size(); }
    uint32_t n_seq_max() const { return n_seq; }

    // sequence ids the per-layer caches accept: one stream per sequence -> n_seq_max, else (all
    // sequences in stream 0, as upstream maps them) LLAMA_MAX_SEQ
    uint32_t n_seq_ids() const { return n_stream() > 1 ? n_seq : LLAMA_MAX_SEQ; }
    uint32_t n_stream()  const { return unified ? 1 : std::max<uint32_t>(1, n_seq); }
    uint32_t stream_of(llama_seq_id seq_id) const { return n_stream() > 1 ? (uint32_t) seq_id : 0; }

    // the cache of layer il (nullptr if il has no KV)
    llama_kv_cache * layer(int32_t il) const { return caches[il].get(); }

    uint32_t capacity(int32_t il) const { return n_cells[il]; }

    // evict the (sorted, unique) positions of seq_id from layer il; returns the cells released
    int32_t evict(int32_t il, llama_seq_id seq_id, const std::vector<llama_pos> & pos);

    // positions decoded so far: the batch validator requires the next token at seq_pos_max + 1,
    // which must not move back when a per-layer eviction drops the newest token everywhere
    void note_ubatch(const llama_ubatch & ubatch);

private:
    const bool     unified;
    const uint32_t n_seq;

    std::vector<uint32_t> n_cells;
    std::vector<std::unique_ptr<llama_kv_cache>> caches; // [n_layer]

    std::vector<llama_pos> pos_hw; // [n_seq_ids()] highest position decoded and not removed by a seq op

    llama_pos layers_pos_max(llama_seq_id seq_id) const;
    void      refresh_hw(llama_seq_id seq_id); // seq_id < 0: all
};

class llama_kv_cache_layered_context : public llama_memory_context_i {
public:
    using slot_info_vec_t = llama_kv_cache::slot_info_vec_t;

    explicit llama_kv_cache_layered_context(llama_memory_status status);

    // full-cache context (graph reservation)
    explicit llama_kv_cache_layered_context(llama_kv_cache_layered * kv);

    // update context
    llama_kv_cache_layered_context(llama_kv_cache_layered * kv, llama_context * lctx, bool optimize);

    // batch context: sinfos[il] are the slots of layer il (empty for layers without KV)
    llama_kv_cache_layered_context(
            llama_kv_cache_layered * kv,
            std::vector<slot_info_vec_t> sinfos,
            std::vector<llama_ubatch> ubatches);

    ~llama_kv_cache_layered_context() override;

    bool next()  override;
    bool apply() override;

    llama_memory_status  get_status() const override;
    const llama_ubatch & get_ubatch() const override;

    int32_t n_layer() const { return (int32_t) ctxs.size(); }

    // the context of layer il (nullptr if il has no KV)
    const llama_kv_cache_context * layer(int32_t il) const;

private:
    llama_kv_cache_layered * kv = nullptr;

    size_t i_next = 0;

    std::vector<llama_ubatch> ubatches;

    std::vector<llama_memory_context_ptr> ctxs; // [n_layer]

    llama_memory_status status;
};

// one attention input per layer; the two "faces" are what the model graphs receive from
// build_attn_inp_kv() / build_attn_inp_kv_iswa(): build_attn() sees face->pask_layered and
// dispatches to the input of the layer being built
class pask_graph_input_attn_layered : public llm_graph_input_i {
public:
    pask_graph_input_attn_layered(const llama_hparams & hparams, const llama_cparams & cparams);

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    llm_graph_input_attn_kv * layer(int32_t il) const;

    std::vector<std::unique_ptr<llm_graph_input_attn_kv>> layers; // [n_layer], nullptr where no KV

    std::unique_ptr<llm_graph_input_attn_kv>      face_kv;
    std::unique_ptr<llm_graph_input_attn_kv_iswa> face_iswa;
};

//
// hooks
//

// llama_model::create_memory: the layered cache when pask_init_from_model is creating the context
llama_memory_i * pask_kv_layered_create_memory(const llama_model & model, const llama_memory_params & params, const llama_cparams & cparams);

// llm_graph_context::build_attn_inp_kv[_iswa]: the layered input when the memory is layered, else nullptr
pask_graph_input_attn_layered * pask_kv_layered_build_input(const llm_graph_context & gctx);

// every other build_attn_inp_*: throws when the memory is layered (an attention path the layered cache
// does not implement, e.g. a K-only MLA cache), so context creation fails with an error, never a crash
void pask_kv_layered_refuse_input(const llm_graph_context & gctx, const char * what);

// "" if the model can use a layered cache, else why not (names the architecture)
std::string pask_kv_layered_unsupported(const llama_model & model);

// set pask_kv_last_error() and return code (for the other pask_* C APIs of this patch series)
int32_t pask_kv_fail(int32_t code, const std::string & msg);
