/* The dynamic batcher's C hot path: plain C over flat int32 arrays (no Python headers).
 *
 * This header pins the ABI shared by the stub (katas/), the reference (solutions/),
 * the CPython binding (module.c) and the C unit test (test_hotpath.c):
 *   - every per-request column is a flat array of hp_int, one entry per request,
 *     in scheduling order (index 0 is scheduled first);
 *   - every function returns HP_OK, HP_NOT_IMPLEMENTED (the stub) or HP_INVALID,
 *     and on HP_INVALID writes nothing.
 * The Python twin of the batcher runs the same algorithm on the same columns; both must
 * give identical results.
 */
#ifndef KATAS_DYNAMIC_BATCHER_HOTPATH_H
#define KATAS_DYNAMIC_BATCHER_HOTPATH_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One column entry: token counts, request counts and block ids are all int32. */
typedef int32_t hp_int;
#define HP_INT_MAX INT32_MAX

enum {
    HP_OK = 0,
    HP_NOT_IMPLEMENTED = -1, /* the stub: this function is the learner's to write */
    HP_INVALID = -2          /* bad arguments; nothing was written */
};

/* Apply one step's token budget (iteration-level scheduling with chunked prefill).
 *
 * need[i] (>= 1) is how many tokens request i still has to compute: 1 for a decode,
 * the rest of the prompt for a prefill. Requests are served strictly in order: each gets
 * chunk[i] = min(need[i], budget left), and scheduling stops at the first request that
 * would get nothing (budget spent) or once max_seqs requests are scheduled — a request is
 * never skipped for a later, smaller one. Only the last scheduled request can get a
 * partial chunk (its prefill continues next step).
 *
 * Outputs: chunk[i] for every i < n (0 for each request not scheduled), *out_seqs = the
 * number of requests scheduled (always a prefix of the array), *out_tokens = the sum of
 * the chunks (<= token_budget).
 *
 * HP_INVALID when n, token_budget or max_seqs is negative, a pointer is NULL, or some
 * need[i] < 1. chunk must not overlap need.
 */
int hp_fill_token_budget(hp_int n, const hp_int *need, hp_int token_budget, hp_int max_seqs,
                         hp_int *chunk, hp_int *out_seqs, hp_int *out_tokens);

#ifdef __cplusplus
}
#endif

#endif /* KATAS_DYNAMIC_BATCHER_HOTPATH_H */
