/* C unit test of the dynamic batcher's hot path (hotpath.h), run by ctest.
 *
 * The same file is linked against the reference (test "hotpath_reference", run by plain
 * `ctest --test-dir build`) and against your csrc/hotpath.c (test "hotpath_kata", run with
 * `ctest --test-dir build -C kata --output-on-failure`). Plain C, no assert(): checks stay
 * on in release builds. Configure with -DKATAS_SANITIZE=ON to run it under ASan+UBSan.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hotpath.h"

static int passed = 0;
static int failed = 0;

#define CHECK(cond, ...)                                                                          \
    do {                                                                                          \
        if (cond) {                                                                               \
            passed++;                                                                             \
        } else {                                                                                  \
            failed++;                                                                             \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                  \
            fprintf(stderr, __VA_ARGS__);                                                         \
            fputc('\n', stderr);                                                                  \
        }                                                                                         \
    } while (0)

#define MAX_N 64
#define SENTINEL ((hp_int)-7777)

static void format_array(char *out, size_t size, const hp_int *a, hp_int n) {
    size_t used = (size_t)snprintf(out, size, "[");
    for (hp_int i = 0; i < n && used < size; i++) {
        used += (size_t)snprintf(out + used, size - used, i ? ", %d" : "%d", (int)a[i]);
    }
    if (used < size) {
        snprintf(out + used, size - used, "]");
    }
}

/* The contract, written as plainly as possible: what the step should grant. */
static void model_fill(hp_int n, const hp_int *need, hp_int budget, hp_int max_seqs,
                       hp_int *chunk, hp_int *seqs, hp_int *tokens) {
    *seqs = 0;
    *tokens = 0;
    for (hp_int i = 0; i < n; i++) {
        hp_int left = budget - *tokens;
        if (*seqs == max_seqs || left == 0) {
            chunk[i] = 0;
            continue;
        }
        chunk[i] = need[i] <= left ? need[i] : left;
        *tokens += chunk[i];
        *seqs += 1;
    }
}

/* Run the implementation on one case and compare everything with the model. */
static void expect_fill(const char *what, hp_int n, const hp_int *need, hp_int budget,
                        hp_int max_seqs) {
    hp_int chunk[MAX_N], want[MAX_N];
    hp_int seqs = SENTINEL, tokens = SENTINEL, want_seqs, want_tokens;
    for (hp_int i = 0; i < MAX_N; i++) {
        chunk[i] = SENTINEL; /* garbage the function must overwrite (or, past n, keep) */
    }
    int rc = hp_fill_token_budget(n, need, budget, max_seqs, chunk, &seqs, &tokens);
    if (rc == HP_NOT_IMPLEMENTED) {
        fprintf(stderr, "not implemented yet: hp_fill_token_budget \xe2\x80\x94 see "
                        "katas/dynamic_batcher/csrc/hotpath.h\n");
        exit(1);
    }
    model_fill(n, need, budget, max_seqs, want, &want_seqs, &want_tokens);
    char need_s[512], got_s[512], want_s[512];
    format_array(need_s, sizeof need_s, need, n);
    format_array(got_s, sizeof got_s, chunk, n);
    format_array(want_s, sizeof want_s, want, n);
    CHECK(rc == HP_OK, "%s: need=%s budget=%d max_seqs=%d: expected HP_OK, got %d", what, need_s,
          (int)budget, (int)max_seqs, rc);
    if (rc != HP_OK) {
        return;
    }
    CHECK(memcmp(chunk, want, (size_t)n * sizeof(hp_int)) == 0,
          "%s: need=%s budget=%d max_seqs=%d: chunks expected %s, got %s", what, need_s,
          (int)budget, (int)max_seqs, want_s, got_s);
    CHECK(seqs == want_seqs && tokens == want_tokens,
          "%s: need=%s budget=%d max_seqs=%d: expected (seqs, tokens) = (%d, %d), got (%d, %d)",
          what, need_s, (int)budget, (int)max_seqs, (int)want_seqs, (int)want_tokens, (int)seqs,
          (int)tokens);
    CHECK(chunk[n < MAX_N ? n : MAX_N - 1] == SENTINEL || n == MAX_N,
          "%s: wrote past the end of chunk (n=%d)", what, (int)n);
}

