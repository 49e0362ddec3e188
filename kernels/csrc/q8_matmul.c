/* 8-bit weights (GGUF Q8_0 blocks: w = scale * code, code in -127..127, one fp16 scale per 32
   weights of a row) times a few fp32 rows: the LM head of a GGUF model, which a small decode step
   reads whole (49152 x 576 for SmolLM2, 28 MB), so its bytes set its speed.

   As in decode_stack.c, each group of 32 activations is scaled to 16-bit integers (q16.h) and the
   codes' products are integer dot products
   (`vpdpwssd` with AVX512-VNNI, `vpmaddwd` with AVX2): per row and group,
   y += scale * q_scale * sum_j code_j * q_j. */
#include "q16.h"
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
