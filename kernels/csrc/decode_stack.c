/* A whole decode step's decoder stack in one native call, on 4-bit (GGUF Q4_1) weights.

   Why: a small decode step on a CPU is ~15 torch ops per layer, each a Python call, an allocation
   and (for the low-bit linears) two dtype casts; over 30 layers that costs as much as the weights
   take to stream. Here every layer (norms, the four linears, RoPE, the K/V write into the paged
   pool, attention over the pool in place) runs back to back in C on fp32 activations, and the
   4-bit weights are used exactly as the GGUF stores them (w = scale * code + minimum, fp16 scale
   and minimum); the linears' inputs enter as 16-bit integers (below), so their products are the
   fp32 reference's on the same weights within ~2e-5. */
#include "cpu_kernels.h"
#include "q16.h"
#include "thread_pool.h"

#include <stdlib.h>
#include <string.h>

/* ---- 4-bit weights times a few fp32 rows ---------------------------------------------------
   Weights: blocks of Q4_ROWS output rows, so one row block streams from memory sequentially:
   codes [N / 4, K / 32, 4, 16] bytes, byte j of a row's group packing code j (low nibble) and code
   j + 16 (high nibble) as a Q4_1 block does, and params [N / 4, K / 32, 2, 4] fp16 (the 4 rows'
   scales, then their minimums; GGUF stores both as fp16, so this is exact). w = scale * code + min.

   Activations: each group of 32 is scaled to 16-bit integers (q16.h) and split into two int8
   digits, q = 256 * high + low. The codes' products are then exact integer dot products (VNNI `vpdpbusd`, or AVX2's
   `vpmaddubsw` + `vpmaddwd`): sum_j code_j * q_j = 256 * (codes . high) + (codes . low), at most
   15 * 32 * 32639 < 2^24, so exact in int32 and in its float conversion. Per row and group:
   y += scale * q_scale * that + min * sum(x_group) (the exact fp32 sum). */
#define Q4_ROWS 4

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>

typedef struct {
    const uint8_t *codes;
    const _Float16 *params;
    const float *bias; /* [out] or NULL */
    int64_t in, out;   /* in a multiple of 32, out a multiple of Q4_ROWS */
} rb_q4_weight;

/* One activation group as int8 digits, each half of 16 features repeated twice so that one 32-byte
   vector of digits meets the codes of two weight rows (row r's 16 bytes, then row r + 1's). */
typedef struct {
    int8_t high_first[32], high_second[32], low_first[32], low_second[32];
} q16_group;

typedef struct {
    q16_group *groups; /* [M, K / 32] */
    float *scale, *sum; /* [M, K / 32]: q -> x scale, exact fp32 sum of the group */
} q16_rows;

static void quantize_rows(const float *x, int64_t M, int64_t K, q16_rows *out) {
    const int64_t groups = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + m * K + g * 32;
            const int64_t at = m * groups + g;
            int32_t q[32];
            float sum = 0.f;
            for (int i = 0; i < 32; i++) sum += xg[i];
            out->scale[at] = quantize_group_q16(xg, q);
            out->sum[at] = sum;
            q16_group *d = out->groups + at;
            for (int i = 0; i < 32; i++) {
                const int32_t low = ((q[i] + 128) & 255) - 128, high = (q[i] - low) / 256;
                int8_t *hi = i < 16 ? d->high_first : d->high_second, *lo = i < 16 ? d->low_first : d->low_second;
                hi[i & 15] = hi[16 + (i & 15)] = (int8_t)high;
                lo[i & 15] = lo[16 + (i & 15)] = (int8_t)low;
            }
        }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* acc + the sums of 4 adjacent u8 * s8 products per int32 lane */
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* int32 lanes 0-3: row r's exact sum_j code_j * q_j, lanes 4-7: row r + 1's; `first` / `second`
   hold the two rows' codes 0-15 / 16-31 of the group */
