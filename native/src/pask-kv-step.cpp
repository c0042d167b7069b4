// pask-kv-step.cpp - the native persistence step (see include/pask-step.h).
//
// One pask_step per request: the class of every position so far (with class totals and same-class
// run offsets kept incrementally), per-layer rules, per-position attention scores when a rule ranks
// by them, and an event queue for traces. Selection works on the (position, cell) pairs a layer
// holds; eviction removes cells by index (llama_kv_cache::pask_seq_rm_cells), one pass per batch.
#include "pask-step.h"

#include "pask-attn.h"
#include "pask-kv.h"

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-kv-cells.h"
#include "pask-kv-layered.h"

#include "ggml-backend.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <numeric>
#include <string>
#include <vector>

uint32_t llama_kv_cache::pask_seq_rm_cells(llama_seq_id seq_id, const std::vector<uint32_t> & idxs) {
    auto & cells = v_cells[seq_to_stream[seq_id]];
    auto & head  = v_heads[seq_to_stream[seq_id]];
    uint32_t freed    = 0;
    uint32_t new_head = cells.size();
    for (const uint32_t i : idxs) {
        if (i >= cells.size() || cells.is_empty(i) || !cells.seq_has(i, seq_id)) {
            continue;
        }
        ++freed;
        if (cells.seq_rm(i, seq_id)) {
            new_head = std::min(new_head, i);
        }
    }
    if (new_head < head) {
        head = new_head;
    }
    return freed;
}

int32_t llama_kv_cache::pask_compact(llama_seq_id seq_id) {
    if (other || seq_id < 0 || (size_t) seq_id >= seq_to_stream.size()) {
        return -1;
    }
    // one stream: its cells and its slice of every K/V tensor (streams are the outermost dimension)
    const uint32_t s = seq_to_stream[seq_id];
    auto & cells = v_cells[s];
    const uint32_t n_cells = cells.size();
    const uint32_t n_used  = cells.get_used();
    // every used cell at or above n_used goes to a free cell below it (as many of each)
    std::vector<uint32_t> src, dst;
    uint32_t d = 0;
    for (uint32_t i = n_used; i < n_cells; ++i) {
        if (cells.is_empty(i)) {
            continue;
        }
        while (!cells.is_empty(d)) {
            ++d;
        }
        src.push_back(i);
        dst.push_back(d++);
    }
    if (src.empty()) {
        return 0;
    }
    std::vector<uint8_t> buf;
    for (const auto & layer : layers) {
        for (ggml_tensor * t : { layer.k, layer.v }) {
            if (!t) {
                continue;
            }
            const size_t per = ggml_nbytes(t) / n_stream;
            buf.resize(per);
            ggml_backend_tensor_get(t, buf.data(), (size_t) s * per, per);
            if (t == layer.v && v_trans) {
                // transposed V: cell c of dimension j at j * n_cells + c
                const size_t es = ggml_type_size(t->type);
                for (int64_t j = 0; j < t->ne[0]; ++j) {
                    uint8_t * row = buf.data() + (size_t) j * n_cells * es;
                    for (size_t m = 0; m < src.size(); ++m) {
                        memcpy(row + dst[m] * es, row + src[m] * es, es);
                    }
                }
            } else {
                const size_t rs = t->nb[1];
                for (size_t m = 0; m < src.size(); ++m) {
                    memcpy(buf.data() + dst[m] * rs, buf.data() + src[m] * rs, rs);
                }
            }
            ggml_backend_tensor_set(t, buf.data(), (size_t) s * per, per);
        }
    }
    const llama_kv_cells moved = cells.cp(src);
    for (const uint32_t i : src) {
        cells.rm(i);
    }
    cells.set(dst, moved);
    v_heads[s] = n_used;
    return (int32_t) src.size();
}

