/* The fp32 kernels of cpu_kernels.c, shared with the fused decode step (decode_stack.c). */
#ifndef RB_CPU_KERNELS_H
#define RB_CPU_KERNELS_H
#include "prefetch.h"
#include <stdint.h>

/* the 64-byte lines of `floats` floats from `row` on, fetched ahead (pool rows are scattered: no
   hardware prefetcher follows them). The empty volatile asm is a side effect: GCC counts a prefetch
   as none, judged a helper around it pure and deleted every call whose result went unused, so no
   caller's prefetch was ever compiled in. */
static inline void rb_prefetch_floats(const float *row, int64_t floats) {
    const char *bytes = (const char *)row;
    for (int64_t c = 0; c < floats * (int64_t)sizeof(float); c += 64) rb_prefetch(bytes + c);
    __asm__ __volatile__("");
}

int rb_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *kv_indices, const int64_t *starts, const int64_t *lens,
                        int64_t batch, int64_t hkv, int64_t group, int64_t dim, float scale,
                        float *out, float *lse, int64_t threads);
/* Decode rows whose requests begin with the same pool slots, in chunks that read those keys once:
   chunk c's members are requests order[bounds[c] : bounds[c + 1]], all of whose first shared[c]
   keys are the same slots (rb_decode_attention_invariant). */
typedef struct {
    const int64_t *order, *bounds, *shared;
    int64_t chunks;
} rb_key_sharing;
int rb_decode_attention_invariant(const float *q, const float *k_cache, const float *v_cache,
                              const int64_t *kv_indices, const int64_t *starts, const int64_t *lens,
                              int64_t batch, int64_t hkv, int64_t group, int64_t dim, float scale, float softcap,
                              const rb_key_sharing *sharing, float *out, float *lse, int64_t threads,
                              int64_t bf16);
/* The attention kernels' `bf16` argument: 0 fp32 products, 1 bf16 products over an fp32 pool,
   KV16_POOL bf16 products over a pool of bf16 rows (k_cache and v_cache then point at uint16_t). */
#define KV16_POOL 2
/* out[0 .. n) = the bf16 of x[0 .. n) as the bf16 products round it: what a bf16 pool stores */
void rb_round_bf16(const float *x, int64_t n, uint16_t *out);
int rb_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t kv_size,
                const int64_t *slots, int64_t pool_rows, void *k_cache, void *v_cache, int64_t bf16_pool);
int rb_extend_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *kv_indices,
                        const int64_t *q_starts, const int64_t *q_lens, const int64_t *kv_starts,
                        const int64_t *kv_lens, int64_t batch, int64_t hkv, int64_t group, int64_t dim,
                        float scale, int causal, float *out, float *lse, int64_t threads);
int rb_extend_attention_window(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *kv_indices, const int64_t *q_starts, const int64_t *q_lens,
                               const int64_t *kv_starts, const int64_t *kv_lens, int64_t batch, int64_t hkv,
                               int64_t group, int64_t dim, float scale, int causal, int64_t window, float softcap,
                               float *out, float *lse, int64_t threads, int64_t bf16);
int rb_extend_attention_shared(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *kv_indices, const int64_t *q_starts, const int64_t *q_lens,
                               const int64_t *kv_starts, const int64_t *kv_lens, int64_t batch, int64_t hkv,
                               int64_t group, int64_t dim, float scale, int causal, int64_t window, float softcap,
                               const rb_key_sharing *sharing, float *out, float *lse, int64_t threads, int64_t bf16);
void rb_add_rms_norm(const float *x, const float *residual, const float *weight, int64_t rows, int64_t dim,
                     float eps, float *out, float *out_residual);
void rb_rope(const float *x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t dim,
             const int64_t *positions, const float *cos_sin, int64_t rot, float *out);
enum { RB_SILU = 0, RB_GELU_TANH = 1 }; /* a gated MLP's activation */
void rb_silu_and_mul(const float *x, int64_t rows, int64_t d, float *out);
void rb_gelu_tanh_and_mul(const float *x, int64_t rows, int64_t d, float *out);
void rb_sigmoid_gated_add(float *y, const float *gate, const float *x, int64_t rows, int64_t d);
void rb_silu_and_mul_bf16(const uint16_t *x, int64_t rows, int64_t d, uint16_t *out);

#endif
