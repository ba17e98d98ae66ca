/* The dynamic batcher's C hot path — yours to write (see hotpath.h for the contract).
 *
 * TODO(hotpath): implement every function below. Check your work with the C unit test:
 *   cmake -S . -B build && cmake --build build && ctest --test-dir build -C kata
 * (the rest of the dynamic-batcher kata, its prompt and Python suite, is coming).
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
