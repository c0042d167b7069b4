// pask.h - pask-local extensions to llama.cpp (Parser-Aware Structural KV persistence).
//
// Kept apart from llama.h so that rebasing the patch series onto a newer llama.cpp stays easy.
// Every function here is exported from libllama with C linkage.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Identifier of the applied pask patch series (sha256 of patches/ and ggml_kernels/ as computed
// by pask-local's build script), or "unknown" when the library was built outside that script.
LLAMA_API const char * pask_patch_version(void);

#ifdef __cplusplus
}
#endif
