/* 4-bit weights times fp32 rows (layout and activation formats: q4.h).

   Per output row n and group g, the codes' dot product with the activations' integers is exact in
   int32 (VNNI `vpdpbusd`: u8 codes times s8 activations, 4 products per int32 lane; AVX2's
   `vpmaddubsw` + `vpmaddwd` elsewhere), and
       y[m, n] = sum_g scale[n, g] * xscale[m, g] * dot + minimum[n, g] * xsum[m, g].
   Each int32 lane is one output row (16 rows per 512-bit vector), so a group costs 8 integer
   instructions per activation row and plane, and the float work (convert, two multiply-adds) is
   paid once per 32 products per lane. A block's codes are unpacked once per group for a tile of
   activation rows (or, for formats with more to put together, once for a chunk's tiles:
   keeps_codes); a thread owns a range of blocks and sweeps them for a chunk of rows at a time,
   so the chunk's activations stay in L2 (a tile's rows side by side: q4.h). */
#include "prefetch.h"
#include "cpu_kernels.h"
#include "q4.h"
#include "q16.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdlib.h>

int q4_activations_alloc(q4_activations *x, int64_t M, int64_t K, int planes) {
    const int64_t tiles = (M + Q4_ROW_TILE - 1) / Q4_ROW_TILE; /* room for any q4_row_tile of up to M rows */
    const int64_t groups = tiles * Q4_ROW_TILE * (K / 32), bytes = ((groups * planes * 32 + 63) / 64) * 64;
    x->digits = (int8_t *)aligned_alloc(64, 64 + bytes + ((4 * sizeof(float) * groups + 63) / 64) * 64); /* 64: never 0 */
    if (!x->digits) return -1;
    x->scale = (float *)(x->digits + bytes);
    x->sum = x->scale + groups;
    x->sum16 = x->sum + groups;
    x->row_tile = q4_row_tile(M);
    x->planes = planes;
    x->offset_digits = 0;
    return 0;
}

void q4_activations_free(q4_activations *x) { free(x->digits); }

/* One group as integers q = round(x / scale), scale = max|x| / largest (q4.h's formats), written
   as its digits; the group's scale and scale * sum(q) go to *scale and *sum, and scale * the sums
   of its two halves to sum16[0], sum16[1]. The vector versions
   compute exactly what the scalar one does (round-to-nearest-even conversion of the same
   products), so every build quantizes alike. */
static inline void store_digits(const int32_t q[32], int planes, int offset, int8_t *d) {
    const uint8_t flip = offset ? 0x80 : 0; /* s8 v ^ 0x80 is the uint8 v + 128 */
    for (int i = 0; i < 32; i++) {
        if (planes == 1) {
            d[i] = (int8_t)((uint8_t)q[i] ^ flip);
        } else {
            const int32_t low = ((q[i] + 128) & 255) - 128;
            d[i] = (int8_t)((uint8_t)((q[i] - low) / 256) ^ flip), d[32 + i] = (int8_t)((uint8_t)low ^ flip);
        }
    }
}

#if defined(__AVX512F__)
static void quantize_group(const float *x, int32_t largest, int planes, int offset, int8_t *d, float *scale,
                           float *sum, float *sum16) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? (float)largest / amax : 0.f);
    const __m512i hi = _mm512_set1_epi32(largest), lo = _mm512_set1_epi32(-largest);
    const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), hi), lo);
    const __m512i qb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), hi), lo);
    int32_t q[32];
    _mm512_storeu_si512((void *)q, qa);
    _mm512_storeu_si512((void *)(q + 16), qb);
    *scale = amax / (float)largest;
    const int32_t sa = _mm512_reduce_add_epi32(qa), sb = _mm512_reduce_add_epi32(qb);
    *sum = *scale * (float)(sa + sb);
    sum16[0] = *scale * (float)sa, sum16[1] = *scale * (float)sb;
    if (planes == 1) {
        const __m128i flip = _mm_set1_epi8(offset ? (char)0x80 : 0);
        _mm_storeu_si128((__m128i *)d, _mm_xor_si128(_mm512_cvtepi32_epi8(qa), flip));
        _mm_storeu_si128((__m128i *)(d + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(qb), flip));
    } else {
        store_digits(q, planes, offset, d);
    }
}

/* quantize_group for one group of a whole tile of 8 rows (row m at x + m * stride) into its 8 side
   by side entries, 8-bit digits only: the same values, with each row's maximum and two sums taken in
   one transposing tree over the tile (a reduction per row and half cost more than the arithmetic:
   quantizing took 7 % of a 1024-token prefill) */
static void quantize_tile8(const float *x, int64_t stride, int32_t largest, int offset, int8_t *d, float *scale,
                           float *sum, float *sum16) {
    __m512 a[8], b[8], v[8];
    for (int m = 0; m < 8; m++) {
        a[m] = _mm512_loadu_ps(x + m * stride), b[m] = _mm512_loadu_ps(x + m * stride + 16);
        v[m] = _mm512_max_ps(_mm512_abs_ps(a[m]), _mm512_abs_ps(b[m]));
    }
    __m512 half[4], amax[2]; /* rows 2i, 2i + 1 in 8 lanes each; then rows 4i .. 4i + 3 in a 128-bit lane each */
    for (int i = 0; i < 4; i++)
        half[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) {
        __m512 r = _mm512_max_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xDD));
        r = _mm512_max_ps(r, _mm512_permute_ps(r, 0xB1));
        amax[i] = _mm512_max_ps(r, _mm512_permute_ps(r, 0x4E)); /* each row's maximum in all 4 lanes */
    }
    const __m512 top = _mm512_set1_ps((float)largest), zero = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32(largest), lo = _mm512_set1_epi32(-largest);
    const __m128i flip = _mm_set1_epi8(offset ? (char)0x80 : 0);
    __m512i sums[16]; /* row m's halves at 2m, 2m + 1 */
    for (int i = 0; i < 2; i++) {
        const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax[i], zero, _CMP_GT_OQ), top, amax[i]);
        for (int k = 0; k < 4; k++) {
            const int m = 4 * i + k;
            const __m512 row_inv = _mm512_shuffle_f32x4(inv, inv, k * 0x55);
            const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a[m], row_inv)), hi), lo);
            const __m512i qb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b[m], row_inv)), hi), lo);
            _mm_storeu_si128((__m128i *)(d + 32 * m), _mm_xor_si128(_mm512_cvtepi32_epi8(qa), flip));
            _mm_storeu_si128((__m128i *)(d + 32 * m + 16), _mm_xor_si128(_mm512_cvtepi32_epi8(qb), flip));
            sums[2 * m] = qa, sums[2 * m + 1] = qb;
        }
    }
    /* 16 vectors of partial sums into one of their totals: halves, quarters, then within lanes */
    __m512i p[8], r[4];
    for (int i = 0; i < 8; i++)
        p[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(sums[2 * i], sums[2 * i + 1], 0x44),
                                _mm512_shuffle_i32x4(sums[2 * i], sums[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        r[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(p[2 * i], p[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(p[2 * i], p[2 * i + 1], 0xDD));
    /* r[i]'s 128-bit lane k: 4 partial sums of vector 4i + k */
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi64(r[0], r[1]), _mm512_unpackhi_epi64(r[0], r[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi64(r[2], r[3]), _mm512_unpackhi_epi64(r[2], r[3]));
    const __m512 s01f = _mm512_castsi512_ps(s01), s23f = _mm512_castsi512_ps(s23);
    const __m512i mixed = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(s01f, s23f, 0x88)),
                                           _mm512_castps_si512(_mm512_shuffle_ps(s01f, s23f, 0xDD)));
    /* mixed lane 4k + c: vector 4c + k; halves lane v: vector v (row v / 2's half v % 2) */
    const __m512i halves = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), mixed);
    const __m512 row_scale = _mm512_div_ps( /* amax of row m in lanes 2m, 2m + 1, over largest */
        _mm512_permutex2var_ps(amax[0], _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28),
                               amax[1]), top);
    _mm512_storeu_ps(sum16, _mm512_mul_ps(row_scale, _mm512_cvtepi32_ps(halves)));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 totals = _mm512_mul_ps(row_scale, _mm512_cvtepi32_ps(
        _mm512_add_epi32(halves, _mm512_shuffle_epi32(halves, _MM_PERM_CDAB))));
    _mm256_storeu_ps(sum, _mm512_castps512_ps256(_mm512_permutexvar_ps(even, totals)));
    _mm256_storeu_ps(scale, _mm512_castps512_ps256(_mm512_permutexvar_ps(even, row_scale)));
}
#define HAVE_QUANTIZE_TILE8 1
#elif defined(__AVX2__) /* quantize_group: the portable one below */
/* the 8 lanes' maxima of 8 vectors, vector i's in lane i */
static inline __m256 lanes_max8(const __m256 v[8]) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++) /* vectors 2i, 2i + 1: 4 lanes each */
        t[i] = _mm256_max_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* low 128 bits: vectors 4i, 4i + 2; high: 4i + 1, 4i + 3; 2 lanes each */
        u[i] = _mm256_max_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x88), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xDD));
    const __m256 m = _mm256_max_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
    return _mm256_permutevar8x32_ps(m, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* m: 0 2 4 6 | 1 3 5 7 */
}

