/* A vectorizable exp for the native kernels' softmax and SiLU loops. */
#ifndef RB_FAST_EXP_H
#define RB_FAST_EXP_H
#include <stdint.h>

/* exp(x), written so loops over it vectorize: exp(x) = 2^n * exp(r), n = round(x / ln2),
   |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (relative error < 2e-7, about one float
   ulp). x is clamped to [-87, 88], where 2^n stays a normal float: softmax scores after the max
   subtraction and SiLU's exp(-gate) both live there or saturate harmlessly (0, or inf / 1e38
   in a denominator). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest by the 1.5 * 2^23 trick: plain arithmetic, so the loop vectorizes (roundf
       would be a library call per element) */
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

#endif