namespace {

// what a selection looks at besides the held positions
struct view {
    const pask_step_rule & r;
    const int32_t * totals;     // [n_classes] tokens of each class so far
    const int32_t * span_off;   // [n_all] offset of each position in its same-class run
    int32_t n_all;
    int32_t prompt_len;
};

struct held_set {
    std::vector<int32_t> pos, cls;
    std::vector<double>  score;  // empty: no scores
    std::vector<uint32_t> cell;  // empty in pask_step_select
};

void pool_scores(const std::vector<int32_t> & pos, const std::vector<double> & s, int32_t kernel,
                 std::vector<double> & out) {
    const int32_t n = (int32_t) pos.size();
    out.assign(s.begin(), s.end());
    if (kernel <= 1 || n == 0) {
        return;
    }
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pos[a] < pos[b]; });
    const int32_t pad = kernel / 2;
    const double  w   = 1.0 / kernel;
    for (int32_t i = 0; i < n; ++i) {
        double acc = 0.0;
        for (int32_t j = 0; j < kernel; ++j) {
            const int32_t k = std::min(n - 1, std::max(0, i + j - pad));  // edge padding
            acc += s[order[k]] * w;
        }
        out[order[i]] = acc;
    }
}

// top-k by score (ties: newer first), protected positions first (if more than k: the newest k)
void select_topk(const held_set & h, const std::vector<double> & score, const std::vector<uint8_t> & protect,
                 int32_t k, std::vector<uint8_t> & keep) {
    const int32_t n = (int32_t) h.pos.size();
    std::vector<int32_t> prot, rest;
    for (int32_t i = 0; i < n; ++i) {
        (protect[i] ? prot : rest).push_back(i);
    }
    const int32_t n_forced = std::min<int32_t>(k, (int32_t) prot.size());
    if (n_forced > 0) {
        std::nth_element(prot.begin(), prot.begin() + (n_forced - 1), prot.end(),
                         [&](int32_t a, int32_t b) { return h.pos[a] > h.pos[b]; });  // the newest first
    }
    for (int32_t i = 0; i < n_forced; ++i) {
        keep[prot[i]] = 1;
    }
    const int32_t room = std::min<int32_t>(k - n_forced, (int32_t) rest.size());
    if (room <= 0) {
        return;
    }
    auto better = [&](int32_t a, int32_t b) {
        if (score[a] != score[b]) {
            return score[a] > score[b];
        }
        return h.pos[a] > h.pos[b];
    };
    std::nth_element(rest.begin(), rest.begin() + (room - 1), rest.end(), better);
    for (int32_t i = 0; i < room; ++i) {
        keep[rest[i]] = 1;
    }
}

void select_sink_recent(const held_set & h, int32_t cap, int32_t n_sink, std::vector<uint8_t> & keep) {
    const int32_t n = (int32_t) h.pos.size();
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return h.pos[a] < h.pos[b]; });
    const int32_t sinks  = std::min(n_sink, cap);
    const int32_t window = cap - sinks;
    for (int32_t i = 0; i < sinks; ++i) {
        keep[order[i]] = 1;
    }
    for (int32_t i = std::max(sinks, n - window); i < n; ++i) {
        keep[order[i]] = 1;
    }
}

