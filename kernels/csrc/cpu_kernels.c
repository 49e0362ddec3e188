/* radix-backend's native CPU kernels (fp32), loaded through ctypes by kernels/native.py.

   Why native: a decode step on a CPU runs ~30 small torch ops per layer, each with its own
   dispatch and allocation, and its attention gathered every request's K/V out of the paged pool
   before the product. These kernels read the pool in place through the slot table and fuse the
   small element-wise ops. Plain C (no Python or torch headers) so that it compiles in well under
   a second with the system compiler; the compiler vectorizes the `omp simd` loops for the CPU it
   runs on (-march=native). */
#include "cpu_kernels.h"
#include "fast_exp.h"
#include "thread_pool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_AHEAD 4 /* key rows */
#define SPLIT_MIN_KEYS 256 /* a request's keys are split over threads only in pieces at least this long */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *kv_indices, *starts, *lens;
    int64_t batch, hkv, group, dim;
    float scale;
    float *out, *lse;
    _Atomic int failed;
} decode_job;

/* One request: all its query heads against its keys, reading each K/V row of the pool once. */
static inline __attribute__((always_inline)) void decode_request_dim(
        const decode_job *a, int64_t b, float *restrict scores, const int64_t D) {
    const int64_t G = a->group, L = a->lens[b], H = a->hkv * G, row = a->hkv * D;
    const float *q = a->q + b * H * D; /* [Hkv, G, D] */
    const int64_t *slots = a->kv_indices + a->starts[b];
    float *restrict out = a->out + b * H * D;
    for (int64_t j = 0; j < L; j++) {
        if (j + PREFETCH_AHEAD < L) rb_prefetch_floats(a->k_cache + slots[j + PREFETCH_AHEAD] * row, row);
        const float *krow = a->k_cache + slots[j] * row;
        for (int64_t h = 0; h < a->hkv; h++) {
            const float *k = krow + h * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + (h * G + g) * D;
                float s = 0.f;
                #pragma omp simd reduction(+:s)
                for (int64_t d = 0; d < D; d++) s += qg[d] * k[d];
                scores[(h * G + g) * L + j] = s * a->scale;
            }
        }
    }
    for (int64_t hg = 0; hg < H; hg++) {
        float *sg = scores + hg * L;
        float m = -INFINITY;
        for (int64_t j = 0; j < L; j++) m = sg[j] > m ? sg[j] : m;
        float sum = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < L; j++) { sg[j] = exp_clamped(sg[j] - m); sum += sg[j]; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int64_t j = 0; j < L; j++) sg[j] *= inv;
        if (a->lse) a->lse[b * H + hg] = m + logf(sum);
    }
    memset(out, 0, sizeof(float) * H * D);
    for (int64_t j = 0; j < L; j++) {
        if (j + PREFETCH_AHEAD < L) rb_prefetch_floats(a->v_cache + slots[j + PREFETCH_AHEAD] * row, row);
        const float *vrow = a->v_cache + slots[j] * row;
        for (int64_t h = 0; h < a->hkv; h++) {
            const float *v = vrow + h * D;
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[(h * G + g) * L + j];
                float *og = out + (h * G + g) * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) og[d] += p * v[d];
            }
        }
    }
}

static void decode_request(const decode_job *a, int64_t b, float *scores) {
    switch (a->dim) { /* constant head sizes let the compiler unroll the per-head loops */
    case 64: decode_request_dim(a, b, scores, 64); break;
    case 128: decode_request_dim(a, b, scores, 128); break;
    default: decode_request_dim(a, b, scores, a->dim);
    }
}

/* requests [batch * part / parts, batch * (part + 1) / parts) of the job */
static void decode_part(void *ctx, int64_t part, int64_t parts) {
    decode_job *a = (decode_job *)ctx;
    const int64_t first = a->batch * part / parts, last = a->batch * (part + 1) / parts;
    int64_t longest = 1;
    for (int64_t b = first; b < last; b++) longest = a->lens[b] > longest ? a->lens[b] : longest;
    float *scores = (float *)malloc(sizeof(float) * a->hkv * a->group * longest);
    if (!scores) {
        a->failed = 1;
        return;
    }
    for (int64_t b = first; b < last; b++) decode_request(a, b, scores);
    free(scores);
}

/* Fewer requests than threads: each request's keys in `chunks` pieces, attended as separate
   requests into scratch, then merged by their log-sum-exps (flash-decoding's split-K). */