/* the 8 lanes' sums of 8 vectors, vector i's in lane i */
static inline __m256i lanes_sum8(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* round(x * inv) clamped to +-largest (lrintf's rounding: the default round-to-nearest-even) */
static inline __m256i quantize8(__m256 x, __m256 inv, __m256i hi, __m256i lo) {
    return _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x, inv)), hi), lo);
}

/* lane-wise max |x| over a group's 32 values (4 vectors) */
static inline __m256 group_abs_max(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 1; i < 4; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    return m;
}

/* a group's 32 values as integers q[4] (8 each) at the given 1 / scale */
static inline void quantize_group8(const float *x, __m256 inv, int32_t largest, __m256i q[4]) {
    const __m256i hi = _mm256_set1_epi32(largest), lo = _mm256_set1_epi32(-largest);
    for (int i = 0; i < 4; i++) q[i] = quantize8(_mm256_loadu_ps(x + 8 * i), inv, hi, lo);
}

/* q[4] (|q| <= 127) as the group's 32 8-bit digits, in order (+ 128 as uint8 with `offset`) */
static inline void store_bytes8(const __m256i q[4], int offset, int8_t *d) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)d, _mm256_xor_si256(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                                                       _mm256_set1_epi8(offset ? (char)0x80 : 0)));
}

/* quantize_tile8 (above) with AVX2's 8 lanes: the same values as quantize_group_int row by row */
static void quantize_tile8(const float *x, int64_t stride, int32_t largest, int offset, int8_t *d, float *scale,
                           float *sum, float *sum16) {
    __m256 v[8];
    for (int m = 0; m < 8; m++) v[m] = group_abs_max(x + m * stride);
    const __m256 amax = lanes_max8(v), top = _mm256_set1_ps((float)largest);
    const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_div_ps(top, amax));
    __m256i first[8], second[8]; /* each row's halves, partial sums */
    for (int m = 0; m < 8; m++) {
        __m256i q[4];
        quantize_group8(x + m * stride, _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(m)), largest, q);
        store_bytes8(q, offset, d + 32 * m);
        first[m] = _mm256_add_epi32(q[0], q[1]), second[m] = _mm256_add_epi32(q[2], q[3]);
    }
    const __m256 row_scale = _mm256_div_ps(amax, top);
    const __m256i sa = lanes_sum8(first), sb = lanes_sum8(second);
    _mm256_storeu_ps(scale, row_scale);
    _mm256_storeu_ps(sum, _mm256_mul_ps(row_scale, _mm256_cvtepi32_ps(_mm256_add_epi32(sa, sb))));
    const __m256 fa = _mm256_mul_ps(row_scale, _mm256_cvtepi32_ps(sa)), fb = _mm256_mul_ps(row_scale, _mm256_cvtepi32_ps(sb));
    const __m256 low = _mm256_unpacklo_ps(fa, fb), high = _mm256_unpackhi_ps(fa, fb); /* rows 0 1 4 5, rows 2 3 6 7 */
    _mm256_storeu_ps(sum16, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(sum16 + 8, _mm256_permute2f128_ps(low, high, 0x31));
}
#define HAVE_QUANTIZE_TILE8 1

/* quantize_group (below) on AVX2: the same values */
static void quantize_group(const float *x, int32_t largest, int planes, int offset, int8_t *d, float *scale,
                           float *sum, float *sum16) {
    __m256 m = group_abs_max(x);
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 0x01));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1)); /* the maximum in every lane */
    const float amax = _mm256_cvtss_f32(m);
    __m256i q[4];
    quantize_group8(x, _mm256_set1_ps(amax > 0.f ? (float)largest / amax : 0.f), largest, q);
    *scale = amax / (float)largest;
    const __m256i halves = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    int32_t h[8];
    _mm256_storeu_si256((__m256i *)h, halves); /* first half: h 0 1 4 5, second: 2 3 6 7 */
    const int32_t sa = h[0] + h[1] + h[4] + h[5], sb = h[2] + h[3] + h[6] + h[7];
    *sum = *scale * (float)(sa + sb);
    sum16[0] = *scale * (float)sa, sum16[1] = *scale * (float)sb;
    if (planes == 1) {
        store_bytes8(q, offset, d);
    } else {
        int32_t all[32];
        for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(all + 8 * i), q[i]);
        store_digits(all, planes, offset, d);
    }
}
#else
static void quantize_group(const float *x, int32_t largest, int planes, int offset, int8_t *d, float *scale,
                           float *sum, float *sum16) {
    int32_t q[32], half[2] = {0, 0};
    *scale = quantize_group_int(x, largest, q);
    for (int i = 0; i < 32; i++) half[i / 16] += q[i];
    *sum = *scale * (float)(half[0] + half[1]);
    sum16[0] = *scale * (float)half[0], sum16[1] = *scale * (float)half[1];
    store_digits(q, planes, offset, d);
}
#endif

typedef struct {
    const float *x;
    int64_t M, row_groups; /* rows, K / 32 */
    q4_activations *out;
} quantize_job;

/* A part takes whole units of one group of one tile of rows (q4_group_index: the unit's entries
   lie side by side), so two threads never write the same cache line of scales and sums: split by
   rows, the two halves of an 8-row decode step shared every line, and its 1536-wide matmul took
   2.2x as long (Zen 5). */
static void quantize_part(void *ctx, int64_t part, int64_t parts) {
    const quantize_job *job = (const quantize_job *)ctx;
    const int planes = job->out->planes;
    const int32_t largest = planes == 1 ? Q8_MAX : Q16_MAX;
    const int64_t G = job->row_groups, T = job->out->row_tile, units = (job->M + T - 1) / T * G;
    for (int64_t unit = units * part / parts; unit < units * (part + 1) / parts; unit++) {
        const int64_t row0 = unit / G * T, g = unit % G;
#ifdef HAVE_QUANTIZE_TILE8
        if (T == 8 && planes == 1 && row0 + 8 <= job->M) {
            const int64_t at = unit * T; /* q4_group_index(row0, g, G, T) */
            quantize_tile8(job->x + (row0 * G + g) * 32, G * 32, largest, job->out->offset_digits,
                           job->out->digits + at * 32, job->out->scale + at, job->out->sum + at, job->out->sum16 + 2 * at);
            continue;
        }
#endif
        for (int64_t m = row0; m < row0 + T && m < job->M; m++) {
            const int64_t at = unit * T + m - row0; /* q4_group_index(m, g, G, T) */
            quantize_group(job->x + (m * G + g) * 32, largest, planes, job->out->offset_digits,
                           job->out->digits + at * planes * 32, job->out->scale + at, job->out->sum + at,
                           job->out->sum16 + 2 * at);
        }
    }
}