// PASK: never-evict classes and the newest first, then each class's share by within-class worth,
// then fit to capacity by protection rank
void select_quota(const view & v, const held_set & h, int32_t cap, std::vector<uint8_t> & keep) {
    const pask_step_rule & r = v.r;
    const int32_t n = (int32_t) h.pos.size();
    std::vector<uint8_t> never(n), recent(n);
    int32_t n_never = 0, n_gen = 0, n_tail = 0, max_pos = 0;
    for (int32_t i = 0; i < n; ++i) {
        never[i] = (r.never_mask >> h.cls[i]) & 1u;
        n_never += never[i];
        n_gen   += v.prompt_len && h.pos[i] >= v.prompt_len;
        n_tail  += !never[i] && r.protect_from >= 0 && h.pos[i] >= r.protect_from;
        max_pos  = std::max(max_pos, h.pos[i]);
    }
    recent = never;
    // the newest max(recent, generated, held at or after protect_from) of the others
    const int32_t n_recent = std::max(0, std::min(std::max({r.recent, n_gen, n_tail}), cap - n_never));
    if (n_recent) {
        std::vector<int32_t> others;
        for (int32_t i = 0; i < n; ++i) {
            if (!never[i]) {
                others.push_back(i);
            }
        }
        const int32_t m = std::min<int32_t>(n_recent, (int32_t) others.size());
        std::nth_element(others.begin(), others.begin() + (m - 1), others.end(),
                         [&](int32_t a, int32_t b) { return h.pos[a] > h.pos[b]; });  // the newest m first
        for (int32_t i = 0; i < m; ++i) {
            recent[others[i]] = 1;
        }
    }
    // within-class worth: higher persists first (all values distinct)
    std::vector<double> worth(n);
    if (r.order == PASK_ORDER_ATTENTION) {
        std::vector<double> pooled;
        pool_scores(h.pos, h.score, 7, pooled);
        std::vector<int32_t> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return pooled[a] != pooled[b] ? pooled[a] < pooled[b] : h.pos[a] < h.pos[b];
        });
        for (int32_t i = 0; i < n; ++i) {
            worth[order[i]] = i;
        }
    } else if (r.order == PASK_ORDER_PRIORITY) {
        // a prompt position: its priority; a generated one: span-head, as PASK_ORDER_SPAN_HEAD
        for (int32_t i = 0; i < n; ++i) {
            worth[i] = h.pos[i] < v.prompt_len && !h.score.empty() ? h.score[i]
                                                                    : -(double) v.span_off[h.pos[i]] + h.pos[i] / (max_pos + 1.0);
        }
    } else if (r.order == PASK_ORDER_NEWEST) {
        for (int32_t i = 0; i < n; ++i) {
            worth[i] = -h.pos[i];
        }
    } else if (r.order == PASK_ORDER_SPAN_HEAD && v.n_all > max_pos) {
        for (int32_t i = 0; i < n; ++i) {
            worth[i] = -(double) v.span_off[h.pos[i]] + h.pos[i] / (max_pos + 1.0);
        }
    } else {
        for (int32_t i = 0; i < n; ++i) {
            worth[i] = h.pos[i];
        }
    }
    keep = recent;
    int32_t n_kept = 0;
    std::vector<std::vector<int32_t>> by_class(PASK_STEP_MAX_CLASSES);
    std::vector<int32_t> of_class(PASK_STEP_MAX_CLASSES, 0), kept_of_class(PASK_STEP_MAX_CLASSES, 0);
    for (int32_t i = 0; i < n; ++i) {
        of_class[h.cls[i]]++;
        if (keep[i]) {
            kept_of_class[h.cls[i]]++;
            n_kept++;
        } else {
            by_class[h.cls[i]].push_back(i);
        }
    }
    for (int32_t c = 0; c < PASK_STEP_MAX_CLASSES; ++c) {
        auto & members = by_class[c];
        if (of_class[c] == 0) {
            continue;
        }
        const bool is_never = (r.never_mask >> c) & 1u;
        const int32_t target = is_never ? of_class[c] : (int32_t) std::ceil(r.keep[c] * v.totals[c] - 1e-9);
        const int32_t want = std::min<int32_t>(std::max(0, target - kept_of_class[c]), (int32_t) members.size());
        if (want <= 0) {
            continue;
        }
        std::nth_element(members.begin(), members.begin() + (want - 1), members.end(),
                         [&](int32_t a, int32_t b) { return worth[a] > worth[b]; });
        for (int32_t i = 0; i < want; ++i) {
            keep[members[i]] = 1;
        }
        n_kept += want;
    }
    if (n_kept > cap) {
        std::vector<int32_t> idx;
        for (int32_t i = 0; i < n; ++i) {
            if (keep[i] && !recent[i]) {
                idx.push_back(i);
            }
        }
        // least protective, least worth first (a strict total order: ranks differ between classes,
        // worth within one)
        const int32_t m = std::min<int32_t>(n_kept - cap, (int32_t) idx.size());
        if (m > 0) {
            std::nth_element(idx.begin(), idx.begin() + (m - 1), idx.end(), [&](int32_t a, int32_t b) {
                const int32_t ra = r.rank[h.cls[a]], rb = r.rank[h.cls[b]];
                return ra != rb ? ra > rb : worth[a] < worth[b];
            });
        }
        for (int32_t i = 0; i < m; ++i) {
            keep[idx[i]] = 0;
        }
    } else if (n_kept < cap) {
        std::vector<int32_t> idx;
        for (int32_t i = 0; i < n; ++i) {
            if (!keep[i]) {
                idx.push_back(i);
            }
        }
        // most protective, most worth first
        const int32_t m = std::min<int32_t>(cap - n_kept, (int32_t) idx.size());
        if (m > 0) {
            std::nth_element(idx.begin(), idx.begin() + (m - 1), idx.end(), [&](int32_t a, int32_t b) {
                const int32_t ra = r.rank[h.cls[a]], rb = r.rank[h.cls[b]];
                return ra != rb ? ra < rb : worth[a] > worth[b];
            });
        }
        for (int32_t i = 0; i < m; ++i) {
            keep[idx[i]] = 1;
        }
    }
}

