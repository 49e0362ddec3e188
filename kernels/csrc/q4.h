/* Low-bit weights in the shapes of GGUF's 4-, 5-, 6- and 8-bit types (per group of 32 input
   features: w = scale * code + minimum, or w = scale * (code - offset), with one scale per 16
   features for Q6_K; Q8_0 as unsigned codes + 128 with offset 128) times fp32 rows, with the
   activations as integers per group of 32 (q4_matmul.c); used by the decode stack
   (decode_stack.c) and, through rb_q4_matmul, by the low-bit linears of the torch path. Which
   GGUF type maps to which fields: kernels/q4.py. */
#ifndef RB_Q4_H
#define RB_Q4_H
#include <stdint.h>
#include <string.h>

#define Q4_ROWS 16 /* output rows per block of the packed layout: one int32 lane each in 512 bits */

/* How a group's parameters give its weights (`layout`):
   Q4_SCALE_MIN      params [scale, minimum]: w = scale * code + minimum (Q4_1, Q5_1, Q4_K, Q5_K)
   Q4_SCALE_OFFSET   params [scale]: w = scale * (code - offset) (Q4_0, Q5_0, Q8_0)
   Q4_SCALE16_OFFSET params [scale of features 0..15, scale of 16..31]: w = scale * (code - offset)
                     (Q6_K, whose sub-blocks are 16 weights) */
enum { Q4_SCALE_MIN = 0, Q4_SCALE_OFFSET = 1, Q4_SCALE16_OFFSET = 2 };
enum { Q4_PARAMS_F16 = 0, Q4_PARAMS_F32 = 1, Q4_PARAMS_K = 2 };

/* codes [N / 16, K / 32, 4, 16, 4] bytes: for block b, group g, quad j (0..3), row r, byte k the
   low nibble holds the low 4 bits of feature 4j + k's code and the high nibble those of feature
   16 + 4j + k ("quads" 0..3 and 4..7), so a 64-byte load holds 4 features of all 16 rows.
   high [N / 16, K / 32, high_bits, 64] (5-, 6- and 8-bit codes): code bits 4.. of quad j sit in
   byte (r, k) of vector (j * high_bits) / 8 at bit (j * high_bits) % 8.
   params [N / 16, K / 32, S, 16], S per `layout`, in one of three kinds (`params_kind`):
   Q4_PARAMS_F16 (the types that store fp16 per block of 32: exact), Q4_PARAMS_F32, or
   Q4_PARAMS_K: the K-quants' int8 sub-block scales (and minimums), each multiplied by its
   super-block's fp16 factor in `super` [N / 16, K / 256, 2, 16] (d for the first parameter, the
   second's factor next: dmin negated for Q4_K/Q5_K, d again for Q6_K), as the file stores them:
   the products are exact in fp32.
   `next` chains weights of the same input whose outputs are concatenated (a fused q/k/v of
   mixed types).
   `dense` set: the weight is fp32 rows [out, in] instead (f32_matmul.c; any sizes, every link of
   the chain dense), the fields above unused. */
typedef struct rb_q4_weight {
    const uint8_t *codes;
    const void *params;
    const float *bias; /* [out] or NULL */
    int64_t in, out;   /* in a multiple of 32, out a multiple of Q4_ROWS */
    const uint8_t *high;
    const _Float16 *super; /* Q4_PARAMS_K only */
    int32_t high_bits;   /* 0, 1, 2 or 4: codes of 4, 5, 6 or 8 bits */
    int32_t layout;      /* Q4_SCALE_MIN, Q4_SCALE_OFFSET or Q4_SCALE16_OFFSET */
    int32_t params_kind; /* Q4_PARAMS_F16, Q4_PARAMS_F32 or Q4_PARAMS_K */
    float offset;       /* the code offset of the *_OFFSET layouts */
    const struct rb_q4_weight *next;
    const float *dense;
} rb_q4_weight;

/* output features of a weight and the weights chained to it */
static inline int64_t q4_chain_out(const rb_q4_weight *w) {
    int64_t out = 0;
    for (; w; w = w->next) out += w->out;
    return out;
}

/* bytes of one parameter */
static inline int64_t q4_param_bytes(const rb_q4_weight *w) {
    return w->params_kind == Q4_PARAMS_F32 ? 4 : (w->params_kind == Q4_PARAMS_K ? 1 : 2);
}

/* bytes of one group's parameters for 16 rows */
static inline int64_t q4_param_stride(const rb_q4_weight *w) {
    return (w->layout == Q4_SCALE_OFFSET ? 1 : 2) * Q4_ROWS * q4_param_bytes(w);
}

/* Activations as integers per group of 32, scaled so the group's largest magnitude is the
   format's largest value: 8 bits (planes = 1, llama.cpp's Q8_1 idea: each value within 0.4 % of
   the group's largest, a product within ~5e-3, about twice bf16's error, at half the integer
   work) or 16 bits as two int8 digits (planes = 2, high then low: ~1.5e-5, for the fp32
   reference's accuracy). With every group: its scale and the sum of
   its rounded values (scale * sum q: with the rounded sum, the minimum term's error partly
   cancels the codes', which halves the 8-bit error against the exact sum). */
