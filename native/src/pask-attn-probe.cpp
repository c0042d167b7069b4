// pask-attn-probe.cpp - the attention probe: statistics read from kq_soft_max tensors by an eval
// callback, or computed in the decode graph (pask-attn-graph.cpp) after pask_attn_probe_attach. See pask-attn.h.
#include "pask-attn-probe-impl.h"

#include "llama-context.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

static const char PREFIX[] = "kq_soft_max-";

static int32_t probe_layer(const ggml_tensor * t) {
    if (strncmp(t->name, PREFIX, sizeof(PREFIX) - 1) != 0) {
        return -1;
    }
    char * end = nullptr;
    long il = strtol(t->name + sizeof(PREFIX) - 1, &end, 10);
    return (end && *end == '\0' && il >= 0) ? (int32_t) il : -1;
}

pask_attn_probe * pask_attn_probe_init(int32_t n_layer, int32_t n_window) {
    if (n_layer <= 0 || n_layer > (1 << 16) || n_window < 0) {
        return nullptr;
    }
    try {
        auto * p = new pask_attn_probe();
        p->n_window = n_window;
        for (auto & s : p->stat) {
            s.resize(n_layer);
        }
        p->acc.assign(n_layer, nullptr);
        return p;
    } catch (...) {
        return nullptr;
    }
}

void pask_attn_probe::release_graph() {
    for (auto * b : bufs) {
        ggml_backend_buffer_free(b);
    }
    for (auto * c : tctx) {
        ggml_free(c);
    }
    bufs.clear();
    tctx.clear();
    acc.assign(n_layer(), nullptr);
    graph = false;
    ctx = nullptr;
    ++sig;
}

void pask_attn_probe_free(pask_attn_probe * probe) {
    if (probe) {
        probe->release_graph();
    }
    delete probe;
}

int32_t pask_attn_probe_attach(llama_context * ctx, pask_attn_probe * probe, int32_t stats, int32_t n_cells) {
    if (!ctx || !probe || stats <= 0 || stats > 7 || n_cells <= 0) {
        return -1;
    }
    const llama_model & model = ctx->get_model();
    const int32_t n_layer = (int32_t) model.hparams.n_layer();
    const int32_t n_stream = ctx->get_cparams().kv_unified ? 1 : (int32_t) ctx->get_cparams().n_seq_max;
    if (n_layer != probe->n_layer() || n_stream < 1 || (int64_t) n_stream * n_cells > (int64_t) 1 << 31) {
        return -1;
    }
    if (probe->ctx && probe->ctx != ctx) {
        probe->ctx->pask_set_attn_probe(nullptr);  // the earlier context must not write into the new tensors
    }
    probe->release_graph();
    try {
        // one context and buffer per device the layers' attention runs on (the KV cache's rule)
        std::map<ggml_backend_buffer_type_t, ggml_context *> by_buft;
        const bool offload = ctx->get_cparams().offload_kqv;
        for (int32_t il = 0; il < n_layer; ++il) {
            ggml_backend_buffer_type_t buft = offload ? ggml_backend_dev_buffer_type(model.dev_layer(il))
                                                      : ggml_backend_cpu_buffer_type();
            auto it = by_buft.find(buft);
            if (it == by_buft.end()) {
                ggml_init_params ip = { (size_t) n_layer * ggml_tensor_overhead(), nullptr, true };
                ggml_context * c = ggml_init(ip);
                if (!c) {
                    throw std::bad_alloc();
                }
                probe->tctx.push_back(c);
                it = by_buft.emplace(buft, c).first;
            }
            probe->acc[il] = ggml_new_tensor_1d(it->second, GGML_TYPE_F32, 3 * (int64_t) n_stream * n_cells);
            ggml_format_name(probe->acc[il], "pask_stats-%d", il);
        }
        for (auto & [buft, c] : by_buft) {
            ggml_backend_buffer_t b = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
            if (!b) {
                throw std::bad_alloc();
            }
            probe->bufs.push_back(b);
        }
    } catch (...) {
        probe->release_graph();
        return -1;
    }
    probe->graph = true;
    probe->ctx = ctx;
    probe->stats = stats;
    probe->cap = n_cells;
    probe->n_stream = n_stream;
    probe->graph_n_kv.assign((size_t) n_layer * n_stream, 0);
    probe->graph_last_n_kv.assign((size_t) n_layer * n_stream, 0);
    pask_attn_probe_reset(probe);
    ctx->pask_set_attn_probe(probe);
    return 0;
}

void pask_attn_probe_detach(llama_context * ctx) {
    if (ctx) {
        auto * p = ctx->get_cparams().pask_probe;
        if (p && p->ctx == ctx) {
            p->ctx = nullptr;
        }
        ctx->pask_set_attn_probe(nullptr);
    }
}

// An accelerator computes the graph asynchronously: the accumulators are read or cleared only after
// the attached context's last decode has finished.
static void sync_attached(const pask_attn_probe * probe) {
    if (probe->graph && probe->ctx) {
        llama_synchronize(probe->ctx);
    }
}

void pask_attn_probe_set_enabled(pask_attn_probe * probe, int32_t enabled) {
    if (probe && probe->enabled != (enabled != 0)) {
        probe->enabled = enabled != 0;
        ++probe->sig;  // an in-graph probe's graph gains or loses its statistic nodes
    }
}