static inline __m256i two_rows_dot(__m256i first, __m256i second, const q16_group *x) {
    __m256i t = dot_u8s8(_mm256_setzero_si256(), first, _mm256_loadu_si256((const __m256i *)x->high_first));
    t = dot_u8s8(t, second, _mm256_loadu_si256((const __m256i *)x->high_second));
    t = _mm256_slli_epi32(t, 8);
    t = dot_u8s8(t, first, _mm256_loadu_si256((const __m256i *)x->low_first));
    return dot_u8s8(t, second, _mm256_loadu_si256((const __m256i *)x->low_second));
}

static inline float sum_lanes4(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

/* out[i][r] for the 4 weight rows of one block and activation rows row0 .. row0 + R - 1: each
   group's codes are unpacked once for all R rows (R is a constant after inlining) */
static inline __attribute__((always_inline)) void q4_tile(const uint8_t *codes, const _Float16 *params,
                                                          const q16_rows *x, int64_t row0, int64_t groups,
                                                          float out[][Q4_ROWS], const int R) {
    __m256 acc01[4], acc23[4];
    __m128 offset[4];
    for (int i = 0; i < R; i++) acc01[i] = acc23[i] = _mm256_setzero_ps(), offset[i] = _mm_setzero_ps();
    const __m256i rows01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), rows23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i nibble = _mm256_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        const __m256 p = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(params + g * 2 * Q4_ROWS)));
        const __m128 minimums = _mm256_extractf128_ps(p, 1);
        const __m256i c01 = _mm256_loadu_si256((const __m256i *)(codes + g * Q4_ROWS * 16));
        const __m256i c23 = _mm256_loadu_si256((const __m256i *)(codes + g * Q4_ROWS * 16 + 32));
        const __m256i first01 = _mm256_and_si256(c01, nibble), second01 = _mm256_and_si256(_mm256_srli_epi16(c01, 4), nibble);
        const __m256i first23 = _mm256_and_si256(c23, nibble), second23 = _mm256_and_si256(_mm256_srli_epi16(c23, 4), nibble);
        for (int i = 0; i < R; i++) {
            const int64_t at = (row0 + i) * groups + g;
            const __m256 scales = _mm256_mul_ps(p, _mm256_set1_ps(x->scale[at])); /* lanes 0-3 */
            offset[i] = _mm_fmadd_ps(minimums, _mm_set1_ps(x->sum[at]), offset[i]);
            acc01[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(two_rows_dot(first01, second01, x->groups + at)),
                                       _mm256_permutevar8x32_ps(scales, rows01), acc01[i]);
            acc23[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(two_rows_dot(first23, second23, x->groups + at)),
                                       _mm256_permutevar8x32_ps(scales, rows23), acc23[i]);
        }
    }
    for (int i = 0; i < R; i++) {
        float off[4];
        _mm_storeu_ps(off, offset[i]);
        out[i][0] = sum_lanes4(_mm256_castps256_ps128(acc01[i])) + off[0];
        out[i][1] = sum_lanes4(_mm256_extractf128_ps(acc01[i], 1)) + off[1];
        out[i][2] = sum_lanes4(_mm256_castps256_ps128(acc23[i])) + off[2];
        out[i][3] = sum_lanes4(_mm256_extractf128_ps(acc23[i], 1)) + off[3];
    }
}

#define Q4_TILE 4 /* activation rows per pass over a block's codes */

static void q4_rows(const uint8_t *codes, const _Float16 *params, const q16_rows *x, int64_t row0, int64_t rows,
                    int64_t groups, float out[][Q4_ROWS]) {
    switch (rows) {
    case 1: q4_tile(codes, params, x, row0, groups, out, 1); break;
    case 2: q4_tile(codes, params, x, row0, groups, out, 2); break;
    case 3: q4_tile(codes, params, x, row0, groups, out, 3); break;
    default: q4_tile(codes, params, x, row0, groups, out, 4); break;
    }
}
#else
#define Q4_TILE 1

