/* Causal attention of many new tokens (prefill / extend) over the paged K/V pool, read in place.

   Why: torch's path gathered each request's keys out of the pool, repeated them for every query
   head of a GQA group and ran one flash-attention call per request (or a padded product with an
   explicit mask); on a 2-core CPU that was 40-50 % of an extend's time. Here one call covers the
   whole batch: a task is (request, kv head, tile of TILE_ROWS query rows); the tile's rows are the
   group's query heads of consecutive positions, so each block of keys is loaded (and transposed)
   once for all of them. Scores and the online softmax stay in fp32 (flash attention's running max
   and sum); tasks are pulled from a shared counter by the pool's threads, heaviest (last) tiles
   first. The inner products are written with the compiler's vector types, so the same code is
   AVX-512, AVX2 or plain scalar code depending on the build. */
#include "cpu_kernels.h"
#include "fast_exp.h"
#include "thread_pool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8
#endif
#define BLOCK_KEYS (4 * VEC) /* keys per block: four vectors of scores per row */
#define ROW_BLOCK 4          /* query rows sharing each loaded vector of keys or values */
#define TILE_ROWS 48         /* query rows (positions x heads of a group) per task, about */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(VEC * sizeof(float)), aligned(4)));

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *kv_indices, *q_starts, *q_lens, *kv_starts, *kv_lens;
    int64_t batch, hkv, group, dim, positions_per_tile, tasks;
    int causal;
    float scale;
    float *out, *lse;
    const int64_t *task_first; /* [batch + 1]: first task id of each request */
    _Atomic int64_t next;
    _Atomic int failed;
} extend_job;

typedef struct {
    float *q, *scores, *acc, *keys_t, *max, *sum; /* 64-byte aligned scratch of one thread */
    const float **values;
    int64_t *limit;
} tile_scratch;

/* Scores of ROW_BLOCK rows against one key block: s[r][j] = q[r] . k[j], keys_t = [D][BLOCK_KEYS]. */
static inline void block_scores(const float *restrict q, const float *restrict keys_t, int64_t D,
                                float *restrict s) {
    vec acc[ROW_BLOCK][4] = {{{0}}};
    for (int64_t d = 0; d < D; d++) {
        const vec *k = (const vec *)(keys_t + d * BLOCK_KEYS);
        const vec k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
        for (int r = 0; r < ROW_BLOCK; r++) {
            const float x = q[r * D + d];
            acc[r][0] += x * k0;
            acc[r][1] += x * k1;
            acc[r][2] += x * k2;
            acc[r][3] += x * k3;
        }
    }
    for (int r = 0; r < ROW_BLOCK; r++)
        for (int u = 0; u < 4; u++) ((vec *)(s + r * BLOCK_KEYS))[u] = acc[r][u];
}

/* acc[r] += sum_j p[r][j] * v[j] for ROW_BLOCK rows, over NV (<= 4) vectors of features at `d0`. */
static inline __attribute__((always_inline)) void block_values_n(
        const float *restrict p, const float **values, int64_t keys, int64_t d0, int64_t D, float *restrict acc,
        const int NV) {
    vec o[ROW_BLOCK][4];
    for (int r = 0; r < ROW_BLOCK; r++)
        for (int u = 0; u < NV; u++) o[r][u] = ((const vec *)(acc + r * D + d0))[u];
    for (int64_t j = 0; j < keys; j++) {
        const vec_unaligned *v = (const vec_unaligned *)(values[j] + d0);
        vec vj[4];
        for (int u = 0; u < NV; u++) vj[u] = v[u];
        for (int r = 0; r < ROW_BLOCK; r++) {
            const float w = p[r * BLOCK_KEYS + j];
            for (int u = 0; u < NV; u++) o[r][u] += w * vj[u];
        }
    }
    for (int r = 0; r < ROW_BLOCK; r++)
        for (int u = 0; u < NV; u++) ((vec *)(acc + r * D + d0))[u] = o[r][u];
}

