/* Codes into the low-bit layout (q4.h): from a [N, K] byte array, or straight from a GGUF tensor's
   blocks.

   A block of 16 output rows keeps, per group of 32 features, the codes' low nibbles as 4 quads of
   16 rows x 4 features and their upper bits in `high_bits` planes. From GGUF blocks, each 16-row
   block is first decoded into a per-thread scratch of 16 x K codes (what `kernels/ggml.py`'s numpy
   decoder gives, tested bit for bit per type: Q4_0/Q4_1 nibbles, Q5_0/Q5_1 nibbles plus a fifth
   bit, Q8_0's signed byte + 128, Q4_K/Q5_K's four chunks of 64 as low then high nibbles, Q6_K's two
   halves of 128 with two upper bits each) and packed from there, so a load never holds a whole
   tensor's codes: on a 0.5B file the numpy decoding took most of the load. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4.h"
#include "thread_pool.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* rows b*16 .. b*16+15 of codes (K apart) into block b of the layout.
   Four bytes at a time: byte k of word j is feature 4j+k, so quad j's low nibbles are word j's
   (and word j+4's, shifted up), and bit `j * high_bits` of each high-plane byte k is word j's
   upper bits, shifted without carrying into the next byte. */
static void pack_block(const uint8_t *codes, int64_t K, int64_t b, int64_t high_bits, uint8_t *nibbles,
                       uint8_t *high) {
    const int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = b * groups + g;
        for (int r = 0; r < Q4_ROWS; r++) {
            const uint8_t *row = codes + r * K + g * 32;
            uint32_t words[8], planes[4] = {0, 0, 0, 0};
            for (int j = 0; j < 8; j++) words[j] = load32(row + 4 * j);
            for (int j = 0; j < 4; j++) {
                const uint32_t quad = (words[j] & 0x0F0F0F0Fu) | ((words[j + 4] & 0x0F0F0F0Fu) << 4);
                memcpy(nibbles + ((at * 4 + j) * Q4_ROWS + r) * 4, &quad, 4);
            }
            if (!high_bits) continue;
            for (int j = 0; j < 8; j++) {
                const int bit = j * (int)high_bits;
                planes[bit / 8] |= ((words[j] >> 4) & 0x0F0F0F0Fu) << (bit % 8);
            }
            for (int p = 0; p < high_bits; p++) memcpy(high + (at * high_bits + p) * 64 + r * 4, &planes[p], 4);
        }
    }
}

typedef struct {
    const uint8_t *src;                         /* codes [N, K], or GGUF blocks */
    int64_t type, rows, N, K, row_bytes, high_bits;
    uint8_t *nibbles, *high;
} pack_job;

static void codes_part(void *ctx, int64_t part, int64_t parts) {
    const pack_job *job = (const pack_job *)ctx;
    const int64_t blocks = job->N / Q4_ROWS;
    for (int64_t b = blocks * part / parts; b < blocks * (part + 1) / parts; b++)
        pack_block(job->src + b * Q4_ROWS * job->K, job->K, b, job->high_bits, job->nibbles, job->high);
}

void rb_q4_pack_codes(const uint8_t *codes, int64_t N, int64_t K, int64_t high_bits, uint8_t *nibbles,
                      uint8_t *high, int64_t threads) {
    pack_job job = {codes, 0, N, N, K, K, high_bits, nibbles, high};
    rb_parallel(codes_part, &job, N >= 64 ? threads : 1);
}

/* ---- GGUF blocks -> codes ------------------------------------------------------------------- */
static void nibbles_of(const uint8_t *qs, int n, uint8_t *out) { /* n low nibbles, then n high ones */
    for (int i = 0; i < n; i++) out[i] = qs[i] & 15, out[n + i] = qs[i] >> 4;
}

static void q5_block(const uint8_t *qh, const uint8_t *qs, uint8_t *out) {
    uint32_t upper;
    memcpy(&upper, qh, 4); /* bit i: element i's fifth bit (little endian, as ggml stores it) */
    nibbles_of(qs, 16, out);
    for (int i = 0; i < 32; i++) out[i] |= (uint8_t)(((upper >> i) & 1) << 4);
}

