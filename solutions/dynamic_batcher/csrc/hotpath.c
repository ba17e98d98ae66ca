/* Reference implementation of the dynamic batcher's C hot path (see hotpath.h). */
#include "hotpath.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

/* ceil(tokens / block_size) without the overflow of (tokens + block_size - 1). */
static hp_int blocks_for(hp_int tokens, hp_int block_size) {
    return tokens / block_size + (tokens % block_size != 0);
}

/* The layout hotpath.h pins, checked in full before anything is written. Rows 0 .. seqs
 * also carry a scheduled chunk (>= 1) that their blocks already cover (hp_apply's input);
 * hp_schedule passes seqs == 0. */
static int state_valid(const hp_state *s, hp_int seqs, const hp_int *chunk) {
    if (s == NULL || s->rows < 0 || s->n < 0 || s->n > s->rows || s->stride < 1 ||
        s->block_size < 1 || s->num_blocks < 0 || s->free_top < 0 ||
        s->free_top > s->num_blocks || seqs < 0 || seqs > s->n ||
        (seqs > 0 && chunk == NULL)) {
        return 0;
    }
    if (s->rows > 0 && (s->known == NULL || s->computed == NULL || s->held == NULL ||
                        s->table == NULL || (int64_t)s->rows * s->stride > HP_INT_MAX)) {
        return 0;
    }
    if (s->num_blocks > 0 && s->free_ids == NULL) {
        return 0;
    }
    int64_t blocks = s->free_top;
    for (hp_int i = 0; i < s->n; i++) {
        hp_int c = i < seqs ? chunk[i] : 0;
        if (s->known[i] < 1 || s->computed[i] < 0 || s->computed[i] >= s->known[i] ||
            c < (i < seqs) || c > s->known[i] - s->computed[i] ||
            s->held[i] != blocks_for(s->computed[i] + c, s->block_size) ||
            blocks_for(s->known[i], s->block_size) > s->stride) {
            return 0;
        }
        blocks += s->held[i];
    }
    return blocks <= s->num_blocks; /* so no push can overflow the free stack */
}

/* Push row's blocks back, last block first (so its first block ends on top). */
static void push_blocks(hp_state *s, hp_int row) {
    const hp_int *blocks = s->table + (int64_t)row * s->stride;
    for (hp_int k = s->held[row]; k-- > 0;) {
        s->free_ids[s->free_top++] = blocks[k];
    }
    s->held[row] = 0;
}

static void release(hp_state *s, hp_int row) {
    push_blocks(s, row);
    s->computed[row] = 0; /* recompute: the KV is gone */
}

int hp_schedule(hp_state *state, hp_int token_budget, hp_int max_seqs, hp_int *chunk,
                hp_int *out_seqs, hp_int *out_tokens, hp_int *out_preempted) {
    if (token_budget < 0 || max_seqs < 0 || out_seqs == NULL || out_tokens == NULL ||
        out_preempted == NULL || !state_valid(state, 0, NULL) || (state->rows > 0 && chunk == NULL)) {
        return HP_INVALID;
    }
    hp_state *s = state;
    hp_int left = token_budget;
    hp_int seqs = 0;
    hp_int preempted = 0;
    while (seqs < s->n && seqs < max_seqs && left > 0) {
        hp_int i = seqs;
        hp_int want = s->known[i] - s->computed[i];
        hp_int granted = want < left ? want : left;
        hp_int missing = blocks_for(s->computed[i] + granted, s->block_size) - s->held[i];
        while (missing > s->free_top) {
            hp_int victim = --s->n; /* the most recently admitted gives its blocks */
            release(s, victim);
            preempted++;
            if (victim == i) {
                goto done; /* it was its own victim: scheduling ends with it */
            }
        }
        hp_int *row = s->table + (int64_t)i * s->stride;
        for (hp_int k = 0; k < missing; k++) {
            row[s->held[i]++] = s->free_ids[--s->free_top];
        }
        chunk[i] = granted;
        left -= granted;
        seqs++;
    }
done:
    for (hp_int i = seqs; i < s->rows; i++) {
        chunk[i] = 0;
    }
    *out_seqs = seqs;
    *out_tokens = token_budget - left;
    *out_preempted = preempted;
    return HP_OK;
}

int hp_apply(hp_state *state, hp_int seqs, const hp_int *chunk, const hp_int *finished) {
    if (!state_valid(state, seqs, chunk) || (state->n > 0 && finished == NULL)) {
        return HP_INVALID;
    }
    hp_state *s = state;
    for (hp_int i = 0; i < s->n; i++) {
        if (finished[i] != 0 && finished[i] != 1) {
            return HP_INVALID;
        }
        /* A row that samples and goes on must still fit its table row next step. */
        if (i < seqs && s->computed[i] + chunk[i] == s->known[i] && !finished[i] &&
            (s->known[i] == HP_INT_MAX || blocks_for(s->known[i] + 1, s->block_size) > s->stride)) {
            return HP_INVALID;
        }
    }
    for (hp_int i = 0; i < seqs; i++) {
        s->computed[i] += chunk[i];
        if (s->computed[i] == s->known[i] && !finished[i]) {
            s->known[i]++; /* it sampled the token after the known ones, and goes on */
        }
    }
    /* Release first, in row order, then close the gaps: the stack's order is the same
     * whichever rows stay. */
    for (hp_int i = 0; i < s->n; i++) {
        if (finished[i]) {
            push_blocks(s, i);
        }
    }
    hp_int kept = 0;
    for (hp_int i = 0; i < s->n; i++) {
        if (finished[i]) {
            continue;
        }
        if (kept != i) {
            s->known[kept] = s->known[i];
            s->computed[kept] = s->computed[i];
            s->held[kept] = s->held[i];
            memcpy(s->table + (int64_t)kept * s->stride, s->table + (int64_t)i * s->stride,
                   (size_t)s->held[i] * sizeof(hp_int));
        }
        kept++;
    }
    s->n = kept;
    return HP_OK;
}