static void test_examples(void) {
    /* A long prefill takes the whole budget: it gets a partial chunk, nothing after it. */
    const hp_int prefill_first[] = {5, 1, 1};
    expect_fill("partial chunk clamped to the budget", 3, prefill_first, 4, 8);
    /* Decodes (1 token each) up to the sequence cap. */
    const hp_int decodes[] = {1, 1, 1, 1};
    expect_fill("max_seqs caps the batch", 4, decodes, 10, 3);
    /* Exactly enough budget: everyone scheduled, nothing left. */
    const hp_int exact[] = {3, 2};
    expect_fill("exact fit", 2, exact, 5, 2);
    /* FCFS: a small request behind a big one waits, even if it would fit. */
    const hp_int big_then_small[] = {8, 1};
    expect_fill("no skipping ahead", 2, big_then_small, 8, 4);
    /* Decodes first, then a prefill chunk with the rest. */
    const hp_int mixed[] = {1, 1, 100, 7};
    expect_fill("decodes then a prefill chunk", 4, mixed, 10, 4);
    expect_fill("zero budget schedules nothing", 4, mixed, 0, 4);
    expect_fill("zero max_seqs schedules nothing", 4, mixed, 10, 0);
    expect_fill("no requests", 0, mixed, 10, 4);
}

static void test_explicit_values(void) {
    /* The model above could share a misreading with the implementation: pin a few values. */
    const hp_int need[] = {1, 1, 100, 7};
    hp_int chunk[4] = {9, 9, 9, 9}, seqs = 0, tokens = 0;
    if (hp_fill_token_budget(4, need, 10, 4, chunk, &seqs, &tokens) == HP_OK) {
        CHECK(chunk[0] == 1 && chunk[1] == 1 && chunk[2] == 8 && chunk[3] == 0,
              "need=[1, 1, 100, 7] budget=10: chunks expected [1, 1, 8, 0], got [%d, %d, %d, %d]",
              (int)chunk[0], (int)chunk[1], (int)chunk[2], (int)chunk[3]);
        CHECK(seqs == 3 && tokens == 10, "expected (3, 10), got (%d, %d)", (int)seqs,
              (int)tokens);
    } else {
        CHECK(0, "need=[1, 1, 100, 7] budget=10: expected HP_OK");
    }
    hp_int seqs0 = -1, tokens0 = -1;
    CHECK(hp_fill_token_budget(0, NULL, 5, 5, NULL, &seqs0, &tokens0) == HP_OK &&
              seqs0 == 0 && tokens0 == 0,
          "n=0 with NULL arrays: expected HP_OK and (0, 0), got (%d, %d)", (int)seqs0,
          (int)tokens0);
}

/* Bad arguments return HP_INVALID and leave every output untouched. */
static void expect_invalid(const char *what, hp_int n, const hp_int *need, hp_int budget,
                           hp_int max_seqs) {
    hp_int chunk[MAX_N], seqs = SENTINEL, tokens = SENTINEL;
    for (hp_int i = 0; i < MAX_N; i++) {
        chunk[i] = SENTINEL;
    }
    int rc = hp_fill_token_budget(n, need, budget, max_seqs, chunk, &seqs, &tokens);
    CHECK(rc == HP_INVALID, "%s: expected HP_INVALID (%d), got %d", what, HP_INVALID, rc);
    int untouched = seqs == SENTINEL && tokens == SENTINEL;
    for (hp_int i = 0; i < MAX_N; i++) {
        untouched = untouched && chunk[i] == SENTINEL;
    }
    CHECK(untouched, "%s: an invalid call must write nothing", what);
}