/* portable: the same integer arithmetic, one product at a time */
static void q4_rows(const uint8_t *codes, const _Float16 *params, const q16_rows *x, int64_t row,
                    int64_t rows, int64_t groups, float out[][Q4_ROWS]) {
    (void)rows; /* always 1 (Q4_TILE) */
    for (int r = 0; r < Q4_ROWS; r++) out[0][r] = 0.f;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = row * groups + g;
        const q16_group *d = x->groups + at;
        for (int r = 0; r < Q4_ROWS; r++) {
            const uint8_t *c = codes + (g * Q4_ROWS + r) * 16;
            int32_t dot = 0;
            for (int j = 0; j < 16; j++) {
                const int32_t first = c[j] & 15, second = c[j] >> 4;
                dot += first * (256 * d->high_first[j] + d->low_first[j])
                     + second * (256 * d->high_second[j] + d->low_second[j]);
            }
            const float scale = (float)params[g * 2 * Q4_ROWS + r], minimum = (float)params[g * 2 * Q4_ROWS + Q4_ROWS + r];
            out[0][r] += scale * x->scale[at] * (float)dot + minimum * x->sum[at];
        }
    }
}
#endif

/* y [M, N] = x @ W^T (+ bias) for the row blocks [first, last), x quantized by quantize_rows */
static void q4_matmul_blocks(const rb_q4_weight *w, const q16_rows *x, int64_t M, float *y, int64_t first,
                             int64_t last) {
    const int64_t groups = w->in / 32;
    for (int64_t block = first; block < last; block++) {
        const uint8_t *codes = w->codes + block * groups * Q4_ROWS * 16;
        const _Float16 *params = w->params + block * groups * 2 * Q4_ROWS;
        for (int64_t m0 = 0; m0 < M; m0 += Q4_TILE) {
            const int64_t rows = M - m0 < Q4_TILE ? M - m0 : Q4_TILE;
            float out[Q4_TILE][Q4_ROWS];
            q4_rows(codes, params, x, m0, rows, groups, out);
            for (int64_t i = 0; i < rows; i++) {
                float *ym = y + (m0 + i) * w->out + block * Q4_ROWS;
                for (int r = 0; r < Q4_ROWS; r++)
                    ym[r] = out[i][r] + (w->bias ? w->bias[block * Q4_ROWS + r] : 0.f);
            }
        }
    }
}

/* scratch for quantize_rows of up to M rows of K features */
static int q16_alloc(q16_rows *x, int64_t M, int64_t K) {
    const int64_t n = M * (K / 32);
    x->groups = (q16_group *)malloc(sizeof(q16_group) * n + 2 * sizeof(float) * n);
    if (!x->groups) return -1;
    x->scale = (float *)(x->groups + n);
    x->sum = x->scale + n;
    return 0;
}

typedef struct {
    const rb_q4_weight *w;
    const q16_rows *x;
    int64_t M;
    float *y;
} q4_job;

static void q4_part(void *ctx, int64_t part, int64_t parts) {
    const q4_job *job = (const q4_job *)ctx;
    const int64_t blocks = job->w->out / Q4_ROWS;
    q4_matmul_blocks(job->w, job->x, job->M, job->y, blocks * part / parts, blocks * (part + 1) / parts);
}

/* y = x @ W^T with x [M, K] quantized into `scratch` first, the rows split over `threads` */
static void q4_linear(const rb_q4_weight *w, const float *x, int64_t M, q16_rows *scratch, float *y,
                      int64_t threads) {
    quantize_rows(x, M, w->in, scratch);
    q4_job job = {w, scratch, M, y};
    rb_parallel(q4_part, &job, threads);
}