// keep[i] = 1 for the positions a layer with rule v.r keeps at capacity cap
void select_keep(const view & v, const held_set & h, int32_t cap, std::vector<uint8_t> & keep) {
    const int32_t n = (int32_t) h.pos.size();
    keep.assign(n, 0);
    if (n <= cap) {
        std::fill(keep.begin(), keep.end(), 1);
        return;
    }
    cap = std::max(0, cap);
    const pask_step_rule & r = v.r;
    switch (r.kind) {
        case PASK_RULE_QUOTA:
            select_quota(v, h, cap, keep);
            return;
        case PASK_RULE_SINK_RECENT:
            select_sink_recent(h, cap, r.n_sink, keep);
            return;
        default: {
            std::vector<uint8_t> protect(n, 0);
            const int32_t n_newest = std::min(n, r.protect_newest + (int32_t) std::floor(cap * r.protect_ratio));
            if (n_newest > 0) {
                std::vector<int32_t> order(n);
                std::iota(order.begin(), order.end(), 0);
                std::nth_element(order.begin(), order.begin() + (n_newest - 1), order.end(),
                                 [&](int32_t a, int32_t b) { return h.pos[a] > h.pos[b]; });
                for (int32_t i = 0; i < n_newest; ++i) {
                    protect[order[i]] = 1;
                }
            }
            if (r.protect_from >= 0) {
                for (int32_t i = 0; i < n; ++i) {
                    protect[i] |= h.pos[i] >= r.protect_from;
                }
            }
            for (int32_t i = 0; i < n; ++i) {
                protect[i] |= h.pos[i] < r.n_sink;  // attention sinks (a scored method's first positions)
            }
            std::vector<double> score;
            if (h.score.empty()) {
                score.assign(n, 0.0);
            } else {
                pool_scores(h.pos, h.score, r.pool_kernel, score);
            }
            select_topk(h, score, protect, cap, keep);
        }
    }
}

bool rule_ok(const pask_step_rule & r, int32_t n_classes) {
    if (r.kind < PASK_RULE_QUOTA || r.kind > PASK_RULE_SINK_RECENT || r.cap < 1 || !(r.ratio >= 0.0) ||
        r.order < PASK_ORDER_OLDEST || r.order > PASK_ORDER_PRIORITY || r.protect_newest < 0 ||
        !(r.protect_ratio >= 0.0 && r.protect_ratio <= 1.0) || r.n_sink < 0 || r.recent < 0 || r.swa_window < 0 ||
        r.hysteresis < 0) {
        return false;
    }
    for (int32_t c = 0; c < n_classes; ++c) {
        if (!(r.keep[c] >= 0.0 && r.keep[c] <= 1.0)) {
            return false;
        }
    }
    return true;
}

} // namespace