void q4_quantize(const float *x, int64_t M, int64_t K, q4_activations *out, int64_t threads) {
    out->row_tile = q4_row_tile(M);
    quantize_job job = {x, M, K / 32, out};
    rb_parallel(quantize_part, &job, M * K >= 8192 ? threads : 1); /* a thread hand-off costs ~1 us */
}

#define TILE 8 /* activation rows per pass over a block's codes */
/* How a tile gets a block's quads (see keeps_codes): UNPACK them from the codes, UNPACK_AND_KEEP
   them (unpack, and store them for the chunk's next tiles) or REUSE the kept ones */
enum { UNPACK = 0, UNPACK_AND_KEEP = 1, REUSE = 2 };
#define KEPT_GROUP_BYTES (8 * 64) /* a group's 8 quads */
#define PLAIN_GROUP_PARAM_BYTES (2 * Q4_ROWS * (int64_t)sizeof(_Float16)) /* plain Q4_1: a group's fp16 scales and minimums */

/* Group g's lines of the next block of 16 weight rows (its codes, high bits and parameters), asked
   for while this block's group g is multiplied. A decode step's few activation rows give each block
   too little arithmetic to hide the wait for the next one: batch-8 to batch-32 decode steps of the
   embedded model ran 1.1-1.2x faster with these on a Zen 5 (prefill level, batch 1 level). A thread's
   last block asks for lines it will not read: harmless, a prefetch never faults. The empty volatile
   asm keeps GCC from dropping the prefetches (see rb_prefetch_floats). */
static inline __attribute__((always_inline)) void fetch_next_block(const uint8_t *codes, const uint8_t *high, int hb,
                                                                   const uint8_t *params, int64_t param_bytes,
                                                                   int64_t groups, int64_t g) {
    const uint8_t *next_codes = codes + (groups + g) * 4 * 64;
    for (int c = 0; c < 4; c++) rb_prefetch(next_codes + c * 64);
    for (int c = 0; c < hb; c++) rb_prefetch(high + (groups + g) * hb * 64 + c * 64);
    for (int64_t c = 0; c < param_bytes; c += 64) rb_prefetch(params + (groups + g) * param_bytes + c);
    __asm__ __volatile__("");
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* A group's integer dot products with one activation row's digits, for each of the block's 16
   rows: quads 0..3 (features 0..15) into *a, quads 4..7 (16..31) into *b. One accumulator per
   plane and pair of quads keeps the dependency chains short (a single chain made the 16-bit
   decode step latency bound: 1.5x slower). */
static inline __attribute__((always_inline)) void group_dots(const __m512i quad[8], const int8_t *q, const int P,
                                                             __m512i *a, __m512i *b) {
    __m512i part[2][4];
    for (int p = 0; p < P; p++)
        for (int c = 0; c < 4; c++) {
            part[p][c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), quad[2 * c],
                                             _mm512_set1_epi32(load_i32(q + p * 32 + 8 * c)));
            part[p][c] = _mm512_dpbusd_epi32(part[p][c], quad[2 * c + 1], _mm512_set1_epi32(load_i32(q + p * 32 + 8 * c + 4)));
        }
    *a = _mm512_add_epi32(part[0][0], part[0][1]), *b = _mm512_add_epi32(part[0][2], part[0][3]);
    if (P == 2) { /* high digits, then low ones */
        *a = _mm512_add_epi32(_mm512_slli_epi32(*a, 8), _mm512_add_epi32(part[1][0], part[1][1]));
        *b = _mm512_add_epi32(_mm512_slli_epi32(*b, 8), _mm512_add_epi32(part[1][2], part[1][3]));
    }
}

/* The dot products of a group for a tile of R rows at once (R >= TILE_DOTS_ROWS), the whole group
   into dots[i] for row i, whose digits start at rows + i * stride. The rows are interleaved so that
   consecutive vpdpbusd are independent: one row at a time, the compiler joined each row's parts
   into chains of 4 dependent vpdpbusd and the core could not look far enough ahead to keep its
   VNNI pipes busy (plain Q4_1 at 512 rows: 1.1-1.3x faster this way on an AVX-512 Zen 5). The
   other formats keep group_dots: the same interleaving measured 0.7-0.9x there. */
#define TILE_DOTS_ROWS 4
static inline __attribute__((always_inline)) void tile_dots(const __m512i quad[8], const int8_t *rows,
                                                            int64_t stride, const int R, const int P,
                                                            __m512i dots[TILE]) {
    for (int i = 0; i < R; i++) dots[i] = _mm512_setzero_si512();
    for (int p = 0; p < P; p++) {
        if (p) /* high digits, then low ones */
            for (int i = 0; i < R; i++) dots[i] = _mm512_slli_epi32(dots[i], 8);
        for (int k = 0; k < 8; k++) /* quad k: features 4k..4k+3 */
            for (int i = 0; i < R; i++)
                dots[i] = _mm512_dpbusd_epi32(dots[i], quad[k],
                                              _mm512_set1_epi32(load_i32(rows + i * stride + p * 32 + 4 * k)));
    }
}

/* a group's 4 code vectors as 8 quads of nibbles: quad j < 4 the low nibbles (features 4j..4j+3),
   quad 4 + j the high ones (features 16 + 4j..) */
static inline __attribute__((always_inline)) void load_quads(const uint8_t *group_codes, __m512i quad[8]) {
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m512i c = _mm512_loadu_si512((const void *)(group_codes + j * 64));
        quad[j] = _mm512_and_si512(c, nibble);
        quad[4 + j] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
    }
}

#define HAVE_KEPT_CODES 1

static inline __attribute__((always_inline)) void keep_quads(uint8_t *kept, int64_t g, const __m512i quad[8]) {
    for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(kept + g * KEPT_GROUP_BYTES + j * 64), quad[j]);
}

static inline __attribute__((always_inline)) void kept_quads(const uint8_t *kept, int64_t g, __m512i quad[8]) {
    for (int j = 0; j < 8; j++) quad[j] = _mm512_load_si512((const void *)(kept + g * KEPT_GROUP_BYTES + j * 64));
}

/* out[i * 16 + r]: the 16 rows of one block for activation rows row0 .. row0 + R - 1 (R and P are
   constants after inlining, so the accumulators stay in registers) */
static inline __attribute__((always_inline)) void q4_tile(const uint8_t *codes, const _Float16 *params,
                                                          const q4_activations *x, int64_t row0, int64_t groups,
                                                          float *out, const int R, const int P) {
    const int64_t T = x->row_tile, first_at = q4_group_index(row0, 0, groups, T); /* row0 + i's group g: first_at + g * T + i */
    __m512 acc[TILE];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        fetch_next_block(codes, NULL, 0, (const uint8_t *)params, PLAIN_GROUP_PARAM_BYTES, groups, g);
        const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(params + g * 2 * Q4_ROWS)));
        const __m512 minimums = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(params + g * 2 * Q4_ROWS + Q4_ROWS)));
        __m512i quad[8];
        load_quads(codes + g * 4 * 64, quad);
        __m512i dots[TILE];
        const int64_t at0 = first_at + g * T; /* row0 + i: at0 + i */
        if (R >= TILE_DOTS_ROWS) {
            tile_dots(quad, x->digits + at0 * P * 32, P * 32, R, P, dots); /* R > 1: 8-row tiles (q4_row_tile) */
        } else {
            #pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                __m512i dot_a, dot_b;
                group_dots(quad, x->digits + (at0 + i) * P * 32, P, &dot_a, &dot_b);
                dots[i] = _mm512_add_epi32(dot_a, dot_b);
            }
        }
        #pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const int64_t at = at0 + i;
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i]), _mm512_mul_ps(scales, _mm512_set1_ps(x->scale[at])), acc[i]);
            acc[i] = _mm512_fmadd_ps(minimums, _mm512_set1_ps(x->sum[at]), acc[i]);
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out + i * Q4_ROWS, acc[i]);
}

/* 8-bit codes (4 high bits, Q8_0): quad j's byte is its nibble with the high plane's nibble above
   it, put together by one ternary-logic select (upper nibble from the plane, lower from the codes)
   instead of load_quads' masks and the high bits' and + or: the same bytes */
