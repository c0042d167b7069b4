// pask-version.cpp - identifies the pask patch series compiled into this libllama.
#include "pask.h"

#ifndef PASK_PATCH_SERIES
#define PASK_PATCH_SERIES "unknown"
#endif

const char * pask_patch_version(void) {
    return PASK_PATCH_SERIES;
}
