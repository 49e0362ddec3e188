/* The LM head for rows that only need their argmax (greedy picks): the exact head (16-bit
   activations, q4_matmul.c) costs about twice the 8-bit one, yet only the few outputs that may be
   the largest decide the token. So every output is computed with 8-bit activations, each with a
   bound on its distance from the 16-bit value, and only the blocks of 16 outputs that may hold the
   row's maximum are computed again at 16 bits, in place, exactly as the full head computes them.

   The bound. Per group g of 32 input features a row's activations x are rounded to s * q with
   |x - s q| <= 0.51 s (round to nearest; the scale's own rounding adds < 0.01), s8 = amax / 127
   and s16 = amax / Q16_MAX. For output row j with group weights w, |8-bit - 16-bit| over the group
   is at most sum |w| * 0.51 * (s8 + s16), plus both products' float rounding: each group adds at
   most 4 terms of magnitude <= 32 * (|scale| * largest code + |minimum|) * amax to a sum of 4G
   terms, i.e. (4G + 8) * 2^-24 of that per product. Both are a factor f[j, g] of s8[g], so the
   distance is at most sum_g f[j, g] s8[g] <= cap * sum_g f[j, g] + sum_top (s8[g] - cap) * (the
   largest f[., g] of j's block of 16), cap the row's 9th-largest s8 and `top` its 8 largest
   groups: the table keeps those two factors. err_j is that plus a few ulps of the 8-bit value (for
   the rounding of err and of the sums below), so lower_j = y8_j - err_j <= y16_j <= y8_j + err_j
   = upper_j.

   The pick. thr = max_j lower_j <= max_j y16_j. An output with upper_j < thr is below the maximum,
   and so is its 8-bit value; every block holding an output with upper_j >= thr is recomputed at 16
   bits. The row's argmax over the result (ties: the first) is then the full 16-bit head's. A row
   with any non-finite bound is recomputed whole. */
#include "prefetch.h"
#include "q4.h"
#include "q16.h"
#include "thread_pool.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the table: per block of 16 output rows, 16 + G floats: each row's bound factor of s8 summed
   over the groups, then per group the largest factor of the block's rows ---- */

typedef struct {
    const rb_q4_weight *w;
    float *table;
} table_job;

static void table_part(void *ctx, int64_t part, int64_t parts) {
    const table_job *job = (const table_job *)ctx;
    const rb_q4_weight *w = job->w;
    const int64_t G = w->in / 32, blocks = w->out / Q4_ROWS, stride = q4_param_stride(w);
    const int hb = w->high_bits, kind = w->params_kind, S = w->layout == Q4_SCALE_OFFSET ? 1 : 2;
    const double top_code = (double)((1 << (4 + hb)) - 1), off = w->offset;
    const double rounding = (4.0 * (double)G + 8.0) * ldexp(1.0, -24);
    for (int64_t b = blocks * part / parts; b < blocks * (part + 1) / parts; b++) {
        const uint8_t *params = (const uint8_t *)w->params + b * G * stride;
        const _Float16 *super = w->super ? w->super + b * (G / 8) * 2 * Q4_ROWS : NULL;
        double sums[Q4_ROWS] = {0};
        float *table = job->table + b * (Q4_ROWS + G);
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *codes = w->codes + (b * G + g) * 4 * Q4_ROWS * 4;
            const uint8_t *high = hb ? w->high + (b * G + g) * hb * 64 : NULL;
            double block_max = 0.0;
            for (int r = 0; r < Q4_ROWS; r++) {
                double first = q4_param(params + g * stride, kind, r);
                double second = S == 2 ? q4_param(params + g * stride, kind, Q4_ROWS + r) : first;
                if (kind == Q4_PARAMS_K) {
                    first *= (double)super[(g / 8) * 2 * Q4_ROWS + r];
                    second *= (double)super[(g / 8) * 2 * Q4_ROWS + Q4_ROWS + r];
                }
                double weights = 0.0, terms = 0.0;
                for (int f = 0; f < 32; f++) {
                    const double code = q4_code(codes, high, hb, r, f);
                    const double scale = w->layout == Q4_SCALE16_OFFSET && f >= 16 ? second : first;
                    const double minimum = w->layout == Q4_SCALE_MIN ? second : -scale * off;
                    weights += fabs(scale * code + minimum);
                    terms += fabs(scale) * top_code + fabs(minimum);
                }
                const double factor = weights * 0.51 * (1.0 + (double)Q8_MAX / Q16_MAX)
                                    + 2.0 * rounding * terms * Q8_MAX;
                sums[r] += factor * 1.001;
                block_max = factor * 1.001 > block_max ? factor * 1.001 : block_max;
            }
            table[Q4_ROWS + g] = (float)(block_max * 1.000001);
        }
        for (int r = 0; r < Q4_ROWS; r++) table[r] = (float)(sums[r] * 1.000001);
    }
}

int rb_q4_screen_table(const rb_q4_weight *w, float *table, int64_t threads) {
    if (w->next || w->dense) return -2;
    table_job job = {w, table};
    rb_parallel(table_part, &job, threads);
    return 0;
}

