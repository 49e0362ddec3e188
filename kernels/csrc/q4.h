/* 4-bit weights (GGUF Q4_1: w = scale * code + minimum per group of 32 input features) times fp32
   rows, with the activations as integers per group of 32 (q4_matmul.c); used by the decode stack
   (decode_stack.c) and, through rb_q4_matmul, by the 4-bit linears of the torch path. */
#ifndef RB_Q4_H
#define RB_Q4_H
#include <stdint.h>
#include <string.h>

#define Q4_ROWS 16 /* output rows per block of the packed layout: one int32 lane each in 512 bits */

/* codes [N / 16, K / 32, 4, 16, 4] bytes: for block b, group g, quad j (0..3), row r, byte k the
   low nibble is the code of feature 4j + k and the high nibble that of feature 16 + 4j + k, so a
   64-byte load holds 4 features of all 16 rows; params [N / 16, K / 32, 2, 16] fp16: the rows'
   scales, then their minimums (GGUF stores both as fp16, so this is exact) */
typedef struct {
    const uint8_t *codes;
    const _Float16 *params;
    const float *bias; /* [out] or NULL */
    int64_t in, out;   /* in a multiple of 32, out a multiple of Q4_ROWS */
} rb_q4_weight;

/* Activations as integers per group of 32, scaled so the group's largest magnitude is the
   format's largest value: 8 bits (planes = 1, llama.cpp's Q8_1 idea: each value within 0.4 % of
   the group's largest, a product within ~5e-3, about twice bf16's error, at half the integer
   work) or 16 bits as two int8 digits (planes = 2, high then low: ~1.5e-5, for the fp32
   reference's accuracy). With every group: its scale and the sum of
   its rounded values (scale * sum q: with the rounded sum, the minimum term's error partly
   cancels the codes', which halves the 8-bit error against the exact sum). */
typedef struct {
    int8_t *digits;      /* [M, K / 32, planes, 32] */
    float *scale, *sum;  /* [M, K / 32] */
    int planes;
    int offset_digits;   /* digits stored + 128 (as uint8), for signed weights (q8_matmul.c) */
} q4_activations;

int q4_activations_alloc(q4_activations *x, int64_t M, int64_t K, int planes);
void q4_activations_free(q4_activations *x);
/* x [M, K] into `out` (allocated for >= M rows of >= K features), on up to `threads` threads */
void q4_quantize(const float *x, int64_t M, int64_t K, q4_activations *out, int64_t threads);
/* y [M, N] = x [M, K] @ W^T (+ bias): x quantized into `scratch` (allocated for >= M rows of >= K
   features), the output rows split over `threads` threads */
void q4_linear(const rb_q4_weight *w, const float *x, int64_t M, q4_activations *scratch, float *y,
               int64_t threads);

/* 4 activation digits as one int32, to broadcast against 4 features of every weight row */
static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif
