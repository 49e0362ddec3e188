/* Causal attention of many new tokens (prefill / extend) over the paged K/V pool, read in place.

   Why: torch's path gathered each request's keys out of the pool, repeated them for every query
   head of a GQA group and ran one flash-attention call per request (or a padded product with an
   explicit mask); on a 2-core CPU that was 40-50 % of an extend's time. Here one call covers the
   whole batch: a task is (request, kv head, tile of about TILE_ROWS query rows); the tile's rows are
   the group's query heads of consecutive positions, held as vector lanes, so each key or value
   feature read from the pool is one broadcast against all of them (no gathered or transposed copy
   of K/V). Scores and the online softmax stay in fp32 (flash attention's running max and sum,
   vectorized across rows); tasks are pulled from a shared counter by the pool's threads, heaviest
   (last) tiles first. The products use the compiler's vector types, so the same code is AVX-512,
   AVX2 or plain SSE code depending on the build. */
#include "prefetch.h"
#include "cpu_kernels.h"
#include "fast_exp.h"
#include "thread_pool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif

/* Register blocking: KEY_GROUP keys (or value features), each broadcast against ROW_VECS vectors
   of query rows, keep KEY_GROUP * ROW_VECS accumulators and ROW_VECS row vectors in registers. */
#if defined(__AVX512F__)
#define VEC 16      /* floats per vector */
#define ROW_VECS 3  /* 24 accumulators + 3 of 32 registers */
#define KEY_GROUP 8
#elif defined(__AVX__)
#define VEC 8
#define ROW_VECS 3  /* 12 accumulators + 3 + a broadcast: all 16 registers */
#define KEY_GROUP 4
#else
#define VEC 4       /* SSE or NEON */
#define ROW_VECS 3
#define KEY_GROUP 4
#endif
#define CHUNK_ROWS (ROW_VECS * VEC) /* query rows as vector lanes: 48, 24 or 12 */
/* rows per task, about: a larger tile shares each key block's setup (its keys and values turned
   into bf16 pairs, the block's pointers and masks) among more rows; every row's arithmetic is the
   same whatever the tile (96 against 48: 1.03-1.13x on an AVX-512 Zen 5 over head sizes 64-256
   and extends of 16-1,024 tokens, level on AVX2; 144 lost on short extends) */
#define TILE_ROWS ((96 + CHUNK_ROWS - 1) / CHUNK_ROWS * CHUNK_ROWS)
#define BLOCK_KEYS 64 /* keys per online-softmax step */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VEC * sizeof(float))));

static inline vec select_vec(ivec mask, vec yes, vec no) { return (vec)(((ivec)yes & mask) | ((ivec)no & ~mask)); }

/* call(a, k) with k = min(n, limit) as a constant, for a limit of 2 or 4 */
#define SWITCH_2(n, call, a)                                                                         \
    switch ((n) < 2 ? (n) : 2) {                                                                     \
    case 1: call(a, 1); break;                                                                       \
    default: call(a, 2); break;                                                                      \
    }
#define SWITCH_4(n, call, a)                                                                         \
    switch ((n) < 4 ? (n) : 4) {                                                                     \
    case 1: call(a, 1); break;                                                                       \
    case 2: call(a, 2); break;                                                                       \
    case 3: call(a, 3); break;                                                                       \
    default: call(a, 4); break;                                                                      \
    }
#define SWITCH_LIMIT(limit, n, call, a) SWITCH_##limit(n, call, a)
#define SWITCH_UP_TO(limit, n, call, a) SWITCH_LIMIT(limit, n, call, a) /* expands `limit` first */

/* ---- bf16 products ------------------------------------------------------------------------------

   With `bf16` set, Q, K, V and the softmax's probabilities are rounded to bf16 (to nearest even;
   zeros and denormals to signed zero, NaN kept quiet: vcvtne2ps2bf16's rounding) and multiplied in
   pairs: for features (or keys) 2i and 2i + 1 the odd product is added to the fp32 sum first, then
   the even one, each product exact and each sum rounded, which is what vdpbf16ps does per lane
   (checked bit for bit on Zen 4). Where the CPU has that instruction one of them does a pair per
   lane (twice fp32's multiply-adds per instruction); elsewhere the same sums are two fp32
   multiply-adds, whose products are exact too, so every build gives the same bits (products below
   fp32's normal range aside, which the instruction flushes to zero). Scores, the softmax and the
   sums stay fp32. */
typedef uint32_t wvec __attribute__((vector_size(VEC * sizeof(float)))); /* lanes of two bf16 each */
typedef uint16_t hvec __attribute__((vector_size(VEC * sizeof(uint16_t))));
#define BF16_PAIRS (BLOCK_KEYS / 2)

static inline wvec select_words(ivec mask, wvec yes, wvec no) { return (yes & (wvec)mask) | (no & ~(wvec)mask); }

/* each lane's bf16, in its low 16 bits */
static inline wvec bf16_bits(vec x) {
    const wvec u = (wvec)x, magnitude = u & 0x7fffffffu;
    const wvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    wvec r = select_words((ivec)(magnitude > 0x7f800000u), (u >> 16) | 0x40u, rounded);
    return select_words((ivec)((u & 0x7f800000u) == 0), (u >> 16) & 0x8000u, r);
}

static inline vec load_vec(const float *x) {
    vec v;
    memcpy(&v, x, sizeof v);
    return v;
}

#if defined(__AVX512BF16__) && VEC == 16 /* vcvtne2ps2bf16: the same rounding (checked on all 2^32 inputs) */
/* lanes of (even, odd) pairs: even's bf16 in the low half, odd's in the high half */
static inline wvec bf16_pairs(vec even, vec odd) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    __m512i order;
    memcpy(&order, interleave, sizeof order);
    return (wvec)_mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh((__m512)odd, (__m512)even));
}

/* out[0 .. n) = the bf16 of x[0 .. n), n a multiple of 2 * VEC: consecutive pairs as words */
static inline void bf16_row(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i += 2 * VEC) {
        const __m512bh h = _mm512_cvtne2ps_pbh((__m512)load_vec(x + i + VEC), (__m512)load_vec(x + i));
        memcpy(out + i, &h, sizeof h);
    }
}
#else
static inline wvec bf16_pairs(vec even, vec odd) { return bf16_bits(even) | (bf16_bits(odd) << 16); }

static inline void bf16_row(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i += VEC) {
        const hvec h = __builtin_convertvector(bf16_bits(load_vec(x + i)), hvec);
        memcpy(out + i, &h, sizeof h);
    }
}
#endif

/* A pool of bf16 rows (`bf16` == KV16) holds exactly what the products above round the fp32 pool's
   rows to, so reading it gives the same bits at half the bytes. */
#define KV16 KV16_POOL

/* the pool's row at element `offset`: fp32 elements, or bf16 ones for a bf16 pool */
static inline const float *pool_at(const float *cache, int bf16, int64_t offset) {
    return bf16 == KV16 ? (const float *)((const uint16_t *)cache + offset) : cache + offset;
}

/* features d .. d + VEC of two pool rows as (even, odd) pairs */
static inline wvec pairs_at(const float *even, const float *odd, int bf16, int64_t d) {
    if (bf16 != KV16) return bf16_pairs(load_vec(even + d), load_vec(odd + d));
#if VEC == 16 && defined(__AVX512BW__)
    { /* the two rows' 16 words side by side, interleaved by one word permute */
        static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
        const __m512i both = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)((const uint16_t *)even + d))),
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)odd + d)), 1);
        return (wvec)_mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)interleave), both);
    }
#endif
    hvec e, o;
    memcpy(&e, (const uint16_t *)even + d, sizeof e), memcpy(&o, (const uint16_t *)odd + d, sizeof o);
    return __builtin_convertvector(e, wvec) | (__builtin_convertvector(o, wvec) << 16);
}

/* out[0 .. n) = the bf16 of x[0 .. n), any n: what a bf16 pool stores (the products' rounding) */
void rb_round_bf16(const float *x, int64_t n, uint16_t *out) {
    const int64_t whole = n / (2 * VEC) * (2 * VEC);
    bf16_row(x, whole, out);
    for (int64_t i = whole; i < n; i += VEC) {
        vec v = {0};
        const int64_t m = n - i < VEC ? n - i : VEC;
        memcpy(&v, x + i, sizeof(float) * m);
        const hvec h = __builtin_convertvector(bf16_bits(v), hvec);
        memcpy(out + i, &h, sizeof(uint16_t) * m);
    }
}

/* A step's new K and V rows into their pool slots in one pass: row t of k and v (kv_size floats,
   rows k_stride / v_stride floats apart: views into a fused qkv output serve as they are) goes to
   slot slots[t] of k_cache / v_cache, rounded to bf16 as rb_round_bf16 rounds them (bf16_pool) or
   copied (an fp32 pool). torch's index_copy_ of the rounded copies took ~0.5 ms a layer for a
   1,024-token prefill. Returns 0, or -1 (nothing written) if a slot is outside the pool's
   `pool_rows`. */
int rb_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t kv_size,
                const int64_t *slots, int64_t pool_rows, void *k_cache, void *v_cache, int64_t bf16_pool) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= pool_rows) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t at = slots[t] * kv_size;
        if (bf16_pool) {
            rb_round_bf16(k + t * k_stride, kv_size, (uint16_t *)k_cache + at);
            rb_round_bf16(v + t * v_stride, kv_size, (uint16_t *)v_cache + at);
        } else {
            memcpy((float *)k_cache + at, k + t * k_stride, sizeof(float) * kv_size);
            memcpy((float *)v_cache + at, v + t * v_stride, sizeof(float) * kv_size);
        }
    }
    return 0;
}

