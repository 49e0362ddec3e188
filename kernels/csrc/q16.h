/* Activations as integers per group of 32: the group is scaled so its largest magnitude maps to
   the format's largest value. 16 bits (Q16_MAX: error <= 1.5e-5 of that magnitude, against 4e-3
   for bf16) keep the weights' integer dot products exact; q4_matmul.c also uses 8 bits. */
#ifndef RB_Q16_H
#define RB_Q16_H
#include <math.h>
#include <stdint.h>

#define Q8_MAX 127
#define Q16_MAX 32639 /* 127 * 256 + 127: the largest value two int8 digits hold */

/* q[i] = round(x[i] / scale) for the 32 values of one group, |q| <= largest; returns scale */
static inline float quantize_group_int(const float *x, int32_t largest, int32_t q[32]) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = amax > 0.f ? (float)largest / amax : 0.f;
    for (int i = 0; i < 32; i++) {
        const int32_t v = (int32_t)lrintf(x[i] * inv);
        q[i] = v > largest ? largest : (v < -largest ? -largest : v);
    }
    return amax / (float)largest;
}

static inline float quantize_group_q16(const float *x, int32_t q[32]) { return quantize_group_int(x, Q16_MAX, q); }

#endif