/* y [M, N] = x [M, K] @ W^T (+ bias) on `threads` threads. Returns 0, or -1 if memory ran out. */
int rb_q4_matmul(const rb_q4_weight *w, const float *x, int64_t M, float *y, int64_t threads) {
    q16_rows q;
    if (q16_alloc(&q, M, w->in)) return -1;
    q4_linear(w, x, M, &q, y, threads);
    free(q.groups);
    return 0;
}

/* ---- the decoder stack ---------------------------------------------------------------------- */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] RMSNorm weights */
    rb_q4_weight qkv, o, gate_up, down;  /* qkv: q, k, v heads stacked; gate_up: gate, up */
    float *k_cache, *v_cache;            /* this layer's pool [slots, kv_heads, head_dim] */
} rb_decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;     /* RMSNorm epsilon, attention scale */
    const float *cos_sin; /* [positions, head_dim]: cos half, sin half (neox RoPE) */
} rb_decoder_dims;

/* One new token per request. Token t belongs to request t, sits at positions[t], writes its K/V
   at pool slot out_slots[t], and attends to the slots kv_indices[starts[t] : starts[t] + lens[t]]
   (its own slot included). residual: in, the embeddings [T, hidden]; out, the residual stream
   before the last layer's MLP output, which goes to `hidden` [T, hidden] (the model's final norm
   adds the two). The linears split their rows, and attention its requests (or a long request's
   keys), over `threads` threads. Returns 0, or -1 if memory ran out. */
int rb_decode_stack(const rb_decoder_layer *layers, int64_t n_layers, const rb_decoder_dims *d, int64_t T,
                    const int64_t *positions, const int64_t *out_slots, const int64_t *kv_indices,
                    const int64_t *starts, const int64_t *lens, float *residual, float *hidden, int64_t threads) {
    const int64_t H = d->hidden, D = d->head_dim, q_size = d->heads * D, kv_size = d->kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, I = d->intermediate;
    const int64_t widest = H > I ? (H > q_size ? H : q_size) : (I > q_size ? I : q_size);
    float *scratch = (float *)malloc(sizeof(float) * T * (H + qkv_size + 2 * q_size + 3 * I));
    q16_rows quantized;
    if (!scratch || q16_alloc(&quantized, T, widest)) {
        free(scratch);
        return -1;
    }
    float *normed = scratch, *qkv = normed + T * H, *q = qkv + T * qkv_size, *attn = q + T * q_size;
    float *gate_up = attn + T * q_size, *act = gate_up + T * 2 * I;
    int rc = 0;
    for (int64_t l = 0; l < n_layers && rc == 0; l++) {
        const rb_decoder_layer *L = layers + l;
        rb_add_rms_norm(l ? hidden : NULL, residual, L->input_norm, T, H, d->eps, normed, l ? residual : NULL);
        q4_linear(&L->qkv, normed, T, &quantized, qkv, threads);
        rb_rope(qkv, qkv_size, T, d->heads, D, positions, d->cos_sin, D, q);
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * qkv_size;
            rb_rope(row + q_size, qkv_size, 1, d->kv_heads, D, positions + t, d->cos_sin, D,
                    L->k_cache + out_slots[t] * kv_size);
            memcpy(L->v_cache + out_slots[t] * kv_size, row + q_size + kv_size, sizeof(float) * kv_size);
        }
        rc = rb_decode_attention(q, L->k_cache, L->v_cache, kv_indices, starts, lens, T, d->kv_heads,
                                 d->heads / d->kv_heads, D, d->scale, attn, NULL, threads);
        q4_linear(&L->o, attn, T, &quantized, hidden, threads);
        rb_add_rms_norm(hidden, residual, L->post_norm, T, H, d->eps, normed, residual);
        q4_linear(&L->gate_up, normed, T, &quantized, gate_up, threads);
        rb_silu_and_mul(gate_up, T, I, act);
        q4_linear(&L->down, act, T, &quantized, hidden, threads);
    }
    free(quantized.groups);
    free(scratch);
    return rc;
}
