/* Linears on dense fp32 weights for the decode stack (decode_stack.c): the fp32 reference path's
   small steps run every layer in one native call, as the low-bit ones do.

   Why not torch: a decode step's linears are small matmuls (one row to a few dozen), where each
   torch call off the main thread pays an OpenMP hand-off of ~100 us, so the scheduler runs them on
   one thread and reads the weights at half the memory bandwidth. Here the output rows are split
   over the persistent thread pool (thread_pool.c), and a register tile of 4 weight rows x 4
   activation rows reads each weight once per 4 activation rows. Sums run in fp32 in 16 lanes (the
   order differs from a BLAS's, as any two BLAS builds' do). */
#include "q4.h"
#include "thread_pool.h"

typedef float v16 __attribute__((vector_size(64)));

#define W_ROWS 4 /* weight rows per register tile */
#define X_ROWS 4 /* activation rows per register tile */

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float lanes_sum(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* out[i][j] = x[i] . w[j] for a full tile: every bound a constant, so the 16 sums stay in registers */
static inline void dot_tile_full(const float *const *x, const float *const *w, int64_t K, float out[X_ROWS][W_ROWS]) {
    v16 acc[X_ROWS][W_ROWS] = {{{0}}};
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const v16 a = load16(w0 + k), b = load16(w1 + k), c = load16(w2 + k), d = load16(w3 + k);
        v16 xv = load16(x0 + k);
        acc[0][0] += xv * a, acc[0][1] += xv * b, acc[0][2] += xv * c, acc[0][3] += xv * d;
        xv = load16(x1 + k);
        acc[1][0] += xv * a, acc[1][1] += xv * b, acc[1][2] += xv * c, acc[1][3] += xv * d;
        xv = load16(x2 + k);
        acc[2][0] += xv * a, acc[2][1] += xv * b, acc[2][2] += xv * c, acc[2][3] += xv * d;
        xv = load16(x3 + k);
        acc[3][0] += xv * a, acc[3][1] += xv * b, acc[3][2] += xv * c, acc[3][3] += xv * d;
    }
    for (int i = 0; i < X_ROWS; i++)
        for (int j = 0; j < W_ROWS; j++) {
            float s = lanes_sum(acc[i][j]);
            for (int64_t t = k; t < K; t++) s += x[i][t] * w[j][t];
            out[i][j] = s;
        }
}

/* the same for an edge tile of `xr` x `wr` (each <= 4) */
static inline void dot_tile(const float *const *x, int xr, const float *const *w, int wr, int64_t K,
                            float out[X_ROWS][W_ROWS]) {
    if (xr == X_ROWS && wr == W_ROWS) {
        dot_tile_full(x, w, K, out);
        return;
    }
    v16 acc[X_ROWS][W_ROWS] = {{{0}}};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        v16 wv[W_ROWS];
        for (int j = 0; j < W_ROWS; j++) wv[j] = j < wr ? load16(w[j] + k) : (v16){0};
        for (int i = 0; i < X_ROWS; i++) {
            if (i >= xr) break;
            const v16 xv = load16(x[i] + k);
            for (int j = 0; j < W_ROWS; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < xr; i++)
        for (int j = 0; j < wr; j++) {
            float s = lanes_sum(acc[i][j]);
            for (int64_t t = k; t < K; t++) s += x[i][t] * w[j][t];
            out[i][j] = s;
        }
}

typedef struct {
    const rb_q4_weight *w;
    const float *x;
    int64_t M;
    float *y;
} f32_job;

/* this part's share of the chain's output rows, tile by tile */
static void f32_part(void *ctx, int64_t part, int64_t parts) {
    const f32_job *job = (const f32_job *)ctx;
    const int64_t width = q4_chain_out(job->w), K = job->w->in;
    const int64_t tiles = (width + W_ROWS - 1) / W_ROWS;
    const int64_t first = tiles * part / parts * W_ROWS, last = tiles * (part + 1) / parts * W_ROWS;
    int64_t base = 0; /* the chain's first output row of weight w */
    for (const rb_q4_weight *w = job->w; w; base += w->out, w = w->next) {
        const int64_t lo = first > base ? first : base, end = base + w->out;
        const int64_t hi = last < end ? last : end;
        for (int64_t n0 = lo; n0 < hi; n0 += W_ROWS) {
            const int wr = (int)(hi - n0 < W_ROWS ? hi - n0 : W_ROWS);
            const float *rows[W_ROWS];
            for (int j = 0; j < W_ROWS; j++) rows[j] = w->dense + (n0 - base + (j < wr ? j : 0)) * K;
            for (int64_t m0 = 0; m0 < job->M; m0 += X_ROWS) {
                const int xr = (int)(job->M - m0 < X_ROWS ? job->M - m0 : X_ROWS);
                const float *xs[X_ROWS];
                for (int i = 0; i < X_ROWS; i++) xs[i] = job->x + (m0 + (i < xr ? i : 0)) * K;
                float out[X_ROWS][W_ROWS];
                dot_tile(xs, xr, rows, wr, K, out);
                for (int i = 0; i < xr; i++)
                    for (int j = 0; j < wr; j++)
                        job->y[(m0 + i) * width + n0 + j] = out[i][j] + (w->bias ? w->bias[n0 - base + j] : 0.f);
            }
        }
    }
}

/* y [M, N] = x [M, K] @ W^T (+ bias) for a chain of dense weights, the output rows split over
   `threads` threads */
void f32_linear(const rb_q4_weight *w, const float *x, int64_t M, float *y, int64_t threads) {
    f32_job job = {w, x, M, y};
    rb_parallel(f32_part, &job, threads);
}
