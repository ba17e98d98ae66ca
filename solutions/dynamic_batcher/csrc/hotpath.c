/* Reference implementation of the dynamic batcher's C hot path (see hotpath.h). */
#include "hotpath.h"

#include <stddef.h>

int hp_fill_token_budget(hp_int n, const hp_int *need, hp_int token_budget, hp_int max_seqs,
                         hp_int *chunk, hp_int *out_seqs, hp_int *out_tokens) {
    if (n < 0 || token_budget < 0 || max_seqs < 0 || out_seqs == NULL || out_tokens == NULL) {
        return HP_INVALID;
    }
    if (n > 0 && (need == NULL || chunk == NULL)) {
        return HP_INVALID;
    }
    /* Validate every entry before writing anything: bad input changes no state. */
    for (hp_int i = 0; i < n; i++) {
        if (need[i] < 1) {
            return HP_INVALID;
        }
    }

    hp_int left = token_budget;
    hp_int seqs = 0;
    /* The cap on sequences is checked before the budget so that max_seqs == 0 schedules
     * nothing even with budget to spare. */
    while (seqs < n && seqs < max_seqs && left > 0) {
        /* Clamp to what is left: the last request scheduled may get a partial chunk. */
        hp_int granted = need[seqs] < left ? need[seqs] : left;
        chunk[seqs] = granted;
        left -= granted;
        seqs++;
    }
    for (hp_int i = seqs; i < n; i++) {
        chunk[i] = 0;
    }
    *out_seqs = seqs;
    *out_tokens = token_budget - left;
    return HP_OK;
}