static void test_invalid_arguments(void) {
    const hp_int ok[] = {2, 3, 1};
    const hp_int zero_late[] = {2, 3, 0};
    const hp_int negative[] = {-1, 3};
    expect_invalid("negative token_budget", 3, ok, -1, 4);
    expect_invalid("negative max_seqs", 3, ok, 4, -1);
    expect_invalid("negative n", -1, ok, 4, 4);
    expect_invalid("need[2] == 0, past where the budget runs out", 3, zero_late, 2, 4);
    expect_invalid("negative need", 2, negative, 4, 4);
    hp_int chunk[3], seqs, tokens;
    CHECK(hp_fill_token_budget(3, NULL, 4, 4, chunk, &seqs, &tokens) == HP_INVALID,
          "need == NULL with n > 0: expected HP_INVALID");
    CHECK(hp_fill_token_budget(3, ok, 4, 4, NULL, &seqs, &tokens) == HP_INVALID,
          "chunk == NULL with n > 0: expected HP_INVALID");
    CHECK(hp_fill_token_budget(3, ok, 4, 4, chunk, NULL, &tokens) == HP_INVALID,
          "out_seqs == NULL: expected HP_INVALID");
}

/* Deterministic pseudo-random cases (xorshift32, fixed seed) against the model. */
static uint32_t rng_state = 2463534242u;

static uint32_t next_random(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}

static void test_random_against_model(void) {
    hp_int need[MAX_N];
    int failed_before = failed;
    for (int round = 0; round < 20000 && failed == failed_before; round++) {
        hp_int n = (hp_int)(next_random() % (MAX_N + 1));
        for (hp_int i = 0; i < n; i++) {
            /* Mostly decodes and short prompts, sometimes a long prefill. */
            need[i] = (hp_int)(next_random() % 4 == 0 ? 1 + next_random() % 600
                                                      : 1 + next_random() % 3);
        }
        hp_int budget = (hp_int)(next_random() % 5 == 0 ? next_random() % 4 : next_random() % 900);
        hp_int max_seqs = (hp_int)(next_random() % (MAX_N + 8));
        expect_fill("random case", n, need, budget, max_seqs);
    }
    /* Large values: nothing overflows near INT32_MAX. */
    const hp_int huge[] = {HP_INT_MAX, HP_INT_MAX, 1};
    expect_fill("entries at INT32_MAX", 3, huge, HP_INT_MAX, HP_INT_MAX);
    const hp_int ones[] = {1, 1, 1};
    expect_fill("budget at INT32_MAX", 3, ones, HP_INT_MAX, HP_INT_MAX);
    /* A sum of granted tokens and the next need would overflow int32 here: count the
     * budget down, never add up past it. */
    const hp_int small_then_huge[] = {1, HP_INT_MAX};
    expect_fill("a sum past INT32_MAX", 2, small_then_huge, HP_INT_MAX, 4);
}

static int same(const hp_int *a, const hp_int *b, size_t n) {
    return memcmp(a, b, n * sizeof(hp_int)) == 0;
}

/* hp_schedule: row 1 needs a block with none free, so row 2 gives way (it holds none),
 * then row 1 itself; row 0 keeps the block it took. Then a broken state, refused. */
