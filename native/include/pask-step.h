// pask-step.h - the native persistence step: per-token KV bookkeeping and eviction for every method.
//
// Python uploads once per request the class of every prompt position and one rule per layer
// (struct pask_step_rule: capacity, growth, the selection rule and its parameters); the engine then
// calls pask_step_token() once per generated token. It appends the token's class, adds the attention
// probe's statistic to the per-position scores (methods that rank by attention), drops positions
// that left a sliding window, and, when a layer holds more than its target
// (cap + ceil(ratio x n_gen)), evicts in one batch down to target - the layer's hysteresis, by
// cell index.
// Selection is by class quota (PASK), top-k score with a protected set (H2O, TOVA, SnapKV,
// PyramidKV; the scored query-agnostic methods, with scores set once) or sinks + recent window
// (StreamingLLM); pask_step_select() exposes the same
// selection on explicit arrays, so it can be checked against the Python reference rules.
// Every function returns a negative PASK_KV_E* code (pask-kv.h) on bad input and never aborts.
#pragma once

#include "llama.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct pask_attn_probe;
struct pask_step;

#define PASK_STEP_MAX_CLASSES 32

#define PASK_RULE_QUOTA       0  // PASK: per-class shares, never-evict classes, recent window, within-class order
#define PASK_RULE_TOPK        1  // top-k by (optionally pooled) score, a protected set kept first
#define PASK_RULE_SINK_RECENT 2  // the first n_sink positions and the newest ones

#define PASK_ORDER_OLDEST    0   // within a class the oldest persist first
#define PASK_ORDER_NEWEST    1
#define PASK_ORDER_SPAN_HEAD 2   // the smaller a token's offset in its same-class run, the longer it persists
#define PASK_ORDER_ATTENTION 3   // rank by pooled attention score (ties: newer first)
#define PASK_ORDER_PRIORITY  4   // prompt positions by a priority the caller set once (pask_step_set_priority;
                                 // pask_step_select: the scores argument; higher persists first), generated
                                 // ones as PASK_ORDER_SPAN_HEAD

#define PASK_EVICT_POLICY 0      // event rule codes (trace)
#define PASK_EVICT_SCORE  1
#define PASK_EVICT_WINDOW 2

struct pask_step_rule {
    int32_t kind;              // PASK_RULE_*
    int32_t cap;               // entries after prefill (prompt capacity)
    double  ratio;             // growth per generated token: target = cap + ceil(ratio * n_gen - 1e-9)
    int32_t swa_window;        // > 0: a sliding-window layer; positions <= now - window are dropped
    int32_t rule_code;         // PASK_EVICT_* reported for this layer's budget evictions
    int32_t hysteresis;        // >= 0: an over-target layer evicts down to target - hysteresis
    // PASK_RULE_TOPK
    int32_t protect_newest;    // the newest n positions are protected
    double  protect_ratio;     // plus floor(capacity * ratio) newest (H2O's recent half)
    int32_t protect_from;      // positions >= protect_from are protected (-1: none)
    int32_t pool_kernel;       // average-pool scores along positions (<= 1: raw scores)
    // PASK_RULE_SINK_RECENT (and PASK_RULE_TOPK: positions < n_sink are protected)
    int32_t n_sink;
    // PASK_RULE_QUOTA
    int32_t  recent;           // newest positions kept first (at least every generated token and,
                               // protect_from >= 0, every position >= protect_from)
    uint32_t never_mask;       // bit c: class c is never evicted
    int32_t  order;            // PASK_ORDER_*
    double   keep[PASK_STEP_MAX_CLASSES];   // fraction of each class's tokens (so far) kept
    int32_t  rank[PASK_STEP_MAX_CLASSES];   // protection rank of each class (0: most protective)
};

