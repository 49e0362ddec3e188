/* Linears on dense fp32 weights: the fp32 reference path's fixed-order matmul (ops.fixed_order_linear)
   and its decode stack (decode_stack.c), which runs every layer of a small step in one native call.

   Why not torch: a decode step's linears are small matmuls (one row to a few dozen), where each
   torch call off the main thread pays an OpenMP hand-off of ~100 us, so the scheduler runs them on
   one thread and reads the weights at half the memory bandwidth; and no BLAS sums a row in an order
   that does not depend on how many rows came with it. Here every output is x . w summed in 16
   lanes (lane l takes the features k = l mod 16, in order), the lanes added as a fixed tree (halves,
   quarters, eighths, the last pair), then the tail: an order fixed by K alone, whatever the tile,
   the thread count or the row count.

   Speed: the output rows are split over the persistent thread pool (thread_pool.c); a register
   tile of X_ROWS activation rows x W_ROWS weight rows reads each weight vector once per X_ROWS
   rows and each activation vector once per W_ROWS weights. Activations are taken in chunks that
   stay in L2 while every weight tile of the thread's share passes over them, each weight tile
   staying in L1 across the chunk. */
#include "prefetch.h"
#include "q4.h"
#include "thread_pool.h"

typedef float v16 __attribute__((vector_size(64)));

