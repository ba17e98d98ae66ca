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
 * need[i] < 1; need and chunk may be NULL when n == 0 (nothing to read or write): HP_OK,
 * with (0, 0). chunk must not overlap need.
 */
int hp_fill_token_budget(hp_int n, const hp_int *need, hp_int token_budget, hp_int max_seqs,
                         hp_int *chunk, hp_int *out_seqs, hp_int *out_tokens);

/* The running requests' KV bookkeeping, struct of arrays: row i is the i-th running request
 * in admission order (row n - 1 the most recently admitted), and every column has `rows`
 * entries, of which the first `n` are in use.
 *   known[i]     tokens the request knows (prompt + tokens produced), >= 1
 *   computed[i]  tokens written to its KV, 0 <= computed[i] < known[i]
 *   held[i]      blocks it holds: exactly ceil(computed[i] / block_size)
 *   table        the block table, `stride` entries a row: row i's blocks are
 *                table[i * stride + 0 .. held[i]), in token order;
 *                ceil(known[i] / block_size) <= stride
 *   free_ids     the free-block stack of the pool's `num_blocks` entries: the free ids are
 *                free_ids[0 .. free_top), and free_ids[free_top - 1] is taken next;
 *                free_top + (blocks held by rows 0 .. n) <= num_blocks
 */
typedef struct {
    hp_int rows, n, stride, block_size, num_blocks, free_top;
    hp_int *known, *computed, *held, *table, *free_ids;
} hp_state;

/* Schedule the running requests for one step, blocks included (schedule + apply of
 * vLLM's scheduler, for the requests already running).
 *
 * Row by row in order, as hp_fill_token_budget does (the same budget rule and the same
 * cap), request i is granted chunk[i] = min(known[i] - computed[i], budget left) and the
 * blocks its KV then needs: ceil((computed[i] + chunk[i]) / block_size) - held[i] more,
 * popped from the free stack into its table row in order. When the stack has too few,
 * the most recently admitted running row (row n - 1) is preempted until it has enough:
 * its blocks are pushed back last block first (so its first block is on top), its
 * computed and held become 0, and n shrinks by one. If the row that needs the blocks is
 * itself preempted, scheduling ends there.
 *
 * Outputs: chunk[i] for every i < rows (0 for each row not scheduled); *out_seqs rows
 * scheduled (always rows 0 .. *out_seqs); *out_tokens their chunks' sum; *out_preempted
 * rows preempted, which are rows state->n .. state->n + *out_preempted of the updated
 * state, the first preempted last (their known[] left as it was). The state's n,
 * free_top, computed (preempted rows only), held, table and free_ids are updated;
 * computed[] of a scheduled row is not: the step computes its chunk after this call.
 *
 * HP_INVALID, writing nothing, when a pointer is NULL (an array with no entries, as chunk
 * when rows == 0, may be), a count is out of range, or a row breaks the layout above.
 */
int hp_schedule(hp_state *state, hp_int token_budget, hp_int max_seqs, hp_int *chunk,
                hp_int *out_seqs, hp_int *out_tokens, hp_int *out_preempted);

/* Apply one step's outcome to the running rows (after hp_schedule and the forward pass).
 *
 * Rows 0 .. seqs were scheduled with chunk[i] >= 1 (their blocks already cover it): each
 * computes it, computed[i] += chunk[i], and a row whose computed then reaches known[i]
 * has sampled its next token: if it goes on, known[i] += 1. Then every row i < n with
 * finished[i] == 1 is released, rows in order, each pushing its blocks back last block
 * first, and the rows left move down in order (known, computed, held and their table
 * row), so that rows 0 .. the new n are the unfinished ones in their old order. Entries
 * past the new n, and table entries past a row's held, are left unspecified.
 *
 * The state's n, free_top, known, computed, held, table and free_ids are updated.
 *
 * HP_INVALID, writing nothing, when a pointer is NULL (chunk may be when seqs == 0, and
 * finished when n == 0), seqs is not in [0, n], a flag is
 * neither 0 nor 1, or a row breaks the layout of hp_state with its chunk counted:
 * chunk[i] >= 1 and computed[i] + chunk[i] <= known[i] for a scheduled row, held[i] ==
 * ceil((computed[i] + its chunk) / block_size), and a row that samples and is not
 * finished must still fit its table row (ceil((known[i] + 1) / block_size) <= stride)
 * with known[i] + 1 in range.
 */
int hp_apply(hp_state *state, hp_int seqs, const hp_int *chunk, const hp_int *finished);

#ifdef __cplusplus
}
#endif

#endif /* KATAS_DYNAMIC_BATCHER_HOTPATH_H */
