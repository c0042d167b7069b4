// pask-attn-graph.cpp - attention statistics computed inside the decode graph (see pask-attn-graph.h).
//
// Per layer and KV cell j, over the ubatch's queries i, heads h and streams s, with P = softmax(QK^T):
//   SUM    += sum_{i,h,s} P[s,h,i,j]                 (every query)
//   WINDOW += sum_{i >= n_tok - n_window, h, s} P    (the last n_window queries)
//   LAST    = sum_{h,s} P[s,h,n_tok-1,j] / n_head    (the last query, head average; replaced)
// the same statistics the eval-callback probe reads from kq_soft_max, except that a multi-stream
// cache (one stream per sequence) keeps each stream's apart instead of summing over s. The reductions are two
// ggml_out_prod with a vector of ones (CPU and CUDA have it): no new op, no host copy, no callback.
// With flash attention there is no softmax tensor: the statistic's query rows (all of them only for
// SUM) are recomputed as the layer's plain path would (mask, softcap, scale, ALiBi, sinks).
#include "pask-attn-graph.h"
#include "pask-attn-probe-impl.h"

#include "llama-cparams.h"
#include "llama-hparams.h"

#include <algorithm>
#include <vector>

void pask_graph_input_attn_stats::set_input(const llama_ubatch * ubatch) {
    GGML_UNUSED(ubatch);
    if (ones && ones->buffer) {
        host_ones.resize(n_ones, 1.0f);
        ggml_backend_tensor_set(ones, host_ones.data(), 0, n_ones * sizeof(float));
    }
    for (const auto & e : n_kv) {
        if (e.n_kv > probe->cap || e.stream < 0 || e.stream >= probe->n_stream) {
            probe->overflow = true;
            continue;
        }
        const size_t i = (size_t) e.il * probe->n_stream + e.stream;
        probe->graph_n_kv[i] = std::max(probe->graph_n_kv[i], e.n_kv);
        probe->graph_last_n_kv[i] = e.n_kv;
    }
}

bool pask_graph_input_attn_stats::can_reuse(const llm_graph_params & params) {
    return params.cparams.pask_probe == probe && probe->sig == sig;
}

// Sum over rows [first, first + m) of a [n_kv, rows, n_head, n_stream] and over heads: [n_kv, n_stream].
static ggml_tensor * column_mass(ggml_context * ctx0, ggml_tensor * a, ggml_tensor * ones, int64_t first, int64_t m) {
    const int64_t n_kv = a->ne[0], H = a->ne[2], S = a->ne[3];
    ggml_tensor * rows = ggml_view_4d(ctx0, a, n_kv, m, H, S, a->nb[1], a->nb[2], a->nb[3], first * a->nb[1]);
    ggml_tensor * o1 = ggml_view_4d(ctx0, ones, 1, m, H, S, sizeof(float), m * sizeof(float),
                                    m * H * sizeof(float), 0);
    ggml_tensor * per_head = ggml_out_prod(ctx0, rows, o1);               // [n_kv, 1, H, S]
    per_head = ggml_reshape_3d(ctx0, per_head, n_kv, H, S);
    ggml_tensor * o2 = ggml_view_3d(ctx0, ones, 1, H, S, sizeof(float), H * sizeof(float), 0);
    return ggml_reshape_2d(ctx0, ggml_out_prod(ctx0, per_head, o2), n_kv, S);  // [n_kv, 1, S] -> [n_kv, S]
}