#define X_ROWS 4 /* activation rows per register tile */
#if defined(__AVX512F__)
#define W_ROWS 6 /* weight rows per register tile: 24 accumulators + 4 activation vectors of 32 registers */
#else
#define W_ROWS 2 /* 16 ymm registers: the 8 accumulators are 16 of them already */
#endif
#define CHUNK_BYTES (192 * 1024) /* activations per chunk: within L2 beside the weight tiles */

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* the 16 lanes summed as a fixed tree: halves, quarters, eighths, then the last pair */
static inline float lanes_sum(v16 v) {
    const v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

#if defined(__AVX512F__)
/* lanes_sum of 16 vectors at once, out[t] = lanes_sum(v[t]) bit for bit: each stage adds the same
   lane pairs as lanes_sum, for two vectors per add (their halves, then quarters, eighths and the
   last pair side by side), so 16 sums take 15 adds and 30 shuffles instead of ~8 scalar operations
   each (a 1,024-row matmul of the embedded model's shapes, K = 576 and 1,536: 1.03-1.04x, Zen 4) */
static inline void lanes_sums16(v16 v[16], float out[16]) {
    for (int t = 0; t < 8; t++) /* lanes 0..7: v[2t]'s halves summed, 8..15: v[2t + 1]'s */
        v[t] = __builtin_shufflevector(v[2 * t], v[2 * t + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * t], v[2 * t + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int t = 0; t < 4; t++) /* quarters: lanes 4u..4u + 3 for sum 4t + u */
        v[t] = __builtin_shufflevector(v[2 * t], v[2 * t + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(v[2 * t], v[2 * t + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int t = 0; t < 2; t++) /* q[0] + q[2] and q[1] + q[3]: lanes 2u, 2u + 1 for sum 8t + u */
        v[t] = __builtin_shufflevector(v[2 * t], v[2 * t + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(v[2 * t], v[2 * t + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const v16 sums = __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                     __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    memcpy(out, &sums, sizeof sums);
}

#define TILE_SUMS ((X_ROWS * W_ROWS + 15) / 16 * 16) /* a full tile's sums, padded to whole vectors */

/* sums[i * W_ROWS + j] = lanes_sum(acc[i][j]) for a full tile (the padding's sums are zeros) */
static inline void tile_sums(v16 acc[X_ROWS][W_ROWS], float sums[TILE_SUMS]) {
    for (int t0 = 0; t0 < X_ROWS * W_ROWS; t0 += 16) {
        v16 v[16];
        for (int t = 0; t < 16; t++)
            v[t] = t0 + t < X_ROWS * W_ROWS ? acc[(t0 + t) / W_ROWS][(t0 + t) % W_ROWS] : (v16){0};
        lanes_sums16(v, sums + t0);
    }
}
#endif

/* out[i][j] = x[i] . w[j] for i < xr, j < wr (constants after inlining for the full tile, so the
   sums stay in registers). With `next` (the weight tile after this one, W_ROWS rows of K), its lines
   are asked for alongside: a decode step's few activation rows gave a tile too little arithmetic to
   hide the wait for the next (batch-8 decode steps 1.25x faster on a Zen 5; batch 1 and prefill
   level). The empty volatile asm keeps GCC from dropping the prefetches (see rb_prefetch_floats). */
static inline __attribute__((always_inline)) void dot_tile(const float *const *x, const int xr,
                                                           const float *const *w, const int wr, int64_t K,
                                                           const float *next, float out[X_ROWS][W_ROWS]) {
    v16 acc[X_ROWS][W_ROWS];
    for (int i = 0; i < xr; i++)
        for (int j = 0; j < wr; j++) acc[i][j] = (v16){0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        v16 xv[X_ROWS];
        for (int i = 0; i < xr; i++) xv[i] = load16(x[i] + k);
        if (next) {
            for (int j = 0; j < W_ROWS; j++) rb_prefetch(next + j * K + k);
            __asm__ __volatile__("");
        }
        for (int j = 0; j < wr; j++) {
            v16 wv = load16(w[j] + k);
#if defined(__AVX512F__)
            __asm__("" : "+v"(wv)); /* in a register: folded into every FMA, the load is issued X_ROWS times */
#endif
            for (int i = 0; i < xr; i++) acc[i][j] += xv[i] * wv;
        }
    }
#if defined(__AVX512F__)
    const int summed = xr == X_ROWS && wr == W_ROWS; /* a full tile's sums taken together */
    float sums[TILE_SUMS];
    if (summed) tile_sums(acc, sums);
#else
    const int summed = 0;
    const float *sums = NULL;
#endif
    for (int i = 0; i < xr; i++)
        for (int j = 0; j < wr; j++) {
            float s = summed ? sums[i * W_ROWS + j] : lanes_sum(acc[i][j]);
            for (int64_t t = k; t < K; t++) s += x[i][t] * w[j][t];
            out[i][j] = s;
        }
}

static void full_tile(const float *const *x, const float *const *w, int64_t K, const float *next, float out[X_ROWS][W_ROWS]) {
    if (next) dot_tile(x, X_ROWS, w, W_ROWS, K, next, out);
    else dot_tile(x, X_ROWS, w, W_ROWS, K, NULL, out); /* no fetch test in the loop of every later pass:
                                                          with the sums above 1.07-1.10x at 8-1,024 rows */
}

/* an edge tile: one compiled body per row count, the weight rows padded by repeating the last */
static void edge_tile(const float *const *x, int xr, const float *const *w, int64_t K, const float *next, float out[X_ROWS][W_ROWS]) {
    switch (xr) {
    case 1: dot_tile(x, 1, w, W_ROWS, K, next, out); break;
    case 2: dot_tile(x, 2, w, W_ROWS, K, next, out); break;
    case 3: dot_tile(x, 3, w, W_ROWS, K, next, out); break;
    default: dot_tile(x, X_ROWS, w, W_ROWS, K, next, out); break;
    }
}

typedef struct {
    const rb_q4_weight *w;
    const float *x;
    int64_t M;
    float *y;
} f32_job;

/* rows m0 .. m1 - 1 of the outputs n0 .. n0 + wr - 1 of weight w (its outputs from `base` on) */
static void tile_column(const f32_job *job, const rb_q4_weight *w, int64_t base, int64_t width, int64_t n0, int wr,
                        int64_t m0, int64_t m1) {
    const int64_t K = w->in;
    const float *rows[W_ROWS];
    for (int j = 0; j < W_ROWS; j++) rows[j] = w->dense + (n0 - base + (j < wr ? j : wr - 1)) * K;
    for (int64_t m = m0; m < m1; m += X_ROWS) {
        const int xr = (int)(m1 - m < X_ROWS ? m1 - m : X_ROWS);
        const float *xs[X_ROWS];
        for (int i = 0; i < X_ROWS; i++) xs[i] = job->x + (m + (i < xr ? i : xr - 1)) * K;
        float out[X_ROWS][W_ROWS];
        /* the first pass over the tile fetches the next one (a thread's last asks for lines it will
           not read: harmless, a prefetch never faults) */
        const float *next = m == m0 ? w->dense + (n0 - base + W_ROWS) * K : NULL;
        if (xr == X_ROWS) full_tile(xs, rows, K, next, out);
        else edge_tile(xs, xr, rows, K, next, out);
        for (int i = 0; i < xr; i++)
            for (int j = 0; j < wr; j++)
                job->y[(m + i) * width + n0 + j] = out[i][j] + (w->bias ? w->bias[n0 - base + j] : 0.f);
    }
}

/* this part's share of the chain's output rows, a chunk of activation rows at a time */
static void f32_part(void *ctx, int64_t part, int64_t parts) {
    const f32_job *job = (const f32_job *)ctx;
    const int64_t width = q4_chain_out(job->w), K = job->w->in;
    const int64_t tiles = (width + W_ROWS - 1) / W_ROWS;
    const int64_t first = tiles * part / parts * W_ROWS, last = tiles * (part + 1) / parts * W_ROWS;
    int64_t chunk = CHUNK_BYTES / (K * (int64_t)sizeof(float)) / X_ROWS * X_ROWS;
    if (chunk < X_ROWS) chunk = X_ROWS;
    for (int64_t m0 = 0; m0 < job->M; m0 += chunk) {
        const int64_t m1 = m0 + chunk < job->M ? m0 + chunk : job->M;
        int64_t base = 0; /* the chain's first output row of weight w */
        for (const rb_q4_weight *w = job->w; w; base += w->out, w = w->next) {
            const int64_t lo = first > base ? first : base, end = base + w->out;
            const int64_t hi = last < end ? last : end;
            for (int64_t n0 = lo; n0 < hi; n0 += W_ROWS)
                tile_column(job, w, base, width, n0, (int)(hi - n0 < W_ROWS ? hi - n0 : W_ROWS), m0, m1);
        }
    }
}

/* y [M, N] = x [M, K] @ W^T (+ bias) for a chain of dense weights, the output rows split over
   `threads` threads */
void f32_linear(const rb_q4_weight *w, const float *x, int64_t M, float *y, int64_t threads) {
    f32_job job = {w, x, M, y};
    rb_parallel(f32_part, &job, threads);
}
