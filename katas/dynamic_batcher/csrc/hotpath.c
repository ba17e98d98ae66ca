/* The dynamic batcher's C hot path — yours to write (see hotpath.h for the contract).
 *
 * TODO(stage1): implement every function below (the prompt: katas/dynamic_batcher/README.md).
 * Check your work with the Python suite, which builds this file when it imports it:
 *   pytest katas/dynamic_batcher -k hotpath
 * or with the C unit test (then under the sanitizers: --preset sanitize):
 *   cmake --workflow --preset dev
 */
#include "hotpath.h"

int hp_fill_token_budget(hp_int n, const hp_int *need, hp_int token_budget, hp_int max_seqs,
                         hp_int *chunk, hp_int *out_seqs, hp_int *out_tokens) {
    (void)n;
    (void)need;
    (void)token_budget;
    (void)max_seqs;
    (void)chunk;
    (void)out_seqs;
    (void)out_tokens;
    return HP_NOT_IMPLEMENTED;
}

int hp_schedule(hp_state *state, hp_int token_budget, hp_int max_seqs, hp_int *chunk,
                hp_int *out_seqs, hp_int *out_tokens, hp_int *out_preempted) {
    (void)state;
    (void)token_budget;
    (void)max_seqs;
    (void)chunk;
    (void)out_seqs;
    (void)out_tokens;
    (void)out_preempted;
    return HP_NOT_IMPLEMENTED;
}

int hp_apply(hp_state *state, hp_int seqs, const hp_int *chunk, const hp_int *finished) {
    (void)state;
    (void)seqs;
    (void)chunk;
    (void)finished;
    return HP_NOT_IMPLEMENTED;
}