static inline __attribute__((always_inline)) void load_quads8(const uint8_t *group_codes, const uint8_t *group_high,
                                                              __m512i quad[8]) {
    const __m512i upper = _mm512_set1_epi8((char)0xF0);
    for (int j = 0; j < 8; j++) {
        const __m512i c = _mm512_loadu_si512((const void *)(group_codes + (j % 4) * 64));
        const __m512i h = _mm512_loadu_si512((const void *)(group_high + (j / 2) * 64)); /* bits 4j.. */
        const __m512i t = j % 2 ? h : _mm512_slli_epi16(h, 4);
        quad[j] = _mm512_ternarylogic_epi32(upper, t, j < 4 ? c : _mm512_srli_epi16(c, 4), 0xCA); /* upper ? t : c */
    }
}

static inline __m512 load_params16(const uint8_t *p, int kind) {
    if (kind == Q4_PARAMS_F32) return _mm512_loadu_ps((const float *)p);
    if (kind == Q4_PARAMS_K) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* group g's codes as the tiles multiply them: 8 quads of whole codes, the high bits (hb of them:
   5-, 6- and 8-bit codes) put above the nibbles */
static inline __attribute__((always_inline)) void unpack_group(const uint8_t *codes, const uint8_t *high, int hb,
                                                               int64_t g, __m512i quad[8]) {
    if (hb == 4) {
        load_quads8(codes + g * 4 * 64, high + g * 4 * 64, quad);
        return;
    }
    load_quads(codes + g * 4 * 64, quad);
    const __m512i hmask = _mm512_set1_epi8((char)(((1 << hb) - 1) << 4));
    for (int j = 0; j < 8 && hb; j++) {
        const int bit = j * hb, s = bit % 8;
        const __m512i h = _mm512_loadu_si512((const void *)(high + (g * hb + bit / 8) * 64));
        const __m512i t = s <= 4 ? _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - s))
                                 : _mm512_srl_epi16(h, _mm_cvtsi32_si128(s - 4));
        quad[j] = _mm512_ternarylogic_epi32(quad[j], t, hmask, 0xF8); /* quad | (t & hmask) */
    }
}

/* any format of q4.h (high bits, fp32 parameters, code offset, a scale per 16): the codes of quad
   j for the block's 16 rows are put together in quad[j]; features 0..15 and 16..31 keep their
   own dot products for the per-16 scales */
static inline __attribute__((always_inline)) void qx_tile(const rb_q4_weight *w, const uint8_t *codes,
                                                          const uint8_t *high, const uint8_t *params,
                                                          const _Float16 *super,
                                                          const q4_activations *x, int64_t row0, int64_t groups,
                                                          float *out, const int R, const int P, const int layout,
                                                          uint8_t *kept, const int use) {
    const int64_t T = x->row_tile, first_at = q4_group_index(row0, 0, groups, T); /* row0 + i's group g: first_at + g * T + i */
    const int hb = w->high_bits, kind = w->params_kind;
    const int64_t stride = q4_param_stride(w), half = Q4_ROWS * q4_param_bytes(w);
    const __m512 negoff = _mm512_set1_ps(-w->offset);
    __m512 acc[TILE];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (use != REUSE) fetch_next_block(codes, high, hb, params, stride, groups, g);
        __m512 first = load_params16(params + g * stride, kind);
        __m512 second = layout == Q4_SCALE_OFFSET ? first : load_params16(params + g * stride + half, kind);
        if (kind == Q4_PARAMS_K) { /* sub-block integers times their super-block's factors */
            const _Float16 *f = super + (g / 8) * 2 * Q4_ROWS;
            first = _mm512_mul_ps(first, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)f)));
            second = _mm512_mul_ps(second, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(f + Q4_ROWS))));
        }
        const __m512 scale_b = layout == Q4_SCALE16_OFFSET ? second : first;
        const __m512 min_a = layout == Q4_SCALE_MIN ? second : _mm512_mul_ps(first, negoff);
        const __m512 min_b = _mm512_mul_ps(scale_b, negoff);
        __m512i quad[8];
        if (use == REUSE) kept_quads(kept, g, quad);
        else unpack_group(codes, high, hb, g, quad);
        if (use == UNPACK_AND_KEEP) keep_quads(kept, g, quad);
        /* unrolled, so acc[i] stays in a register (the rows' loops below too): GCC left this body
           rolled, with each row's accumulator loaded and stored per group (0.54B file's Q6_K
           down projection at 512 rows: 1.07x faster unrolled, Zen 5) */
        #pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const int64_t at = first_at + g * T + i;
            __m512i dot_a, dot_b;
            group_dots(quad, x->digits + at * P * 32, P, &dot_a, &dot_b);
            const __m512 xs = _mm512_set1_ps(x->scale[at]);
            if (layout == Q4_SCALE16_OFFSET) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_a), _mm512_mul_ps(first, xs), acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_b), _mm512_mul_ps(scale_b, xs), acc[i]);
                acc[i] = _mm512_fmadd_ps(min_a, _mm512_set1_ps(x->sum16[2 * at]), acc[i]);
                acc[i] = _mm512_fmadd_ps(min_b, _mm512_set1_ps(x->sum16[2 * at + 1]), acc[i]);
            } else {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot_a, dot_b)), _mm512_mul_ps(first, xs), acc[i]);
                acc[i] = _mm512_fmadd_ps(min_a, _mm512_set1_ps(x->sum[at]), acc[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out + i * Q4_ROWS, acc[i]);
}
#define HAVE_Q4_TILE 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#undef TILE
#define TILE 4 /* 16 ymm registers: 8 hold a half block's codes */

static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else /* codes <= 63, |digits| <= 128: the pairwise int16 sums cannot saturate (8-bit codes: see
          signed_group_dots) */
#define DOT_U8S8_SATURATES 1
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* group_dots of the AVX-512 build on 32-byte vectors (8 rows) */
static inline __attribute__((always_inline)) void group_dots(const __m256i quad[8], const int8_t *q, const int P,
                                                             __m256i *a, __m256i *b) {
    __m256i part[2][4];
    for (int p = 0; p < P; p++)
        for (int c = 0; c < 4; c++) {
            part[p][c] = dot_u8s8(_mm256_setzero_si256(), quad[2 * c], _mm256_set1_epi32(load_i32(q + p * 32 + 8 * c)));
            part[p][c] = dot_u8s8(part[p][c], quad[2 * c + 1], _mm256_set1_epi32(load_i32(q + p * 32 + 8 * c + 4)));
        }
    *a = _mm256_add_epi32(part[0][0], part[0][1]), *b = _mm256_add_epi32(part[0][2], part[0][3]);
    if (P == 2) {
        *a = _mm256_add_epi32(_mm256_slli_epi32(*a, 8), _mm256_add_epi32(part[1][0], part[1][1]));
        *b = _mm256_add_epi32(_mm256_slli_epi32(*b, 8), _mm256_add_epi32(part[1][2], part[1][3]));
    }
}

#ifdef DOT_U8S8_SATURATES
/* group_dots for 8-bit codes (Q8_0 as codes + 128), where `vpmaddubsw`'s pair sums of unsigned
   codes could saturate (255 * 128 * 2 > 32767): the codes as signed bytes (code - 128) and
   llama.cpp's sign trick, |digit| times code * sign(digit), pair sums within 2 * 128 * 127. The
   dots are of the signed codes (no offset term to add), exact for every code but -128, which Q8_0
   files do not hold (q4.py keeps a tensor with one off this kernel). */
