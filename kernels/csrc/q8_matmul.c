/* 8-bit weights (GGUF Q8_0 blocks: w = scale * code, code in -127..127, one fp16 scale per 32
   weights of a row) times a few fp32 rows: the LM head of a GGUF model, which a small decode step
   reads whole (49152 x 576 for SmolLM2, 28 MB), so its bytes set its speed.

   As in q4_matmul.c, each group of 32 activations is scaled to 16-bit integers (q16.h) and the
   codes' products are integer dot products
   (`vpdpwssd` with AVX512-VNNI, `vpmaddwd` with AVX2): per row and group,
   y += scale * q_scale * sum_j code_j * q_j. */
#include "q16.h"
#include "q4.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>


typedef struct {
    const int8_t *codes;    /* [N, K] */
    const _Float16 *scales; /* [N, K / 32] */
    int64_t in, out;        /* in a multiple of 32 */
} rb_q8_weight;

typedef struct {
    const rb_q8_weight *w;
    const int16_t *q;   /* [M, K] activations as 16-bit integers */
    const float *scale; /* [M, K / 32] */
    int64_t M;
    float *y;
} q8_job;

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
static inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

static inline float sum_lanes8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static float q8_row(const int8_t *codes, const _Float16 *scales, const int16_t *q, const float *q_scale,
                    int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + g * 32));
        __m256i t = dot_s16(_mm256_setzero_si256(), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(c)),
                            _mm256_loadu_si256((const __m256i *)(q + g * 32)));
        t = dot_s16(t, _mm256_cvtepi8_epi16(_mm256_extracti128_si256(c, 1)),
                    _mm256_loadu_si256((const __m256i *)(q + g * 32 + 16)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps((float)scales[g] * q_scale[g]), acc);
    }
    return sum_lanes8(acc);
}
#else
static float q8_row(const int8_t *codes, const _Float16 *scales, const int16_t *q, const float *q_scale,
                    int64_t groups) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        int32_t dot = 0;
        for (int j = 0; j < 32; j++) dot += (int32_t)codes[g * 32 + j] * q[g * 32 + j];
        acc += (float)scales[g] * q_scale[g] * (float)dot;
    }
    return acc;
}
#endif

static void q8_part(void *ctx, int64_t part, int64_t parts) {
    const q8_job *job = (const q8_job *)ctx;
    const int64_t K = job->w->in, N = job->w->out, groups = K / 32;
    const int64_t first = N * part / parts, last = N * (part + 1) / parts;
    for (int64_t n = first; n < last; n++)
        for (int64_t m = 0; m < job->M; m++)
            job->y[m * N + n] = q8_row(job->w->codes + n * K, job->w->scales + n * groups, job->q + m * K,
                                       job->scale + m * groups, groups);
}

/* y [M, N] = x [M, K] @ W^T on `threads` threads. Returns 0, or -1 if memory ran out. */
int rb_q8_matmul(const rb_q8_weight *w, const float *x, int64_t M, float *y, int64_t threads) {
    const int64_t K = w->in, groups = K / 32;
    int16_t *q = (int16_t *)malloc(sizeof(int16_t) * M * K + sizeof(float) * M * groups);
    if (!q) return -1;
    float *scale = (float *)(q + M * K);
    for (int64_t at = 0; at < M * groups; at++) {
        int32_t group[32];
        scale[at] = quantize_group_q16(x + at * 32, group);
        for (int i = 0; i < 32; i++) q[at * 32 + i] = (int16_t)group[i];
    }
    q8_job job = {w, q, scale, M, y};
    rb_parallel(q8_part, &job, threads);
    free(q);
    return 0;
}

/* ---- the same weights tiled for many rows -----------------------------------------------------
   The row-at-a-time kernel above re-reads the whole head per activation row; with VNNI the head
   is also kept as blocks of 16 rows (one int32 lane each, as q4_matmul.c does for 4 bits) so a
   group's codes meet a tile of activation rows at once. vpdpbusd multiplies unsigned by signed
   bytes: the codes stay signed and the activations' digits are stored + 128 (q4.h), which adds
   128 * sum(codes) per group and plane to each dot product; `offsets` holds that sum and it is
   subtracted in int32, so the result is exact as in the row kernel. */
typedef struct {
    const int8_t *codes;    /* [N / 16, K / 32, 8, 16, 4]: quad j = features 4j .. 4j + 3 of the 16 rows */
    const _Float16 *scales; /* [N / 16, K / 32, 16] */
    const int32_t *offsets; /* [N / 16, K / 32, 16]: 128 * the row's code sum over the group */
    int64_t in, out;        /* in a multiple of 32, out a multiple of 16 */
} rb_q8_tiled_weight;