/* the features of ROW_BLOCK rows, four vectors at a time (D is a multiple of VEC) */
static void block_values(const float *p, const float **values, int64_t keys, int64_t D, float *acc) {
    int64_t d0 = 0;
    for (; d0 + 4 * VEC <= D; d0 += 4 * VEC) block_values_n(p, values, keys, d0, D, acc, 4);
    switch ((D - d0) / VEC) {
    case 3: block_values_n(p, values, keys, d0, D, acc, 3); break;
    case 2: block_values_n(p, values, keys, d0, D, acc, 2); break;
    case 1: block_values_n(p, values, keys, d0, D, acc, 1); break;
    default: break;
    }
}

/* One task: request b, kv head h, query positions [first, first + count) of the request. */
static void attend_tile(const extend_job *a, const tile_scratch *t, int64_t b, int64_t h, int64_t first,
                        int64_t count) {
    const int64_t G = a->group, D = a->dim, Hq = a->hkv * G, row = a->hkv * D;
    const int64_t rows = count * G, padded = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    const int64_t L = a->kv_lens[b], offset = L - a->q_lens[b];
    const int64_t *slots = a->kv_indices + a->kv_starts[b];
    int64_t keys_end = 0;
    for (int64_t r = 0; r < padded; r++) { /* row r = position first + r / G, query head h * G + r % G */
        float *qr = t->q + r * D;
        if (r < rows) {
            const float *src = a->q + ((a->q_starts[b] + first + r / G) * Hq + h * G + r % G) * D;
            for (int64_t d = 0; d < D; d++) qr[d] = src[d] * a->scale;
            t->limit[r] = a->causal ? offset + first + r / G + 1 : L;
        } else {
            memset(qr, 0, sizeof(float) * D);
            t->limit[r] = L; /* padding rows see every key: no empty softmax, never written out */
        }
        keys_end = t->limit[r] > keys_end ? t->limit[r] : keys_end;
        t->max[r] = -INFINITY;
        t->sum[r] = 0.f;
    }
    memset(t->acc, 0, sizeof(float) * padded * D);
    for (int64_t j0 = 0; j0 < keys_end; j0 += BLOCK_KEYS) {
        const int64_t n = keys_end - j0 < BLOCK_KEYS ? keys_end - j0 : BLOCK_KEYS;
        for (int64_t j = 0; j < n; j++) {
            const float *k = a->k_cache + slots[j0 + j] * row + h * D;
            for (int64_t d = 0; d < D; d++) t->keys_t[d * BLOCK_KEYS + j] = k[d];
            t->values[j] = a->v_cache + slots[j0 + j] * row + h * D;
        }
        for (int64_t j = n; j < BLOCK_KEYS; j++)
            for (int64_t d = 0; d < D; d++) t->keys_t[d * BLOCK_KEYS + j] = 0.f;
        for (int64_t r = 0; r < padded; r += ROW_BLOCK) block_scores(t->q + r * D, t->keys_t, D, t->scores + r * BLOCK_KEYS);
        for (int64_t r = 0; r < padded; r++) { /* online softmax: rescale what came before */
            float *s = t->scores + r * BLOCK_KEYS;
            const int64_t visible = t->limit[r] - j0 < n ? t->limit[r] - j0 : n;
            float m = t->max[r];
            for (int64_t j = 0; j < visible; j++) m = s[j] > m ? s[j] : m;
            if (visible <= 0 || m == -INFINITY) {
                memset(s, 0, sizeof(float) * BLOCK_KEYS);
                continue;
            }
            const float correction = t->max[r] == -INFINITY ? 0.f : exp_clamped(t->max[r] - m);
            float total = 0.f;
            #pragma omp simd reduction(+:total)
            for (int64_t j = 0; j < BLOCK_KEYS; j++) {
                const float p = j < visible ? exp_clamped(s[j] - m) : 0.f;
                s[j] = p;
                total += p;
            }
            t->sum[r] = t->sum[r] * correction + total;
            t->max[r] = m;
            if (correction != 1.f) {
                float *o = t->acc + r * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] *= correction;
            }
        }
        for (int64_t r = 0; r < padded; r += ROW_BLOCK)
            block_values(t->scores + r * BLOCK_KEYS, t->values, n, D, t->acc + r * D);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = a->q_starts[b] + first + r / G, head = h * G + r % G;
        const float inv = 1.f / t->sum[r], *o = t->acc + r * D;
        float *dst = a->out + (token * Hq + head) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = o[d] * inv;
        if (a->lse) a->lse[token * Hq + head] = t->max[r] + logf(t->sum[r]);
    }
}