static inline __attribute__((always_inline)) void signed_group_dots(const __m256i quad[8], const int8_t *q,
                                                                    const int P, __m256i *a, __m256i *b) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256i part[2][4];
    for (int p = 0; p < P; p++)
        for (int c = 0; c < 4; c++) {
            __m256i sum = _mm256_setzero_si256();
            for (int k = 0; k < 2; k++) {
                const __m256i x = _mm256_set1_epi32(load_i32(q + p * 32 + 8 * c + 4 * k));
                const __m256i code = _mm256_xor_si256(quad[2 * c + k], flip);
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(code, x)), ones));
            }
            part[p][c] = sum;
        }
    *a = _mm256_add_epi32(part[0][0], part[0][1]), *b = _mm256_add_epi32(part[0][2], part[0][3]);
    if (P == 2) {
        *a = _mm256_add_epi32(_mm256_slli_epi32(*a, 8), _mm256_add_epi32(part[1][0], part[1][1]));
        *b = _mm256_add_epi32(_mm256_slli_epi32(*b, 8), _mm256_add_epi32(part[1][2], part[1][3]));
    }
}
#define SIGNED_8BIT_CODES 1
#else
#define SIGNED_8BIT_CODES 0
#endif

/* load_quads of the AVX-512 build for one half block (8 rows: `group_codes` already offset) */
static inline __attribute__((always_inline)) void load_quads(const uint8_t *group_codes, __m256i quad[8]) {
    const __m256i nibble = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(group_codes + j * 64));
        quad[j] = _mm256_and_si256(c, nibble);
        quad[4 + j] = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
    }
}

/* as above on 32-byte vectors, one half block (8 rows) at a time */
static inline __attribute__((always_inline)) void q4_tile(const uint8_t *codes, const _Float16 *params,
                                                          const q4_activations *x, int64_t row0, int64_t groups,
                                                          float *out, const int R, const int P) {
    const int64_t T = x->row_tile, first_at = q4_group_index(row0, 0, groups, T); /* row0 + i's group g: first_at + g * T + i */
    for (int h = 0; h < 2; h++) {
        __m256 acc[TILE];
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if (h == 0) fetch_next_block(codes, NULL, 0, (const uint8_t *)params, PLAIN_GROUP_PARAM_BYTES, groups, g);
            const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(params + g * 2 * Q4_ROWS + h * 8)));
            const __m256 minimums = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(params + g * 2 * Q4_ROWS + Q4_ROWS + h * 8)));
            __m256i quad[8];
            load_quads(codes + g * 4 * 64 + h * 32, quad);
            #pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                const int64_t at = first_at + g * T + i;
                __m256i dot_a, dot_b;
                group_dots(quad, x->digits + at * P * 32, P, &dot_a, &dot_b);
                const __m256i dot = _mm256_add_epi32(dot_a, dot_b);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scales, _mm256_set1_ps(x->scale[at])), acc[i]);
                acc[i] = _mm256_fmadd_ps(minimums, _mm256_set1_ps(x->sum[at]), acc[i]);
            }
        }
        for (int i = 0; i < R; i++) _mm256_storeu_ps(out + i * Q4_ROWS + h * 8, acc[i]);
    }
}

static inline __m256 load_params8(const uint8_t *p, int kind) {
    if (kind == Q4_PARAMS_F32) return _mm256_loadu_ps((const float *)p);
    if (kind == Q4_PARAMS_K) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* unpack_group of the AVX-512 build for half h of the block (8 rows) */
static inline __attribute__((always_inline)) void unpack_half(const uint8_t *codes, const uint8_t *high, int hb,
                                                              __m256i hmask, int64_t g, int h, __m256i quad[8]) {
    load_quads(codes + g * 4 * 64 + h * 32, quad);
    for (int j = 0; j < 8 && hb; j++) {
        const int bit = j * hb, s = bit % 8;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(high + (g * hb + bit / 8) * 64 + h * 32));
        const __m256i t = s <= 4 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - s))
                                 : _mm256_srl_epi16(v, _mm_cvtsi32_si128(s - 4));
        quad[j] = _mm256_or_si256(quad[j], _mm256_and_si256(t, hmask));
    }
}

/* keep_quads and kept_quads of the AVX-512 build for half h: a group's two halves one after the other */
static inline __attribute__((always_inline)) void keep_quads(uint8_t *kept, int64_t g, int h, const __m256i quad[8]) {
    for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(kept + g * KEPT_GROUP_BYTES + (h * 8 + j) * 32), quad[j]);
}

static inline __attribute__((always_inline)) void kept_quads(const uint8_t *kept, int64_t g, int h, __m256i quad[8]) {
    for (int j = 0; j < 8; j++) quad[j] = _mm256_load_si256((const __m256i *)(kept + g * KEPT_GROUP_BYTES + (h * 8 + j) * 32));
}

/* qx_tile of the AVX-512 build on 32-byte vectors, one half block (8 rows) at a time */
static inline __attribute__((always_inline)) void qx_tile(const rb_q4_weight *w, const uint8_t *codes,
                                                          const uint8_t *high, const uint8_t *params,
                                                          const _Float16 *super,
                                                          const q4_activations *x, int64_t row0, int64_t groups,
                                                          float *out, const int R, const int P, const int layout,
                                                          uint8_t *kept, const int use) {
    const int64_t T = x->row_tile, first_at = q4_group_index(row0, 0, groups, T); /* row0 + i's group g: first_at + g * T + i */
    const int hb = w->high_bits, kind = w->params_kind;
    const int64_t bytes = q4_param_bytes(w), half = Q4_ROWS * bytes, stride = q4_param_stride(w);
    const int signed_codes = SIGNED_8BIT_CODES && hb == 4; /* signed_group_dots: no offset term */
    const __m256 negoff = _mm256_set1_ps(signed_codes ? 0.f : -w->offset);
    const __m256i hmask = _mm256_set1_epi8((char)(((1 << hb) - 1) << 4));
    for (int h = 0; h < 2; h++) {
        __m256 acc[TILE];
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if (h == 0 && use != REUSE) fetch_next_block(codes, high, hb, params, stride, groups, g);
            const uint8_t *pg = params + g * stride + h * 8 * bytes;
            __m256 first = load_params8(pg, kind);
            __m256 second = layout == Q4_SCALE_OFFSET ? first : load_params8(pg + half, kind);
            if (kind == Q4_PARAMS_K) {
                const _Float16 *f = super + (g / 8) * 2 * Q4_ROWS + h * 8;
                first = _mm256_mul_ps(first, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)f)));
                second = _mm256_mul_ps(second, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(f + Q4_ROWS))));
            }
            const __m256 scale_b = layout == Q4_SCALE16_OFFSET ? second : first;
            const __m256 min_a = layout == Q4_SCALE_MIN ? second : _mm256_mul_ps(first, negoff);
            const __m256 min_b = _mm256_mul_ps(scale_b, negoff);
            __m256i quad[8];
            if (use == REUSE) kept_quads(kept, g, h, quad);
            else unpack_half(codes, high, hb, hmask, g, h, quad);
            if (use == UNPACK_AND_KEEP) keep_quads(kept, g, h, quad);
            #pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                const int64_t at = first_at + g * T + i;
                __m256i dot_a, dot_b;
#ifdef DOT_U8S8_SATURATES
                if (signed_codes) signed_group_dots(quad, x->digits + at * P * 32, P, &dot_a, &dot_b);
                else
#endif
                    group_dots(quad, x->digits + at * P * 32, P, &dot_a, &dot_b);
                const __m256 xs = _mm256_set1_ps(x->scale[at]);
                if (layout == Q4_SCALE16_OFFSET) {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_a), _mm256_mul_ps(first, xs), acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_b), _mm256_mul_ps(scale_b, xs), acc[i]);
                    acc[i] = _mm256_fmadd_ps(min_a, _mm256_set1_ps(x->sum16[2 * at]), acc[i]);
                    acc[i] = _mm256_fmadd_ps(min_b, _mm256_set1_ps(x->sum16[2 * at + 1]), acc[i]);
                } else {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dot_a, dot_b)), _mm256_mul_ps(first, xs), acc[i]);
                    acc[i] = _mm256_fmadd_ps(min_a, _mm256_set1_ps(x->sum[at]), acc[i]);
                }
            }
        }
        for (int i = 0; i < R; i++) _mm256_storeu_ps(out + i * Q4_ROWS + h * 8, acc[i]);
    }
}
#define HAVE_Q4_TILE 1
#define HAVE_KEPT_CODES 1
#endif