struct pask_step {
    llama_kv_cache_layered * kv = nullptr;
    llama_seq_id seq = 0;
    std::vector<pask_step_rule> rules;
    int32_t n_classes = 0;
    int32_t prompt_len = 0;
    int32_t max_len = 0;
    std::vector<int32_t> classes;   // [position]
    std::vector<int32_t> span_off;  // [position]
    std::vector<int32_t> totals;    // [PASK_STEP_MAX_CLASSES]
    pask_attn_probe * probe = nullptr;
    int32_t score_stat = -1;
    std::vector<std::vector<double>> scores;  // [layer][position]; empty without a probe or set scores
    std::vector<double> priority;  // [position] for PASK_ORDER_PRIORITY rules (pask_step_set_priority)
    bool trace = false;
    std::deque<std::array<int32_t, 4>> events;
    std::vector<float> stat_buf;
    held_set held;
    std::vector<uint8_t> keep;
    std::vector<uint32_t> drop;

    void append(int32_t c) {
        const int32_t p = (int32_t) classes.size();
        span_off.push_back(p > 0 && classes[p - 1] == c ? span_off[p - 1] + 1 : 0);
        classes.push_back(c);
        totals[c]++;
    }

    int32_t n_held(int32_t il) const {
        return (int32_t) kv->layer(il)->get_cells(seq).seq_pos_get(seq).size();
    }

    void gather(int32_t il) {
        const auto & sp = kv->layer(il)->get_cells(seq).seq_pos_get(seq);
        held.pos.clear();
        held.cls.clear();
        held.cell.clear();
        held.score.clear();
        const bool with_scores = !scores.empty();
        const bool with_priority = rules[il].kind == PASK_RULE_QUOTA && rules[il].order == PASK_ORDER_PRIORITY;
        for (const auto & [p, cell] : sp) {
            held.pos.push_back(p);
            held.cls.push_back(p < (llama_pos) classes.size() ? classes[p] : 0);
            held.cell.push_back(cell);
            if (with_priority) {
                held.score.push_back(p < (llama_pos) priority.size() ? priority[p] : 0.0);
            } else if (with_scores) {
                held.score.push_back(p < (llama_pos) scores[il].size() ? scores[il][p] : 0.0);
            }
        }
    }

    void note(int32_t step, int32_t il, int32_t pos, int32_t code) {
        if (trace) {
            events.push_back({ step, il, pos, code });
        }
    }

    int32_t evict_to(int32_t il, int32_t cap, int32_t step, int32_t code) {
        if (n_held(il) <= cap) {
            return 0;
        }
        gather(il);
        const view v{ rules[il], totals.data(), span_off.data(), (int32_t) classes.size(), prompt_len };
        select_keep(v, held, cap, keep);
        drop.clear();
        for (size_t i = 0; i < keep.size(); ++i) {
            if (!keep[i]) {
                drop.push_back(held.cell[i]);
                note(step, il, held.pos[i], code);
            }
        }
        return (int32_t) kv->layer(il)->pask_seq_rm_cells(seq, drop);
    }

    int32_t drop_window(llama_pos now, int32_t step) {
        int32_t total = 0;
        for (int32_t il = 0; il < (int32_t) rules.size(); ++il) {
            const int32_t w = rules[il].swa_window;
            if (w <= 0) {
                continue;
            }
            drop.clear();
            for (const auto & [p, cell] : kv->layer(il)->get_cells(seq).seq_pos_get(seq)) {
                if (p > now - w) {
                    break;  // ordered by position
                }
                drop.push_back(cell);
                note(step, il, p, PASK_EVICT_WINDOW);
            }
            if (!drop.empty()) {
                total += (int32_t) kv->layer(il)->pask_seq_rm_cells(seq, drop);
            }
        }
        return total;
    }