// A step for sequence seq_id of a layered context (pask_init_from_model). rules: one per layer;
// classes: the class of each of the n_prompt prompt positions (< n_classes <= PASK_STEP_MAX_CLASSES);
// max_len: positions the request may reach; probe (may be NULL): the context's attention probe,
// read after each decode when score_stat >= 0 (PASK_ATTN_SUM or PASK_ATTN_LAST).
LLAMA_API struct pask_step * pask_step_init(struct llama_context * ctx, llama_seq_id seq_id,
        const struct pask_step_rule * rules, int32_t n_layer, const int32_t * classes, int32_t n_prompt,
        int32_t n_classes, int32_t max_len, int32_t prompt_len, struct pask_attn_probe * probe,
        int32_t score_stat);
LLAMA_API void pask_step_free(struct pask_step * st);

// The priority of every prompt position (n == prompt_len) for rules with order PASK_ORDER_PRIORITY;
// generated positions rank as PASK_ORDER_SPAN_HEAD. Returns 0 or a negative code.
LLAMA_API int32_t pask_step_set_priority(struct pask_step * st, const double * priority, int32_t n);

// Layer il's score of each position < n (the rest 0), ranked by its PASK_RULE_TOPK rule: scores taken
// once before the prefill (a scored method's scoring pass), for a step without a probe statistic.
// n <= max_len + 1. Returns 0 or a negative code.
LLAMA_API int32_t pask_step_set_scores(struct pask_step * st, int32_t il, const double * scores, int32_t n);

// Record trace events (step, layer, position, rule) for pask_step_take_events (default off).
LLAMA_API void pask_step_set_trace(struct pask_step * st, int32_t on);

// Add the probe's statistic `what` (PASK_ATTN_*) of the last decode to every layer's scores
// (PASK_ATTN_LAST replaces them). Returns 0 or a negative code.
LLAMA_API int32_t pask_step_collect(struct pask_step * st, int32_t what);

// Evict layer il down to `capacity` entries with its rule (no hysteresis); returns entries evicted.
LLAMA_API int32_t pask_step_evict_to(struct pask_step * st, int32_t il, int32_t capacity, int32_t step, int32_t rule_code);

// Sliding-window layers: drop positions <= now - window. Returns entries evicted.
LLAMA_API int32_t pask_step_drop_window(struct pask_step * st, llama_pos now, int32_t step);

// After the decode of generated token number n_gen (1-based) of class cls at position pos:
// append its class, collect scores (score_stat), evict layers over target (with their hysteresis) and
// drop what left sliding windows. held (may be NULL): n_layer entries held after the step.
// Returns the entries evicted, or a negative code.
LLAMA_API int32_t pask_step_token(struct pask_step * st, int32_t cls, llama_pos pos, int32_t n_gen,
                                  int32_t * held);

// Move every layer's held cells to its lowest cell indices (K/V rows with them), so that the used
// range, and with it n_kv, covers only what is held (after a one-time compression of a prompt
// prefilled whole, or a pool slot's prefill). Only the step's sequence's stream is touched (its cells
// move with every sequence id they carry). Returns the cells moved or a negative code.
LLAMA_API int32_t pask_step_compact(struct pask_step * st);

// Move recorded events (4 int32 each: step, layer, position, rule) into out (cap events at most);
// returns the number moved. Events beyond cap stay queued.
LLAMA_API int32_t pask_step_take_events(struct pask_step * st, int32_t * out, int32_t cap);

// The selection alone: which of n held positions (pos, cls, scores may be NULL) a layer with `rule`
// keeps at `capacity`. all_classes: classes of every position so far (n_all > max pos);
// keep_out[i] = 1 if pos[i] is kept. Returns the number kept or a negative code.
LLAMA_API int32_t pask_step_select(const struct pask_step_rule * rule, const int32_t * pos, const int32_t * cls,
        const double * scores, int32_t n, const int32_t * all_classes, int32_t n_all, int32_t prompt_len,
        int32_t capacity, uint8_t * keep_out);

#ifdef __cplusplus
}
#endif
