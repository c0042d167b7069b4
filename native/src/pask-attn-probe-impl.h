// pask-attn-probe-impl.h - the attention probe's state, shared by the eval-callback reader
// (pask-attn-probe.cpp) and the in-graph statistics (pask-attn-graph.cpp). Internal: see pask-attn.h.
#pragma once

#include "pask-attn.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

struct pask_attn_probe {
    int32_t n_window = 0;
    bool enabled = true;

    // eval-callback mode: statistics accumulated on the host from kq_soft_max tensors
    std::vector<std::vector<float>> stat[3];   // [what][il][col]
    std::vector<float> scratch;

    // in-graph mode (pask_attn_probe_attach): per layer one F32 tensor of 3 x n_stream x cap cells
    // ([what][stream][cell]: SUM, WINDOW, LAST of each KV stream), on the layer's device, written by
    // the decode graph itself
    bool graph = false;
    struct llama_context * ctx = nullptr;      // the attached context: synchronized before a read or reset
    int32_t stats = 0;                         // bit (1 << what) per statistic the graph computes
    int64_t cap = 0;                           // cells per statistic, stream and layer
    int32_t n_stream = 1;                      // KV streams of the context (1: a unified cache)
    std::vector<ggml_context *> tctx;
    std::vector<ggml_backend_buffer_t> bufs;
    std::vector<ggml_tensor *> acc;            // [il]
    std::vector<int32_t> graph_n_kv;           // [il * n_stream + stream] largest n_kv since the last reset
    std::vector<int32_t> graph_last_n_kv;      // [il * n_stream + stream] n_kv of the stream's last ubatch
    bool overflow = false;                     // a layer attended more cells than cap since the reset
    uint64_t sig = 1;                          // changes when the graph's statistic nodes must change

    int32_t n_layer() const { return (int32_t) stat[0].size(); }
    size_t offset(int32_t what, int32_t stream) const { return ((size_t) what * n_stream + stream) * cap * sizeof(float); }
    void release_graph();
};