    int32_t collect(int32_t what) {
        if (!probe || scores.empty()) {
            return pask_kv_fail(PASK_KV_E_ARG, "the step has no attention probe");
        }
        for (int32_t il = 0; il < (int32_t) rules.size(); ++il) {
            const int32_t n_kv = pask_attn_probe_n_kv_seq(probe, il, seq);
            if (n_kv == -2) {
                return pask_kv_fail(PASK_KV_E_ARG, "a layer attended more KV cells than the in-graph probe holds");
            }
            if (n_kv < 0) {
                return pask_kv_fail(PASK_KV_E_LAYER, "the probe has no layer " + std::to_string(il));
            }
            stat_buf.resize(std::max(1, n_kv));
            pask_attn_probe_get_seq(probe, il, what, seq, stat_buf.data(), n_kv);
            auto & s = scores[il];
            if (what == PASK_ATTN_LAST) {
                std::fill(s.begin(), s.end(), 0.0);
            }
            const auto & cells = kv->layer(il)->get_cells(seq);
            const int32_t m = std::min<int32_t>(n_kv, (int32_t) cells.size());
            for (int32_t j = 0; j < m; ++j) {
                if (!cells.is_empty(j) && cells.seq_has(j, seq)) {
                    const llama_pos p = cells.pos_get(j);
                    if (p >= 0 && p < (llama_pos) s.size()) {
                        s[p] += stat_buf[j];
                    }
                }
            }
        }
        return 0;
    }
};

static int32_t fail(int32_t code, const std::string & msg) {
    return pask_kv_fail(code, msg);
}

struct pask_step * pask_step_init(struct llama_context * ctx, llama_seq_id seq_id, const struct pask_step_rule * rules,
                                  int32_t n_layer, const int32_t * classes, int32_t n_prompt, int32_t n_classes,
                                  int32_t max_len, int32_t prompt_len, struct pask_attn_probe * probe,
                                  int32_t score_stat) {
    if (!ctx || !rules || n_prompt < 0 || (n_prompt > 0 && !classes)) {
        fail(PASK_KV_E_ARG, "ctx, rules and classes must not be NULL");
        return nullptr;
    }
    auto * kv = dynamic_cast<llama_kv_cache_layered *>(llama_get_memory(ctx));
    if (!kv) {
        fail(PASK_KV_E_NOT_LAYERED, "the step needs a layered-cache context");
        return nullptr;
    }
    if (n_layer != kv->n_layer()) {
        fail(PASK_KV_E_ARG, "need one rule per layer: got " + std::to_string(n_layer) + ", the cache has " +
                                std::to_string(kv->n_layer()));
        return nullptr;
    }
    if (seq_id < 0 || (uint32_t) seq_id >= kv->n_seq_ids()) {
        fail(PASK_KV_E_SEQ, "sequence id " + std::to_string(seq_id) + " out of range [0, " +
                                std::to_string(kv->n_seq_ids()) + ")");
        return nullptr;
    }
    if (n_classes < 1 || n_classes > PASK_STEP_MAX_CLASSES || max_len < n_prompt ||
        prompt_len < 0 || score_stat < -1 || score_stat > PASK_ATTN_LAST || (score_stat >= 0 && !probe)) {
        fail(PASK_KV_E_ARG, "bad step arguments (n_classes, max_len, prompt_len or score_stat)");
        return nullptr;
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        if (!kv->layer(il) || !rule_ok(rules[il], n_classes)) {
            fail(PASK_KV_E_ARG, "bad rule for layer " + std::to_string(il));
            return nullptr;
        }
    }
    for (int32_t i = 0; i < n_prompt; ++i) {
        if (classes[i] < 0 || classes[i] >= n_classes) {
            fail(PASK_KV_E_ARG, "class " + std::to_string(classes[i]) + " of position " + std::to_string(i) +
                                    " out of range [0, " + std::to_string(n_classes) + ")");
            return nullptr;
        }
    }
    auto * st = new pask_step();
    st->kv = kv;
    st->seq = seq_id;
    st->rules.assign(rules, rules + n_layer);
    st->n_classes  = n_classes;
    st->prompt_len = prompt_len;
    st->max_len    = max_len;
    st->totals.assign(PASK_STEP_MAX_CLASSES, 0);
    st->classes.reserve(max_len + 1);
    st->span_off.reserve(max_len + 1);
    for (int32_t i = 0; i < n_prompt; ++i) {
        st->append(classes[i]);
    }
    st->probe = probe;
    st->score_stat = score_stat;
    if (probe) {
        st->scores.assign(n_layer, std::vector<double>(max_len + 1, 0.0));
    }
    return st;
}

void pask_step_free(struct pask_step * st) {
    delete st;
}