static void test_schedule(void) {
    hp_int known[] = {5, 3, 1}, computed[] = {4, 2, 0}, held[] = {2, 1, 0};
    hp_int table[] = {0, 1, 0, 2, 0, 0, 0, 0, 0}, free_ids[] = {3, 0, 0, 0};
    hp_int chunk[] = {SENTINEL, SENTINEL, SENTINEL};
    hp_state s = {3, 3, 3, 2, 4, 1, known, computed, held, table, free_ids};
    hp_int seqs = SENTINEL, tokens = SENTINEL, preempted = SENTINEL;
    int rc = hp_schedule(&s, 10, 4, chunk, &seqs, &tokens, &preempted);
    if (rc == HP_NOT_IMPLEMENTED) {
        fprintf(stderr, "not implemented yet: hp_schedule \xe2\x80\x94 see "
                        "katas/dynamic_batcher/csrc/hotpath.h\n");
        exit(1);
    }
    CHECK(rc == HP_OK, "schedule, its own victim: expected HP_OK, got %d", rc);
    const hp_int want_chunk[] = {1, 0, 0}, want_held[] = {3, 0, 0}, want_computed[] = {4, 0, 0};
    const hp_int want_table[] = {0, 1, 3, 2, 0, 0, 0, 0, 0};
    CHECK(seqs == 1 && tokens == 1 && preempted == 2,
          "schedule, its own victim: expected (seqs, tokens, preempted) = (1, 1, 2), got "
          "(%d, %d, %d)", (int)seqs, (int)tokens, (int)preempted);
    CHECK(s.n == 1 && s.free_top == 1 && free_ids[0] == 2,
          "schedule, its own victim: expected n = 1 and block 2 back on the free stack, got "
          "n = %d, free_top = %d, free_ids[0] = %d", (int)s.n, (int)s.free_top,
          (int)free_ids[0]);
    CHECK(same(chunk, want_chunk, 3) && same(held, want_held, 3) &&
              same(computed, want_computed, 3) && same(table, want_table, 9),
          "schedule, its own victim: chunk, held, computed or table differ from the contract");

    hp_int bad_computed[] = {5, 2, 0}; /* computed == known: nothing left to schedule */
    hp_int before[9];
    memcpy(before, table, sizeof before);
    hp_state broken = {3, 3, 3, 2, 4, 1, known, bad_computed, held, table, free_ids};
    chunk[0] = SENTINEL;
    rc = hp_schedule(&broken, 10, 4, chunk, &seqs, &tokens, &preempted);
    CHECK(rc == HP_INVALID && chunk[0] == SENTINEL && same(table, before, 9),
          "schedule with computed[0] == known[0]: expected HP_INVALID and nothing written, "
          "got %d", rc);
}

/* hp_schedule with blocks to spare: every row gets its chunk and the blocks it misses,
 * popped from the top of the stack in order; nobody is preempted. */
static void test_schedule_with_blocks_to_spare(void) {
    hp_int known[] = {3, 8}, computed[] = {2, 0}, held[] = {1, 0};
    hp_int table[] = {9, 0, 0, 0, 0, 0}, free_ids[] = {4, 5, 6, 7, 0};
    hp_int chunk[] = {SENTINEL, SENTINEL};
    hp_state s = {2, 2, 3, 3, 5, 4, known, computed, held, table, free_ids};
    hp_int seqs = SENTINEL, tokens = SENTINEL, preempted = SENTINEL;
    int rc = hp_schedule(&s, 6, 4, chunk, &seqs, &tokens, &preempted);
    const hp_int want_chunk[] = {1, 5}, want_held[] = {1, 2}, want_table[] = {9, 0, 0, 7, 6, 0};
    CHECK(rc == HP_OK && seqs == 2 && tokens == 6 && preempted == 0 && s.n == 2 &&
              s.free_top == 2 && same(chunk, want_chunk, 2) && same(held, want_held, 2) &&
              same(table, want_table, 6),
          "schedule with blocks to spare: expected chunks [1, 5], row 1 taking blocks 7 then "
          "6 and no preemption; got rc %d, (seqs, tokens, preempted) = (%d, %d, %d), n = %d, "
          "free_top = %d", rc, (int)seqs, (int)tokens, (int)preempted, (int)s.n,
          (int)s.free_top);
}

/* hp_apply after a schedule of rows 0-2 (block_size 2): row 0 samples at its table row's
 * end and finishes, row 1 samples and goes on, row 2 (a partial prefill) is aborted, row 3
 * was not scheduled. Then a flag other than 0 or 1, refused. */