static int decode_split_keys(const decode_job *a, int64_t chunks, int64_t threads) {
    const int64_t B = a->batch, H = a->hkv * a->group, D = a->dim, V = B * chunks;
    float *buf = (float *)malloc(sizeof(float) * (2 * V * H * D + V * H) + sizeof(int64_t) * 2 * V);
    if (!buf) return -1;
    float *vq = buf, *vout = vq + V * H * D, *vlse = vout + V * H * D;
    int64_t *vstarts = (int64_t *)(vlse + V * H), *vlens = vstarts + V;
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t v = b * chunks + c, from = a->lens[b] * c / chunks, to = a->lens[b] * (c + 1) / chunks;
            memcpy(vq + v * H * D, a->q + b * H * D, sizeof(float) * H * D);
            vstarts[v] = a->starts[b] + from;
            vlens[v] = to - from;
        }
    decode_job split = {vq, a->k_cache, a->v_cache, a->kv_indices, vstarts, vlens, V, a->hkv, a->group, D,
                        a->scale, vout, vlse, 0};
    rb_parallel(decode_part, &split, threads);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            float m = -INFINITY, total = 0.f;
            for (int64_t c = 0; c < chunks; c++) m = fmaxf(m, vlse[(b * chunks + c) * H + h]);
            float *o = a->out + (b * H + h) * D;
            memset(o, 0, sizeof(float) * D);
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t v = b * chunks + c;
                const float w = expf(vlse[v * H + h] - m);
                const float *ov = vout + (v * H + h) * D;
                total += w;
                for (int64_t d = 0; d < D; d++) o[d] += w * ov[d];
            }
            for (int64_t d = 0; d < D; d++) o[d] /= total;
            if (a->lse) a->lse[b * H + h] = m + logf(total);
        }
    const int failed = split.failed;
    free(buf);
    return failed ? -1 : 0;
}

/* One query token per request. Request b attends to the keys at pool slots
   kv_indices[starts[b] : starts[b] + lens[b]] (lens[b] >= 1).
   q, out: [B, Hkv * G, D]; k_cache, v_cache: [slots, Hkv, D]; lse: [B, Hkv * G] or NULL.
   Up to `threads` threads (the pool's) share the work: whole requests when there are enough of
   them, else each request's keys split in pieces of at least SPLIT_MIN_KEYS. Returns 0, or -1 if
   memory ran out. */
int rb_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *kv_indices, const int64_t *starts, const int64_t *lens,
                        int64_t batch, int64_t hkv, int64_t group, int64_t dim, float scale,
                        float *out, float *lse, int64_t threads) {
    decode_job job = {q, k_cache, v_cache, kv_indices, starts, lens, batch, hkv, group, dim, scale, out, lse, 0};
    if (threads > batch) {
        int64_t shortest = lens[0];
        for (int64_t b = 1; b < batch; b++) shortest = lens[b] < shortest ? lens[b] : shortest;
        int64_t chunks = (threads + batch - 1) / batch;
        if (chunks > shortest / SPLIT_MIN_KEYS) chunks = shortest / SPLIT_MIN_KEYS;
        if (chunks > 1) return decode_split_keys(&job, chunks, threads);
        threads = batch;
    }
    rb_parallel(decode_part, &job, threads < 1 ? 1 : threads);
    return job.failed ? -1 : 0;
}

/* out_residual = x + residual (x may be NULL: out_residual unused, residual normalized as is);
   out = rms_norm(out_residual) * weight, with fp32 statistics as HF's LlamaRMSNorm. */
void rb_add_rms_norm(const float *x, const float *residual, const float *weight, int64_t rows, int64_t dim,
                     float eps, float *out, float *out_residual) {
    for (int64_t r = 0; r < rows; r++) {
        const float *h = residual + r * dim;
        if (x) {
            const float *xr = x + r * dim;
            float *sum = out_residual + r * dim;
            #pragma omp simd
            for (int64_t d = 0; d < dim; d++) sum[d] = xr[d] + h[d];
            h = sum;
        }
        float squares = 0.f;
        #pragma omp simd reduction(+:squares)
        for (int64_t d = 0; d < dim; d++) squares += h[d] * h[d];
        const float inv = 1.f / sqrtf(squares / (float)dim + eps);
        float *o = out + r * dim;
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (h[d] * inv);
    }
}

/* Neox-style RoPE ("rotate half") of x [tokens, heads, dim], rows `x_stride` floats apart (a view
   into a fused qkv output), into contiguous out [tokens, heads, dim]. cos_sin: [positions, rot]
   with cos in the first rot/2 columns and sin in the rest; features past rot pass through. */