int32_t pask_step_set_priority(struct pask_step * st, const double * priority, int32_t n) {
    if (!st || (st->prompt_len > 0 && !priority) || n != st->prompt_len) {
        return fail(PASK_KV_E_ARG, "pask_step_set_priority: need one priority per prompt position");
    }
    for (int32_t i = 0; i < n; ++i) {
        if (!std::isfinite(priority[i])) {
            return fail(PASK_KV_E_ARG, "pask_step_set_priority: priority of position " + std::to_string(i) +
                                           " is not finite");
        }
    }
    st->priority.assign(priority, priority + n);
    return 0;
}

int32_t pask_step_set_scores(struct pask_step * st, int32_t il, const double * scores, int32_t n) {
    if (!st || (n > 0 && !scores) || n < 0 || n > st->max_len + 1) {
        return fail(PASK_KV_E_ARG, "pask_step_set_scores: need a step and at most max_len + 1 scores");
    }
    if (il < 0 || il >= (int32_t) st->rules.size()) {
        return fail(PASK_KV_E_LAYER, "layer " + std::to_string(il) + " out of range");
    }
    for (int32_t i = 0; i < n; ++i) {
        if (!std::isfinite(scores[i])) {
            return fail(PASK_KV_E_ARG, "pask_step_set_scores: score of position " + std::to_string(i) +
                                           " is not finite");
        }
    }
    if (st->scores.empty()) {
        st->scores.assign(st->rules.size(), std::vector<double>(st->max_len + 1, 0.0));
    }
    auto & s = st->scores[il];
    std::fill(s.begin(), s.end(), 0.0);
    std::copy(scores, scores + n, s.begin());
    return 0;
}

void pask_step_set_trace(struct pask_step * st, int32_t on) {
    if (st) {
        st->trace = on != 0;
    }
}

int32_t pask_step_collect(struct pask_step * st, int32_t what) {
    if (!st || what < PASK_ATTN_SUM || what > PASK_ATTN_LAST) {
        return fail(PASK_KV_E_ARG, "pask_step_collect: bad step or statistic");
    }
    return st->collect(what);
}

int32_t pask_step_evict_to(struct pask_step * st, int32_t il, int32_t capacity, int32_t step, int32_t rule_code) {
    if (!st) {
        return fail(PASK_KV_E_ARG, "step must not be NULL");
    }
    if (il < 0 || il >= (int32_t) st->rules.size()) {
        return fail(PASK_KV_E_LAYER, "layer " + std::to_string(il) + " out of range");
    }
    if (capacity < 0) {
        return fail(PASK_KV_E_ARG, "capacity must be >= 0");
    }
    return st->evict_to(il, capacity, step, rule_code);
}

int32_t pask_step_drop_window(struct pask_step * st, llama_pos now, int32_t step) {
    if (!st) {
        return fail(PASK_KV_E_ARG, "step must not be NULL");
    }
    return st->drop_window(now, step);
}

int32_t pask_step_token(struct pask_step * st, int32_t cls, llama_pos pos, int32_t n_gen, int32_t * held) {
    if (!st || cls < 0 || cls >= st->n_classes || n_gen < 1) {
        return fail(PASK_KV_E_ARG, "pask_step_token: bad step, class or n_gen");
    }
    if ((int32_t) st->classes.size() > st->max_len || pos != (llama_pos) st->classes.size()) {
        return fail(PASK_KV_E_ARG, "pask_step_token: position " + std::to_string(pos) + " is not the next one (" +
                                       std::to_string(st->classes.size()) + ") or exceeds max_len");
    }
    st->append(cls);
    if (st->score_stat >= 0) {
        const int32_t rc = st->collect(st->score_stat);
        if (rc < 0) {
            return rc;
        }
    }
    const int32_t step = n_gen - 1;
    int32_t total = st->drop_window(pos, step);  // first: the budget chooses among what windows hold
    for (int32_t il = 0; il < (int32_t) st->rules.size(); ++il) {
        const pask_step_rule & r = st->rules[il];
        const int32_t target = r.cap + (int32_t) std::ceil(r.ratio * n_gen - 1e-9);
        if (st->n_held(il) > target) {
            total += st->evict_to(il, std::max(1, target - r.hysteresis), step, r.rule_code);
        }
    }
    // (a position that left a sliding window never counts against that layer's budget)
    if (held) {
        for (int32_t il = 0; il < (int32_t) st->rules.size(); ++il) {
            held[il] = st->n_held(il);
        }
    }
    return total;
}