/* ---- the screened product ---- */


/* A row's s8 bounded by a cap for all groups but its TOP largest, those by the cap plus their
   excess: err = cap * (a row's factors summed) + sum_top excess * (the block's largest factor of the
   group), one vector multiply-add and TOP scalar ones per block instead of one vector one per group.
   The groups' largest activations vary (an outlier channel), the rest are alike. */
#define TOP 8
typedef struct {
    float cap, excess[TOP];
    int32_t group[TOP];
} row_scales;

/* row m's G group scales s8[g] (in q8), as the bound needs them */
static void row_scales_of(const q4_activations *q8, int64_t m, int64_t G, row_scales *out) {
    float top[TOP + 1];
    int32_t at[TOP + 1];
    int n = 0;
    for (int64_t g = 0; g < G; g++) { /* the TOP + 1 largest, in decreasing order */
        const float s8 = q8->scale[q4_group_index(m, g, G, q8->row_tile)];
        int k = n < TOP + 1 ? n++ : TOP + 1;
        if (k == TOP + 1 && !(s8 > top[TOP])) continue;
        if (k == TOP + 1) k = TOP;
        while (k > 0 && s8 > top[k - 1]) top[k] = top[k - 1], at[k] = at[k - 1], k--;
        top[k] = s8, at[k] = (int32_t)g;
    }
    out->cap = n == TOP + 1 ? top[TOP] : 0.f;
    for (int k = 0; k < TOP; k++) {
        out->group[k] = k < n ? at[k] : 0;
        out->excess[k] = k < n ? top[k] - out->cap : 0.f;
    }
}

typedef float lanes16 __attribute__((vector_size(64), aligned(4))); /* one block's outputs */
typedef int32_t ilanes16 __attribute__((vector_size(64), aligned(4)));

typedef struct {
    const rb_q4_weight *w;
    const float *table;
    const q4_activations *q8, *q16;
    const row_scales *rows;
    int64_t M, valid; /* outputs past `valid` (the packing's padding) are never picked */
    int64_t parts;    /* asked for: the pool may run fewer (the others' thresholds stay -inf) */
    float *y;
    uint8_t *maybe; /* [M, blocks]: an upper bound of the block reached its part's threshold so far */
    float *upper;   /* [M, blocks]: where `maybe`, the block's largest upper bound */
    float *thr;     /* [M, parts]: each part's largest lower bound (NAN: a bound was not finite) */
    lanes16 *state; /* [parts, M, 2]: a part's running largest lower bounds and finiteness check */
} screen_job;

static inline lanes16 lanes_vmax(lanes16 a, lanes16 b) {
    const ilanes16 m = a > b;
    return (lanes16)((m & (ilanes16)a) | (~m & (ilanes16)b));
}

static inline float lanes_max(lanes16 v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)v);
#else
    float top = v[0];
    for (int r = 1; r < 16; r++) top = v[r] > top ? v[r] : top;
    return top;
#endif
}

static inline float lanes_sum(lanes16 v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#else
    float total = 0.f;
    for (int r = 0; r < 16; r++) total += v[r];
    return total;
#endif
}

static inline int lanes_any_ge(lanes16 v, float t) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(t), _CMP_GE_OQ) != 0;
#else
    int any = 0;
    for (int r = 0; r < 16; r++) any |= v[r] >= t;
    return any;
#endif
}

/* After the 8-bit matmul wrote a tile (rows m0.. of one block): each row's bounds. A block is marked
   `maybe` when an upper bound reaches the largest lower bound its part has seen so far (reduced only
   then: it only grows towards the row's threshold), so most tiles cost a compare and a lane-wise max. */
static void bound_tile(void *ctx, int64_t part, int64_t b, int64_t m0, int64_t rows) {
    const screen_job *job = (const screen_job *)ctx;
    const rb_q4_weight *w = job->w;
    const int64_t G = w->in / 32, blocks = w->out / Q4_ROWS, M = job->M;
    const lanes16 zero = {0}, ulps = zero + 0x1p-20f, none = zero - INFINITY;
    const ilanes16 magnitude = (ilanes16){0} + 0x7FFFFFFF, lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    lanes16 *running = job->state + part * M * 2; /* per row: largest lower bounds, finiteness check */
    const float *factors = job->table + b * (Q4_ROWS + G);
    const int padded = job->valid < (b + 1) * Q4_ROWS;
    const ilanes16 padding = lane >= (int32_t)(padded ? job->valid - b * Q4_ROWS : 16);
    lanes16 sums;
    memcpy(&sums, factors, sizeof sums);
    for (int64_t m = m0; m < m0 + rows; m++) {
        const row_scales *rs = job->rows + m;
        float excess = 0.f;
        for (int k = 0; k < TOP; k++) excess += factors[Q4_ROWS + rs->group[k]] * rs->excess[k];
        lanes16 v, err = sums * rs->cap + excess;
        memcpy(&v, job->y + m * w->out + b * Q4_ROWS, sizeof v);
        err += (lanes16)((ilanes16)v & magnitude) * ulps; /* |v| */
        lanes16 lower = v - err, upper = v + err;
        running[2 * m + 1] += (upper - lower) * zero; /* NaN once a bound is not finite */
        if (padded) {
            lower = (lanes16)((padding & (ilanes16)none) | (~padding & (ilanes16)lower));
            upper = (lanes16)((padding & (ilanes16)none) | (~padding & (ilanes16)upper));
        }
        running[2 * m] = lanes_vmax(running[2 * m], lower);
        float *thr = job->thr + m * job->parts + part;
        if (lanes_any_ge(upper, *thr)) {
            const float top = lanes_max(running[2 * m]);
            *thr = top > *thr ? top : *thr;
            if (lanes_any_ge(upper, *thr)) job->maybe[m * blocks + b] = 1, job->upper[m * blocks + b] = lanes_max(upper);
        }
    }
}

