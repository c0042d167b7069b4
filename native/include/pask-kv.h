// pask-kv.h - layered KV cache: every attention layer owns its own cells with its own capacity.
//
// A context created with pask_init_from_model() holds one KV cache per layer (llama_kv_cache_layered);
// each layer keeps and evicts its own set of token positions, attends only to them, and allocates
// only n_cells_per_layer[il] cells per stream. All functions use C linkage and never abort: bad
// arguments give a negative PASK_KV_E* code (or NULL) and pask_kv_last_error() says why.
#pragma once

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PASK_KV_OK              0
#define PASK_KV_E_NOT_LAYERED  -1  // the context's memory is not a layered KV cache
#define PASK_KV_E_LAYER        -2  // layer index out of range
#define PASK_KV_E_SEQ          -3  // sequence id out of range [0, pask_kv_n_seq_ids(ctx))
#define PASK_KV_E_ARG          -4  // other bad argument (NULL pointer, negative position/count)
#define PASK_KV_E_ARCH         -5  // the model's architecture cannot use a layered KV cache

// Upper bound on the cells of one layer (per stream): larger requests are refused, not allocated.
#define PASK_KV_MAX_CELLS      (1u << 22)

// PASK_KV_OK if every attention layer of the model goes through the standard KV cache (plain or
// iSWA: llama, qwen2, qwen3, gemma3, mistral3, phi3, ...), else PASK_KV_E_ARCH (or PASK_KV_E_ARG for
// a NULL model) with pask_kv_last_error() naming the architecture and the reason: recurrent
// (Mamba, RWKV), hybrid, MLA (deepseek2-style), encoder-only / non-causal, diffusion, sparse or
// compressed-attention caches, KV shared across layers.
LLAMA_API int32_t pask_kv_model_supported(const struct llama_model * model);

// Create a context whose KV memory is a layered cache. n_cells_per_layer has n_layer entries (must
// equal llama_model_n_layer(model)); layer il gets n_cells_per_layer[il] >= 1 cells per stream
// (one stream per sequence unless params.kv_unified). Sliding-window layers keep their window mask.
// The model must pass pask_kv_model_supported(). Returns NULL on failure (see pask_kv_last_error()).
LLAMA_API struct llama_context * pask_init_from_model(
        struct llama_model        * model,
        struct llama_context_params params,
        const uint32_t            * n_cells_per_layer,
        int32_t                     n_layer);

// Number of layers of a layered context, or PASK_KV_E_NOT_LAYERED.
LLAMA_API int32_t pask_kv_n_layer(const struct llama_context * ctx);

// Number of sequence ids the context's memory accepts (seq ids 0 .. n-1): n_seq_max with one stream
// per sequence, LLAMA_MAX_SEQ when all sequences share one stream (kv_unified or n_seq_max == 1),
// as upstream's KV cache does. PASK_KV_E_NOT_LAYERED for other contexts.
LLAMA_API int32_t pask_kv_n_seq_ids(const struct llama_context * ctx);

// Cells per stream of layer il.
LLAMA_API int32_t pask_kv_capacity(const struct llama_context * ctx, int32_t il);

// Remove the given positions of seq_id from layer il only. Positions not held are ignored.
// Returns the number of cells seq_id released (>= 0) or a negative PASK_KV_E* code.
LLAMA_API int32_t pask_kv_evict(
        struct llama_context * ctx,
        int32_t                il,
        llama_seq_id           seq_id,
        const llama_pos      * pos,
        int32_t                n);

// Cells of layer il that hold seq_id.
LLAMA_API int32_t pask_kv_used(const struct llama_context * ctx, int32_t il, llama_seq_id seq_id);

// Free cells of layer il in the stream of seq_id.
LLAMA_API int32_t pask_kv_free(const struct llama_context * ctx, int32_t il, llama_seq_id seq_id);

// Positions of seq_id held by layer il, in cell order. Writes min(count, cap) entries to out
// (out may be NULL when cap == 0) and returns count, or a negative PASK_KV_E* code.
LLAMA_API int32_t pask_kv_positions(
        const struct llama_context * ctx,
        int32_t                      il,
        llama_seq_id                 seq_id,
        llama_pos                  * out,
        int32_t                      cap);

// Bytes allocated for K and V of layer il (all streams). Returns PASK_KV_OK or a PASK_KV_E* code.
LLAMA_API int32_t pask_kv_layer_bytes(
        const struct llama_context * ctx,
        int32_t                      il,
        int64_t                    * k_bytes,
        int64_t                    * v_bytes);

// Bytes allocated by the context's memory module (any memory type, all buffers), or -1 if none.
LLAMA_API int64_t pask_kv_total_bytes(const struct llama_context * ctx);

// The reason of the last failure of a pask_kv_* / pask_init_from_model call on this thread.
LLAMA_API const char * pask_kv_last_error(void);

#ifdef __cplusplus
}
#endif