int32_t pask_step_compact(struct pask_step * st) {
    if (!st) {
        return fail(PASK_KV_E_ARG, "step must not be NULL");
    }
    int32_t total = 0;
    for (int32_t il = 0; il < (int32_t) st->rules.size(); ++il) {
        const int32_t moved = st->kv->layer(il)->pask_compact(st->seq);
        if (moved < 0) {
            return fail(PASK_KV_E_ARG, "compaction: the layer shares another layer's cache");
        }
        total += moved;
    }
    return total;
}

int32_t pask_step_take_events(struct pask_step * st, int32_t * out, int32_t cap) {
    if (!st || cap < 0 || (cap > 0 && !out)) {
        return fail(PASK_KV_E_ARG, "pask_step_take_events: bad arguments");
    }
    int32_t n = 0;
    while (n < cap && !st->events.empty()) {
        const auto & e = st->events.front();
        std::copy(e.begin(), e.end(), out + 4 * n);
        st->events.pop_front();
        ++n;
    }
    return n;
}

int32_t pask_step_select(const struct pask_step_rule * rule, const int32_t * pos, const int32_t * cls,
                         const double * scores, int32_t n, const int32_t * all_classes, int32_t n_all,
                         int32_t prompt_len, int32_t capacity, uint8_t * keep_out) {
    if (!rule || n < 0 || (n > 0 && (!pos || !cls || !keep_out)) || n_all < 0 || (n_all > 0 && !all_classes) ||
        capacity < 0 || prompt_len < 0) {
        return fail(PASK_KV_E_ARG, "pask_step_select: bad arguments");
    }
    if (!rule_ok(*rule, PASK_STEP_MAX_CLASSES)) {
        return fail(PASK_KV_E_ARG, "pask_step_select: bad rule");
    }
    std::vector<int32_t> totals(PASK_STEP_MAX_CLASSES, 0), span_off(n_all, 0);
    for (int32_t p = 0; p < n_all; ++p) {
        if (all_classes[p] < 0 || all_classes[p] >= PASK_STEP_MAX_CLASSES) {
            return fail(PASK_KV_E_ARG, "pask_step_select: class out of range");
        }
        totals[all_classes[p]]++;
        span_off[p] = p > 0 && all_classes[p - 1] == all_classes[p] ? span_off[p - 1] + 1 : 0;
    }
    held_set h;
    for (int32_t i = 0; i < n; ++i) {
        if (pos[i] < 0 || cls[i] < 0 || cls[i] >= PASK_STEP_MAX_CLASSES ||
            (rule->kind == PASK_RULE_QUOTA &&
             (rule->order == PASK_ORDER_SPAN_HEAD || rule->order == PASK_ORDER_PRIORITY) && pos[i] >= n_all)) {
            return fail(PASK_KV_E_ARG, "pask_step_select: position or class out of range");
        }
        h.pos.push_back(pos[i]);
        h.cls.push_back(cls[i]);
        if (scores) {
            h.score.push_back(scores[i]);
        }
    }
    if (!scores && rule->kind == PASK_RULE_QUOTA &&
        (rule->order == PASK_ORDER_ATTENTION || rule->order == PASK_ORDER_PRIORITY)) {
        return fail(PASK_KV_E_ARG, "pask_step_select: the attention and priority orders need scores");
    }
    const view v{ *rule, totals.data(), span_off.data(), n_all, prompt_len };
    std::vector<uint8_t> keep;
    select_keep(v, h, capacity, keep);
    int32_t kept = 0;
    for (int32_t i = 0; i < n; ++i) {
        keep_out[i] = keep[i];
        kept += keep[i];
    }
    return kept;
}