/* each row's blocks that may hold its maximum, again at 16 bits (every block if a bound was not
   finite); the next block's codes are fetched while one is computed */
static inline int exact_needed(const screen_job *job, int64_t at, float thr, int whole) {
    return whole || (job->maybe[at] && job->upper[at] >= thr);
}

static void exact_part(void *ctx, int64_t part, int64_t parts) {
    const screen_job *job = (const screen_job *)ctx;
    const rb_q4_weight *w = job->w;
    const int64_t blocks = w->out / Q4_ROWS, block_bytes = (w->in / 32) * 4 * Q4_ROWS * 4;
    const int64_t high_bytes = (w->in / 32) * w->high_bits * 64;
    for (int64_t m = job->M * part / parts; m < job->M * (part + 1) / parts; m++) {
        float thr = -INFINITY;
        int whole = 0;
        for (int64_t p = 0; p < job->parts; p++) { /* every part's largest lower bound and check */
            const lanes16 *running = job->state + (p * job->M + m) * 2;
            const float seen = job->thr[m * job->parts + p], top = lanes_max(running[0]);
            whole |= isnan(lanes_sum(running[1]));
            thr = seen > thr ? seen : thr;
            thr = top > thr ? top : thr;
        }
        int64_t b = 0;
        while (b < blocks && !exact_needed(job, m * blocks + b, thr, whole)) b++;
        while (b < blocks) {
            int64_t next = b + 1;
            while (next < blocks && !exact_needed(job, m * blocks + next, thr, whole)) next++;
            if (next < blocks) {
                for (int64_t at = 0; at < block_bytes; at += 64) rb_prefetch(w->codes + next * block_bytes + at);
                for (int64_t at = 0; at < high_bytes; at += 64) rb_prefetch(w->high + next * high_bytes + at);
            }
            q4_block_rows(w, b, job->q16, m, 1, job->y + m * w->out + b * Q4_ROWS);
            b = next;
        }
    }
}

int rb_q4_screened(const rb_q4_weight *w, const float *table, const float *x, int64_t M, int64_t valid,
                   float *y, int64_t threads) {
    if (w->next || w->dense || valid < 1 || valid > w->out || M < 1) return -2;
    const int64_t G = w->in / 32, blocks = w->out / Q4_ROWS, parts = threads < 1 ? 1 : threads;
    const size_t state = sizeof(lanes16) * 2 * (size_t)(parts * M), upper = sizeof(float) * (size_t)(M * blocks);
    const size_t thr = sizeof(float) * (size_t)(M * parts), scales = sizeof(row_scales) * (size_t)M;
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, ((state + upper + thr + scales + (size_t)(M * blocks)) / 64 + 1) * 64);
    q4_activations q8, q16;
    int failed = !scratch;
    if (!failed && q4_activations_alloc(&q8, M, w->in, 1)) failed = 1;
    else if (!failed && q4_activations_alloc(&q16, M, w->in, 2)) {
        q4_activations_free(&q8);
        failed = 1;
    }
    if (failed) {
        free(scratch);
        return -1;
    }
    screen_job job = {w, table, &q8, &q16, (const row_scales *)(scratch + state + upper + thr), M, valid, parts, y,
                      scratch + state + upper + thr + scales, (float *)(scratch + state),
                      (float *)(scratch + state + upper), (lanes16 *)scratch};
    memset(job.maybe, 0, (size_t)(M * blocks));
    const lanes16 zero = {0};
    for (int64_t i = 0; i < M * parts; i++) job.thr[i] = -INFINITY;
    for (int64_t i = 0; i < M * parts; i++) job.state[2 * i] = zero - INFINITY, job.state[2 * i + 1] = zero;
    q4_quantize(x, M, w->in, &q8, threads);
    q4_quantize(x, M, w->in, &q16, threads);
    for (int64_t m = 0; m < M; m++) row_scales_of(&q8, m, G, (row_scales *)job.rows + m);
    q4_linear_hooked(w, &q8, M, y, parts, bound_tile, &job);
    rb_parallel(exact_part, &job, M < parts ? M : parts);
    q4_activations_free(&q16);
    q4_activations_free(&q8);
    free(scratch);
    return 0;
}