/* acc + a.odd * b.odd + a.even * b.even per lane, in that order */
static inline vec dot2(vec acc, wvec a, wvec b) {
#if defined(__AVX512BF16__) && VEC == 16
    return (vec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
    acc += (vec)(a & 0xffff0000u) * (vec)(b & 0xffff0000u);
    return acc + (vec)(a << 16) * (vec)(b << 16);
#endif
}

/* fast_exp.h's exp_clamped on a vector (same operations, so the same results): the softmax loops
   below are written on vectors because compilers left them scalar for some targets (AVX2) */
static inline vec exp_vec(vec x) {
    const vec lo = (vec){0} - 87.0f, hi = (vec){0} + 88.0f;
    x = select_vec(x < lo, lo, x);
    x = select_vec(x > hi, hi, x);
    const vec n = EXP_ROUND_N(x);
    const vec r = EXP_REDUCE(x, n);
    const ivec two_n = (__builtin_convertvector(n, ivec) + 127) << 23;
    return EXP_TAYLOR7(r) * (vec)two_n;
}

/* cap * tanh(s / cap) as 2x = 2s / cap, tanh|x| = (1 - e) / (1 + e), e = exp(-2|x|) <= 1 (no
   overflow), the sign put back: within ~1e-7 of tanhf times cap */
static inline vec softcap_vec(vec s, float cap) {
    const vec x = s * (1.f / cap), ax = select_vec(x < 0, -x, x);
    const vec e = exp_vec(-2.f * ax), t = ((vec){0} + 1.f - e) / ((vec){0} + 1.f + e);
    return select_vec(x < 0, -t, t) * cap;
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *kv_indices, *q_starts, *q_lens, *kv_starts, *kv_lens;
    int64_t batch, hkv, group, dim, positions_per_tile, tasks;
    int causal;
    int64_t window; /* > 0: a causal row sees only its last `window` keys (itself included) */
    float scale;
    float softcap; /* > 0: every score s becomes softcap * tanh(s / softcap) (Gemma 2), before masking */
    float *out, *lse;
    int bf16; /* the products in bf16 pairs (above): 1 from an fp32 pool, KV16 from a bf16 pool */
    const int64_t *task_first; /* [batch + 1]: first task id of each request */
    _Atomic int64_t next;
    _Atomic int failed;
    /* an extend with shared prefixes (rb_extend_attention_shared): request b's first start[b] keys
       (0: none) were attended by the shared pass, which left each of its rows' running max and sum
       in state[2 * i], state[2 * i + 1] (i = token * Hq + head) and its unscaled output in out */
    const int64_t *start;
    float *state;
} extend_job;

/* The key block a thread reads next: the rest of its task's keys (a decode chunk's next member), or
   the first keys of the task it has already claimed. Their K and V rows are fetched while this
   block's arithmetic runs, a few keys per step of its loops: keys lie at scattered slots that no
   hardware prefetcher follows, and a block's 256 lines requested at once overflowed the core's
   outstanding misses and left the arithmetic waiting (decode attention over contexts of 200-1,000
   keys took 1.2-1.6x the time without). */
typedef struct {
    const int64_t *slots; /* NULL: nothing known to follow */
    int64_t n;            /* keys (at most a block) */
    const char *k, *v;    /* kv head h's row in slot 0 of the pools */
    int64_t row_bytes, bytes; /* a slot's bytes in the pools; head h's in it */
} upcoming_keys;

/* the first of `keys` keys at `slots` (of kv head h) as the upcoming block: at most a block's */
static inline upcoming_keys upcoming_block(const extend_job *a, const int64_t *slots, int64_t keys, int64_t h) {
    const int64_t element = a->bf16 == KV16 ? 2 : 4;
    return (upcoming_keys){slots, slots ? (keys < BLOCK_KEYS ? keys : BLOCK_KEYS) : 0,
                           (const char *)a->k_cache + h * a->dim * element, (const char *)a->v_cache + h * a->dim * element,
                           a->hkv * a->dim * element, a->dim * element};
}

/* request b's keys from its key `from` on (kv head h) as the upcoming block */
static inline upcoming_keys request_keys_from(const extend_job *a, int64_t b, int64_t from, int64_t h) {
    return upcoming_block(a, a->kv_indices + a->kv_starts[b] + from, a->kv_lens[b] - from, h);
}

/* key i of the upcoming block, if it has one (up may be NULL). Its addresses come from the block's
   precomputed bases: this runs once per key inside the products' loops, where the general address
   arithmetic per key had cost decode attention a third of its time with every key in cache. */
static inline void prefetch_upcoming(const upcoming_keys *up, int64_t i) {
    if (!up || i >= up->n) return;
    const int64_t at = up->slots[i] * up->row_bytes;
    for (int64_t c = 0; c < up->bytes; c += 64) rb_prefetch(up->k + at + c), rb_prefetch(up->v + at + c);
    __asm__ __volatile__(""); /* see rb_prefetch_floats */
}

/* keys [from, to) of the upcoming block: those a loop's steps did not reach */
static inline void prefetch_upcoming_range(const upcoming_keys *up, int64_t from, int64_t to) {
    for (int64_t i = from; up && i < to; i++) prefetch_upcoming(up, i);
}

/* One thread's scratch, rows as the last (vector) dimension so that both products are broadcasts
   of key / value features from the pool against vectors of query rows: no transposed copy of K. */
typedef struct {
    float *q_t;     /* [D][rows]: the tile's scaled queries, transposed once per task */
    float *s_t;     /* [BLOCK_KEYS][rows]: scores, then probabilities */
    float *o_t;     /* [D][rows]: output accumulators */
    float *max, *sum, *limit, *corr; /* [rows]: running max and sum; keys visible to the row (as a
                                        float); the block's rescale factor */
    float *lower;   /* [rows]: the row's first visible key (0 without a window), as a float */
    const float **keys, **values; /* [BLOCK_KEYS]: the block's rows in the pool */
    /* bf16 products: the queries as [D / 2][rows] pairs of features, the block's keys as
       [BLOCK_KEYS][D / 2] pairs of features (rounded from an fp32 pool; a bf16 pool's rows are
       read in place, kb NULL), its values as [BF16_PAIRS][D] pairs of keys, the probabilities as
       [BF16_PAIRS][rows] pairs of keys; o_t then holds [rows][D] */
    uint32_t *qb, *kb, *vp, *pb;
} tile_scratch;

/* s_t[j][c] = sum_d keys[j][d] * q_t[d][c] for KEY_GROUP keys and one chunk of `nv` row vectors at
   column c0 (nv is a constant where inlined; every lane computes the same sums whatever nv is). */
static inline __attribute__((always_inline)) void scores_chunk(const float *restrict q_t, const float **keys,
                                                               int64_t rows, int64_t D, int64_t c0,
                                                               float *restrict s_t, const int nv) {
    vec acc[KEY_GROUP][ROW_VECS] = {{{0}}};
    for (int64_t d = 0; d < D; d++) {
        const vec *q = (const vec *)(q_t + d * rows + c0);
        vec qv[ROW_VECS];
        for (int u = 0; u < nv; u++) qv[u] = q[u];
        for (int k = 0; k < KEY_GROUP; k++) {
            const float x = keys[k][d];
            for (int u = 0; u < nv; u++) acc[k][u] += x * qv[u];
        }
    }
    for (int k = 0; k < KEY_GROUP; k++)
        for (int u = 0; u < nv; u++) ((vec *)(s_t + k * rows + c0))[u] = acc[k][u];
}

/* o_t[d][c] += sum_j values[j][d] * p_t[j][c] for KEY_GROUP features d0.. and one chunk of `nv` row
   vectors. */
static inline __attribute__((always_inline)) void values_chunk(const float *restrict p_t, const float **values,
                                                               int64_t keys, int64_t rows, int64_t d0, int64_t c0,
                                                               float *restrict o_t, const int nv) {
    vec acc[KEY_GROUP][ROW_VECS];
    for (int k = 0; k < KEY_GROUP; k++)
        for (int u = 0; u < nv; u++) acc[k][u] = ((const vec *)(o_t + (d0 + k) * rows + c0))[u];
    for (int64_t j = 0; j < keys; j++) {
        const vec *p = (const vec *)(p_t + j * rows + c0);
        vec pv[ROW_VECS];
        for (int u = 0; u < nv; u++) pv[u] = p[u];
        const float *v = values[j] + d0;
        for (int k = 0; k < KEY_GROUP; k++) {
            const float x = v[k];
            for (int u = 0; u < nv; u++) acc[k][u] += x * pv[u];
        }
    }
    for (int k = 0; k < KEY_GROUP; k++)
        for (int u = 0; u < nv; u++) ((vec *)(o_t + (d0 + k) * rows + c0))[u] = acc[k][u];
}

/* Both products over the tile's rows: whole chunks of ROW_VECS vectors, then the last 1-2 vectors
   (a decode tile of one position is a single vector of rows). */
static void tile_scores(const tile_scratch *t, int64_t j, int64_t rows, int64_t D) {
    int64_t c0 = 0;
    for (; c0 + CHUNK_ROWS <= rows; c0 += CHUNK_ROWS) scores_chunk(t->q_t, t->keys + j, rows, D, c0, t->s_t + j * rows, ROW_VECS);
    for (; c0 < rows; c0 += VEC) scores_chunk(t->q_t, t->keys + j, rows, D, c0, t->s_t + j * rows, 1);
}

static void tile_values(const tile_scratch *t, int64_t keys, int64_t d0, int64_t rows) {
    int64_t c0 = 0;
    for (; c0 + CHUNK_ROWS <= rows; c0 += CHUNK_ROWS) values_chunk(t->s_t, t->values, keys, rows, d0, c0, t->o_t, ROW_VECS);
    for (; c0 < rows; c0 += VEC) values_chunk(t->s_t, t->values, keys, rows, d0, c0, t->o_t, 1);
}

/* bf16 scores: s_t[j][c] = sum over feature pairs i of kb[k][i] . qb[i][c] for the KEY_GROUP keys
   j + k (kb[k]: key j + k's row of pairs) and one chunk of `nv` row vectors at column c0 */
static inline __attribute__((always_inline)) void scores_chunk_bf16(const uint32_t *restrict qb,
                                                                    const uint32_t *const kb[KEY_GROUP], int64_t rows,
                                                                    int64_t pairs, int64_t c0, float *restrict s_t,
                                                                    const int nv) {
    vec acc[KEY_GROUP][ROW_VECS] = {{{0}}};
    for (int64_t i = 0; i < pairs; i++) {
        const wvec *q = (const wvec *)(qb + i * rows + c0);
        wvec qv[ROW_VECS];
        for (int u = 0; u < nv; u++) qv[u] = q[u];
        for (int k = 0; k < KEY_GROUP; k++) {
            const wvec w = (wvec){0} + kb[k][i];
            for (int u = 0; u < nv; u++) acc[k][u] = dot2(acc[k][u], w, qv[u]);
        }
    }
    for (int k = 0; k < KEY_GROUP; k++)
        for (int u = 0; u < nv; u++) ((vec *)(s_t + k * rows + c0))[u] = acc[k][u];
}

#if VEC == 16
#define VALUE_ROWS 6 /* rows x VALUE_COLS accumulators + VALUE_COLS value vectors: 28 of 32 registers */
#define VALUE_COLS 4
#else
#define VALUE_ROWS 2
#define VALUE_COLS 2
#endif

/* bf16 values, features as lanes: o[r][d0 + c * VEC ..] += sum over key pairs jp of
   vp[jp][..] . pb[jp][r] for `nr` rows from r0 and `nc` vectors of features */
static inline __attribute__((always_inline)) void values_rows_bf16(const uint32_t *restrict vp,
                                                                   const uint32_t *restrict pb, int64_t pairs,
                                                                   int64_t rows, int64_t D, int64_t r0, int64_t d0,
                                                                   float *restrict o, const int nr, const int nc) {
    vec acc[VALUE_ROWS][VALUE_COLS];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = load_vec(o + (r0 + r) * D + d0 + c * VEC);
    for (int64_t jp = 0; jp < pairs; jp++) {
        wvec v[VALUE_COLS];
        for (int c = 0; c < nc; c++) v[c] = *(const wvec *)(vp + jp * D + d0 + c * VEC);
        for (int r = 0; r < nr; r++) {
            const wvec w = (wvec){0} + pb[jp * rows + r0 + r];
            for (int c = 0; c < nc; c++) acc[r][c] = dot2(acc[r][c], v[c], w);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) memcpy(o + (r0 + r) * D + d0 + c * VEC, &acc[r][c], sizeof(vec));
}

/* keys j .. j + KEY_GROUP: a bf16 pool's rows where they lie, else their rounded copies in kb */
static void tile_scores_bf16(const tile_scratch *t, int bf16, int64_t j, int64_t rows, int64_t D) {
    const int64_t pairs = D / 2;
    const uint32_t *kb[KEY_GROUP];
    for (int k = 0; k < KEY_GROUP; k++)
        kb[k] = bf16 == KV16 ? (const uint32_t *)t->keys[j + k] : t->kb + (j + k) * pairs;
    int64_t c0 = 0;
    for (; c0 + CHUNK_ROWS <= rows; c0 += CHUNK_ROWS)
        scores_chunk_bf16(t->qb, kb, rows, pairs, c0, t->s_t + j * rows, ROW_VECS);
    for (; c0 < rows; c0 += VEC) scores_chunk_bf16(t->qb, kb, rows, pairs, c0, t->s_t + j * rows, 1);
}

/* call(r, cols) with cols = min(cols_left, VALUE_COLS) as a constant */
#define COLS_SWITCH(cols_left, call, r) SWITCH_UP_TO(VALUE_COLS, cols_left, call, r)

static void tile_values_bf16(const tile_scratch *t, int64_t pairs, int64_t used, int64_t rows, int64_t D) {
    for (int64_t r0 = 0; r0 < used; r0 += VALUE_ROWS)
        for (int64_t d0 = 0; d0 < D; d0 += VALUE_COLS * VEC) {
            const int64_t left = used - r0, cols = (D - d0) / VEC;
#define VALUES(nr, nc) values_rows_bf16(t->vp, t->pb, pairs, rows, D, r0, d0, t->o_t, nr, nc)
            if (left >= VALUE_ROWS) {
                COLS_SWITCH(cols, VALUES, VALUE_ROWS)
            } else {
                switch (left) {
                case 1: COLS_SWITCH(cols, VALUES, 1) break;
#if VALUE_ROWS > 2
                case 2: COLS_SWITCH(cols, VALUES, 2) break;
                case 3: COLS_SWITCH(cols, VALUES, 3) break;
                case 4: COLS_SWITCH(cols, VALUES, 4) break;
                default: COLS_SWITCH(cols, VALUES, 5) break;
#endif
                }
            }
#undef VALUES
        }
}

/* the block's values as bf16 key pairs (`keys` rows, even) and, from an fp32 pool, its keys rounded
   to bf16 feature pairs (a bf16 pool's key rows are read where they lie) */
static void block_to_bf16(const tile_scratch *t, int bf16, int64_t keys, int64_t D) {
    for (int64_t j = 0; j < keys && bf16 != KV16; j++) bf16_row(t->keys[j], D, (uint16_t *)(t->kb + j * (D / 2)));
    for (int64_t jp = 0; jp < keys / 2; jp++)
        for (int64_t d = 0; d < D; d += VEC)
            *(wvec *)(t->vp + jp * D + d) = pairs_at(t->values[2 * jp], t->values[2 * jp + 1], bf16, d);
}

/* out[d * stride + i] = k[i][d] for VEC rows: AVX-512 transposes 16 x 16 tiles in registers
   (four steps, each swapping the off-diagonal s x s blocks of row pairs i, i + s), else one float at a time */
static void transpose_rows(const float *const *k, int64_t D, float *out, int64_t stride) {
#if VEC == 16
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        vec r[16];
        for (int i = 0; i < 16; i++) memcpy(&r[i], k[i] + d0, sizeof(vec));
#define UNWRAP(...) __VA_ARGS__
#define SWAP_BLOCKS(s, lo, hi)                                                                      \
        for (int i = 0; i < 16; i++)                                                                 \
            if (!(i & s)) {                                                                          \
                const vec a = r[i], b = r[i + s];                                                    \
                r[i] = __builtin_shufflevector(a, b, UNWRAP lo), r[i + s] = __builtin_shufflevector(a, b, UNWRAP hi); \
            }
        SWAP_BLOCKS(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                    (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
        SWAP_BLOCKS(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                    (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
        SWAP_BLOCKS(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                    (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
        SWAP_BLOCKS(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                    (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef SWAP_BLOCKS
#undef UNWRAP
        for (int i = 0; i < 16; i++) memcpy(out + (d0 + i) * stride, &r[i], sizeof(vec));
    }
#else
    for (int i = 0; i < VEC; i++)
        for (int64_t d = 0; d < D; d++) out[d * stride + i] = k[i][d];
#endif
}

#define transpose_keys(k, D, kt) transpose_rows(k, D, kt, BLOCK_KEYS) /* into a block's [D][BLOCK_KEYS] */

/* a tile's rows padded to whole vectors */
static inline int64_t tile_rows(int64_t positions, int64_t group) {
    return (positions * group + VEC - 1) / VEC * VEC;
}

/* The tile's queries: src[r] is row r's query (padding rows: a zero row), transposed VEC rows at a
   time into q_t and scaled (and, for bf16 products, paired into qb) */
static void tile_queries(const extend_job *a, const tile_scratch *t, const float *const *src, int64_t rows) {
    const int64_t D = a->dim;
    for (int64_t r0 = 0; r0 < rows; r0 += VEC) transpose_rows(src + r0, D, t->q_t + r0, rows);
    for (int64_t i = 0; i < D * rows / VEC; i++) ((vec *)t->q_t)[i] *= a->scale;
    for (int64_t i = 0; a->bf16 && i < D / 2; i++)
        for (int64_t u = 0; u < rows / VEC; u++)
            ((wvec *)(t->qb + i * rows))[u] = bf16_pairs(((vec *)(t->q_t + 2 * i * rows))[u],
                                                         ((vec *)(t->q_t + (2 * i + 1) * rows))[u]);
}

/* The tile's rows (the first `used` of `rows` real) over key block j0 of `slots` (n keys): scores,
   the online softmax vectorized across rows (masked by each row's limit and lower bound unless the
   block is `open`, every row seeing all of it: the masks would all pass, the same bits), the
   output rescaled and the block's values added. One compiled body for every caller (no copy
   specialised on a constant n whose multiplies and adds the compiler might fuse otherwise). */
static __attribute__((noinline)) void tile_block(const extend_job *a, const tile_scratch *t, const int64_t *slots,
                                                  int64_t h, int64_t j0, int64_t n, int64_t rows, int64_t used,
                                                  int open, const upcoming_keys *up) {
    const int64_t D = a->dim, row = a->hkv * D;
    const int64_t padded_keys = (n + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
    for (int64_t j = 0; j < padded_keys; j++) { /* the block's tail repeats its last key, masked below */
        const int64_t slot = slots[j0 + (j < n ? j : n - 1)];
        t->keys[j] = pool_at(a->k_cache, a->bf16, slot * row + h * D);
        t->values[j] = pool_at(a->v_cache, a->bf16, slot * row + h * D);
    }
    if (a->bf16) block_to_bf16(t, a->bf16, padded_keys, D);
    for (int64_t j = 0; j < padded_keys; j += KEY_GROUP) { /* the upcoming block's keys alongside */
        prefetch_upcoming_range(up, j * BLOCK_KEYS / padded_keys, (j + KEY_GROUP) * BLOCK_KEYS / padded_keys);
        if (a->bf16) tile_scores_bf16(t, a->bf16, j, rows, D);
        else tile_scores(t, j, rows, D);
    }
    for (int64_t j = 0; j < n && a->softcap > 0; j++)
        for (int64_t u = 0; u < rows / VEC; u++) ((vec *)(t->s_t + j * rows))[u] = softcap_vec(((vec *)(t->s_t + j * rows))[u], a->softcap);
    /* online softmax, vectorized across rows: new max, rescale factor, probabilities */
    vec *restrict mx = (vec *)t->max, *restrict sm = (vec *)t->sum, *restrict corr = (vec *)t->corr;
    const vec *restrict lim = (const vec *)t->limit, *restrict low = (const vec *)t->lower;
    const vec none = (vec){0} - INFINITY;
    const int64_t row_vecs = rows / VEC;
    for (int64_t u = 0; u < row_vecs; u++) corr[u] = mx[u];
    for (int64_t j = 0; j < n; j++) {
        const vec *s = (const vec *)(t->s_t + j * rows), key = (vec){0} + (float)(j0 + j);
        if (open)
            for (int64_t u = 0; u < row_vecs; u++) mx[u] = select_vec(s[u] > mx[u], s[u], mx[u]);
        else
            for (int64_t u = 0; u < row_vecs; u++)
                mx[u] = select_vec((key >= low[u]) & (key < lim[u]) & (s[u] > mx[u]), s[u], mx[u]);
    }
    for (int64_t u = 0; u < row_vecs; u++) {
        corr[u] = select_vec(corr[u] == none, (vec){0}, exp_vec(corr[u] - mx[u]));
        sm[u] *= corr[u];
    }
    for (int64_t j = 0; j < padded_keys; j++) {
        vec *s = (vec *)(t->s_t + j * rows), key = (vec){0} + (float)(j0 + j);
        if (j >= n)
            for (int64_t u = 0; u < row_vecs; u++) s[u] = (vec){0}, sm[u] += (vec){0};
        else if (open)
            for (int64_t u = 0; u < row_vecs; u++) s[u] = exp_vec(s[u] - mx[u]), sm[u] += s[u];
        else
            for (int64_t u = 0; u < row_vecs; u++) {
                s[u] = select_vec((key >= low[u]) & (key < lim[u]), exp_vec(s[u] - mx[u]), (vec){0});
                sm[u] += s[u];
            }
    }
    if (a->bf16) { /* o_t is [rows][D] */
        for (int64_t r = 0; r < used; r++)
            for (int64_t d = 0; d < D; d++) t->o_t[r * D + d] *= t->corr[r];
        for (int64_t jp = 0; jp < padded_keys / 2; jp++)
            for (int64_t u = 0; u < row_vecs; u++)
                ((wvec *)(t->pb + jp * rows))[u] = bf16_pairs(((vec *)(t->s_t + 2 * jp * rows))[u],
                                                              ((vec *)(t->s_t + (2 * jp + 1) * rows))[u]);
        tile_values_bf16(t, padded_keys / 2, used, rows, D);
        return;
    }
    for (int64_t d = 0; d < D; d++) {
        vec *o = (vec *)(t->o_t + d * rows);
        for (int64_t u = 0; u < row_vecs; u++) o[u] *= corr[u];
    }
    for (int64_t d0 = 0; d0 < D; d0 += KEY_GROUP) tile_values(t, padded_keys, d0, rows);
}

/* row r's accumulated output feature d (the layouts of the two products) */
static inline float tile_output(const extend_job *a, const tile_scratch *t, int64_t r, int64_t d, int64_t rows) {
    return a->bf16 ? t->o_t[r * a->dim + d] : t->o_t[d * rows + r];
}

/* row r's output accumulator for feature d, written (the layouts of tile_output) */
static inline float *tile_output_at(const extend_job *a, const tile_scratch *t, int64_t r, int64_t d, int64_t rows) {
    return a->bf16 ? &t->o_t[r * a->dim + d] : &t->o_t[d * rows + r];
}

/* One task: request b, kv head h, query positions [first, first + count) of the request. */
static void attend_tile(const extend_job *a, const tile_scratch *t, int64_t b, int64_t h, int64_t first,
                        int64_t count, upcoming_keys after) {
    const int64_t G = a->group, D = a->dim, Hq = a->hkv * G;
    const int64_t used = count * G, rows = tile_rows(count, G);
    const int64_t L = a->kv_lens[b], offset = L - a->q_lens[b];
    const int64_t *slots = a->kv_indices + a->kv_starts[b];
    int64_t keys_end = 0, keys_begin = L, first_end = L, last_begin = 0; /* first_end, last_begin: keys every row sees */
    const float *src[rows]; /* a VLA: a tile of one position holds a whole GQA group, however large */
    memset(t->o_t, 0, sizeof(float) * rows * D); /* also the padding rows' zero queries */
    for (int64_t r = 0; r < rows; r++) { /* row r = position first + r / G, query head h * G + r % G */
        if (r < used) {
            src[r] = a->q + ((a->q_starts[b] + first + r / G) * Hq + h * G + r % G) * D;
            t->limit[r] = (float)(a->causal ? offset + first + r / G + 1 : L);
            const int64_t lower = a->causal && a->window > 0 ? (int64_t)t->limit[r] - a->window : 0;
            t->lower[r] = (float)(lower > 0 ? lower : 0);
        } else { /* padding: zero queries, the last real row's keys (never empty, no extra blocks), never written out */
            src[r] = t->o_t;
            t->limit[r] = t->limit[used - 1];
            t->lower[r] = t->lower[used - 1];
        }
        keys_end = (int64_t)t->limit[r] > keys_end ? (int64_t)t->limit[r] : keys_end;
        keys_begin = (int64_t)t->lower[r] < keys_begin ? (int64_t)t->lower[r] : keys_begin;
        first_end = (int64_t)t->limit[r] < first_end ? (int64_t)t->limit[r] : first_end;
        last_begin = (int64_t)t->lower[r] > last_begin ? (int64_t)t->lower[r] : last_begin;
        t->max[r] = -INFINITY;
        t->sum[r] = 0.f;
    }
    tile_queries(a, t, src, rows);
    const int64_t start = a->start ? a->start[b] : 0; /* keys the shared pass took: its state resumed */
    for (int64_t r = 0; start && r < used; r++) {
        const int64_t i = (a->q_starts[b] + first + r / G) * Hq + h * G + r % G;
        t->max[r] = a->state[2 * i], t->sum[r] = a->state[2 * i + 1];
        for (int64_t d = 0; d < D; d++) *tile_output_at(a, t, r, d, rows) = a->out[i * D + d];
    }
    /* blocks before every row's window would add exact zeros: skipped, keeping the block grid */
    for (int64_t j0 = start ? start : keys_begin / BLOCK_KEYS * BLOCK_KEYS; j0 < keys_end; j0 += BLOCK_KEYS) {
        const int64_t n = keys_end - j0 < BLOCK_KEYS ? keys_end - j0 : BLOCK_KEYS, left = keys_end - j0 - n;
        const upcoming_keys up = left > 0 ? upcoming_block(a, slots + j0 + n, left, h) : after;
        tile_block(a, t, slots, h, j0, n, rows, used, j0 >= last_begin && j0 + n <= first_end, &up);
    }
    for (int64_t r = 0; r < used; r++) {
        const int64_t token = a->q_starts[b] + first + r / G, head = h * G + r % G;
        const float inv = 1.f / t->sum[r];
        float *dst = a->out + (token * Hq + head) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = tile_output(a, t, r, d, rows) * inv;
        if (a->lse) a->lse[token * Hq + head] = t->max[r] + logf(t->sum[r]);
    }
}

static void *aligned_floats(int64_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, sizeof(float) * (size_t)(n < 16 ? 16 : n)) ? NULL : p;
}

/* A tile's scratch for up to `rows` rows; 0, or -1 when memory ran out (whatever was allocated freed) */
static void tile_scratch_free(tile_scratch *t) {
    free(t->q_t), free(t->s_t), free(t->o_t), free(t->max), free(t->sum), free(t->limit), free(t->corr);
    free(t->lower), free(t->keys), free(t->values), free(t->qb), free(t->kb), free(t->vp), free(t->pb);
}

static int tile_scratch_alloc(tile_scratch *t, int64_t rows, int64_t D, int bf16) {
    *t = (tile_scratch){aligned_floats(D * rows), aligned_floats(BLOCK_KEYS * rows), aligned_floats(D * rows),
                        aligned_floats(rows), aligned_floats(rows), aligned_floats(rows), aligned_floats(rows),
                        aligned_floats(rows), malloc(sizeof(float *) * BLOCK_KEYS),
                        malloc(sizeof(float *) * BLOCK_KEYS), NULL, NULL, NULL, NULL};
    if (bf16) /* words are float-sized */
        t->qb = aligned_floats(D / 2 * rows), t->kb = bf16 == KV16 ? NULL : aligned_floats(BLOCK_KEYS * D / 2),
        t->vp = aligned_floats(BF16_PAIRS * D), t->pb = aligned_floats(BF16_PAIRS * rows);
    if (t->q_t && t->s_t && t->o_t && t->max && t->sum && t->limit && t->corr && t->lower && t->keys && t->values
        && (!bf16 || (t->qb && (t->kb || bf16 == KV16) && t->vp && t->pb)))
        return 0;
    tile_scratch_free(t);
    return -1;
}

/* ---- shared prefixes: the first pass of rb_extend_attention_shared ---------------------------------
   Requests that continue one radix node hold the same slots for their common prefix, which every
   one of their new rows sees whole (it is cached). A request of a few new tokens fills a tile with
   few rows, and each of its tiles steps through the whole prefix: 32 requests of 12 new tokens
   behind 1,057 shared keys took twice the time of the same rows over the prefix in full tiles.
   Here the members' rows are packed into full tiles for the shared keys' blocks; each row's
   running max, sum and output are then handed to its own request's tiles, which go on from the
   next block. A row's arithmetic is the same lane by lane whichever tile holds it, and its
   blocks keep the request's grid (shared lengths are whole blocks), so it gets the same bits. */
typedef struct {
    const int64_t *members; /* requests (batch indices) */
    int64_t shared;         /* keys they share, a multiple of BLOCK_KEYS */
    int64_t first, positions; /* the tile: positions [first, first + positions) of the members' new tokens in turn */
    int64_t h;              /* kv head */
} shared_task;

/* one shared task: its rows over the shared blocks, their state left for their requests' tiles */
static void shared_tile(const extend_job *a, const tile_scratch *t, const shared_task *task, upcoming_keys after) {
    const int64_t G = a->group, D = a->dim, Hq = a->hkv * G, h = task->h;
    const int64_t used = task->positions * G, rows = tile_rows(task->positions, G);
    const float *src[rows];
    int64_t index[rows]; /* row r's token * Hq + head */
    memset(t->o_t, 0, sizeof(float) * rows * D);
    int64_t m = 0, p = task->first; /* member m's new position p: the tile's first */
    while (p >= a->q_lens[task->members[m]]) p -= a->q_lens[task->members[m++]];
    for (int64_t r = 0; r < rows; r++) {
        if (r < used) {
            if (r && r % G == 0 && ++p == a->q_lens[task->members[m]]) p = 0, m++;
            index[r] = (a->q_starts[task->members[m]] + p) * Hq + h * G + r % G;
            src[r] = a->q + index[r] * D;
        } else {
            src[r] = t->o_t; /* padding: a zero query, never written out */
        }
        t->limit[r] = (float)task->shared, t->lower[r] = 0.f; /* unread: every block is open */
        t->max[r] = -INFINITY, t->sum[r] = 0.f;
    }
    tile_queries(a, t, src, rows);
    const int64_t *slots = a->kv_indices + a->kv_starts[task->members[0]];
    for (int64_t j0 = 0; j0 < task->shared; j0 += BLOCK_KEYS) {
        const upcoming_keys up = j0 + BLOCK_KEYS < task->shared
                                     ? upcoming_block(a, slots + j0 + BLOCK_KEYS, task->shared - j0 - BLOCK_KEYS, h) : after;
        tile_block(a, t, slots, h, j0, BLOCK_KEYS, rows, used, 1, &up);
    }
    for (int64_t r = 0; r < used; r++) {
        a->state[2 * index[r]] = t->max[r], a->state[2 * index[r] + 1] = t->sum[r];
        for (int64_t d = 0; d < D; d++) a->out[index[r] * D + d] = tile_output(a, t, r, d, rows);
    }
}

typedef struct {
    const extend_job *a;
    const shared_task *tasks;
    int64_t count;
    _Atomic int64_t next;
    _Atomic int failed;
} shared_job;

static void shared_part(void *ctx, int64_t part, int64_t parts) {
    (void)part, (void)parts;
    shared_job *job = (shared_job *)ctx;
    const extend_job *a = job->a;
    tile_scratch t;
    if (tile_scratch_alloc(&t, tile_rows(a->positions_per_tile, a->group), a->dim, a->bf16)) {
        job->failed = 1;
        return;
    }
    for (int64_t i = atomic_fetch_add(&job->next, 1), following; i < job->count; i = following) {
        following = atomic_fetch_add(&job->next, 1);
        const shared_task *next = following < job->count ? &job->tasks[following] : NULL;
        const upcoming_keys after = next ? upcoming_block(a, a->kv_indices + a->kv_starts[next->members[0]],
                                                          next->shared, next->h)
                                         : upcoming_block(a, NULL, 0, 0);
        shared_tile(a, &t, &job->tasks[i], after);
    }
    tile_scratch_free(&t);
}

/* Whether request b's rows join the shared pass: a tile of fewer than CHUNK_ROWS rows (one register
   block) leaves lanes idle and repeats each block's setup for few rows, which full shared tiles
   avoid (32 requests of 12 new tokens behind 1,024 shared keys: 1.2x a layer, 1 new token: 2.1-2.5x);
   fuller ones gain nothing and would hand their state over through memory (48 requests of 109
   tokens behind 192: 0.71-0.82x with every request in; AVX-512 Zen 4). */
static inline int joins_shared_pass(const extend_job *a, int64_t b) {
    return a->q_lens[b] * a->group < CHUNK_ROWS;
}

/* The shared pass over `sharing`'s chunks: the members that join it (joins_shared_pass), two or more
   sharing a whole block, get start[b] (0 for every other request) and their state in a->state.
   0; -1 when memory ran out. */
static int shared_pass(extend_job *a, const rb_key_sharing *sharing, int64_t *start, int64_t threads) {
    const int64_t per_tile = a->positions_per_tile;
    int64_t *joined = (int64_t *)malloc(sizeof(int64_t) * (a->batch > 0 ? a->batch : 1));
    int64_t *first_joined = (int64_t *)malloc(sizeof(int64_t) * (sharing->chunks + 1));
    if (!joined || !first_joined) {
        free(joined), free(first_joined);
        return -1;
    }
    int64_t n = 0, tasks_needed = 0, rows = 0;
    for (int64_t b = 0; b < a->batch; b++) start[b] = 0, rows += a->q_lens[b];
    for (int64_t c = 0; c < sharing->chunks; c++) { /* chunk c's joining members: joined[first_joined[c] ..) */
        first_joined[c] = n;
        int64_t positions = 0;
        for (int64_t m = sharing->bounds[c]; m < sharing->bounds[c + 1]; m++)
            if (joins_shared_pass(a, sharing->order[m])) joined[n++] = sharing->order[m], positions += a->q_lens[sharing->order[m]];
        if (n - first_joined[c] < 2 || sharing->shared[c] < BLOCK_KEYS) n = first_joined[c]; /* nothing to share */
        else tasks_needed += (positions + per_tile - 1) / per_tile * a->hkv;
    }
    first_joined[sharing->chunks] = n;
    shared_task *tasks = tasks_needed ? (shared_task *)malloc(sizeof(shared_task) * tasks_needed) : NULL;
    float *state = tasks_needed ? (float *)malloc(sizeof(float) * 2 * rows * a->hkv * a->group) : NULL;
    if (tasks_needed && (!tasks || !state)) {
        free(joined), free(first_joined), free(tasks), free(state);
        return -1;
    }
    n = 0;
    for (int64_t c = 0; c < sharing->chunks; c++) {
        const int64_t *members = joined + first_joined[c], count = first_joined[c + 1] - first_joined[c];
        const int64_t shared = sharing->shared[c] / BLOCK_KEYS * BLOCK_KEYS;
        int64_t positions = 0;
        for (int64_t m = 0; m < count; m++) positions += a->q_lens[members[m]], start[members[m]] = shared;
        for (int64_t first = 0; first < positions; first += per_tile)
            for (int64_t h = 0; h < a->hkv; h++)
                tasks[n++] = (shared_task){members, shared, first,
                                           positions - first < per_tile ? positions - first : per_tile, h};
    }
    a->state = state;
    shared_job job = {a, tasks, n, 0, 0};
    if (n) rb_parallel(shared_part, &job, threads < 1 ? 1 : threads > n ? n : threads);
    free(joined), free(first_joined), free(tasks);
    return job.failed ? -1 : 0;
}

/* Task `task` of an extend: request b's kv head h over its new positions [first, first + count).
   The last tiles of a request see the most keys, so tasks run from the last. */
typedef struct {
    int64_t b, h, first, count;
} tile_task;

static tile_task tile_task_of(const extend_job *a, int64_t task) {
    const int64_t id = a->tasks - 1 - task;
    int64_t b = 0;
    while (a->task_first[b + 1] <= id) b++;
    const int64_t local = id - a->task_first[b], first = local / a->hkv * a->positions_per_tile;
    const int64_t left = a->q_lens[b] - first;
    return (tile_task){b, local % a->hkv, first, left < a->positions_per_tile ? left : a->positions_per_tile};
}

/* the first key block a task reads (its first row's window start, on the block grid), or none past
   the last task */
static upcoming_keys tile_first_keys(const extend_job *a, int64_t task) {
    if (task >= a->tasks) return upcoming_block(a, NULL, 0, 0);
    const tile_task at = tile_task_of(a, task);
    const int64_t L = a->kv_lens[at.b], limit = a->causal ? L - a->q_lens[at.b] + at.first + 1 : L;
    const int64_t lower = a->causal && a->window > 0 && limit > a->window ? limit - a->window : 0;
    const int64_t start = a->start ? a->start[at.b] : 0, j0 = start ? start : lower / BLOCK_KEYS * BLOCK_KEYS;
    return upcoming_block(a, a->kv_indices + a->kv_starts[at.b] + j0, limit - j0, at.h);
}

static void extend_part(void *ctx, int64_t part, int64_t parts) {
    (void)part, (void)parts;
    extend_job *a = (extend_job *)ctx;
    tile_scratch t;
    if (tile_scratch_alloc(&t, tile_rows(a->positions_per_tile, a->group), a->dim, a->bf16)) {
        a->failed = 1;
        return;
    }
    /* each thread claims its next task before it works on this one, to fetch that task's first keys */
    for (int64_t task = atomic_fetch_add(&a->next, 1), following; task < a->tasks; task = following) {
        following = atomic_fetch_add(&a->next, 1);
        const tile_task at = tile_task_of(a, task);
        attend_tile(a, &t, at.b, at.h, at.first, at.count, tile_first_keys(a, following));
    }
    tile_scratch_free(&t);
}

static int attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *kv_indices,
                  const int64_t *q_starts, const int64_t *q_lens, const int64_t *kv_starts, const int64_t *kv_lens,
                  int64_t batch, int64_t hkv, int64_t group, int64_t dim, float scale, int causal,
                  int64_t window, float softcap, float *out, float *lse, int64_t threads, int64_t per_tile,
                  int64_t bf16, const rb_key_sharing *sharing) {
    if (dim % (bf16 ? 32 : 16) != 0 || bf16 < 0 || bf16 > KV16) return -2; /* a multiple of KEY_GROUP; bf16: of two vectors' pairs */
    for (int64_t c = 0; sharing && c < sharing->chunks; c++) /* every member's rows see its shared keys whole */
        for (int64_t m = sharing->bounds[c]; m < sharing->bounds[c + 1]; m++) {
            const int64_t b = sharing->order[m];
            if (b < 0 || b >= batch || sharing->shared[c] > kv_lens[b] - (causal ? q_lens[b] : 0)) return -3;
        }
    int64_t *task_first = malloc(sizeof(int64_t) * (batch + 1)), *start = NULL;
    if (!task_first) return -1;
    task_first[0] = 0;
    for (int64_t b = 0; b < batch; b++)
        task_first[b + 1] = task_first[b] + (q_lens[b] + per_tile - 1) / per_tile * hkv;
    extend_job job = {q, k_cache, v_cache, kv_indices, q_starts, q_lens, kv_starts, kv_lens, batch, hkv, group,
                      dim, per_tile, task_first[batch], causal, window, scale, softcap, out, lse, (int)bf16, task_first,
                      0, 0, NULL, NULL};
    if (sharing && window == 0) { /* a window's rows do not all see a prefix whole */
        start = malloc(sizeof(int64_t) * (batch > 0 ? batch : 1));
        if (!start || shared_pass(&job, sharing, start, threads)) job.failed = 1;
        job.start = start;
    }
    if (threads > job.tasks) threads = job.tasks;
    if (!job.failed) rb_parallel(extend_part, &job, threads < 1 ? 1 : threads);
    free(task_first), free(start), free(job.state);
    return job.failed ? -1 : 0;
}

/* Request b's q_lens[b] new tokens are q rows [q_starts[b], + q_lens[b]); its keys are the pool slots
   kv_indices[kv_starts[b] : + kv_lens[b]], the new tokens' own last. Causal: new token i sees keys
   [0, kv_lens[b] - q_lens[b] + i]; otherwise every token sees all kv_lens[b] keys.
   q, out: [T, Hkv * G, D]; k_cache, v_cache: [slots, Hkv, D]; lse: [T, Hkv * G] (natural log) or NULL.
   dim must be a multiple of 16. Returns 0; -1 when memory ran out, -2 for an unsupported dim.
   A row's result depends on its own query and keys only: key blocks start at the request's first
   key whatever the tile, masked keys add exact zeros, and blocks past a row's last key leave it
   unchanged (exp(0) == 1 exactly), so chunked prefill, a cached prefix and the tile a row shares
   with others give the same bits. */
int rb_extend_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *kv_indices,
                        const int64_t *q_starts, const int64_t *q_lens, const int64_t *kv_starts,
                        const int64_t *kv_lens, int64_t batch, int64_t hkv, int64_t group, int64_t dim,
                        float scale, int causal, float *out, float *lse, int64_t threads) {
    return rb_extend_attention_window(q, k_cache, v_cache, kv_indices, q_starts, q_lens, kv_starts, kv_lens, batch,
                                      hkv, group, dim, scale, causal, 0, 0.f, out, lse, threads, 0);
}

/* The same with a sliding window (`window` > 0, causal only): new token i of request b, at key
   position p = kv_lens[b] - q_lens[b] + i, sees keys [max(0, p - window + 1), p] (HF's sliding-window
   mask). Key blocks stay on the request's grid of BLOCK_KEYS, so rows keep the bits above.
   `softcap` > 0 caps every score s (after the scale) as softcap * tanh(s / softcap), Gemma 2's
   attention logit soft-capping. `bf16`: the products in bf16 pairs (see above; dim a multiple of
   32), the same bits on every build. */
int rb_extend_attention_window(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *kv_indices, const int64_t *q_starts, const int64_t *q_lens,
                               const int64_t *kv_starts, const int64_t *kv_lens, int64_t batch, int64_t hkv,
                               int64_t group, int64_t dim, float scale, int causal, int64_t window, float softcap,
                               float *out, float *lse, int64_t threads, int64_t bf16) {
    return rb_extend_attention_shared(q, k_cache, v_cache, kv_indices, q_starts, q_lens, kv_starts, kv_lens, batch,
                                      hkv, group, dim, scale, causal, window, softcap, NULL, out, lse, threads, bf16);
}

/* The same where requests of the batch begin with the same slots (`sharing`, or NULL: none; the
   chunks of `rb_key_sharing`, each request in at most one, each chunk's shared keys inside every
   member's cached prefix: kv_lens[b] - q_lens[b], or kv_lens[b] when not causal): a chunk's rows
   attend its shared whole blocks in full tiles first (shared_pass), the same bits as without.
   Ignored with a window. Returns -3 for a shared length past a member's prefix, else as above. */
int rb_extend_attention_shared(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *kv_indices, const int64_t *q_starts, const int64_t *q_lens,
                               const int64_t *kv_starts, const int64_t *kv_lens, int64_t batch, int64_t hkv,
                               int64_t group, int64_t dim, float scale, int causal, int64_t window, float softcap,
                               const rb_key_sharing *sharing, float *out, float *lse, int64_t threads, int64_t bf16) {
    const int64_t per_tile = TILE_ROWS / group;
    return attend(q, k_cache, v_cache, kv_indices, q_starts, q_lens, kv_starts, kv_lens, batch, hkv, group, dim,
                  scale, causal, window, softcap, out, lse, threads, per_tile < 1 ? 1 : per_tile, bf16, sharing);
}

/* ---- decode: one query row per request, the same sums with keys as vector lanes ------------------

   A decode row must get exactly the bits the tiles above give it (a token decoded, the same
   position recomputed by a cold prefill, or verified inside a longer extend), but a tile of one
   position fills only G lanes of a vector. Here the lanes hold keys instead: scores are the same
   fused multiply-adds over d in the same order (each lane one key), the softmax takes the same
   64-key blocks, running max, rescale factor and sequential sum, and the values are accumulated
   per feature in key order, as `values_chunk` does per row. */
typedef struct {
    float *qs;    /* [M][G][D]: scaled queries of a chunk's M requests */
    float *kt;    /* [D][BLOCK_KEYS]: the block's keys, transposed */
    float *s;     /* [G][BLOCK_KEYS]: scores, then probabilities */
    float *o;     /* [M][G][D]: output accumulators */
    float *max, *sum; /* [M][G] */
    /* bf16 products: the queries as [M][G][D / 2] pairs of features, the block's keys as
       [D / 2][BLOCK_KEYS] pairs of features (transposed from the pool's rows, an fp32 pool's rounded
       into `rows16` first, [VEC][D] bf16; NULL for a bf16 pool), its values
       as [BF16_PAIRS][D] pairs of keys, the probabilities as [G][BF16_PAIRS] pairs of keys */
    uint32_t *qw, *ktw, *vpw, *pw;
    uint16_t *rows16;
} decode_scratch;

static inline float exp_one(float x) { return exp_vec((vec){0} + x)[0]; } /* exp_vec's value, lane 0 */

/* the scores loop fetches the first half of the upcoming block, the values loop the second */
#define UPCOMING_HALF (BLOCK_KEYS / 2)

#define DECODE_CHAINS 4 /* independent vectors per pass: one chain of D dependent FMAs was latency bound */
#if VEC == 16
#define DECODE_HEADS 4 /* query heads that use each loaded key or value vector: 16 accumulators of 32 registers */
#else
#define DECODE_HEADS 2 /* 8 accumulators + 4 loaded vectors of 16 registers */
#endif

/* s[g][u] = sum_d kt[d][u] * qs[g][d] for `heads` query heads and `c` vectors of keys from u0 on
   (both constants where inlined): each lane's fused multiply-adds run over d in order, as one
   vector of one head at a time would, so the bits do not depend on the blocking. */
static inline __attribute__((always_inline)) void decode_scores(const float *kt, const float *qs, int64_t D,
                                                                int64_t u0, float *s, const int c, const int heads,
                                                                const upcoming_keys *up) {
    vec acc[DECODE_HEADS][DECODE_CHAINS] = {{{0}}};
    for (int64_t d = 0; d < D; d++) {
        if (d < UPCOMING_HALF) prefetch_upcoming(up, d);
        const vec *k = (const vec *)(kt + d * BLOCK_KEYS) + u0;
        vec kv[DECODE_CHAINS];
        for (int i = 0; i < c; i++) kv[i] = k[i];
        for (int g = 0; g < heads; g++) {
            const float x = qs[g * D + d];
            for (int i = 0; i < c; i++) acc[g][i] += kv[i] * x;
        }
    }
    for (int g = 0; g < heads; g++)
        for (int i = 0; i < c; i++) ((vec *)(s + g * BLOCK_KEYS))[u0 + i] = acc[g][i];
}

/* o[g][d0 + i * VEC ..] += sum_j v_j[..] * p[g][j] over the block's n keys in order, for `heads`
   query heads and `c` vectors of features (in registers across the keys; each element summed in
   key order) */
static inline __attribute__((always_inline)) void decode_values(const extend_job *a, const int64_t *slots,
                                                                int64_t row, int64_t h, const float *p, int64_t n,
                                                                int64_t d0, float *o, const int c, const int heads,
                                                                const upcoming_keys *up) {
    const int64_t D = a->dim;
    vec acc[DECODE_HEADS][DECODE_CHAINS];
    for (int g = 0; g < heads; g++)
        for (int i = 0; i < c; i++) acc[g][i] = *(const vec *)(o + g * D + d0 + i * VEC);
    for (int64_t j = 0; j < n; j++) {
        if (j < UPCOMING_HALF) prefetch_upcoming(up, UPCOMING_HALF + j);
        const float *v = a->v_cache + slots[j] * row + h * D + d0;
        vec vv[DECODE_CHAINS];
        for (int i = 0; i < c; i++) vv[i] = *(const vec *)(v + i * VEC);
        for (int g = 0; g < heads; g++) {
            const float x = p[g * BLOCK_KEYS + j];
            for (int i = 0; i < c; i++) acc[g][i] += vv[i] * x;
        }
    }
    for (int g = 0; g < heads; g++)
        for (int i = 0; i < c; i++) *(vec *)(o + g * D + d0 + i * VEC) = acc[g][i];
}

/* call(c, heads) with c = min(left, DECODE_CHAINS) and heads = min(heads_left, DECODE_HEADS) as constants */
#define HEADS_SWITCH(left, call, c) SWITCH_UP_TO(DECODE_HEADS, left, call, c)
#define DECODE_SWITCH(left, heads_left, call)                                                       \
    switch ((left) < DECODE_CHAINS ? (left) : DECODE_CHAINS) {                                      \
    case 1: HEADS_SWITCH(heads_left, call, 1) break;                                                 \
    case 2: HEADS_SWITCH(heads_left, call, 2) break;                                                 \
    case 3: HEADS_SWITCH(heads_left, call, 3) break;                                                 \
    default: HEADS_SWITCH(heads_left, call, 4) break;                                                \
    }

/* Member m of a chunk (request b) starts: its scaled queries, an empty softmax state */
static void member_begin(const extend_job *a, const decode_scratch *t, int64_t m, int64_t b, int64_t h) {
    const int64_t G = a->group, D = a->dim, Hq = a->hkv * G;
    for (int64_t g = 0; g < G; g++) {
        const float *src = a->q + (b * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; d++) t->qs[(m * G + g) * D + d] = src[d] * a->scale;
        if (a->bf16) bf16_row(t->qs + (m * G + g) * D, D, (uint16_t *)(t->qw + (m * G + g) * D / 2));
        t->max[m * G + g] = -INFINITY;
        t->sum[m * G + g] = 0.f;
    }
    memset(t->o + m * G * D, 0, sizeof(float) * G * D);
}

/* t->kt = the n keys of block j0 of `slots`, transposed; lanes past n repeat the last key and are
   never used */
static void load_block(const extend_job *a, const decode_scratch *t, const int64_t *slots, int64_t h,
                       int64_t j0, int64_t n) {
    const int64_t D = a->dim, row = a->hkv * D, nv = (n + VEC - 1) / VEC;
    for (int64_t u = 0; u < nv; u++) {
        const float *k[VEC];
        for (int64_t i = 0; i < VEC; i++) {
            const int64_t j = u * VEC + i;
            k[i] = pool_at(a->k_cache, a->bf16, slots[j0 + (j < n ? j : n - 1)] * row + h * D);
        }
        if (!a->bf16) {
            transpose_keys(k, D, t->kt + u * VEC);
            continue;
        }
        /* the keys' bf16 rows as word-sized lanes to transpose: a bf16 pool's rows are read where
           they lie (a copy per key was 4 % of a workload's time), an fp32 pool's rounded first */
        const float *words[VEC];
        for (int64_t i = 0; i < VEC; i++) {
            if (a->bf16 != KV16) bf16_row(k[i], D, t->rows16 + i * D);
            words[i] = a->bf16 == KV16 ? k[i] : (const float *)(t->rows16 + i * D);
        }
        transpose_keys(words, D / 2, (float *)t->ktw + u * VEC);
    }
    for (int64_t jp = 0; a->bf16 && jp < (n + 1) / 2; jp++) { /* an odd block's last pair repeats its key */
        const float *even = pool_at(a->v_cache, a->bf16, slots[j0 + 2 * jp] * row + h * D);
        const float *odd = pool_at(a->v_cache, a->bf16, slots[j0 + (2 * jp + 1 < n ? 2 * jp + 1 : n - 1)] * row + h * D);
        for (int64_t d = 0; d < D; d += VEC) *(wvec *)(t->vpw + jp * D + d) = pairs_at(even, odd, a->bf16, d);
    }
}

/* The online softmax of `heads` query heads (state at mg0..) over a block's n scores s[g][j]
   (keys as lanes; lanes n.. of the last of the nv vectors repeat key n - 1): the new max, the
   rescale factor, the probabilities in place, each head's sum taken key by key in order (as
   `attend_tile` sums a row's lane) with the heads' chains interleaved, the output rescaled. The
   max is taken on vectors: a maximum does not depend on the order it is taken in. */
static inline __attribute__((always_inline)) void block_softmax(const extend_job *a, const decode_scratch *t,
                                                                int64_t mg0, float *s, float *o, int64_t n,
                                                                int64_t nv, const int heads) {
    const int64_t D = a->dim;
    float mx[DECODE_HEADS], corr[DECODE_HEADS], sum[DECODE_HEADS];
    for (int g = 0; g < heads; g++) {
        vec *sv = (vec *)(s + g * BLOCK_KEYS);
        for (int64_t u = 0; u < nv && a->softcap > 0; u++) sv[u] = softcap_vec(sv[u], a->softcap);
        const float old = t->max[mg0 + g];
        vec m = (vec){0} + old;
        for (int64_t u = 0; u < nv; u++) m = select_vec(sv[u] > m, sv[u], m);
        mx[g] = old;
        for (int i = 0; i < VEC; i++) mx[g] = m[i] > mx[g] ? m[i] : mx[g];
        corr[g] = old == -INFINITY ? 0.f : exp_one(old - mx[g]);
        t->max[mg0 + g] = mx[g];
        sum[g] = t->sum[mg0 + g] * corr[g];
        for (int64_t u = 0; u < nv; u++) sv[u] = exp_vec(sv[u] - mx[g]);
    }
    for (int64_t j = 0; j < n; j++)
        for (int g = 0; g < heads; g++) sum[g] += s[g * BLOCK_KEYS + j];
    for (int g = 0; g < heads; g++) {
        t->sum[mg0 + g] = sum[g];
        for (int64_t d = 0; d < D; d++) o[g * D + d] *= corr[g];
    }
}

/* decode_scores with bf16 pairs of features */
static inline __attribute__((always_inline)) void decode_scores_bf16(const uint32_t *ktw, const uint32_t *qw,
                                                                     int64_t pairs, int64_t u0, float *s,
                                                                     const int c, const int heads,
                                                                     const upcoming_keys *up) {
    vec acc[DECODE_HEADS][DECODE_CHAINS] = {{{0}}};
    for (int64_t i = 0; i < pairs; i++) {
        if (i < UPCOMING_HALF) prefetch_upcoming(up, i);
        const wvec *k = (const wvec *)(ktw + i * BLOCK_KEYS) + u0;
        wvec kv[DECODE_CHAINS];
        for (int j = 0; j < c; j++) kv[j] = k[j];
        for (int g = 0; g < heads; g++) {
            const wvec w = (wvec){0} + qw[g * pairs + i];
            for (int j = 0; j < c; j++) acc[g][j] = dot2(acc[g][j], kv[j], w);
        }
    }
    for (int g = 0; g < heads; g++)
        for (int j = 0; j < c; j++) ((vec *)(s + g * BLOCK_KEYS))[u0 + j] = acc[g][j];
}

/* decode_values with bf16 pairs of keys (`pairs` of them) */
static inline __attribute__((always_inline)) void decode_values_bf16(const uint32_t *vpw, const uint32_t *pw,
                                                                     int64_t pairs, int64_t D, int64_t d0, float *o,
                                                                     const int c, const int heads,
                                                                     const upcoming_keys *up) {
    vec acc[DECODE_HEADS][DECODE_CHAINS];
    for (int g = 0; g < heads; g++)
        for (int i = 0; i < c; i++) acc[g][i] = *(const vec *)(o + g * D + d0 + i * VEC);
    for (int64_t jp = 0; jp < pairs; jp++) {
        if (jp < UPCOMING_HALF) prefetch_upcoming(up, UPCOMING_HALF + jp);
        wvec vv[DECODE_CHAINS];
        for (int i = 0; i < c; i++) vv[i] = *(const wvec *)(vpw + jp * D + d0 + i * VEC);
        for (int g = 0; g < heads; g++) {
            const wvec w = (wvec){0} + pw[g * BF16_PAIRS + jp];
            for (int i = 0; i < c; i++) acc[g][i] = dot2(acc[g][i], vv[i], w);
        }
    }
    for (int g = 0; g < heads; g++)
        for (int i = 0; i < c; i++) *(vec *)(o + g * D + d0 + i * VEC) = acc[g][i];
}

/* Member m's G query heads over the loaded block j0 (n keys; its values read through `slots`, or
   with bf16 products from the block's pairs, where the probabilities of keys past n, lanes that
   repeat key n - 1, are zero as a masked key's are in the tiles). One compiled body for every
   caller (noinline, and noclone: GCC clones a function for a caller's constant argument even when
   it may not inline it): a copy specialised for a constant n == BLOCK_KEYS fused other multiplies
   and adds (the rescaled sum) and changed bits. */
static __attribute__((noinline, noclone)) void member_block(const extend_job *a, const decode_scratch *t, int64_t m,
                                                  const int64_t *slots, int64_t h, int64_t j0, int64_t n,
                                                  const upcoming_keys *up) {
    const int64_t G = a->group, D = a->dim, row = a->hkv * D, nv = (n + VEC - 1) / VEC, pairs = (n + 1) / 2;
    const float *qs = t->qs + m * G * D;
    const uint32_t *qw = a->bf16 ? t->qw + m * G * D / 2 : NULL;
    float *o = t->o + m * G * D;
    for (int64_t g0 = 0; g0 < G; g0 += DECODE_HEADS)
        for (int64_t u0 = 0; u0 < nv; u0 += DECODE_CHAINS) {
            const upcoming_keys *fetch = g0 == 0 && u0 == 0 ? up : NULL; /* the first pass fetches */
#define SCORES(c, heads)                                                                            \
    if (a->bf16) decode_scores_bf16(t->ktw, qw + g0 * D / 2, D / 2, u0, t->s + g0 * BLOCK_KEYS, c, heads, fetch); \
    else decode_scores(t->kt, qs + g0 * D, D, u0, t->s + g0 * BLOCK_KEYS, c, heads, fetch);
            DECODE_SWITCH(nv - u0, G - g0, SCORES)
#undef SCORES
        }
    prefetch_upcoming_range(up, a->bf16 ? D / 2 : D, UPCOMING_HALF); /* a head too small to reach them */
    for (int64_t g0 = 0; g0 < G; g0 += DECODE_HEADS) {
#define SOFTMAX(unused, heads) block_softmax(a, t, m * G + g0, t->s + g0 * BLOCK_KEYS, o + g0 * D, n, nv, heads);
        HEADS_SWITCH(G - g0, SOFTMAX, 0)
#undef SOFTMAX
    }
    for (int64_t g = 0; a->bf16 && g < G; g++) { /* consecutive keys' probabilities as pairs, none past n */
        float *p = t->s + g * BLOCK_KEYS;
        for (int64_t j = n; j < nv * VEC; j++) p[j] = 0.f;
        bf16_row(p, (nv * VEC + 2 * VEC - 1) / (2 * VEC) * (2 * VEC), (uint16_t *)(t->pw + g * BF16_PAIRS));
    }
    for (int64_t g0 = 0; g0 < G; g0 += DECODE_HEADS)
        for (int64_t d0 = 0; d0 < D; d0 += DECODE_CHAINS * VEC) {
            const upcoming_keys *fetch = g0 == 0 && d0 == 0 ? up : NULL;
#define VALUES(c, heads)                                                                            \
    if (a->bf16) decode_values_bf16(t->vpw, t->pw + g0 * BF16_PAIRS, pairs, D, d0, o + g0 * D, c, heads, fetch); \
    else decode_values(a, slots + j0, row, h, t->s + g0 * BLOCK_KEYS, n, d0, o + g0 * D, c, heads, fetch);
            DECODE_SWITCH((D - d0) / VEC, G - g0, VALUES)
#undef VALUES
        }
    prefetch_upcoming_range(up, UPCOMING_HALF + (a->bf16 ? pairs : n), BLOCK_KEYS); /* a short last block's */
}

static void member_end(const extend_job *a, const decode_scratch *t, int64_t m, int64_t b, int64_t h) {
    const int64_t G = a->group, D = a->dim, Hq = a->hkv * G;
    for (int64_t g = 0; g < G; g++) {
        const int64_t head = h * G + g, mg = m * G + g;
        const float inv = 1.f / t->sum[mg];
        float *dst = a->out + (b * Hq + head) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = t->o[mg * D + d] * inv;
        if (a->lse) a->lse[b * Hq + head] = t->max[mg] + logf(t->sum[mg]);
    }
}

/* The chunk's shared whole blocks with its members' query heads as the rows of one tile (the extend
   kernel's layout: each key feature read once for all of them, the softmax's sums vectorized across
   rows); each row's arithmetic is member_block's, so its state (max, sum, output) is handed over to
   the decode scratch as member_block would have left it. */
static void shared_blocks_as_tile(const extend_job *a, const decode_scratch *t, const tile_scratch *tt,
                                  const int64_t *members, int64_t count, int64_t h, const int64_t *slots,
                                  int64_t together) {
    const int64_t G = a->group, D = a->dim, Hq = a->hkv * G, used = count * G, rows = tile_rows(count, G);
    const float *src[rows];
    memset(tt->o_t, 0, sizeof(float) * rows * D); /* also the padding rows' zero queries */
    for (int64_t r = 0; r < rows; r++) { /* row r = member r / G, query head h * G + r % G */
        src[r] = r < used ? a->q + (members[r / G] * Hq + h * G + r % G) * D : tt->o_t;
        tt->max[r] = -INFINITY, tt->sum[r] = 0.f, tt->limit[r] = (float)together, tt->lower[r] = 0.f;
    }
    tile_queries(a, tt, src, rows);
    for (int64_t j0 = 0; j0 < together; j0 += BLOCK_KEYS) { /* after the last shared block: member 0's own */
        const upcoming_keys up = request_keys_from(a, members[0], j0 + BLOCK_KEYS, h);
        tile_block(a, tt, slots, h, j0, BLOCK_KEYS, rows, used, 1, &up);
    }
    for (int64_t r = 0; r < used; r++) { /* the decode scratch's state m * G + g is row r */
        t->max[r] = tt->max[r], t->sum[r] = tt->sum[r];
        for (int64_t d = 0; d < D; d++) t->o[r * D + d] = tile_output(a, tt, r, d, rows);
    }
}

/* The chunk's shared whole blocks read once for members too few to fill a tile's lanes: each block
   is loaded (its keys transposed, its values paired) once, then every member takes it as it would
   alone, in the same order: a branch's few requests over their common transcript transposed its
   keys once per request before. */
static void shared_blocks_by_member(const extend_job *a, const decode_scratch *t, const int64_t *members,
                                    int64_t count, int64_t h, const int64_t *slots, int64_t together) {
    for (int64_t j0 = 0; j0 < together; j0 += BLOCK_KEYS) {
        const upcoming_keys up = request_keys_from(a, members[0], j0 + BLOCK_KEYS, h);
        load_block(a, t, slots, h, j0, BLOCK_KEYS);
        for (int64_t m = 0; m < count; m++) member_block(a, t, m, slots, h, j0, BLOCK_KEYS, m == 0 ? &up : NULL);
    }
}

/* Kv head h of a chunk of `count` requests whose first `shared` keys (whole blocks, when count > 1)
   are the same slots: those blocks once for all members (as one tile's rows where they fill its
   lanes, `tile`), then each member over its own blocks. Every member's arithmetic is what it would
   do alone (the same block grid, the same sums in the same order), so sharing changes no bit. */
static void decode_chunk(const extend_job *a, const decode_scratch *t, const tile_scratch *tt,
                         const int64_t *members, int64_t count, int64_t shared, int tile, int64_t h,
                         upcoming_keys after) {
    const int64_t together = count > 1 ? shared / BLOCK_KEYS * BLOCK_KEYS : 0;
    const int64_t *shared_slots = a->kv_indices + a->kv_starts[members[0]];
    for (int64_t m = 0; m < count; m++) member_begin(a, t, m, members[m], h);
    if (together && tile) shared_blocks_as_tile(a, t, tt, members, count, h, shared_slots, together);
    else if (together) shared_blocks_by_member(a, t, members, count, h, shared_slots, together);
    for (int64_t m = 0; m < count; m++) {
        const int64_t b = members[m], L = a->kv_lens[b];
        const int64_t *slots = a->kv_indices + a->kv_starts[b];
        for (int64_t j0 = together; j0 < L; j0 += BLOCK_KEYS) {
            const int64_t n = L - j0 < BLOCK_KEYS ? L - j0 : BLOCK_KEYS;
            const upcoming_keys up = j0 + BLOCK_KEYS < L ? request_keys_from(a, b, j0 + BLOCK_KEYS, h) /* this member's next block */
                                     : m + 1 < count     ? request_keys_from(a, members[m + 1], together, h) /* the next member's first */
                                                         : after;
            load_block(a, t, slots, h, j0, n);
            member_block(a, t, m, slots, h, j0, n, &up);
        }
        member_end(a, t, m, b, h);
    }
}

/* Chunks of fewer rows than this (members x query heads per kv head) read their shared blocks member
   by member (shared_blocks_by_member): a tile of a mostly empty vector of lanes did not pay for its
   setup (a request's 2-3 draft rows of the embedded model, 3 query heads per kv head: 1.1-1.3x a
   decode step's time as a tile). With AVX-512 a tile of 12 rows already pays: one request's 4
   rows over 500 / 2,000 keys of the embedded model's shape, 2 threads, 60.5 / 177 us a call as a
   tile against 62.6 / 202 member by member (AMD EPYC Zen 4). */
#if VEC == 16
#define SHARED_TILE_MIN_ROWS 12
#else
#define SHARED_TILE_MIN_ROWS VEC
#endif

/* One task's requests: `count` members from members[0] that read their first `shared` keys once
   (count 1: a request alone), as a tile's rows or member by member */
typedef struct {
    const int64_t *members;
    int64_t count, shared;
    int tile;
} decode_unit;

typedef struct {
    extend_job *job;
    const decode_unit *units; /* task t is unit t / hkv, kv head t % hkv */
    int64_t widest;           /* members of the largest unit */
    int64_t widest_tile;      /* members of the largest unit read as a tile (0: none) */
} decode_job;

/* the first keys a task reads on its own (after any shared tile), or none past the last task */
static upcoming_keys first_keys(const decode_job *dj, int64_t task) {
    const extend_job *a = dj->job;
    if (task >= a->tasks) return upcoming_block(a, NULL, 0, 0);
    const decode_unit *u = dj->units + task / a->hkv;
    const int64_t together = u->count > 1 ? u->shared / BLOCK_KEYS * BLOCK_KEYS : 0;
    return request_keys_from(a, u->members[0], together, task % a->hkv);
}

static void decode_part(void *ctx, int64_t part, int64_t parts) {
    (void)part, (void)parts;
    decode_job *dj = (decode_job *)ctx;
    extend_job *a = dj->job;
    const int64_t G = a->group, D = a->dim, M = dj->widest;
    decode_scratch t = {aligned_floats(M * G * D), aligned_floats(D * BLOCK_KEYS), aligned_floats(G * BLOCK_KEYS),
                        aligned_floats(M * G * D), aligned_floats(M * G), aligned_floats(M * G),
                        NULL, NULL, NULL, NULL, NULL};
    if (a->bf16) /* words are float-sized */
        t.qw = aligned_floats(M * G * D / 2), t.ktw = aligned_floats(D / 2 * BLOCK_KEYS),
        t.vpw = aligned_floats(BF16_PAIRS * D), t.pw = aligned_floats(G * BF16_PAIRS),
        t.rows16 = a->bf16 == KV16 ? NULL : aligned_floats(VEC * D / 2);
    tile_scratch tt; /* shared blocks, the members' heads as a tile's rows */
    const int tiled = dj->widest_tile && tile_scratch_alloc(&tt, tile_rows(dj->widest_tile, G), D, a->bf16) == 0;
    if (t.qs && t.kt && t.s && t.o && t.max && t.sum && (!a->bf16 || (t.qw && t.ktw && t.vpw && t.pw && (t.rows16 || a->bf16 == KV16)))
        && (tiled || !dj->widest_tile)) {
        /* each thread claims its next task before it works on this one, to fetch its first keys */
        for (int64_t task = atomic_fetch_add(&a->next, 1), following; task < a->tasks; task = following) {
            following = atomic_fetch_add(&a->next, 1);
            const decode_unit *u = dj->units + task / a->hkv;
            decode_chunk(a, &t, &tt, u->members, u->count, u->shared, u->tile, task % a->hkv, first_keys(dj, following));
        }
    } else {
        a->failed = 1;
    }
    if (tiled) tile_scratch_free(&tt);
    free(t.qs), free(t.kt), free(t.s), free(t.o), free(t.max), free(t.sum);
    free(t.qw), free(t.ktw), free(t.vpw), free(t.pw), free(t.rows16);
}

/* Few tasks that do not divide among the threads (one request's draft rows, a kv head a task: 3
   tasks on 2 threads, one thread idle a third of the time) are balanced by splitting the widest
   chunk into two halves, each reading the shared blocks for its own members, while every half
   still fills a tile (SHARED_TILE_MIN_ROWS) and the halves' padded rows are no more than the
   whole's. Members keep their arithmetic, so no bit changes. One request's 8 / 9 rows over 500
   keys of the embedded model's shape, 2 threads, a call: 93 -> 85 / 98 -> 89 us, over 2,000 keys
   283 -> 258 / 297 -> 269 us (AMD EPYC Zen 4); the AVX2 build, 9 rows: 204 -> 192 / 689 -> 666
   us, the others level (its 8-row halves would pad more lanes than the whole). Returns the new
   unit count (never more than the batch's requests: every unit keeps at least one). */
static int64_t balance_units(decode_unit *units, int64_t n_units, int64_t hkv, int64_t group, int64_t threads) {
    while (threads > 1 && (n_units * hkv) % threads != 0 && n_units * hkv < 4 * threads) {
        int64_t widest = -1;
        for (int64_t u = 0; u < n_units; u++)
            if (units[u].tile && (widest < 0 || units[u].count > units[widest].count)) widest = u;
        if (widest < 0) return n_units;
        const decode_unit whole = units[widest];
        const int64_t first = whole.count / 2, second = whole.count - first;
        if (first * group < SHARED_TILE_MIN_ROWS
            || tile_rows(first, group) + tile_rows(second, group) > tile_rows(whole.count, group))
            return n_units;
        units[widest] = (decode_unit){whole.members, first, whole.shared, 1};
        units[n_units++] = (decode_unit){whole.members + first, second, whole.shared, 1};
    }
    return n_units;
}

/* One query row per request (a decode step), bit for bit what `rb_extend_attention` gives the last
   row of a request with the same keys. q, out: [B, Hkv * G, D]; request b's keys are
   kv_indices[starts[b] : + lens[b]] (lens[b] >= 1); lse: [B, Hkv * G] or NULL. dim % VEC == 0.
   `softcap`: as in `rb_extend_attention_window` (0: none). `sharing` (or NULL): chunks of requests
   that begin with the same slots (each request in exactly one chunk, shared[c] < every member's
   lens); a chunk reads its shared keys once, which saves memory traffic and changes no bit.
   `bf16`: the extend kernel's bf16 products (dim a multiple of 32), the same bits as its rows.
   Returns 0, -1 when memory ran out, -2 for an unsupported dim. */
int rb_decode_attention_invariant(const float *q, const float *k_cache, const float *v_cache,
                              const int64_t *kv_indices, const int64_t *starts, const int64_t *lens,
                              int64_t batch, int64_t hkv, int64_t group, int64_t dim, float scale, float softcap,
                              const rb_key_sharing *sharing, float *out, float *lse, int64_t threads,
                              int64_t bf16) {
    if (dim % (bf16 ? 32 : 16) != 0 || bf16 < 0 || bf16 > KV16) return -2;
    /* the tasks' requests: each chunk worth a shared tile, every other request alone */
    decode_unit *units = (decode_unit *)malloc(sizeof(decode_unit) * (batch > 0 ? batch : 1));
    int64_t *alone = (int64_t *)malloc(sizeof(int64_t) * (batch > 0 ? batch : 1));
    if (!units || !alone) {
        free(units), free(alone);
        return -1;
    }
    int64_t n_units = 0, widest = 1, widest_tile = 0; /* the scratch holds that many requests' state, the tile's rows */
    for (int64_t b = 0; b < batch; b++) alone[b] = b;
    for (int64_t c = 0; c < (sharing ? sharing->chunks : batch); c++) {
        const int64_t first = sharing ? sharing->bounds[c] : c, count = sharing ? sharing->bounds[c + 1] - first : 1;
        const int64_t *members = sharing ? sharing->order + first : alone + c;
        if (count > 1 && sharing->shared[c] >= BLOCK_KEYS) {
            units[n_units++] = (decode_unit){members, count, sharing->shared[c], count * group >= SHARED_TILE_MIN_ROWS};
        } else {
            for (int64_t m = 0; m < count; m++) units[n_units++] = (decode_unit){alone + members[m], 1, 0, 0};
        }
    }
    n_units = balance_units(units, n_units, hkv, group, threads);
    for (int64_t u = 0; u < n_units; u++) {
        widest = units[u].count > widest ? units[u].count : widest;
        widest_tile = units[u].tile && units[u].count > widest_tile ? units[u].count : widest_tile;
    }
    extend_job job = {q, k_cache, v_cache, kv_indices, NULL, NULL, starts, lens, batch, hkv, group,
                      dim, 1, n_units * hkv, 0, 0, scale, softcap, out, lse, (int)bf16, NULL, 0, 0};
    decode_job dj = {&job, units, widest, widest_tile};
    if (threads > job.tasks) threads = job.tasks;
    rb_parallel(decode_part, &dj, threads < 1 ? 1 : threads);
    free(units), free(alone);
    return job.failed ? -1 : 0;
}
