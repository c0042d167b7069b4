// pask-attn-graph.h - attention statistics computed inside the decode graph (pask_attn_probe_attach).
// Internal to libllama: build_attn_mha() calls pask_attn_graph_build() for every attention layer.
#pragma once

#include "llama-graph.h"

// The per-ubatch graph input of the statistics: a vector of ones (the reductions are outer products
// with it) and the n_kv each layer attended, recorded into the probe when the ubatch's inputs are set.
class pask_graph_input_attn_stats : public llm_graph_input_i {
public:
    pask_graph_input_attn_stats(struct pask_attn_probe * probe, uint64_t sig) : probe(probe), sig(sig) {}

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    struct pask_attn_probe * probe;
    uint64_t sig;                                    // the probe's signature when the graph was built
    ggml_tensor * ones = nullptr;                    // F32 [n_ones]
    int64_t n_ones = 0;
    std::vector<float> host_ones;                    // its values, filled once
    struct seen { int32_t il, stream, n_kv; };
    std::vector<seen> n_kv;                          // (layer, stream, n_kv) of the statistics this graph writes
};

// Adds to the graph of `g` the nodes that accumulate layer il's attention statistics into the
// probe's tensors, one set per KV stream of the ubatch (a multi-stream cache: per sequence): from `kq` (the layer's softmax [n_kv, n_tokens, n_head, n_stream]) when the layer
// computed one, else (flash attention) from a softmax of the statistic's query rows only, recomputed
// from q [d, n_tokens, n_head, n_stream], k [d, n_kv, n_head_kv, n_stream], the mask and the sinks.
// Does nothing when no probe is attached to the context or it is disabled.
void pask_attn_graph_build(const llm_graph_context & g, ggml_tensor * q, ggml_tensor * k, ggml_tensor * kq,
                           ggml_tensor * kq_mask, ggml_tensor * sinks, float kq_scale, int il);