void pask_attn_graph_build(const llm_graph_context & g, ggml_tensor * q, ggml_tensor * k, ggml_tensor * kq,
                           ggml_tensor * kq_mask, ggml_tensor * sinks, float kq_scale, int il) {
    pask_attn_probe * p = g.cparams.pask_probe;
    if (!p || !p->graph) {
        return;
    }
    ggml_context * ctx0 = g.ctx0;
    if (!g.pask_stats_inp) {
        // one input per graph, also when the probe is off: its signature decides graph reuse
        int64_t max_head = 1;
        for (uint32_t l = 0; l < g.hparams.n_layer(); ++l) {
            max_head = std::max<int64_t>(max_head, g.hparams.n_head(l));
        }
        auto inp = std::make_unique<pask_graph_input_attn_stats>(p, p->sig);
        inp->n_ones = std::max<int64_t>(1, (int64_t) g.n_tokens * max_head);
        inp->ones = ggml_new_tensor_1d(ctx0, GGML_TYPE_F32, inp->n_ones);
        ggml_set_name(inp->ones, "pask_stats_ones");
        ggml_set_input(inp->ones);
        g.pask_stats_inp = (pask_graph_input_attn_stats *) g.res->add_input(std::move(inp));
    }
    if (!p->enabled || p->stats == 0 || il < 0 || il >= p->n_layer() || !p->acc[il]) {
        return;
    }
    auto * inp = g.pask_stats_inp;
    const int64_t n_kv = k->ne[1], T = q->ne[1], H = q->ne[2], S = k->ne[3];
    // the ubatch's streams: a unified cache has one; otherwise stream s of the view is the cache
    // stream of the s-th sequence (upstream: one stream per sequence id, consecutive in a ubatch)
    const int32_t s0 = (g.cparams.kv_unified || g.ubatch.n_seqs_unq == 0) ? 0 : g.ubatch.seq_id_unq[0];
    bool fits = n_kv <= p->cap && T > 0;
    for (int64_t s = 0; s < S; ++s) {
        inp->n_kv.push_back({il, (int32_t) (s0 + s), (int32_t) n_kv});
        fits = fits && s0 + s < p->n_stream;
    }
    if (!fits) {
        return;  // recorded as an overflow when the inputs are set: the statistic reads as an error
    }
    const bool want_sum = p->stats & (1 << PASK_ATTN_SUM);
    const bool want_win = (p->stats & (1 << PASK_ATTN_WINDOW)) && p->n_window > 0;
    const bool want_last = p->stats & (1 << PASK_ATTN_LAST);
    const int64_t win = std::min<int64_t>(T, p->n_window);
    int64_t rows = want_sum ? T : std::max<int64_t>(want_win ? win : 0, want_last ? 1 : 0);
    if (rows == 0) {
        return;
    }
    int64_t r0 = 0;  // query index of row 0 of `a`
    ggml_tensor * a = kq;
    if (!a) {
        r0 = T - rows;
        ggml_tensor * qw = ggml_view_4d(ctx0, q, q->ne[0], rows, H, q->ne[3], q->nb[1], q->nb[2], q->nb[3],
                                        r0 * q->nb[1]);
        a = ggml_mul_mat(ctx0, k, qw);
        ggml_prec_set_acc(a, GGML_PREC_F32);
        if (g.hparams.attn_soft_cap) {
            a = ggml_scale(ctx0, a, 1.0f / g.hparams.f_attn_logit_softcapping);
            a = ggml_tanh(ctx0, a);
            a = ggml_scale(ctx0, a, g.hparams.f_attn_logit_softcapping);
        }
        ggml_tensor * m = nullptr;
        if (kq_mask) {
            m = ggml_view_4d(ctx0, kq_mask, kq_mask->ne[0], rows, kq_mask->ne[2], kq_mask->ne[3],
                             kq_mask->nb[1], kq_mask->nb[2], kq_mask->nb[3], r0 * kq_mask->nb[1]);
        }
        a = ggml_soft_max_ext(ctx0, a, m, kq_scale, g.hparams.f_max_alibi_bias);
        ggml_soft_max_add_sinks(a, sinks);
        ggml_format_name(a, "pask_stats_soft_max-%d", il);
    }
    auto store = [&](int what, ggml_tensor * r, bool accumulate) {  // r: [n_kv, S]
        for (int64_t s = 0; s < S; ++s) {
            ggml_tensor * dst = ggml_view_1d(ctx0, p->acc[il], n_kv, p->offset(what, (int32_t) (s0 + s)));
            ggml_tensor * rs = ggml_view_1d(ctx0, r, n_kv, s * r->nb[1]);
            ggml_tensor * v = accumulate ? ggml_add(ctx0, dst, rs) : rs;
            ggml_build_forward_expand(g.gf, ggml_cpy(ctx0, v, dst));
        }
    };
    if (want_sum) {
        store(PASK_ATTN_SUM, column_mass(ctx0, a, inp->ones, 0, T), true);
    }
    if (want_win) {
        store(PASK_ATTN_WINDOW, column_mass(ctx0, a, inp->ones, T - win - r0, win), true);
    }
    if (want_last) {
        store(PASK_ATTN_LAST, ggml_scale(ctx0, column_mass(ctx0, a, inp->ones, T - 1 - r0, 1), 1.0f / H), false);
    }
}