#define Q8_TILE 8 /* activation rows per pass over a block's codes */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline __attribute__((always_inline)) void q8_tile(const int8_t *codes, const _Float16 *scales,
                                                          const int32_t *offsets, const q4_activations *x,
                                                          int64_t row0, int64_t groups, float *out, const int R,
                                                          const int P) {
    const int64_t T = x->row_tile, first_at = q4_group_index(row0, 0, groups, T); /* row0 + i's group g: first_at + g * T + i */
    __m512 acc[Q8_TILE];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * 16)));
        __m512i offset = _mm512_loadu_si512((const void *)(offsets + g * 16));
        if (P == 2) offset = _mm512_mullo_epi32(offset, _mm512_set1_epi32(257)); /* 256 * high + low */
        __m512i c[8];
        for (int j = 0; j < 8; j++) c[j] = _mm512_loadu_si512((const void *)(codes + (g * 8 + j) * 64));
        for (int i = 0; i < R; i++) {
            const int64_t at = first_at + g * T + i; /* m0 steps by Q8_TILE = Q4_ROW_TILE */
            const int8_t *q = x->digits + at * P * 32;
            __m512i dot = _mm512_setzero_si512();
            for (int p = 0; p < P; p++) {
                if (p) dot = _mm512_slli_epi32(dot, 8);
                for (int j = 0; j < 8; j++) dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(load_i32(q + p * 32 + 4 * j)), c[j]);
            }
            dot = _mm512_sub_epi32(dot, offset);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(x->scale[at])), acc[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out + i * 16, acc[i]);
}

#define Q8_TILE_CASE(r)                                                                               \
    case r:                                                                                           \
        if (x->planes == 1) q8_tile(codes, scales, offsets, x, row0, groups, out, r, 1);              \
        else q8_tile(codes, scales, offsets, x, row0, groups, out, r, 2);                             \
        break;

static void q8_tiled_rows(const int8_t *codes, const _Float16 *scales, const int32_t *offsets,
                          const q4_activations *x, int64_t row0, int64_t rows, int64_t groups, float *out) {
    switch (rows) {
    Q8_TILE_CASE(1)
    Q8_TILE_CASE(2)
    Q8_TILE_CASE(3)
    Q8_TILE_CASE(4)
    Q8_TILE_CASE(5)
    Q8_TILE_CASE(6)
    Q8_TILE_CASE(7)
    default:
        if (x->planes == 1) q8_tile(codes, scales, offsets, x, row0, groups, out, Q8_TILE, 1);
        else q8_tile(codes, scales, offsets, x, row0, groups, out, Q8_TILE, 2);
    }
}

typedef struct {
    const rb_q8_tiled_weight *w;
    const q4_activations *x;
    int64_t M;
    float *y;
} q8_tiled_job;

static void q8_tiled_part(void *ctx, int64_t part, int64_t parts) {
    const q8_tiled_job *job = (const q8_tiled_job *)ctx;
    const rb_q8_tiled_weight *w = job->w;
    const int64_t groups = w->in / 32, blocks = w->out / 16;
    for (int64_t block = blocks * part / parts; block < blocks * (part + 1) / parts; block++)
        for (int64_t m0 = 0; m0 < job->M; m0 += Q8_TILE) {
            const int64_t rows = job->M - m0 < Q8_TILE ? job->M - m0 : Q8_TILE;
            float out[Q8_TILE * 16];
            q8_tiled_rows(w->codes + block * groups * 8 * 64, w->scales + block * groups * 16,
                          w->offsets + block * groups * 16, job->x, m0, rows, groups, out);
            for (int64_t i = 0; i < rows; i++) memcpy(job->y + (m0 + i) * w->out + block * 16, out + i * 16, 16 * sizeof(float));
        }
}

int rb_q8_tiled_supported(void) { return 1; }

/* y [M, N] = x [M, K] @ W^T with the activations in 8 or 16 bits (q4.h). Returns 0, -1 if memory
   ran out, -2 for other `bits`. */
int rb_q8_tiled_matmul(const rb_q8_tiled_weight *w, const float *x, int64_t M, float *y, int64_t threads,
                       int64_t bits) {
    if (bits != 8 && bits != 16) return -2;
    q4_activations q;
    if (q4_activations_alloc(&q, M, w->in, (int)(bits / 8))) return -1;
    q.offset_digits = 1;
    q4_quantize(x, M, w->in, &q, threads);
    q8_tiled_job job = {w, &q, M, y};
    rb_parallel(q8_tiled_part, &job, threads);
    q4_activations_free(&q);
    return 0;
}
#else
int rb_q8_tiled_supported(void) { return 0; }

int rb_q8_tiled_matmul(const rb_q8_tiled_weight *w, const float *x, int64_t M, float *y, int64_t threads,
                       int64_t bits) {
    (void)w, (void)x, (void)M, (void)y, (void)threads, (void)bits;
    return -3; /* built without AVX512-VNNI */
}
#endif