void pask_attn_probe_reset(pask_attn_probe * probe) {
    if (!probe) {
        return;
    }
    if (probe->graph) {
        sync_attached(probe);
        for (auto * b : probe->bufs) {
            ggml_backend_buffer_clear(b, 0);
        }
        std::fill(probe->graph_n_kv.begin(), probe->graph_n_kv.end(), 0);
        std::fill(probe->graph_last_n_kv.begin(), probe->graph_last_n_kv.end(), 0);
        probe->overflow = false;
        return;
    }
    for (auto & s : probe->stat) {
        for (auto & col : s) {
            col.clear();
        }
    }
}

bool pask_attn_probe_cb(ggml_tensor * t, bool ask, void * user_data) {
    auto * p = (pask_attn_probe *) user_data;
    const int32_t il = probe_layer(t);
    if (ask) {
        return p && !p->graph && p->enabled && il >= 0 && il < (int32_t) p->stat[0].size();
    }
    if (!p || il < 0 || il >= (int32_t) p->stat[0].size() || t->type != GGML_TYPE_F32) {
        return true;
    }
    const int64_t n_kv = t->ne[0], n_tok = t->ne[1], n_head = t->ne[2], n_stream = t->ne[3];
    p->scratch.resize(ggml_nelements(t));
    ggml_backend_tensor_get(t, p->scratch.data(), 0, ggml_nbytes(t));

    auto & sum = p->stat[PASK_ATTN_SUM][il];
    auto & win = p->stat[PASK_ATTN_WINDOW][il];
    auto & last = p->stat[PASK_ATTN_LAST][il];
    if ((int64_t) sum.size() < n_kv) {
        sum.resize(n_kv, 0.0f);
        win.resize(n_kv, 0.0f);
    }
    last.assign(n_kv, 0.0f);
    const int64_t w0 = n_tok - std::min<int64_t>(n_tok, p->n_window);
    for (int64_t s = 0; s < n_stream; ++s) {
        for (int64_t h = 0; h < n_head; ++h) {
            for (int64_t i = 0; i < n_tok; ++i) {
                const float * row = p->scratch.data() + ((s * n_head + h) * n_tok + i) * n_kv;
                for (int64_t j = 0; j < n_kv; ++j) {
                    sum[j] += row[j];
                }
                if (i >= w0) {
                    for (int64_t j = 0; j < n_kv; ++j) {
                        win[j] += row[j];
                    }
                }
                if (i == n_tok - 1) {
                    for (int64_t j = 0; j < n_kv; ++j) {
                        last[j] += row[j] / (float) n_head;
                    }
                }
            }
        }
    }
    return true;
}

// The accumulator stream that holds seq_id's statistics (in-graph mode; -1: none).
static int32_t stream_of(const pask_attn_probe * probe, int32_t seq_id) {
    if (probe->n_stream == 1) {
        return seq_id >= 0 ? 0 : -1;
    }
    return seq_id >= 0 && seq_id < probe->n_stream ? seq_id : -1;
}

int32_t pask_attn_probe_n_kv(const pask_attn_probe * probe, int32_t il) {
    return pask_attn_probe_n_kv_seq(probe, il, 0);
}

int32_t pask_attn_probe_n_kv_seq(const pask_attn_probe * probe, int32_t il, int32_t seq_id) {
    if (!probe || il < 0 || il >= (int32_t) probe->stat[0].size()) {
        return -1;
    }
    if (probe->graph) {
        const int32_t s = stream_of(probe, seq_id);
        if (s < 0) {
            return -1;
        }
        return probe->overflow ? -2 : probe->graph_n_kv[(size_t) il * probe->n_stream + s];
    }
    return (int32_t) probe->stat[PASK_ATTN_SUM][il].size();
}

int32_t pask_attn_probe_get(const pask_attn_probe * probe, int32_t il, int32_t what, float * out, int32_t cap) {
    return pask_attn_probe_get_seq(probe, il, what, 0, out, cap);
}

int32_t pask_attn_probe_get_seq(const pask_attn_probe * probe, int32_t il, int32_t what, int32_t seq_id,
                                float * out, int32_t cap) {
    if (!probe || il < 0 || il >= (int32_t) probe->stat[0].size() || what < 0 || what > 2 || cap < 0 ||
        (cap > 0 && !out)) {
        return -1;
    }
    if (probe->graph) {
        const int32_t s = stream_of(probe, seq_id);
        if (s < 0) {
            return -1;
        }
        if (probe->overflow) {
            return -2;
        }
        sync_attached(probe);
        const size_t i = (size_t) il * probe->n_stream + s;
        const int32_t n = probe->graph_n_kv[i];
        const int32_t m = std::min(cap, n);
        const int32_t valid = what == PASK_ATTN_LAST ? std::min(m, probe->graph_last_n_kv[i]) : m;
        if (valid > 0 && (probe->stats & (1 << what))) {
            ggml_backend_tensor_get(probe->acc[il], out, probe->offset(what, s), (size_t) valid * sizeof(float));
        } else if (valid > 0) {
            std::fill(out, out + valid, 0.0f);
        }
        std::fill(out + std::max(valid, 0), out + std::max(m, 0), 0.0f);
        return n;
    }
    const auto & v = probe->stat[what][il];
    const int32_t n = (int32_t) probe->stat[PASK_ATTN_SUM][il].size();
    const int32_t m = std::min<int32_t>(cap, (int32_t) v.size());
    if (m > 0) {
        memcpy(out, v.data(), m * sizeof(float));
    }
    for (int32_t j = m; j < std::min(cap, n); ++j) {
        out[j] = 0.0f;
    }
    return n;
}