/* the plain Q4_1 format (the embedded model's) keeps its own tile, whose layout is fixed at compile
   time: qx_tile on the same weights measured ~15 % slower at 512 rows (4096x4096, 2 threads), equal
   at 1; every other format takes qx_tile */
static inline int q4_plain(const rb_q4_weight *w) {
    return !w->high_bits && w->layout == Q4_SCALE_MIN && w->params_kind == Q4_PARAMS_F16;
}

#ifdef HAVE_Q4_TILE
/* the layout as a constant: each format's tile compiled on its own (1.2-1.3x at 8+ rows) */
#define QX_CALL(r, p, kept, use)                                                                      \
    if (w->layout == Q4_SCALE_MIN) qx_tile(w, codes, high, params, super, x, row0, groups, out, r, p, Q4_SCALE_MIN, kept, use); \
    else if (w->layout == Q4_SCALE_OFFSET) qx_tile(w, codes, high, params, super, x, row0, groups, out, r, p, Q4_SCALE_OFFSET, kept, use); \
    else qx_tile(w, codes, high, params, super, x, row0, groups, out, r, p, Q4_SCALE16_OFFSET, kept, use);
#define TILE_CALL(r, p)                                                                               \
    if (plain) q4_tile(codes, (const _Float16 *)params, x, row0, groups, out, r, p);                  \
    else { QX_CALL(r, p, NULL, UNPACK) }
/* CALL(r, p) for the tile's `rows` and the activations' planes, each a constant */
#define ROW_CASE(CALL, r)                                                                             \
    case r:                                                                                           \
        if (x->planes == 1) { CALL(r, 1) }                                                            \
        else { CALL(r, 2) }                                                                           \
        break;
#if TILE > 4
#define WIDE_TILE_CASES(CALL) ROW_CASE(CALL, 4) ROW_CASE(CALL, 5) ROW_CASE(CALL, 6) ROW_CASE(CALL, 7)
#else
#define WIDE_TILE_CASES(CALL)
#endif
#define ROWS_SWITCH(CALL)                                                                             \
    switch (rows) {                                                                                   \
    ROW_CASE(CALL, 1) ROW_CASE(CALL, 2) ROW_CASE(CALL, 3) WIDE_TILE_CASES(CALL)                       \
    default:                                                                                          \
        if (x->planes == 1) { CALL(TILE, 1) }                                                         \
        else { CALL(TILE, 2) }                                                                        \
    }

static void q4_rows(const rb_q4_weight *w, const uint8_t *codes, const uint8_t *high, const uint8_t *params,
                    const _Float16 *super, const q4_activations *x, int64_t row0, int64_t rows, int64_t groups,
                    float *out) {
    const int plain = q4_plain(w);
    ROWS_SWITCH(TILE_CALL)
}

#define KEPT_CALL(r, p) QX_CALL(r, p, kept, use)

static inline __attribute__((always_inline)) void kept_rows_as(const rb_q4_weight *w, const uint8_t *codes,
                                                               const uint8_t *high, const uint8_t *params,
                                                               const _Float16 *super, const q4_activations *x,
                                                               int64_t row0, int64_t rows, int64_t groups, float *out,
                                                               uint8_t *kept, const int use) {
    ROWS_SWITCH(KEPT_CALL)
}

/* q4_rows of a format other than plain Q4_1 (keeps_codes) whose quads a chunk keeps in `kept`: the
   chunk's first tile unpacks and keeps them (`use` UNPACK_AND_KEEP), the others REUSE them; the
   same quads and arithmetic as q4_rows. Apart from q4_rows so that its code stays as it was (one
   body for all three uses made GCC's plain Q4_1 tile 1.15x slower on AVX2). */
static void q4_kept_rows(const rb_q4_weight *w, const uint8_t *codes, const uint8_t *high, const uint8_t *params,
                         const _Float16 *super, const q4_activations *x, int64_t row0, int64_t rows, int64_t groups,
                         float *out, uint8_t *kept, int use) {
    if (use == REUSE) kept_rows_as(w, codes, high, params, super, x, row0, rows, groups, out, kept, REUSE);
    else kept_rows_as(w, codes, high, params, super, x, row0, rows, groups, out, kept, UNPACK_AND_KEEP);
}
#else
/* portable: the same integer arithmetic, one product at a time */
static void q4_rows(const rb_q4_weight *w, const uint8_t *codes, const uint8_t *high, const uint8_t *params,
                    const _Float16 *super, const q4_activations *x, int64_t row0, int64_t rows, int64_t groups,
                    float *out) {
    const int P = x->planes, hb = w->high_bits, kind = w->params_kind, layout = w->layout;
    const int S = layout == Q4_SCALE_OFFSET ? 1 : 2;
    for (int64_t i = 0; i < rows; i++)
        for (int r = 0; r < Q4_ROWS; r++) {
            float total = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = q4_group_index(row0 + i, g, groups, x->row_tile);
                const int8_t *q = x->digits + at * P * 32;
                int32_t dot[2] = {0, 0};
                for (int p = 0; p < P; p++) {
                    dot[0] *= 256, dot[1] *= 256;
                    for (int f = 0; f < 32; f++)
                        dot[f / 16] += q4_code(codes + g * 4 * 64, hb ? high + g * hb * 64 : NULL, hb, r, f) * q[p * 32 + f];
                }
                float first = q4_param(params, kind, g * S * Q4_ROWS + r);
                float second = S == 2 ? q4_param(params, kind, (g * S + 1) * Q4_ROWS + r) : first;
                if (kind == Q4_PARAMS_K) {
                    first *= (float)super[(g / 8) * 2 * Q4_ROWS + r];
                    second *= (float)super[(g / 8) * 2 * Q4_ROWS + Q4_ROWS + r];
                }
                const float xs = x->scale[at];
                if (layout == Q4_SCALE16_OFFSET) {
                    total += first * xs * (float)dot[0] + second * xs * (float)dot[1]
                           + first * -w->offset * x->sum16[2 * at] + second * -w->offset * x->sum16[2 * at + 1];
                } else {
                    const float minimum = layout == Q4_SCALE_MIN ? second : first * -w->offset;
                    total += first * xs * (float)(dot[0] + dot[1]) + minimum * x->sum[at];
                }
            }
            out[i * Q4_ROWS + r] = total;
        }
}
#undef TILE
#define TILE 1
#endif

#define ROW_CHUNK 256 /* activation rows per sweep over a thread's blocks (their digits stay in L2) */
#define UNITS_PER_PART 8 /* the fewest units a part owns (fewer blocks per unit than want) */

typedef struct {
    const rb_q4_weight *w;
    const q4_activations *x;
    int64_t M;
    float *y;
    q4_tile_hook hook; /* or NULL */
    void *hook_ctx;
    int64_t run;       /* blocks per unit */
    rb_units units;
} q4_job;

/* Where block b (16 outputs) of the unchained weight w keeps its codes, high bits, parameters,
   super-block factors and bias */
typedef struct {
    const uint8_t *codes, *high, *params;
    const _Float16 *super;
    const float *bias;
} block_at;

static inline block_at block_of(const rb_q4_weight *w, int64_t b, int64_t groups) {
    return (block_at){w->codes + b * groups * 4 * Q4_ROWS * 4,
                      w->high ? w->high + b * groups * w->high_bits * 64 : NULL,
                      (const uint8_t *)w->params + b * groups * q4_param_stride(w),
                      w->super ? w->super + b * (groups / 8) * 2 * Q4_ROWS : NULL,
                      w->bias ? w->bias + b * Q4_ROWS : NULL};
}

/* dst[i * stride + r] = a tile's out[i * 16 + r] plus the bias (or 0), for its `rows` rows. (Adding
   the bias in place and copying the rows out after made 32- and 512-row matmuls 1.04-1.1x slower.) */
static inline __attribute__((always_inline)) void tile_out(const float *out, const float *bias, int64_t rows,
                                                           float *dst, int64_t stride) {
    for (int64_t i = 0; i < rows; i++)
        for (int r = 0; r < Q4_ROWS; r++) dst[i * stride + r] = out[i * Q4_ROWS + r] + (bias ? bias[r] : 0.f);
}

