// pask-model-info.cpp - model facts for KV policies (per-layer sliding-window flag).
#include "pask-attn.h"

#include "llama-model.h"

int32_t pask_model_layer_is_swa(const struct llama_model * model, int32_t il) {
    if (!model || il < 0 || (uint32_t) il >= model->hparams.n_layer()) {
        return -1;
    }
    return model->hparams.is_swa((uint32_t) il) ? 1 : 0;
}
