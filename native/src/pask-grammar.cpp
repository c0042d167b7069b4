// pask-grammar.cpp - exports the GBNF grammar sampler's parser state (see include/pask-grammar.h).
#include "pask-grammar.h"

#include "llama-grammar.h"
#include "llama-sampler.h"

#include <cmath>
#include <exception>
#include <vector>

namespace {

// rule id of a stack frame (a pointer into one of the grammar's rules), or -1
int32_t frame_rule_id(const llama_grammar & g, const llama_grammar_element * pos) {
    for (size_t r = 0; r < g.rules.size(); r++) {
        const auto & rule = g.rules[r];
        if (!rule.empty() && pos >= rule.data() && pos < rule.data() + rule.size()) {
            return (int32_t) r;
        }
    }
    return -1;
}

bool accepts_one(const llama_grammar & g, llama_token token) {
    llama_token_data data = { token, 0.0f, 0.0f };
    llama_token_data_array arr = { &data, 1, -1, false };
    llama_grammar_apply_impl(g, &arr);
    return data.logit == 0.0f;
}

} // namespace

int32_t pask_grammar_n_rules(const struct llama_sampler * smpl) {
    const llama_grammar * g = pask_sampler_get_grammar(smpl);
    return g ? (int32_t) g->rules.size() : -1;
}

const char * pask_grammar_rule_name(const struct llama_sampler * smpl, int32_t rule_id) {
    const llama_grammar * g = pask_sampler_get_grammar(smpl);
    if (!g || rule_id < 0 || (size_t) rule_id >= g->rule_names.size()) {
        return nullptr;
    }
    return g->rule_names[rule_id].c_str();
}

int32_t pask_grammar_n_stacks(const struct llama_sampler * smpl) {
    const llama_grammar * g = pask_sampler_get_grammar(smpl);
    return g ? (int32_t) g->stacks.size() : -1;
}

int32_t pask_grammar_stack(const struct llama_sampler * smpl, int32_t i, int32_t * out, int32_t n_max) {
    const llama_grammar * g = pask_sampler_get_grammar(smpl);
    if (!g || i < 0 || (size_t) i >= g->stacks.size()) {
        return -1;
    }
    const auto & stack = g->stacks[i];
    const int32_t depth = (int32_t) stack.size();
    for (int32_t k = 0; k < depth && k < n_max && out; k++) {
        out[k] = frame_rule_id(*g, stack[depth - 1 - k]);  // the top is the back of the vector
    }
    return depth;
}

int32_t pask_grammar_stacks_flat(const struct llama_sampler * smpl, int32_t * out, int32_t n_max) {
    const llama_grammar * g = pask_sampler_get_grammar(smpl);
    if (!g) {
        return -1;
    }
    int32_t n = 0;
    for (const auto & stack : g->stacks) {
        const int32_t depth = (int32_t) stack.size();
        if (out && n < n_max) {
            out[n] = depth;
        }
        n++;
        for (int32_t k = 0; k < depth; k++, n++) {
            if (out && n < n_max) {
                out[n] = frame_rule_id(*g, stack[depth - 1 - k]);
            }
        }
    }
    return n;
}

bool pask_grammar_accepts(const struct llama_sampler * smpl, llama_token token) {
    const llama_grammar * g = pask_sampler_get_grammar(smpl);
    if (!g || token < 0 || token >= llama_vocab_n_tokens(g->vocab)) {
        return false;
    }
    return accepts_one(*g, token);
}

int32_t pask_grammar_first_accepted(const struct llama_sampler * smpl, const llama_token * tokens, int32_t n) {
    const llama_grammar * g = pask_sampler_get_grammar(smpl);
    if (!g || tokens == nullptr || n <= 0) {
        return -1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(g->vocab);
    std::vector<llama_token_data> data;
    data.reserve(n);
    for (int32_t i = 0; i < n; i++) {
        // out-of-range ids are kept in place (so indices match) but marked rejected
        const bool ok = tokens[i] >= 0 && tokens[i] < n_vocab;
        data.push_back({ ok ? tokens[i] : 0, ok ? 0.0f : -INFINITY, 0.0f });
    }
    llama_token_data_array arr = { data.data(), data.size(), -1, false };
    llama_grammar_apply_impl(*g, &arr);
    for (int32_t i = 0; i < n; i++) {
        if (data[i].logit == 0.0f) {
            return i;
        }
    }
    return -1;
}

int32_t pask_grammar_accept(struct llama_sampler * smpl, llama_token token) {
    llama_grammar * g = pask_sampler_get_grammar(smpl);
    if (!g || token < 0 || token >= llama_vocab_n_tokens(g->vocab) || !accepts_one(*g, token)) {
        return -1;
    }
    try {
        llama_grammar_accept_impl(*g, token);
    } catch (const std::exception &) {
        return -1;  // cannot happen after accepts_one, kept so that no exception crosses the C API
    }
    return 0;
}