static void k_block(const uint8_t *qh, const uint8_t *qs, uint8_t *out) { /* Q4_K; Q5_K with qh */
    for (int c = 0; c < 4; c++) nibbles_of(qs + 32 * c, 32, out + 64 * c);
    if (qh)
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 32; i++) out[32 * j + i] |= (uint8_t)(((qh[i] >> j) & 1) << 4);
}

static void q6_block(const uint8_t *b, uint8_t *out) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; h++) {
        nibbles_of(ql + 64 * h, 64, out + 128 * h);
        for (int q = 0; q < 4; q++)
            for (int i = 0; i < 32; i++)
                out[128 * h + 32 * q + i] |= (uint8_t)(((qh[32 * h + i] >> (2 * q)) & 3) << 4);
    }
}

static void decode_block(int64_t type, const uint8_t *b, uint8_t *out) { /* a type ggml_block_size knows */
    switch (type) {
    case Q4_0: nibbles_of(b + 2, 16, out); break;
    case Q4_1: nibbles_of(b + 4, 16, out); break;
    case Q5_0: q5_block(b + 2, b + 6, out); break;
    case Q5_1: q5_block(b + 4, b + 8, out); break;
    case Q8_0: for (int i = 0; i < 32; i++) out[i] = b[2 + i] ^ 0x80; break;
    case Q4_K: k_block(NULL, b + 16, out); break;
    case Q5_K: k_block(b + 16, b + 48, out); break;
    case Q6_K: q6_block(b, out); break;
    }
}

/* (weights, bytes) per block of a type decoded here; 0 weights for any other type */
static void ggml_block_size(int64_t type, int64_t *weights, int64_t *bytes) {
    static const int64_t sizes[][3] = {{Q4_0, 32, 18}, {Q4_1, 32, 20}, {Q5_0, 32, 22}, {Q5_1, 32, 24},
                                       {Q8_0, 32, 34}, {Q4_K, 256, 144}, {Q5_K, 256, 176}, {Q6_K, 256, 210}};
    *weights = *bytes = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i][0] == type) *weights = sizes[i][1], *bytes = sizes[i][2];
}

static void decode_rows(const pack_job *job, int64_t first, int64_t count, uint8_t *codes) {
    int64_t per_block, block_bytes;
    ggml_block_size(job->type, &per_block, &block_bytes);
    for (int64_t r = 0; r < count; r++) {
        uint8_t *out = codes + r * job->K;
        if (first + r >= job->rows) { /* padding up to 16 rows: code 0 */
            memset(out, 0, (size_t)job->K);
            continue;
        }
        const uint8_t *row = job->src + (first + r) * job->row_bytes;
        for (int64_t at = 0; at < job->K / per_block; at++) decode_block(job->type, row + at * block_bytes, out + at * per_block);
    }
}

static void blocks_part(void *ctx, int64_t part, int64_t parts) {
    const pack_job *job = (const pack_job *)ctx;
    const int64_t blocks = job->N / Q4_ROWS;
    uint8_t *scratch = (uint8_t *)malloc((size_t)(Q4_ROWS * job->K));
    if (!scratch) abort(); /* a few hundred KB per thread */
    for (int64_t b = blocks * part / parts; b < blocks * (part + 1) / parts; b++) {
        decode_rows(job, b * Q4_ROWS, Q4_ROWS, scratch);
        pack_block(scratch, job->K, b, job->high_bits, job->nibbles, job->high);
    }
    free(scratch);
}

/* [rows, K] decoded from `type` blocks (rows `row_bytes` apart) to the layout, rows padded with
   code 0 up to N (a multiple of 16); returns -1 for a type not decoded here. */
int rb_ggml_pack(int64_t type, const uint8_t *blocks, int64_t rows, int64_t N, int64_t K, int64_t row_bytes,
                 int64_t high_bits, uint8_t *nibbles, uint8_t *high, int64_t threads) {
    int64_t per_block, block_bytes;
    ggml_block_size(type, &per_block, &block_bytes);
    if (!per_block || K % per_block || N % Q4_ROWS || rows > N) return -1;
    pack_job job = {blocks, type, rows, N, K, row_bytes, high_bits, nibbles, high};
    rb_parallel(blocks_part, &job, N >= 64 ? threads : 1);
    return 0;
}