typedef struct {
    int8_t *digits;      /* [groups of rows (q4_group_index), planes, 32] */
    float *scale, *sum;  /* [groups of rows] */
    float *sum16;        /* [groups of rows, 2]: scale * sum q over features 0..15 and 16..31 */
    int64_t row_tile;    /* rows per tile of the layout (q4_group_index), set by q4_quantize */
    int planes;
    int offset_digits;   /* digits stored + 128 (as uint8), for signed weights (q8_matmul.c) */
} q4_activations;

/* Where group g (of `groups` per row) of activation row m is kept: rows come in tiles of `tile`
   rows, and a tile's rows sit side by side within each group, so a kernel's tile of rows (never
   across a tile's edge) is one pointer plus constant offsets. Row by row, the 8-row tile needed 8
   row addresses and the compiler spilled registers in the inner loop: the embedded model's K = 576
   matmuls ran ~1.1x slower at 64 and 512 rows on a Zen 5. A single row keeps a tile of its own
   (row by row): padded to 8, its groups lay 8x the cache lines apart and a 0.5B model's batch-1
   matmuls ran 3-9 % slower. */
#define Q4_ROW_TILE 8
static inline int64_t q4_row_tile(int64_t M) { return M == 1 ? 1 : Q4_ROW_TILE; }
static inline int64_t q4_group_index(int64_t row, int64_t g, int64_t groups, int64_t tile) {
    return ((row / tile) * groups + g) * tile + row % tile;
}

int q4_activations_alloc(q4_activations *x, int64_t M, int64_t K, int planes);
void q4_activations_free(q4_activations *x);
/* x [M, K] into `out` (allocated for >= M rows of >= K features), on up to `threads` threads */
void q4_quantize(const float *x, int64_t M, int64_t K, q4_activations *out, int64_t threads);
/* the same for a chain of dense fp32 weights (f32_matmul.c) */
void f32_linear(const rb_q4_weight *w, const float *x, int64_t M, float *y, int64_t threads);
/* y [M, N] = x [M, K] @ W^T (+ bias), N over the chain (`next`): x quantized into `scratch`
   (allocated for >= M rows of >= K features), the output rows split over `threads` threads */
void q4_linear(const rb_q4_weight *w, const float *x, int64_t M, q4_activations *scratch, float *y,
               int64_t threads);

/* act [M, I] = f(x @ gate^T) * (x @ up^T) for a low-bit chain w of 2I outputs, gate's then up's (I a
   multiple of 16), f RB_SILU or RB_GELU_TANH (cpu_kernels.h): the bits of q4_linear followed by the
   activation kernel, without writing the gate and up products out. x quantized into `scratch` as
   q4_linear does. Returns 0, or -3 (nothing done) for a chain it does not take (dense links, halves
   off a block boundary) or another activation. */
int q4_glu(const rb_q4_weight *w, const float *x, int64_t M, q4_activations *scratch, float *act, int64_t threads,
           int64_t activation);

/* y [count, N]: row i = x row i @ ws[i]^T (+ bias), every ws[i] low-bit, unchained, [N, K] */
void q4_linear_rows(const rb_q4_weight *const *ws, int64_t count, const float *x, q4_activations *scratch,
                    float *y, int64_t threads);

/* Called after the matmul wrote y's rows m0 .. m0 + rows - 1 of a block of 16 outputs, on the thread
   that computed them (part `part` of the thread pool's split), while they are in cache. */
typedef void (*q4_tile_hook)(void *ctx, int64_t part, int64_t block, int64_t m0, int64_t rows);
/* q4_linear on activations already quantized into x, calling `hook` after every tile */
void q4_linear_hooked(const rb_q4_weight *w, const q4_activations *x, int64_t M, float *y, int64_t threads,
                      q4_tile_hook hook, void *hook_ctx);

/* out[i * 16 + r]: block `block` (16 output rows) of the unchained low-bit weight w, bias added, for
   activation rows row0 .. row0 + rows - 1, rows <= rb_q4_tile_rows() and all in one tile of x's
   layout (row0 % x->row_tile + rows <= x->row_tile); each output computed
   exactly as q4_linear computes it */
void q4_block_rows(const rb_q4_weight *w, int64_t block, const q4_activations *x, int64_t row0, int64_t rows,
                   float *out);
int rb_q4_tile_rows(void);

/* parameter i of a block's group parameters, as a float, in its storage kind */
static inline float q4_param(const uint8_t *params, int kind, int64_t i) {
    if (kind == Q4_PARAMS_F32) return ((const float *)params)[i];
    if (kind == Q4_PARAMS_K) return (float)((const int8_t *)params)[i];
    return (float)((const _Float16 *)params)[i];
}

/* the code of feature f (0..31) of row r, from one group's codes [4, 16, 4] and high planes
   [high_bits, 64] (NULL without them): the portable kernel's and the screened head's reader */
static inline int32_t q4_code(const uint8_t *codes, const uint8_t *high, int hb, int r, int f) {
    const int j = f / 4, k = f % 4; /* quad j: features 4j..4j+3 */
    const uint8_t c = codes[((j % 4) * Q4_ROWS + r) * 4 + k];
    int32_t code = j < 4 ? (c & 15) : (c >> 4);
    if (hb) {
        const int bit = j * hb;
        const uint8_t h = high[((bit / 8) * Q4_ROWS + r) * 4 + k];
        code |= ((h >> (bit % 8)) & ((1 << hb) - 1)) << 4;
    }
    return code;
}

/* 4 activation digits as one int32, to broadcast against 4 features of every weight row */
static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif
