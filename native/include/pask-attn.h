// pask-attn.h - attention-mass probe: per-layer attention statistics for score-based KV eviction.
//
// Two modes. In-graph (pask_attn_probe_attach, below): the decode graph computes the statistics.
// Eval callback (the reference the in-graph mode is tested against): Pass pask_attn_probe_cb and the probe as
// llama_context_params.cb_eval / cb_eval_user_data (flash attention must be off: it has no
// explicit softmax). During each llama_decode it reads every "kq_soft_max-<il>" tensor
// ([n_kv, n_tokens, n_head, n_stream]) and accumulates, per layer and KV column (cell index),
//   PASK_ATTN_SUM:      the attention mass summed over all queries and heads,
//   PASK_ATTN_WINDOW:   the mass summed over the last n_window queries of the ubatch and all heads,
//   PASK_ATTN_LAST:     the attention of the ubatch's last query, averaged over heads.
// Columns are KV cells of that layer; map them to positions with the cache's cell positions.
#pragma once

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;
struct pask_attn_probe;

#define PASK_ATTN_SUM    0
#define PASK_ATTN_WINDOW 1
#define PASK_ATTN_LAST   2

LLAMA_API struct pask_attn_probe * pask_attn_probe_init(int32_t n_layer, int32_t n_window);
LLAMA_API void pask_attn_probe_free(struct pask_attn_probe * probe);

// The eval callback; user_data must be a pask_attn_probe *.
LLAMA_API bool pask_attn_probe_cb(struct ggml_tensor * t, bool ask, void * user_data);

// Zero every statistic (call before the decode whose attention you want).
LLAMA_API void pask_attn_probe_reset(struct pask_attn_probe * probe);

// Stop (0) or resume (1) observing: a stopped probe asks the scheduler for no tensor (no host copy).
LLAMA_API void pask_attn_probe_set_enabled(struct pask_attn_probe * probe, int32_t enabled);

// In-graph mode: the decode graph of ctx itself computes the statistics in `stats` (a mask of
// 1 << PASK_ATTN_SUM | 1 << PASK_ATTN_WINDOW | 1 << PASK_ATTN_LAST) into per-layer accumulators of
// n_cells cells on the layer's device: no eval callback, no host copy during the decode, and flash
// attention allowed (the statistic's query rows, all of them only for SUM, are recomputed beside
// the fused kernel). The getters below then read those accumulators. Replaces an earlier attach of
// this probe; the probe must outlive the attachment (pask_attn_probe_detach before freeing it).
// Returns 0, or -1 (bad arguments, a probe for another layer count, allocation failed).
LLAMA_API int32_t pask_attn_probe_attach(struct llama_context * ctx, struct pask_attn_probe * probe,
                                         int32_t stats, int32_t n_cells);
LLAMA_API void pask_attn_probe_detach(struct llama_context * ctx);

// Columns (KV cells) recorded for layer il since the last reset (0: none; -1: bad layer;
// -2: in-graph mode and a layer attended more cells than n_cells).
LLAMA_API int32_t pask_attn_probe_n_kv(const struct pask_attn_probe * probe, int32_t il);

// Copy min(n_kv, cap) values of statistic `what` of layer il into out; returns n_kv, -1 or -2 (above).
// In-graph mode on a multi-stream cache (kv_unified off: one KV stream per sequence) each stream's
// statistics are kept apart; the _seq getters read seq_id's, the plain ones sequence 0's. (Eval-
// callback mode and unified caches sum over the streams of a ubatch; seq_id is then not used.)
LLAMA_API int32_t pask_attn_probe_get(const struct pask_attn_probe * probe, int32_t il, int32_t what,
                                      float * out, int32_t cap);
LLAMA_API int32_t pask_attn_probe_n_kv_seq(const struct pask_attn_probe * probe, int32_t il, int32_t seq_id);
LLAMA_API int32_t pask_attn_probe_get_seq(const struct pask_attn_probe * probe, int32_t il, int32_t what,
                                          int32_t seq_id, float * out, int32_t cap);

#ifdef __cplusplus
}
#endif

// Model facts the KV policies need and llama.h does not expose.
#ifdef __cplusplus
extern "C" {
#endif
// 1 if layer il uses sliding-window attention, 0 if global, -1 if il is out of range.
LLAMA_API int32_t pask_model_layer_is_swa(const struct llama_model * model, int32_t il);
#ifdef __cplusplus
}
#endif
