/* Activations as 16-bit integers per group of 32, shared by the 4-bit and 8-bit matmuls: the group
   is scaled so its largest magnitude maps to Q16_MAX (error <= 1.5e-5 of that magnitude, against
   4e-3 for bf16), which keeps the weights' integer dot products exact. */
#ifndef RB_Q16_H
#define RB_Q16_H
#include <math.h>
#include <stdint.h>

#define Q16_MAX 32639 /* 127 * 256 + 127: the 4-bit kernel splits q into two int8 digits */

/* q[i] = round(x[i] / scale) for the 32 values of one group; returns scale */
static inline float quantize_group_q16(const float *x, int32_t q[32]) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float inv = amax > 0.f ? (float)Q16_MAX / amax : 0.f;
    for (int i = 0; i < 32; i++) {
        const int32_t v = (int32_t)lrintf(x[i] * inv);
        q[i] = v > Q16_MAX ? Q16_MAX : (v < -Q16_MAX ? -Q16_MAX : v);
    }
    return amax / (float)Q16_MAX;
}

#endif
