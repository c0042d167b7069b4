// pask-kv-cells.h - cell-level view of a KV cache, to map attention columns (KV cells) to positions.
#pragma once

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// For every cell i < min(n_cells, cap) of the stream of seq_id in layer il, write the position that
// cell holds for seq_id, or -1 if the cell is empty or holds other sequences. Works for a layered
// context (layer il's own cells) and for a standard KV cache (il ignored: all layers share cells).
// Returns n_cells (the stream's size), or a negative PASK_KV_E* code (pask-kv.h) on bad input or
// unsupported memory, with the reason in pask_kv_last_error(); it never aborts.
LLAMA_API int32_t pask_kv_cell_positions(const struct llama_context * ctx, int32_t il, llama_seq_id seq_id,
                                         llama_pos * out, int32_t cap);

#ifdef __cplusplus
}
#endif
