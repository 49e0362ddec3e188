/* A vectorizable exp for the native kernels' softmax and SiLU loops. */
#ifndef RB_FAST_EXP_H
#define RB_FAST_EXP_H
#include <stdint.h>

/* exp(x), written so loops over it vectorize: exp(x) = 2^n * exp(r), n = round(x / ln2),
   |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (relative error < 2e-7, about one float
   ulp). x is clamped to [-87, 88], where 2^n stays a normal float: softmax scores after the max
   subtraction and SiLU's exp(-gate) both live there or saturate harmlessly (0, or inf / 1e38
   in a denominator). */
#define EXP_ROUND_N(x) (((x) * 1.44269504088896341f + 12582912.f) - 12582912.f) /* round(x / ln2) */
#define EXP_REDUCE(x, n) (((x) - (n) * 0.693359375f) + (n) * 2.12194440e-4f)   /* x - n ln2 */
#define EXP_TAYLOR7(r) (((((((((r) * (1.f / 5040.f) + 1.f / 720.f) * (r) + 1.f / 120.f) * (r) + 1.f / 24.f) \
                             * (r) + 1.f / 6.f) * (r) + 0.5f) * (r) + 1.f) * (r) + 1.f))

/* The steps are macros so that a vector version (extend_attention.c) computes the same values. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest by the 1.5 * 2^23 trick: plain arithmetic, so the loop vectorizes (roundf
       would be a library call per element) */
    const float n = EXP_ROUND_N(x);
    const float r = EXP_REDUCE(x, n);
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return EXP_TAYLOR7(r) * two_n.f;
}

#endif