void rb_rope(const float *x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t dim,
             const int64_t *positions, const float *cos_sin, int64_t rot, float *out) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * rot;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * x_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float c = cs[i], s = cs[half + i], x1 = xi[i], x2 = xi[half + i];
                o[i] = x1 * c - x2 * s;
                o[half + i] = x2 * c + x1 * s;
            }
            for (int64_t i = rot; i < dim; i++) o[i] = xi[i];
        }
    }
}

static inline float silu(float g) { return g / (1.f + exp_clamped(-g)); }

/* x [rows, 2d] = (gate | up) -> out [rows, d] = silu(gate) * up */
void rb_silu_and_mul(const float *x, int64_t rows, int64_t d, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * d, *up = gate + d;
        float *o = out + r * d;
        #pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = silu(gate[i]) * up[i];
    }
}

/* tanh-approximated GELU, 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), written as
   g / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh(u)) is the logistic of 2u), which
   vectorizes like SiLU and keeps its accuracy for small u */
static inline float gelu_tanh(float g) {
    const float u2 = 1.5957691216057308f * (g + 0.044715f * g * g * g); /* 2u */
    return g / (1.f + exp_clamped(-u2));
}

/* x [rows, 2d] = (gate | up) -> out [rows, d] = gelu_tanh(gate) * up (Gemma's GeGLU) */
void rb_gelu_tanh_and_mul(const float *x, int64_t rows, int64_t d, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * d, *up = gate + d;
        float *o = out + r * d;
        #pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = gelu_tanh(gate[i]) * up[i];
    }
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

/* round to nearest even, as torch's float -> bfloat16 conversion */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* y [rows, d] += sigmoid(gate[r]) * x [rows, d], row by row: Qwen2-MoE's shared expert added to the
   routed experts' sum. One function for the per-layer path and the decode stack, so both give the
   same bits. */
void rb_sigmoid_gated_add(float *y, const float *gate, const float *x, int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; r++) {
        const float s = 1.f / (1.f + expf(-gate[r]));
        for (int64_t i = 0; i < d; i++) y[r * d + i] += s * x[r * d + i];
    }
}

/* Value i of a row into lane k's running state: its first maximum (strictly greater replaces) and
   its first NaN (`nan_at` starts at the row length: none). */
static inline void argmax_take(float v, int32_t i, float *lane, int32_t *at, int32_t *nan_at) {
    *at = v > *lane ? i : *at;
    *lane = v > *lane ? v : *lane;
    *nan_at = v != v && i < *nan_at ? i : *nan_at;
}

/* torch.argmax's index of each row: the first maximum, or the first NaN where the row has one.
   Why: greedy sampling's argmax over a batch's logits (32 x 49k floats) took torch ~0.8 ms a
   decode step. One pass: 16 lanes each keep their first maximum and first NaN (lane k sees
   values k, k + 16, ...), then the lanes are merged, the lower index winning a tie. */
static void rb_argmax(const float *x, int64_t rows, int64_t dim, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * dim;
        float lane[16];
        int32_t at[16], nan_at[16];
        for (int k = 0; k < 16; k++) lane[k] = -INFINITY, at[k] = k < dim ? k : 0, nan_at[k] = (int32_t)dim;
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16)
            for (int k = 0; k < 16; k++) argmax_take(row[i + k], (int32_t)(i + k), &lane[k], &at[k], &nan_at[k]);
        for (; i < dim; i++) argmax_take(row[i], (int32_t)i, &lane[i % 16], &at[i % 16], &nan_at[i % 16]);
        int32_t best_at = at[0], first_nan = nan_at[0];
        float best = lane[0];
        for (int k = 1; k < 16; k++) {
            if (lane[k] > best || (lane[k] == best && at[k] < best_at)) best = lane[k], best_at = at[k];
            first_nan = nan_at[k] < first_nan ? nan_at[k] : first_nan;
        }
        out[r] = first_nan < dim ? first_nan : best_at;
    }
}

/* ---- the element-wise kernels above over many rows, split over the pool's threads ---------------
   Prefill-sized calls (thousands of rows) from the per-layer path ran on one core while the other
   waited. Each row's arithmetic is the serial kernel's on the same addresses, so a split changes
   no bit. */
#define ROWS_PARALLEL_MIN 65536 /* elements: below this a thread hand-off (~1 us) costs more than it saves */

typedef enum { ROWS_NORM, ROWS_ROPE, ROWS_SILU, ROWS_GELU, ROWS_ARGMAX } rows_kind;

typedef struct {
    rows_kind kind;
    const float *x, *residual, *weight, *cos_sin;
    const int64_t *positions;
    int64_t rows, dim, stride, heads, rot;
    float eps;
    float *out, *out_residual;
    int64_t *index; /* ROWS_ARGMAX's output */
} rows_job;

static void rows_range(const rows_job *j, int64_t r0, int64_t r1) {
    const int64_t n = r1 - r0, dim = j->dim;
    switch (j->kind) {
    case ROWS_NORM:
        rb_add_rms_norm(j->x ? j->x + r0 * dim : NULL, j->residual + r0 * dim, j->weight, n, dim, j->eps,
                        j->out + r0 * dim, j->out_residual ? j->out_residual + r0 * dim : NULL);
        break;
    case ROWS_ROPE:
        rb_rope(j->x + r0 * j->stride, j->stride, n, j->heads, dim, j->positions + r0, j->cos_sin, j->rot,
                j->out + r0 * j->heads * dim);
        break;
    case ROWS_SILU: rb_silu_and_mul(j->x + r0 * 2 * dim, n, dim, j->out + r0 * dim); break;
    case ROWS_GELU: rb_gelu_tanh_and_mul(j->x + r0 * 2 * dim, n, dim, j->out + r0 * dim); break;
    case ROWS_ARGMAX: rb_argmax(j->x + r0 * dim, n, dim, j->index + r0); break;
    }
}

static void rows_part(void *ctx, int64_t part, int64_t parts) {
    const rows_job *j = (const rows_job *)ctx;
    const int64_t r0 = j->rows * part / parts, r1 = j->rows * (part + 1) / parts;
    if (r0 < r1) rows_range(j, r0, r1);
}

static void over_rows(const rows_job *j, int64_t elements, int64_t threads) {
    if (threads > j->rows) threads = j->rows;
    if (threads <= 1 || elements < ROWS_PARALLEL_MIN)
        rows_range(j, 0, j->rows);
    else
        rb_parallel(rows_part, (void *)j, threads);
}

void rb_add_rms_norm_threads(const float *x, const float *residual, const float *weight, int64_t rows, int64_t dim,
                             float eps, float *out, float *out_residual, int64_t threads) {
    const rows_job j = {.kind = ROWS_NORM, .x = x, .residual = residual, .weight = weight, .rows = rows, .dim = dim,
                        .eps = eps, .out = out, .out_residual = out_residual};
    over_rows(&j, rows * dim, threads);
}

void rb_rope_threads(const float *x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t dim,
                     const int64_t *positions, const float *cos_sin, int64_t rot, float *out, int64_t threads) {
    const rows_job j = {.kind = ROWS_ROPE, .x = x, .cos_sin = cos_sin, .positions = positions, .rows = tokens,
                        .dim = dim, .stride = x_stride, .heads = heads, .rot = rot, .out = out};
    over_rows(&j, tokens * heads * dim, threads);
}

void rb_silu_and_mul_threads(const float *x, int64_t rows, int64_t d, float *out, int64_t threads) {
    const rows_job j = {.kind = ROWS_SILU, .x = x, .rows = rows, .dim = d, .out = out};
    over_rows(&j, rows * d, threads);
}

void rb_gelu_tanh_and_mul_threads(const float *x, int64_t rows, int64_t d, float *out, int64_t threads) {
    const rows_job j = {.kind = ROWS_GELU, .x = x, .rows = rows, .dim = d, .out = out};
    over_rows(&j, rows * d, threads);
}

void rb_argmax_threads(const float *x, int64_t rows, int64_t dim, int64_t *out, int64_t threads) {
    const rows_job j = {.kind = ROWS_ARGMAX, .x = x, .rows = rows, .dim = dim, .index = out};
    over_rows(&j, rows * dim, threads);
}

/* rb_silu_and_mul on bf16 rows: computed in fp32 exactly as the fp32 kernel (so the result is
   the fp32 kernel's on the upcast input, rounded once), read and written as bf16 so that the
   MLP's dense bf16 GEMMs need no casts around it */
void rb_silu_and_mul_bf16(const uint16_t *x, int64_t rows, int64_t d, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * d, *up = gate + d;
        uint16_t *o = out + r * d;
        #pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = float_to_bf16(silu(bf16_to_float(gate[i])) * bf16_to_float(up[i]));
    }
}