/* Block `block` of an unchained weight for activation rows row0 .. row0 + rows - 1 (rows <= TILE, one
   tile of x's layout), bias added: out[i * 16 + r], each output exactly as q4_part computes it (its
   arithmetic is the same whatever `rows` is: the tile only shares the unpacked codes) */
void q4_block_rows(const rb_q4_weight *w, int64_t block, const q4_activations *x, int64_t row0, int64_t rows,
                   float *out) {
    const int64_t groups = w->in / 32;
    const block_at at = block_of(w, block, groups);
    float tile[TILE * Q4_ROWS];
    q4_rows(w, at.codes, at.high, at.params, at.super, x, row0, rows, groups, tile);
    tile_out(tile, at.bias, rows, out, Q4_ROWS);
}

/* Blocks of 16 weight rows per work unit of a thread (rb_units): enough that a unit is ~0.5M
   multiply-adds for the chunk's rows (a claim is an atomic add), so a prefill's units are single
   blocks, but at most 1 / UNITS_PER_PART of a part's blocks, so that a late part's work can be shared */
static int64_t blocks_per_unit(int64_t K, int64_t rows, int64_t blocks, int64_t parts) {
    const int64_t chunk = rows < 1 ? 1 : rows < ROW_CHUNK ? rows : ROW_CHUNK; /* M may be 0: no units then */
    const int64_t per_block = Q4_ROWS * (K < 32 ? 32 : K) * chunk, want = 1 << 19;
    const int64_t run = (want + per_block - 1) / per_block, most = blocks / (UNITS_PER_PART * (parts < 1 ? 1 : parts));
    return run < most ? run : most > 1 ? most : 1;
}

/* A job's units over M rows of K inputs and `blocks` output blocks: row chunks x runs of
   blocks_per_unit blocks, parts owning equal runs of blocks (rb_units). Returns the run. */
static int64_t plan_units(rb_units *units, int64_t K, int64_t M, int64_t blocks, int64_t parts) {
    const int64_t run = blocks_per_unit(K, M, blocks, parts);
    rb_units_init(units, (blocks + run - 1) / run, (M + ROW_CHUNK - 1) / ROW_CHUNK, parts);
    return run;
}

/* A unit's row chunk [*c0, *c1) and blocks [*b0, *b1) */
static void unit_span(const rb_unit *unit, int64_t blocks, int64_t run, int64_t M, int64_t *c0, int64_t *c1,
                      int64_t *b0, int64_t *b1) {
    *c0 = unit->round * ROW_CHUNK, *c1 = *c0 + ROW_CHUNK < M ? *c0 + ROW_CHUNK : M;
    *b0 = unit->group * run, *b1 = *b0 + run < blocks ? *b0 + run : blocks;
}

/* Whether a chunk of `rows` activation rows keeps a block's quads for its later tiles (else each
   tile unpacks the codes again). Unpacking costs more the more a format has to put together (high
   bits, 8-bit codes): kept from the third tile on, the 0.54B file's Q5_0 shapes ran 1.1-1.2x faster
   at 32 rows and 1.2-1.3x at 512; Q5_1, Q5_K 1.1-1.27x, Q6_K, Q8_0, Q4_K 1.06-1.19x; at 16 rows all
   about level (AVX-512, Zen 4, 2 threads). The AVX2 build's 4-row tiles gain more: Q5_0, Q8_0, Q6_K
   1.3-1.5x at 16-512 rows, Q4_0, Q4_K 1.1-1.2x (same Zen 4). The plain Q4_1 tile unpacks in 12
   instructions a group and ran 0.84-0.92x with its quads kept: it always unpacks. */
static inline int keeps_codes(const rb_q4_weight *w, int64_t rows) {
    return !q4_plain(w) && rows > 2 * TILE;
}

/* A part's room for `blocks` blocks of kept quads of chain w's weights (free() it), or NULL where no
   link keeps them for chunks of M rows, this build keeps none or memory ran out (each tile then
   unpacks the codes itself) */
static uint8_t *kept_scratch(const rb_q4_weight *w, int64_t M, int64_t blocks) {
#ifdef HAVE_KEPT_CODES
    for (; w; w = w->next)
        if (keeps_codes(w, M < ROW_CHUNK ? M : ROW_CHUNK))
            return (uint8_t *)aligned_alloc(64, blocks * (w->in / 32) * KEPT_GROUP_BYTES);
#else
    (void)w, (void)M, (void)blocks;
#endif
    return NULL;
}

/* q4_rows for tile m0 of a chunk from row c0, with the block's quads kept in `kept` (or NULL) */
static inline void chunk_rows(const rb_q4_weight *w, const block_at *at, const q4_activations *x, int64_t m0,
                              int64_t rows, int64_t groups, float *out, uint8_t *kept, int64_t c0) {
#ifdef HAVE_KEPT_CODES
    if (kept) {
        q4_kept_rows(w, at->codes, at->high, at->params, at->super, x, m0, rows, groups, out, kept,
                     m0 == c0 ? UNPACK_AND_KEEP : REUSE);
        return;
    }
#endif
    (void)kept, (void)c0;
    q4_rows(w, at->codes, at->high, at->params, at->super, x, m0, rows, groups, out);
}

static void q4_part(void *ctx, int64_t part, int64_t parts) {
    (void)parts;
    q4_job *job = (q4_job *)ctx;
    const int64_t groups = job->w->in / 32, width = q4_chain_out(job->w), blocks = width / Q4_ROWS;
    uint8_t *scratch = kept_scratch(job->w, job->M, 1);
    rb_unit unit;
    while (rb_units_claim(&job->units, part, &unit)) {
        int64_t c0, c1, first, last;
        unit_span(&unit, blocks, job->run, job->M, &c0, &c1, &first, &last);
        int64_t base = 0; /* the chain's first block of weight w */
        for (const rb_q4_weight *w = job->w; w; base += w->out / Q4_ROWS, w = w->next) {
            const int64_t lo = first > base ? first : base, end = base + w->out / Q4_ROWS;
            for (int64_t block = lo; block < (last < end ? last : end); block++) {
                const block_at at = block_of(w, block - base, groups);
                uint8_t *kept = keeps_codes(w, c1 - c0) ? scratch : NULL;
                for (int64_t m0 = c0; m0 < c1; m0 += TILE) {
                    const int64_t rows = c1 - m0 < TILE ? c1 - m0 : TILE;
                    float out[TILE * Q4_ROWS];
                    chunk_rows(w, &at, job->x, m0, rows, groups, out, kept, c0);
                    tile_out(out, at.bias, rows, job->y + m0 * width + block * Q4_ROWS, width);
                    if (job->hook) job->hook(job->hook_ctx, part, block, m0, rows);
                }
            }
        }
    }
    free(scratch);
}

/* ---- a gated MLP's first half: act = f(x @ gate^T) * (x @ up^T) -----------------------------------
   Why: written out whole, a prefill's gate and up products (M x 2I floats: 12 MB a layer for 1,024
   tokens of the embedded model) leave the caches before the activation reads them back. Here a
   thread takes gate block j and up block j (16 features each) for a tile of rows and applies the
   activation while both are in cache, so only act [M, I] is written. Each value is the matmul's and
   then the activation kernel's (cpu_kernels.c, on rows of 16 features: the same vector arithmetic as
   on whole rows), so the bits equal the two calls'. */
typedef struct {
    const rb_q4_weight *w; /* the chain: gate's I outputs, then up's */
    const q4_activations *x;
    int64_t M, half;       /* rows; I */
    float *act;
    int64_t activation;    /* RB_SILU or RB_GELU_TANH */
    int64_t run;           /* gate (and up) blocks per unit */
    rb_units units;
} glu_job;

/* the weight of the chain holding its output block *block, which becomes the index within it */
static const rb_q4_weight *chain_block(const rb_q4_weight *w, int64_t *block) {
    for (; *block >= w->out / Q4_ROWS; w = w->next) *block -= w->out / Q4_ROWS;
    return w;
}