static void *aligned_floats(int64_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, sizeof(float) * (size_t)(n < 16 ? 16 : n)) ? NULL : p;
}

static void extend_part(void *ctx, int64_t part, int64_t parts) {
    (void)part, (void)parts;
    extend_job *a = (extend_job *)ctx;
    const int64_t D = a->dim, rows = (a->positions_per_tile * a->group + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    tile_scratch t = {aligned_floats(rows * D), aligned_floats(rows * BLOCK_KEYS), aligned_floats(rows * D),
                      aligned_floats(D * BLOCK_KEYS), aligned_floats(rows), aligned_floats(rows),
                      malloc(sizeof(float *) * BLOCK_KEYS), malloc(sizeof(int64_t) * rows)};
    if (t.q && t.scores && t.acc && t.keys_t && t.max && t.sum && t.values && t.limit) {
        int64_t task;
        while ((task = atomic_fetch_add(&a->next, 1)) < a->tasks) {
            const int64_t id = a->tasks - 1 - task; /* the last tiles of a request see the most keys */
            int64_t b = 0;
            while (a->task_first[b + 1] <= id) b++;
            const int64_t local = id - a->task_first[b], h = local % a->hkv, tile = local / a->hkv;
            const int64_t first = tile * a->positions_per_tile, left = a->q_lens[b] - first;
            attend_tile(a, &t, b, h, first, left < a->positions_per_tile ? left : a->positions_per_tile);
        }
    } else {
        a->failed = 1;
    }
    free(t.q), free(t.scores), free(t.acc), free(t.keys_t), free(t.max), free(t.sum), free(t.values), free(t.limit);
}

/* Request b's q_lens[b] new tokens are q rows [q_starts[b], + q_lens[b]); its keys are the pool slots
   kv_indices[kv_starts[b] : + kv_lens[b]], the new tokens' own last. Causal: new token i sees keys
   [0, kv_lens[b] - q_lens[b] + i]; otherwise every token sees all kv_lens[b] keys.
   q, out: [T, Hkv * G, D]; k_cache, v_cache: [slots, Hkv, D]; lse: [T, Hkv * G] (natural log) or NULL.
   dim must be a multiple of 16. Returns 0; -1 when memory ran out, -2 for an unsupported dim. */
int rb_extend_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *kv_indices,
                        const int64_t *q_starts, const int64_t *q_lens, const int64_t *kv_starts,
                        const int64_t *kv_lens, int64_t batch, int64_t hkv, int64_t group, int64_t dim,
                        float scale, int causal, float *out, float *lse, int64_t threads) {
    if (dim % 16 != 0) return -2;
    int64_t per_tile = TILE_ROWS / group;
    per_tile = per_tile < 1 ? 1 : per_tile;
    int64_t *task_first = malloc(sizeof(int64_t) * (batch + 1));
    if (!task_first) return -1;
    task_first[0] = 0;
    for (int64_t b = 0; b < batch; b++) task_first[b + 1] = task_first[b] + (q_lens[b] + per_tile - 1) / per_tile * hkv;
    extend_job job = {q, k_cache, v_cache, kv_indices, q_starts, q_lens, kv_starts, kv_lens, batch, hkv, group,
                      dim, per_tile, task_first[batch], causal, scale, out, lse, task_first, 0, 0};
    if (threads > job.tasks) threads = job.tasks;
    rb_parallel(extend_part, &job, threads < 1 ? 1 : threads);
    free(task_first);
    return job.failed ? -1 : 0;
}