static void test_apply(void) {
    hp_int known[] = {6, 3, 6, 2}, computed[] = {3, 2, 0, 1}, held[] = {3, 2, 1, 1};
    hp_int table[] = {1, 2, 8, 3, 4, 0, 5, 0, 0, 6, 0, 0}, free_ids[] = {7, 0, 0, 0, 0, 0, 0, 0};
    const hp_int chunk[] = {3, 1, 2, 0}, finished[] = {1, 0, 1, 0}, bad[] = {1, 0, 2, 0};
    hp_state s = {4, 4, 3, 2, 8, 1, known, computed, held, table, free_ids};
    int rc = hp_apply(&s, 3, chunk, bad);
    if (rc == HP_NOT_IMPLEMENTED) {
        fprintf(stderr, "not implemented yet: hp_apply \xe2\x80\x94 see "
                        "katas/dynamic_batcher/csrc/hotpath.h\n");
        exit(1);
    }
    CHECK(rc == HP_INVALID && s.n == 4 && s.free_top == 1 && computed[0] == 3 && known[1] == 3,
          "apply with finished[2] == 2: expected HP_INVALID and nothing written, got %d", rc);
    rc = hp_apply(&s, 3, chunk, finished);
    const hp_int want_known[] = {4, 2}, want_computed[] = {3, 1}, want_held[] = {2, 1};
    const hp_int want_free[] = {7, 8, 2, 1, 5};
    CHECK(rc == HP_OK && s.n == 2 && s.free_top == 5 && same(known, want_known, 2) &&
              same(computed, want_computed, 2) && same(held, want_held, 2) &&
              table[0] == 3 && table[1] == 4 && table[3] == 6 && same(free_ids, want_free, 5),
          "apply: expected rows 1 and 3 moved down to 0 and 1 (known [4, 2], computed [3, 1], "
          "blocks [3, 4] and [6]) and the stack 7, 8, 2, 1, 5; got rc %d, n = %d, free_top = "
          "%d", rc, (int)s.n, (int)s.free_top);
}

/* The int32 edge: a row a token short of INT32_MAX in one block of INT32_MAX tokens. Its
 * last token needs no new block (ceil without the overflow of tokens + block_size - 1);
 * apply refuses to let it go on past INT32_MAX, and releases it when it finishes. */
static void test_int32_edge(void) {
    hp_int known[] = {HP_INT_MAX}, computed[] = {HP_INT_MAX - 1}, held[] = {1};
    hp_int table[] = {0}, free_ids[] = {0};
    hp_int chunk[] = {SENTINEL};
    hp_state s = {1, 1, 1, HP_INT_MAX, 1, 0, known, computed, held, table, free_ids};
    hp_int seqs = SENTINEL, tokens = SENTINEL, preempted = SENTINEL;
    int rc = hp_schedule(&s, HP_INT_MAX, HP_INT_MAX, chunk, &seqs, &tokens, &preempted);
    CHECK(rc == HP_OK && chunk[0] == 1 && seqs == 1 && tokens == 1 && preempted == 0 &&
              held[0] == 1 && s.free_top == 0,
          "schedule at INT32_MAX: expected chunk [1] and no new block, got rc %d, chunk %d, "
          "held %d, free_top %d", rc, (int)chunk[0], (int)held[0], (int)s.free_top);
    const hp_int go_on[] = {0}, stop[] = {1};
    rc = hp_apply(&s, 1, chunk, go_on);
    CHECK(rc == HP_INVALID && known[0] == HP_INT_MAX && computed[0] == HP_INT_MAX - 1,
          "apply that would take known past INT32_MAX: expected HP_INVALID and nothing "
          "written, got %d", rc);
    rc = hp_apply(&s, 1, chunk, stop);
    CHECK(rc == HP_OK && s.n == 0 && s.free_top == 1 && free_ids[0] == 0,
          "apply finishing the row at INT32_MAX: expected n = 0 and its block freed, got rc "
          "%d, n = %d, free_top = %d", rc, (int)s.n, (int)s.free_top);
}

int main(void) {
    test_examples();
    test_explicit_values();
    test_invalid_arguments();
    test_random_against_model();
    test_schedule();
    test_schedule_with_blocks_to_spare();
    test_apply();
    test_int32_edge();
    printf("hotpath: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