static void glu_part(void *ctx, int64_t part, int64_t parts) {
    (void)parts;
    glu_job *job = (glu_job *)ctx;
    const int64_t groups = job->w->in / 32, blocks = job->half / Q4_ROWS;
    uint8_t *scratch = kept_scratch(job->w, job->M, 2); /* a gate block's and an up block's */
    void (*activate)(const float *, int64_t, int64_t, float *) =
        job->activation == RB_GELU_TANH ? rb_gelu_tanh_and_mul : rb_silu_and_mul;
    rb_unit unit;
    while (rb_units_claim(&job->units, part, &unit)) {
        int64_t c0, c1, first, last;
        unit_span(&unit, blocks, job->run, job->M, &c0, &c1, &first, &last);
        for (int64_t j = first; j < last; j++) {
            int64_t gate_block = j, up_block = j + blocks;
            const rb_q4_weight *gate = chain_block(job->w, &gate_block), *up = chain_block(job->w, &up_block);
            const block_at g = block_of(gate, gate_block, groups), u = block_of(up, up_block, groups);
            uint8_t *gate_kept = keeps_codes(gate, c1 - c0) ? scratch : NULL;
            uint8_t *up_kept = keeps_codes(up, c1 - c0) && scratch ? scratch + groups * KEPT_GROUP_BYTES : NULL;
            for (int64_t m0 = c0; m0 < c1; m0 += TILE) {
                const int64_t rows = c1 - m0 < TILE ? c1 - m0 : TILE;
                float gate_up[TILE * 2 * Q4_ROWS], out[TILE * Q4_ROWS]; /* rows of (gate | up), as the kernel takes them */
                chunk_rows(gate, &g, job->x, m0, rows, groups, out, gate_kept, c0);
                tile_out(out, g.bias, rows, gate_up, 2 * Q4_ROWS);
                chunk_rows(up, &u, job->x, m0, rows, groups, out, up_kept, c0);
                tile_out(out, u.bias, rows, gate_up + Q4_ROWS, 2 * Q4_ROWS);
                activate(gate_up, rows, Q4_ROWS, out);
                for (int64_t i = 0; i < rows; i++)
                    memcpy(job->act + (m0 + i) * job->half + j * Q4_ROWS, out + i * Q4_ROWS, sizeof(float) * Q4_ROWS);
            }
        }
    }
    free(scratch);
}

/* Row i of the activations times its own weight ws[i] (all of one shape, no chains): one
   token's routed experts (moe.c), each expert's down projection on that expert's hidden row. */
typedef struct {
    const rb_q4_weight *const *ws;
    const q4_activations *x;
    int64_t count, width;
    float *y;
} q4_rows_job;

static void q4_rows_part(void *ctx, int64_t part, int64_t parts) {
    const q4_rows_job *job = (const q4_rows_job *)ctx;
    const int64_t per = job->width / Q4_ROWS, blocks = per * job->count;
    const int64_t first = blocks * part / parts, last = blocks * (part + 1) / parts;
    for (int64_t block = first; block < last; block++) {
        const int64_t i = block / per, b = block % per;
        q4_block_rows(job->ws[i], b, job->x, i, 1, job->y + i * job->width + b * Q4_ROWS);
    }
}

void q4_linear_rows(const rb_q4_weight *const *ws, int64_t count, const float *x, q4_activations *scratch,
                    float *y, int64_t threads) {
    scratch->offset_digits = 0;
    q4_quantize(x, count, ws[0]->in, scratch, threads);
    q4_rows_job job = {ws, scratch, count, ws[0]->out, y};
    rb_parallel(q4_rows_part, &job, threads);
}

/* The smallest 8-bit code (Q8_0 code + 128) this build multiplies exactly: 1 on AVX2 without VNNI
   (signed_group_dots), else 0 */
#ifndef SIGNED_8BIT_CODES
#define SIGNED_8BIT_CODES 0
#endif
int rb_q4_smallest_8bit_code(void) { return SIGNED_8BIT_CODES; }

/* Activation rows the low-bit matmul takes in one pass over a block's codes (each pass unpacks them
   once more): a step of one row more than a multiple of this costs a pass (the speculative
   decoder's cost model, scheduler/speculative.py) */
int rb_q4_tile_rows(void) { return TILE; }

static void q4_run(const rb_q4_weight *w, const q4_activations *x, int64_t M, float *y, int64_t threads,
                   q4_tile_hook hook, void *hook_ctx) {
    q4_job job = {.w = w, .x = x, .M = M, .y = y, .hook = hook, .hook_ctx = hook_ctx};
    job.run = plan_units(&job.units, w->in, M, q4_chain_out(w) / Q4_ROWS, threads);
    rb_parallel(q4_part, &job, threads);
}

void q4_linear(const rb_q4_weight *w, const float *x, int64_t M, q4_activations *scratch, float *y,
               int64_t threads) {
    if (w->dense) {
        f32_linear(w, x, M, y, threads);
        return;
    }
    scratch->offset_digits = 0;
    q4_quantize(x, M, w->in, scratch, threads);
    q4_run(w, scratch, M, y, threads, NULL, NULL);
}

void q4_linear_hooked(const rb_q4_weight *w, const q4_activations *x, int64_t M, float *y, int64_t threads,
                      q4_tile_hook hook, void *hook_ctx) {
    q4_run(w, x, M, y, threads, hook, hook_ctx);
}

/* y [M, N] = x [M, K] @ W^T (+ bias) on `threads` threads, the activations in 8 (bits = 8) or 16
   bits (dense weights: fp32 as they are). Returns 0, -1 if memory ran out, -2 for another `bits`. */
int rb_q4_matmul(const rb_q4_weight *w, const float *x, int64_t M, float *y, int64_t threads, int64_t bits) {
    if (bits != 8 && bits != 16) return -2;
    if (w->dense) {
        f32_linear(w, x, M, y, threads);
        return 0;
    }
    q4_activations q;
    if (q4_activations_alloc(&q, M, w->in, bits / 8)) return -1;
    q4_linear(w, x, M, &q, y, threads);
    q4_activations_free(&q);
    return 0;
}

/* Whether w is a gate-then-up chain q4_glu takes: low-bit links only, halves on a block boundary */
static int glu_splits(const rb_q4_weight *w) {
    for (const rb_q4_weight *link = w; link; link = link->next)
        if (link->dense) return 0;
    return q4_chain_out(w) % (2 * Q4_ROWS) == 0;
}

int q4_glu(const rb_q4_weight *w, const float *x, int64_t M, q4_activations *scratch, float *act, int64_t threads,
           int64_t activation) {
    if (!glu_splits(w) || (activation != RB_SILU && activation != RB_GELU_TANH)) return -3;
    scratch->offset_digits = 0;
    q4_quantize(x, M, w->in, scratch, threads);
    glu_job job = {.w = w, .x = scratch, .M = M, .half = q4_chain_out(w) / 2, .act = act, .activation = activation};
    job.run = plan_units(&job.units, w->in, M, job.half / Q4_ROWS, threads);
    rb_parallel(glu_part, &job, threads);
    return 0;
}

/* q4_glu with its own scratch for `bits`-bit activations (8 or 16). Returns 0, -1 if memory ran
   out, -2 for other activation bits, -3 for a chain q4_glu does not take. */
int rb_q4_glu(const rb_q4_weight *w, const float *x, int64_t M, float *act, int64_t threads, int64_t bits,
              int64_t activation) {
    if (bits != 8 && bits != 16) return -2;
    q4_activations q;
    if (q4_activations_alloc(&q, M, w->in, (int)(bits / 8))) return -1;
    const int rc = q4_glu(w, x, M, &q, act, threads, activation);
    q4_activations_free(&q);
    return rc;
}

/* codes [N, K] (one byte each, < 2^(4 + high_bits)) into q4.h's layout: their low 4 bits as the
   nibbles [N / 16, K / 32, 4, 16, 4], their upper bits into the zeroed planes
   [N / 16, K / 32, high_bits, 64] (quad j = features 4j..4j+3 of the group). */
